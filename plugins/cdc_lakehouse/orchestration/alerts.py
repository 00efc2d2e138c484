"""Alerts through Airflow's notifiers: e-mail (SMTP), Amazon SNS, Slack or any provider's notifier.

Four kinds, each naming the table, the shard or endpoint where relevant, the figure, the
threshold and what to do:

  task_failed    every CDC task's on_failure_callback (CdcFailureNotifier), after its retries
  audit_failing  the audit of a table failed N runs in a row   (teardown task check_alerts of cdc_audit__T)
  wal_retained   a capture slot retains more WAL than allowed  (the capture task, which does not fail for it)
  freshness      the lake lags its sources beyond the SLA      (teardown task check_alerts of the ingest DAG)

Channels and default thresholds are data: include/alerting.yaml (or the file named by
CDC_ALERTING_FILE), validated here; per-table thresholds are the table YAML's `alerts:` and its
`alert_emails` get every alert of the table by e-mail. Every alert is also a log line and a
JSON line in $AIRFLOW_HOME/cdc_alerts.jsonl, with the delivery result per channel.

Alert storms: the state of a condition is derived from the run history the jobs already keep in
cdc_meta (audit_results, quality_results, capture_runs, ingest_runs), so no other state exists.
A condition alerts on the run where it starts (for audits: the N-th failed run in a row), then
again every `renotify_every_runs` runs while it lasts, and once with "resolved" on the first
run where it is gone. A failed task alerts every time it fails for good (after its retries).

Secrets: error texts can hold DSNs. Every text passes secrecy.redact() (every secret value this
process knows by origin, credential-named key=value pairs, Authorization headers, user:pass@ in
URLs, and Airflow's own masked secrets) before it is logged, written or sent, and notifiers
get a finished message through notify(): nothing from an error is rendered as a Jinja template.

Module level imports stay light: this module is imported while DAGs are parsed.
"""

from __future__ import annotations

import html
import json
import logging
import os
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from airflow.sdk.bases.notifier import BaseNotifier
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cdc_lakehouse.config import AlertKind, AlertThresholds, TableConfig, load_table_configs
from cdc_lakehouse.secrecy import redact
from cdc_lakehouse.settings import PROJECT_ROOT, tables_dir

log = logging.getLogger(__name__)

KINDS: tuple[str, ...] = ("task_failed", "audit_failing", "wal_retained", "freshness")
# Used when neither the table nor include/alerting.yaml sets a threshold (freshness: the
# table's audit.freshness_sla_minutes).
BUILTIN_DEFAULTS = {"audit_failed_runs": 3, "retained_wal_bytes": 10 * 1024**3, "renotify_every_runs": 6}


# --- configuration --------------------------------------------------------------------------------


class AlertConfigError(ValueError):
    """include/alerting.yaml is invalid, or a channel cannot be built (a provider is missing)."""


class AlertDeliveryError(RuntimeError):
    """At least one channel could not deliver an alert (the others were tried)."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


def _provider_class(module: str, cls: str, package: str):
    import importlib

    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as exc:
        raise AlertConfigError(
            f"alert channel needs the {package} package ({module}.{cls} cannot be imported: {exc}); "
            f"install it (pip install {package}) or remove the channel from {alerting_file()}"
        ) from exc
    except AttributeError as exc:
        raise AlertConfigError(f"{module} has no notifier class {cls!r} (package {package})") from exc


class _Channel(_Model):
    name: str = Field("", description="how tables refer to the channel in `alerts.channels`")
    kinds: list[AlertKind] | None = Field(None, description="alert kinds sent here; default: all")

    def wants(self, kind: str) -> bool:
        return self.kinds is None or kind in self.kinds

    def provider(self) -> tuple[str, str, str] | None:
        """(module, class, pip package) of the notifier, to check it is installed."""
        return None

    def notifier(self, alert: Alert) -> BaseNotifier:
        raise NotImplementedError


class SmtpChannel(_Channel):
    type: Literal["smtp"]
    to: list[str] = Field(min_length=1)
    cc: list[str] = Field(default_factory=list)
    smtp_conn_id: str = "smtp_default"
    from_email: str | None = Field(None, description="default: the connection's extra from_email")

    def provider(self):
        return "airflow.providers.smtp.notifications.smtp", "SmtpNotifier", "apache-airflow-providers-smtp"

    def notifier(self, alert: Alert) -> BaseNotifier:
        cls = _provider_class(*self.provider())
        return cls(
            to=list(self.to),
            cc=list(self.cc) or None,
            from_email=self.from_email,
            smtp_conn_id=self.smtp_conn_id,
            subject=alert.subject,
            html_content=alert.html(),
        )


class SnsChannel(_Channel):
    type: Literal["sns"]
    target_arn: str = Field(description="topic or endpoint ARN")
    aws_conn_id: str | None = "aws_default"
    region_name: str | None = None

    def provider(self):
        return "airflow.providers.amazon.aws.notifications.sns", "SnsNotifier", "apache-airflow-providers-amazon"

    def notifier(self, alert: Alert) -> BaseNotifier:
        cls = _provider_class(*self.provider())
        return cls(
            aws_conn_id=self.aws_conn_id,
            region_name=self.region_name,
            target_arn=self.target_arn,
            message=alert.text(),
            subject=alert.subject,
            message_attributes={
                "cdc_alert_kind": alert.kind,
                "cdc_alert_state": alert.state,
                "cdc_table": ",".join(alert.tables) or "-",
            },
        )


class SlackChannel(_Channel):
    type: Literal["slack"]
    slack_conn_id: str = "slack_api_default"
    channel: str | None = Field(None, description="e.g. '#data-alerts'; default: the notifier's")
    username: str | None = None

    def provider(self):
        return "airflow.providers.slack.notifications.slack", "SlackNotifier", "apache-airflow-providers-slack"

    def notifier(self, alert: Alert) -> BaseNotifier:
        cls = _provider_class(*self.provider())
        kw: dict[str, Any] = {"slack_conn_id": self.slack_conn_id, "text": alert.text()}
        if self.channel:
            kw["channel"] = self.channel
        if self.username:
            kw["username"] = self.username
        return cls(**kw)


class NotifierChannel(_Channel):
    """Any notifier class by import path, e.g. a provider's PagerDuty, Teams or Opsgenie notifier."""

    type: Literal["notifier"]
    import_path: str = Field(pattern=r"^[A-Za-z_][\w.]*\.[A-Za-z_]\w*$", description="module.Class")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="constructor arguments besides the message")
    message_arg: str = Field("message", description="the argument that receives the alert text")
    subject_arg: str | None = Field(None, description="the argument that receives the subject, if any")
    package: str | None = Field(None, description="pip package of the class (named when it is missing)")

    def provider(self):
        module, cls = self.import_path.rsplit(".", 1)
        package = self.package
        if not package:
            m = re.match(r"^airflow\.providers\.([a-z0-9_]+)", module)
            package = f"apache-airflow-providers-{m.group(1).replace('_', '-')}" if m else module.split(".")[0]
        return module, cls, package

    def notifier(self, alert: Alert) -> BaseNotifier:
        cls = _provider_class(*self.provider())
        kw = {**self.kwargs, self.message_arg: alert.text()}
        if self.subject_arg:
            kw[self.subject_arg] = alert.subject
        return cls(**kw)


