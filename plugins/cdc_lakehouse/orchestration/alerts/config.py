"""The alerting configuration: include/alerting.yaml (or CDC_ALERTING_FILE) validated into channels
and default thresholds, each table's thresholds (Rules) and channels.

Cheap to import and to check: DAG files reach it at parse time (alerting_errors imports no provider).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from airflow.sdk.bases.notifier import BaseNotifier
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cdc_lakehouse.config import AlertKind, AlertThresholds, TableConfig
from cdc_lakehouse.settings import PROJECT_ROOT

if TYPE_CHECKING:
    from cdc_lakehouse.orchestration.alerts.alert import Alert

log = logging.getLogger(__name__)

KINDS: tuple[str, ...] = ("task_failed", "audit_failing", "wal_retained", "freshness")
# Used when neither the table nor include/alerting.yaml sets a threshold (freshness: the
# table's audit.freshness_sla_minutes).
BUILTIN_DEFAULTS = {"audit_failed_runs": 3, "retained_wal_bytes": 10 * 1024**3, "renotify_every_runs": 6}


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


class AlertChannel(_Model):
    name: str = Field("", description="how tables refer to the channel in `alerts.channels`")
    kinds: list[AlertKind] | None = Field(None, description="alert kinds sent here; default: all")

    def wants(self, kind: str) -> bool:
        return self.kinds is None or kind in self.kinds

    def provider(self) -> tuple[str, str, str] | None:
        """(module, class, pip package) of the notifier, to check it is installed."""
        return None

    def notifier(self, alert: Alert) -> BaseNotifier:
        raise NotImplementedError


class SmtpChannel(AlertChannel):
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


class SnsChannel(AlertChannel):
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


class SlackChannel(AlertChannel):
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


class NotifierChannel(AlertChannel):
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

    def channel(self, name: str) -> Channel | None:
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


def channels_for(cfgs: list[TableConfig], ac: AlertingConfig) -> list[Channel]:
    """The channels of these tables: those named in their `alerts.channels` (default: all), plus
    one SMTP channel to the union of their `alert_emails`."""
    out: list[Channel] = []
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