Channel = Annotated[SmtpChannel | SnsChannel | SlackChannel | NotifierChannel, Field(discriminator="type")]


class EmailDefaults(_Model):
    """How tables' `alert_emails` are e-mailed."""

    smtp_conn_id: str = "smtp_default"
    from_email: str | None = None


class AlertingConfig(_Model):
    channels: list[Channel] = Field(default_factory=list)
    defaults: AlertThresholds = AlertThresholds()
    alert_emails: EmailDefaults = EmailDefaults()
    log_file: str | None = Field("cdc_alerts.jsonl", description="JSON lines, relative to AIRFLOW_HOME; null: none")

    @model_validator(mode="before")
    @classmethod
    def _names(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("channels"), list):
            data = {
                **data,
                "channels": [
                    {**c, "name": f"{c.get('type', 'channel')}_{i}"} if isinstance(c, dict) and not c.get("name") else c
                    for i, c in enumerate(data["channels"])
                ],
            }
        return data

    @model_validator(mode="after")
    def _unique(self) -> AlertingConfig:
        names = [c.name for c in self.channels]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"channel name(s) {dup} used twice; give each channel its own name")
        return self

    def channel(self, name: str) -> _Channel | None:
        return next((c for c in self.channels if c.name == name), None)


def alerting_file() -> Path:
    return Path(os.environ.get("CDC_ALERTING_FILE") or PROJECT_ROOT / "include" / "alerting.yaml")


_cache: dict[tuple[str, float], AlertingConfig] = {}


def load_alerting(path: str | Path | None = None) -> AlertingConfig:
    """The alerting config; no file means no channels and the built-in thresholds."""
    p = Path(path) if path else alerting_file()
    if not p.exists():
        if path or os.environ.get("CDC_ALERTING_FILE"):
            raise AlertConfigError(f"{p}: the alerting file does not exist (CDC_ALERTING_FILE or the path given)")
        return AlertingConfig()
    key = (str(p), p.stat().st_mtime)
    if key in _cache:
        return _cache[key]
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise AlertConfigError(f"{p}: not valid YAML: {exc}. Fix: correct the YAML syntax") from exc
    try:
        cfg = AlertingConfig.model_validate(data)
    except ValidationError as exc:
        msgs = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "<root>"
            msgs.append(f"{p}: field '{loc}': {err['msg'].removeprefix('Value error, ')}")
        raise AlertConfigError("\n".join(msgs) + "\nFix: see the comments in include/alerting.yaml") from exc
    _cache.clear()
    _cache[key] = cfg
    return cfg


def alerting_errors(tables: dict[str, TableConfig]) -> list[str]:
    """Problems of the alerting config as seen by the DAG parser (cheap: no provider is imported)."""
    import importlib.util

    try:
        ac = load_alerting()
    except AlertConfigError as exc:
        return [str(exc)]
    errors = []
    for c in ac.channels:
        module, cls, package = c.provider() or (None, None, None)
        if module:
            try:
                found = importlib.util.find_spec(module) is not None
            except ModuleNotFoundError:
                found = False
            if not found:
                errors.append(
                    f"{alerting_file()}: channel '{c.name}' ({c.type}) needs the {package} package, "
                    f"which is not installed. Fix: pip install {package}, or remove the channel"
                )
    for name, cfg in sorted(tables.items()):
        for ch in cfg.alerts.channels or []:
            if ac.channel(ch) is None:
                errors.append(
                    f"table {name}: field 'alerts.channels': no channel named {ch!r} in {alerting_file()} "
                    f"(channels: {[c.name for c in ac.channels]}). Fix: use one of those names"
                )
    return errors


@dataclass(frozen=True)
class Rules:
    audit_failed_runs: int
    retained_wal_bytes: int
    freshness_sla: float
    renotify_every_runs: int


def rules_for(cfg: TableConfig, ac: AlertingConfig) -> Rules:
    """The table's thresholds: its `alerts`, else alerting.yaml's defaults, else the built-in ones (0 = off)."""

    def pick(name: str, default: Any) -> Any:
        for src in (cfg.alerts, ac.defaults):
            v = getattr(src, name)
            if v is not None:
                return v
        return default

    return Rules(
        audit_failed_runs=int(pick("audit_failed_runs", BUILTIN_DEFAULTS["audit_failed_runs"])),
        retained_wal_bytes=int(pick("retained_wal_bytes", BUILTIN_DEFAULTS["retained_wal_bytes"])),
        freshness_sla=float(pick("freshness_sla", cfg.audit.freshness_sla_minutes * 60.0)),
        renotify_every_runs=int(pick("renotify_every_runs", BUILTIN_DEFAULTS["renotify_every_runs"])),
    )


def channels_for(cfgs: list[TableConfig], ac: AlertingConfig) -> list[_Channel]:
    """The channels of these tables: those named in their `alerts.channels` (default: all), plus
    one SMTP channel to the union of their `alert_emails`."""
    out: list[_Channel] = []
    for cfg in cfgs:
        names = cfg.alerts.channels if cfg.alerts.channels is not None else [c.name for c in ac.channels]
        for n in names:
            c = ac.channel(n)
            if c is None:
                log.error("table %s: alert channel %r is not in %s (ignored)", cfg.name, n, alerting_file())
            elif c not in out:
                out.append(c)
    if not cfgs and ac.channels:  # a failure whose table is unknown still reaches every channel
        out = list(ac.channels)
    emails = sorted({e for c in cfgs for e in c.alert_emails})
    if emails:
        out.append(
            SmtpChannel(
                type="smtp",
                name="alert_emails",
                to=emails,
                smtp_conn_id=ac.alert_emails.smtp_conn_id,
                from_email=ac.alert_emails.from_email,
            )
        )
    return out


# --- the alert -------------------------------------------------------------------------------------


@dataclass
class Alert:
    kind: str
    summary: str
    tables: list[str]
    details: dict[str, Any]
    fix: str
    state: Literal["firing", "resolved"] = "firing"
    figure: float | None = None
    threshold: float | None = None
    dag_id: str | None = None
    task_id: str | None = None
    run_id: str | None = None
    at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())

    def __post_init__(self) -> None:
        self.summary = redact(self.summary)
        self.fix = redact(self.fix)
        self.details = {k: redact(v) for k, v in self.details.items() if v is not None}

    @property
    def subject(self) -> str:
        """One line, printable ASCII, at most 100 characters (SNS's limits)."""
        head = (
            "RESOLVED"
            if self.state == "resolved"
            else {"task_failed": "FAILED", "audit_failing": "AUDIT", "wal_retained": "WAL", "freshness": "STALE"}[
                self.kind
            ]
        )
        s = f"[CDC {head}] {self.summary}"
        s = "".join(ch if 32 <= ord(ch) < 127 else "?" for ch in s)
        return s if len(s) <= 100 else s[:97] + "..."

    def text(self) -> str:
        lines = [("Resolved: " if self.state == "resolved" else "") + self.summary, ""]
        lines += [f"{k}: {v}" for k, v in self.details.items()]
        if self.state == "firing":
            lines += ["", f"What to do: {self.fix}"]
        where = ", ".join(
            f"{k} {v}" for k, v in (("DAG", self.dag_id), ("task", self.task_id), ("run", self.run_id)) if v
        )
        if where:
            lines += ["", f"Airflow: {where}"]
        lines += [f"Alert: {self.kind} ({self.state}) at {self.at}"]
        return "\n".join(lines)

    def html(self) -> str:
        return f'<pre style="font-family: monospace">{html.escape(self.text())}</pre>'

    def record(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "kind": self.kind,
            "state": self.state,
            "tables": self.tables,
            "table": self.tables[0] if len(self.tables) == 1 else None,
            "summary": self.summary,
            "details": self.details,
            "figure": self.figure,
            "threshold": self.threshold,
            "fix": self.fix,
            "dag_id": self.dag_id,
            "task_id": self.task_id,
            "run_id": self.run_id,
        }


def deliver(
    alert: Alert, channels: list[_Channel], context: dict[str, Any] | None = None, ac: AlertingConfig | None = None
) -> list[str]:
    """Log, record and send the alert through every channel that wants its kind.

    Returns the channels' errors (never raises): one channel's failure never stops the others."""
    level = logging.INFO if alert.state == "resolved" else logging.ERROR
    log.log(level, "CDC ALERT %s (%s): %s", alert.kind, alert.state, alert.text().replace("\n", " | "))
    sent, errors = [], []
    for ch in channels:
        if not ch.wants(alert.kind):
            continue
        try:
            # notify(), not __call__: the message is final; rendering it as a template would
            # evaluate whatever an error text happens to contain.
            ch.notifier(alert).notify(context or {})
            sent.append(ch.name)
        except Exception as exc:  # noqa: BLE001 - reported, the other channels still get it
            errors.append(f"channel {ch.name!r} ({ch.type}): {redact(exc)}")
            log.error("CDC alert not delivered through channel %r: %s", ch.name, redact(exc))
    _record(alert, sent, errors, ac)
    return errors


def _record(alert: Alert, sent: list[str], errors: list[str], ac: AlertingConfig | None) -> None:
    log_file = (ac or AlertingConfig()).log_file
    home = os.environ.get("AIRFLOW_HOME")
    if not log_file or not (home or os.path.isabs(log_file)):
        return
    try:
        path = Path(home or "/") / log_file
        with open(path, "a") as f:
            f.write(json.dumps({**alert.record(), "sent": sent, "errors": errors}, default=str) + "\n")
    except OSError as exc:
        log.warning("could not record the alert: %s", exc)


def decide(flags: list[bool], need: int, every: int) -> Literal["firing", "resolved"] | None:
    """The storm rule. flags: the condition per run, newest (this run) first.

    "firing" when the last `need` runs all had the condition and either it just reached `need`
    or another `every` runs have passed since; "resolved" on the first run without it after it
    fired; None otherwise."""
    if need <= 0 or not flags:
        return None
    now = _streak(flags)
    if now >= need:
        return "firing" if (now - need) % max(every, 1) == 0 else None
    if not flags[0] and _streak(flags[1:]) >= need:
        return "resolved"
    return None


def _streak(flags: list[bool]) -> int:
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "unknown"
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


# --- failed tasks ------------------------------------------------------------------------------------

_FIXES = {
    "capture": "read the task log: the error names the source connection, the slot or the preflight problem. "
    "Nothing is confirmed on the slot before the run's manifest is durable, so clearing the task "
    "after the fix loses nothing.",
    "ingest": "read the task log. Quarantined events: `python -m cdc_lakehouse.cli quarantine list {table}`; "
    "a schema change names the column and the choices in the error. Clear the run after the fix: "
    "the watermark makes reruns converge.",
    "audit": "read the audit in the task log (missing / extra / different keys per shard, with samples) and "
    "cdc_meta.audit_results; set audit.repair: true or re-bootstrap the shard "
    '(trigger cdc_bootstrap__{table} with {{"shards": [...]}}).',
    "bootstrap": "fix what the preflight or the error names, then trigger the DAG again (shards are replaced "
    "atomically).",
    "maintenance": "read the task log; maintenance never changes the table's content, the next run retries.",
    "export": "read the task log. A failed full export never moved the alias, a failed incremental one never "
    "moved the position: clear the task after the fix. A key-count mismatch means the key is not unique or "
    'another writer touched the namespace: trigger cdc_export__{table} with {{"mode": "full"}}; '
    '{{"mode": "rollback"}} points readers back at the previous version (docs/serving-export.md).',
    "check_alerts": "an alert could not be checked or delivered: read the task log (channel errors name the "
    "channel) and the connections of include/alerting.yaml.",
}


def failure_alert(context: dict[str, Any], tables: list[str] | None = None) -> Alert:
    ti = context.get("task_instance") or context.get("ti")
    dag_id = getattr(ti, "dag_id", None) or getattr(context.get("dag"), "dag_id", None) or "?"
    task_id = getattr(ti, "task_id", None) or "?"
    if not tables:
        tables = [dag_id.split("__", 1)[1]] if "__" in dag_id and not dag_id.startswith("cdc_ingest_group") else []
    exc = context.get("exception")
    error = redact(f"{type(exc).__name__}: {exc}" if isinstance(exc, BaseException) else exc)[:4000]
    step = task_id.split("__", 1)[0]
    endpoint = task_id.split("__", 1)[1] if step == "capture" and "__" in task_id else None
    what = ", ".join(tables) or dag_id
    details: dict[str, Any] = {
        "table": ", ".join(tables) or None,
        "endpoint": endpoint,
        "task": f"{dag_id}.{task_id}",
        "try": getattr(ti, "try_number", None),
        "error": error or "(no exception in context)",
        "log": getattr(ti, "log_url", None),
    }
    fix = _FIXES.get(step, "read the task log, fix the cause, clear the task.").format(
        table=tables[0] if len(tables) == 1 else "<table>"
    )
    return Alert(
        "task_failed",
        f"{task_id} of {what} failed",
        list(tables),
        details,
        fix,
        dag_id=dag_id,
        task_id=task_id,
        run_id=context.get("run_id"),
    )


class CdcFailureNotifier(BaseNotifier):
    """on_failure_callback of every CDC task: names the table(s), the task and the (redacted) error,
    and sends it through the tables' channels. Never raises: an alert problem is logged."""

    template_fields = ()

    def __init__(self, tables: list[str] | None = None):
        super().__init__()
        self.tables = list(tables or [])

    def notify(self, context: dict[str, Any]) -> None:
        try:
            alert = failure_alert(context, self.tables)
            try:
                ac = load_alerting()
            except AlertConfigError as exc:
                log.error("alerting config invalid, the alert is only logged: %s", exc)
                ac = AlertingConfig()
            cs = load_table_configs(tables_dir())
            cfgs = [cs.tables[t] for t in alert.tables if t in cs.tables]
            deliver(alert, channels_for(cfgs, ac), context, ac)
        except Exception:  # noqa: BLE001 - a failure callback must never raise
            log.exception("CDC failure alert could not be built or sent")

    def __repr__(self) -> str:
        return f"CdcFailureNotifier(tables={self.tables!r})"


def on_task_failure(context: dict[str, Any]) -> None:
    """Plain-callable form of CdcFailureNotifier (tables from the DAG id)."""
    CdcFailureNotifier().notify(context)


# --- checks on the run history in cdc_meta ------------------------------------------------------------


def _meta_rows(lake, name: str, column: str, value: str, fields: tuple[str, ...]) -> list[dict[str, Any]] | None:
    """Rows of cdc_meta.<name> where column == value (pyiceberg, no Spark); None if the table does not exist."""
    from pyiceberg.catalog import load_catalog
    from pyiceberg.exceptions import NoSuchTableError
    from pyiceberg.expressions import EqualTo

    catalog = load_catalog(lake.catalog_name, **lake.pyiceberg_properties())
    try:
        table = catalog.load_table(lake.meta_table(name))
    except NoSuchTableError:
        return None
    return table.scan(row_filter=EqualTo(column, value), selected_fields=fields).to_arrow().to_pylist()


def _latest_per_run(rows: list[dict[str, Any]], run_col: str, ts_col: str) -> dict[str, list[dict[str, Any]]]:
    """run -> the rows of its last attempt (a retried run is counted once, as it ended)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get(ts_col) is None:
            continue
        cur = out.get(r[run_col])
        if not cur or r[ts_col] > cur[0][ts_col]:
            out[r[run_col]] = [r]
        elif r[ts_col] == cur[0][ts_col]:
            cur.append(r)
    return out


def check_wal(
    manifest: dict[str, Any],
    members: list[TableConfig],
    ac: AlertingConfig,
    history: list[dict[str, Any]] | None = None,
) -> Alert | None:
    """wal_retained: the capture's slot retains more WAL than the smallest threshold of its tables.

    history: earlier cdc_meta.capture_runs rows of the endpoint (any order); the current run is
    taken from the manifest."""
    after = manifest.get("slot_after") or {}
    retained = after.get("retained_wal_bytes")
    rules = [rules_for(c, ac) for c in members]
    enabled = [r.retained_wal_bytes for r in rules if r.retained_wal_bytes > 0]
    if retained is None or not enabled:
        return None
    threshold = min(enabled)
    every = min(r.renotify_every_runs for r in rules)
    run_id = manifest.get("run_id")
    past = sorted(
        (r for r in history or [] if r.get("run_id") != run_id and r.get("finished_at")),
        key=lambda r: r["finished_at"],
        reverse=True,
    )
    flags = [retained > threshold] + [(r.get("retained_wal_bytes") or 0) > threshold for r in past]
    state = decide(flags, 1, every)
    if state is None:
        return None
    return _wal_alert(manifest, members, state, threshold, _streak(flags))


def _wal_alert(
    manifest: dict[str, Any],
    members: list[TableConfig],
    state: Literal["firing", "resolved"],
    threshold: int,
    streak: int,
) -> Alert:
    after = manifest.get("slot_after") or {}
    retained = after.get("retained_wal_bytes")
    run_id = manifest.get("run_id")
    endpoint, slot = manifest.get("endpoint"), after.get("slot") or manifest.get("slot")
    tables = sorted(c.name for c in members)
    if state == "resolved":
        summary = f"slot {slot} of endpoint {endpoint} retains {fmt_bytes(retained)} of WAL again"
    else:
        summary = f"slot {slot} of endpoint {endpoint} retains {fmt_bytes(retained)} of WAL (> {fmt_bytes(threshold)})"
    details = {
        "tables": ", ".join(tables),
        "endpoint": f"{endpoint} (connection {manifest.get('conn_id')})",
        "slot": slot,
        "retained WAL": f"{fmt_bytes(retained)} ({retained} bytes)",
        "threshold": f"{fmt_bytes(threshold)} ({threshold} bytes, alerts.retained_wal_bytes)",
        "unconfirmed (lag)": fmt_bytes(after.get("lag_bytes")),
        "wal_status": after.get("wal_status"),
        "runs over the threshold in a row": streak,
        "capture run": run_id,
    }
    fix = (
        f"the slot keeps WAL on the source until captures confirm it, so the source's disk fills while it "
        f"grows. Check that capture__{endpoint} runs and succeeds in every ingest DAG reading {endpoint} (a "
        f"paused DAG or a failing capture stops confirming); a capture capped by ingest.max_events_per_run / "
        f"max_bytes_per_run falls behind a busy source: raise the caps or run more often. A long transaction "
        f"on the source also holds WAL back. A slot nobody reads any more must be dropped "
        f"(SELECT pg_drop_replication_slot('{slot}')) once its tables are retired."
    )
    return Alert("wal_retained", summary, tables, details, fix, state=state, figure=retained, threshold=threshold)


def check_audit(
    cfg: TableConfig, audit_run: str, ac: AlertingConfig, results: list[dict[str, Any]], quality: list[dict[str, Any]]
) -> Alert | None:
    """audit_failing: the audit of the table failed in the last N runs (N = alerts.audit_failed_runs).

    A run failed when a shard's verdict is `fail` and it was not repaired, or a quality check
    failed (the same rule as the audit job's verdict). results/quality: the table's rows of
    cdc_meta.audit_results and cdc_meta.quality_results."""
    rules = rules_for(cfg, ac)
    if rules.audit_failed_runs <= 0:
        return None
    res = _latest_per_run(results, "audit_run", "audited_at")
    qual = _latest_per_run(quality, "audit_run", "checked_at")
    if audit_run not in res:
        log.info(
            "audit %s: run %s recorded no results (a failed audit job is alerted as a failed task)", cfg.name, audit_run
        )
        return None
    runs = sorted(res, key=lambda r: res[r][0]["audited_at"], reverse=True)
    flags = [bool(_bad_shards(res.get(r, [])) or _bad_quality(qual.get(r, []))) for r in runs]
    state = decide(flags, rules.audit_failed_runs, rules.renotify_every_runs)
    if state is None:
        return None
    return _audit_alert(cfg, audit_run, rules, state, _streak(flags), res[audit_run], qual.get(audit_run, []))


def _bad_shards(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("verdict") == "fail" and not r.get("repaired")]


def _bad_quality(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [q for q in rows if q.get("success") is False]


def _audit_alert(
    cfg: TableConfig,
    audit_run: str,
    rules: Rules,
    state: Literal["firing", "resolved"],
    streak: int,
    results: list[dict[str, Any]],
    quality: list[dict[str, Any]],
) -> Alert:
    """The alert of one audit run; results/quality: that run's rows."""
    bad_shards = _bad_shards(results)
    if state == "resolved":
        summary = f"audit of {cfg.name} passes again (run {audit_run})"
    else:
        summary = f"audit of {cfg.name} failed {streak} runs in a row (alert at {rules.audit_failed_runs})"
    details: dict[str, Any] = {
        "table": cfg.name,
        "lake table": cfg.current_table,
        "failed runs in a row": streak,
        "threshold": f"{rules.audit_failed_runs} runs (alerts.audit_failed_runs)",
        "audit run": audit_run,
    }
    for r in sorted(bad_shards, key=lambda r: r.get("shard") or ""):
        details[f"shard {r.get('shard')}"] = (
            f"{r.get('persistent')} persistent mismatching key(s): missing {r.get('missing')}, extra "
            f"{r.get('extra')}, different {r.get('different')}; source rows {r.get('source_rows')}, lake rows "
            f"{r.get('lake_rows')}; sample {r.get('sample_keys')}"
        )
    for q in _bad_quality(quality):
        details[f"quality {q.get('expectation')}"] = f"failed (observed {q.get('observed')})"
    shards = [r.get("shard") for r in bad_shards]
    fix = (
        f"read the audit in the task log and cdc_meta.audit_results / audit_mismatches (keys per shard, with "
        f"samples); quarantined events of those keys: `python -m cdc_lakehouse.cli quarantine list {cfg.name}`. "
        f"Set audit.repair: true to re-read persistent keys from the source, or re-bootstrap the shard(s): "
        f'trigger cdc_bootstrap__{cfg.name} with {{"shards": {json.dumps(shards)}}}. A failed quality check '
        f"names its expectation (freshness: see the ingest; row counts: see the shards)."
    )
    return Alert(
        "audit_failing",
        summary,
        [cfg.name],
        details,
        fix,
        state=state,
        figure=streak,
        threshold=rules.audit_failed_runs,
    )


def check_freshness(cfg: TableConfig, ingest_run: str, ac: AlertingConfig, runs: list[dict[str, Any]]) -> Alert | None:
    """freshness: the ingest's freshness_seconds (age of the oldest shard's last applied change or
    heartbeat when it committed) is beyond the SLA. runs: the table's cdc_meta.ingest_runs rows."""
    rules = rules_for(cfg, ac)
    if rules.freshness_sla <= 0:
        return None
    per_run = _latest_per_run(runs, "ingest_run", "committed_at")
    if ingest_run not in per_run:
        log.info(
            "freshness %s: ingest run %s committed no metrics (a failed ingest is alerted as a failed task)",
            cfg.name,
            ingest_run,
        )
        return None
    order = sorted(per_run, key=lambda r: per_run[r][0]["committed_at"], reverse=True)
    flags = [(per_run[r][0].get("freshness_seconds") or 0) > rules.freshness_sla for r in order]
    state = decide(flags, 1, rules.renotify_every_runs)
    if state is None:
        return None
    return _freshness_alert(cfg, ingest_run, rules, state, _streak(flags), per_run[ingest_run][0])


def _stalest_shard(row: dict[str, Any]) -> tuple[str | None, str | None]:
    """(shard, ts) of the oldest position in an ingest run's watermark; (None, None) if unreadable."""
    try:
        shards = json.loads(row.get("watermark") or "{}").get("shards") or {}
        ts = {s: v["ts"] for s, v in shards.items() if v.get("ts")}
        if ts:
            stalest = min(ts, key=lambda s: datetime.fromisoformat(ts[s]))
            return stalest, ts[stalest]
    except (ValueError, TypeError, AttributeError):
        pass
    return None, None


def _freshness_alert(
    cfg: TableConfig,
    ingest_run: str,
    rules: Rules,
    state: Literal["firing", "resolved"],
    streak: int,
    row: dict[str, Any],
) -> Alert:
    """The alert of one ingest run; row: that run's cdc_meta.ingest_runs row."""
    fresh = row.get("freshness_seconds")
    stalest, stalest_ts = _stalest_shard(row)
    if state == "resolved":
        summary = f"{cfg.name} is fresh again: {fmt_seconds(fresh)} behind its sources"
    else:
        summary = f"{cfg.name} is {fmt_seconds(fresh)} behind its sources (SLA {fmt_seconds(rules.freshness_sla)})"
    details = {
        "table": cfg.name,
        "lake table": cfg.current_table,
        "freshness": f"{fmt_seconds(fresh)} ({fresh:.0f} s)" if fresh is not None else None,
        "SLA": f"{fmt_seconds(rules.freshness_sla)} ({rules.freshness_sla:.0f} s, alerts.freshness_sla)",
        "stalest shard": f"{stalest} (last change or heartbeat applied: {stalest_ts})" if stalest else None,
        "runs over the SLA in a row": streak,
        "ingest run": ingest_run,
        "events read": row.get("events_read"),
    }
    fix = (
        "freshness is the age of the oldest shard's last applied transaction or heartbeat. Check the capture "
        "tasks of the shard's endpoint (failing, or capped by ingest.max_events_per_run / max_bytes_per_run "
        "so each run applies only part of the backlog), that the ingest DAG is not paused or queued behind "
        "a long maintenance or bootstrap in the table's pool, and that the source writes heartbeats "
        "(_cdc_heartbeat of each shard); per-run figures are in cdc_meta.ingest_runs."
    )
    return Alert(
        "freshness", summary, [cfg.name], details, fix, state=state, figure=fresh, threshold=rules.freshness_sla
    )


def check_shard_freshness(
    cfg: TableConfig, ingest_run: str, ac: AlertingConfig, rows: list[dict[str, Any]]
) -> Alert | None:
    """freshness, per shard: a shard whose position in the lake (fresh_to: its last applied change or
    heartbeat) was older than the SLA when the ingest run finished. rows: the table's
    cdc_meta.freshness rows (one per shard and run)."""
    rules = rules_for(cfg, ac)
    if rules.freshness_sla <= 0:
        return None
    per_run = _latest_per_run(rows, "ingest_run", "updated_at")
    if ingest_run not in per_run:
        log.info(
            "freshness %s: ingest run %s recorded no freshness (a failed ingest fails its task)", cfg.name, ingest_run
        )
        return None
    # This run and the ones before it, newest first (a check of an older run ignores later ones).
    at = per_run[ingest_run][0]["updated_at"]
    order = sorted((r for r in per_run if per_run[r][0]["updated_at"] <= at), key=lambda r: per_run[r][0]["updated_at"])
    flags = [bool(_stale_shards(per_run[r], rules.freshness_sla)) for r in reversed(order)]
    state = decide(flags, 1, rules.renotify_every_runs)
    if state is None:
        return None
    return _shard_freshness_alert(cfg, ingest_run, rules, state, _streak(flags), per_run[ingest_run])


def _stale_shards(rows: list[dict[str, Any]], sla: float) -> list[dict[str, Any]]:
    """The run's shards beyond the SLA, stalest first."""
    stale = [r for r in rows if (r.get("freshness_seconds") or 0) > sla]
    return sorted(stale, key=lambda r: -(r.get("freshness_seconds") or 0))


def _shard_line(r: dict[str, Any]) -> str:
    fresh = r.get("freshness_seconds")
    return (
        f"{fmt_seconds(fresh)} behind ({fresh:.0f} s) on endpoint {r.get('endpoint')} (schema "
        f"{r.get('source_schema')}); lake position {r.get('fresh_to')}, last heartbeat {r.get('last_heartbeat_ts')}, "
        f"last source commit {r.get('last_source_commit_ts')}, made visible by lake snapshot "
        f"{r.get('lake_snapshot_id')} at {r.get('lake_committed_at')}"
    )


def _shard_freshness_alert(
    cfg: TableConfig,
    ingest_run: str,
    rules: Rules,
    state: Literal["firing", "resolved"],
    streak: int,
    rows: list[dict[str, Any]],
) -> Alert:
    """The alert of one ingest run; rows: that run's cdc_meta.freshness rows (one per shard)."""
    stale = _stale_shards(rows, rules.freshness_sla)
    worst = max((r.get("freshness_seconds") or 0 for r in rows), default=0.0)
    sla = fmt_seconds(rules.freshness_sla)
    if state == "resolved":
        summary = f"{cfg.name} is fresh again: every shard within {sla} of its source"
    elif len(stale) == 1:
        summary = f"{cfg.name} shard {stale[0]['shard']} is {fmt_seconds(worst)} behind its source (SLA {sla})"
    else:
        summary = f"{cfg.name}: {len(stale)} shards up to {fmt_seconds(worst)} behind their sources (SLA {sla})"
    details: dict[str, Any] = {
        "table": cfg.name,
        "lake table": cfg.current_table,
        "SLA": f"{sla} ({rules.freshness_sla:.0f} s, alerts.freshness_sla)",
        "runs over the SLA in a row": streak,
        "ingest run": ingest_run,
    }
    for r in stale:
        details[f"shard {r.get('shard')}"] = _shard_line(r)
    endpoints = sorted({str(r.get("endpoint")) for r in stale})
    fix = (
        f"a shard's lake position only moves when a capture of its endpoint ({', '.join(endpoints) or '-'}) lands a "
        "run and this ingest applies it; the capture's heartbeat moves it on quiet shards. Check that "
        + ", ".join(f"capture__{e}" for e in endpoints)
        + " runs and succeeds (source reachable, slot active), that it is not capped by ingest.max_events_per_run / "
        "max_bytes_per_run, that the ingest DAG is not paused or queued behind a maintenance or bootstrap in the "
        "table's pool, and that the shard's _cdc_heartbeat table takes writes. Per-shard history: "
        f"cdc_meta.freshness (table_name = '{cfg.name}')."
    )
    return Alert(
        "freshness", summary, [cfg.name], details, fix, state=state, figure=worst, threshold=rules.freshness_sla
    )


# --- what the tasks call -------------------------------------------------------------------------------


def run_checks(
    kind: Literal["audit", "freshness"],
    tables: list[str],
    run_id: str,
    context: dict[str, Any] | None = None,
    lake=None,
) -> dict[str, Any]:
    """The check_alerts task: evaluate `kind` for each table on the run history and deliver.

    Reading the history is best effort (logged); a channel that cannot deliver fails the task
    after every channel was tried, so a broken channel is seen."""
    ac = load_alerting()
    cs = load_table_configs(tables_dir())
    if lake is None:
        from cdc_lakehouse.orchestration.tasks import lake_settings

        lake = lake_settings()
    check = _audit_from_history if kind == "audit" else _freshness_from_history
    out: dict[str, Any] = {}
    errors: list[str] = []
    for name in tables:
        cfg = cs.tables.get(name)
        if cfg is None:
            log.error("alert check: table %r has no valid config in %s", name, tables_dir())
            continue
        try:
            alert = check(lake, name, cfg, run_id, ac)
        except Exception as exc:  # noqa: BLE001 - the history is unreadable: say so, do not invent an alert
            log.warning("alert check %s of %s: run history not readable: %s", kind, name, redact(exc))
            out[name] = "history not readable"
            continue
        if alert is None:
            out[name] = "no alert"
            continue
        _stamp(alert, context, run_id)
        errors += deliver(alert, channels_for([cfg], ac), context, ac)
        out[name] = f"{alert.kind} {alert.state}"
    if errors:
        raise AlertDeliveryError("alert(s) not delivered: " + "; ".join(errors))
    return out


_AUDIT_FIELDS = (
    "audit_run",
    "shard",
    "verdict",
    "repaired",
    "persistent",
    "missing",
    "extra",
    "different",
    "source_rows",
    "lake_rows",
    "sample_keys",
    "audited_at",
)
_QUALITY_FIELDS = ("audit_run", "expectation", "success", "observed", "checked_at")
_INGEST_FIELDS = ("ingest_run", "freshness_seconds", "committed_at", "watermark", "events_read")


def _audit_from_history(lake, name: str, cfg: TableConfig, run_id: str, ac: AlertingConfig) -> Alert | None:
    results = _meta_rows(lake, "audit_results", "table_name", name, _AUDIT_FIELDS)
    quality = _meta_rows(lake, "quality_results", "table_name", name, _QUALITY_FIELDS) or []
    return check_audit(cfg, run_id, ac, results or [], quality)


_SHARD_FRESHNESS_FIELDS = (
    "ingest_run",
    "shard",
    "endpoint",
    "source_schema",
    "last_source_commit_ts",
    "last_heartbeat_ts",
    "fresh_to",
    "lake_snapshot_id",
    "lake_committed_at",
    "freshness_seconds",
    "updated_at",
)


def _freshness_from_history(lake, name: str, cfg: TableConfig, run_id: str, ac: AlertingConfig) -> Alert | None:
    """Per shard from cdc_meta.freshness; runs recorded before that table existed (no rows for
    the run) are judged on the table-level figure of cdc_meta.ingest_runs."""
    shard_rows = _meta_rows(lake, "freshness", "table_name", name, _SHARD_FRESHNESS_FIELDS) or []
    if any(r.get("ingest_run") == run_id for r in shard_rows):
        return check_shard_freshness(cfg, run_id, ac, shard_rows)
    rows = _meta_rows(lake, "ingest_runs", "table_name", name, _INGEST_FIELDS)
    return check_freshness(cfg, run_id, ac, rows or [])


def _stamp(alert: Alert, context: dict[str, Any] | None, run_id: str | None) -> None:
    """Where the alert comes from: the task instance in the Airflow context, and the run."""
    ti = (context or {}).get("ti") or (context or {}).get("task_instance")
    alert.dag_id, alert.task_id, alert.run_id = getattr(ti, "dag_id", None), getattr(ti, "task_id", None), run_id


def notify_wal(
    manifest: dict[str, Any],
    members: list[TableConfig],
    lake,
    context: dict[str, Any] | None = None,
) -> Alert | None:
    """Called by the capture task after the run is confirmed and recorded. Never raises: a capture
    does not fail because of its slot's size or an alert channel."""
    if manifest.get("reused"):
        return None
    try:
        ac = load_alerting()
        try:
            history = (
                _meta_rows(
                    lake,
                    "capture_runs",
                    "endpoint",
                    manifest["endpoint"],
                    ("run_id", "retained_wal_bytes", "finished_at"),
                )
                or []
            )
        except Exception as exc:  # noqa: BLE001 - without history every run over the threshold alerts
            log.warning("capture_runs history not readable (%s); alerting on this run alone", redact(exc))
            history = []
        alert = check_wal(manifest, members, ac, history)
        if alert is None:
            return None
        _stamp(alert, context, (context or {}).get("run_id"))
        deliver(alert, channels_for(members, ac), context, ac)
        return alert
    except Exception:  # noqa: BLE001
        log.exception("WAL alert check failed (the capture itself succeeded)")
        return None
