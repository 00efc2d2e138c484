"""What the tasks call: the check_alerts tasks (run_checks) and the capture's WAL check (notify_wal),
which read the run history in cdc_meta (pyiceberg, no Spark) and deliver."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from cdc_lakehouse.config import TableConfig, load_table_configs
from cdc_lakehouse.lake.ingest_metrics import IngestMetrics
from cdc_lakehouse.lake.meta_rows import AuditResult, CaptureRun, QualityResult, ShardFreshness
from cdc_lakehouse.orchestration.alerts.alert import Alert
from cdc_lakehouse.orchestration.alerts.checks import check_audit, check_freshness, check_shard_freshness, check_wal
from cdc_lakehouse.orchestration.alerts.config import AlertDeliveryError, AlertingConfig, channels_for, load_alerting
from cdc_lakehouse.orchestration.alerts.delivery import deliver
from cdc_lakehouse.orchestration.history import meta_rows
from cdc_lakehouse.orchestration.metrics import audit_metrics, freshness_metrics, ingest_metrics
from cdc_lakehouse.secrecy import redact
from cdc_lakehouse.settings import tables_dir

if TYPE_CHECKING:
    from cdc_lakehouse.capture.capture_run import CaptureResult

log = logging.getLogger(__name__)


def run_checks(
    kind: Literal["audit", "freshness"],
    tables: list[str],
    run_id: str,
    context: dict[str, Any] | None = None,
    lake=None,
) -> dict[str, str]:
    """The check_alerts task: evaluate `kind` for each table on the run history and deliver;
    returns table -> what came of it ("no alert", "history not readable", "<kind> <state>").

    Reading the history is best effort (logged); a channel that cannot deliver fails the task
    after every channel was tried, so a broken channel is seen."""
    ac = load_alerting()
    cs = load_table_configs(tables_dir())
    if lake is None:
        from cdc_lakehouse.orchestration.tasks import lake_settings

        lake = lake_settings()
    check = _audit_from_history if kind == "audit" else _freshness_from_history
    out: dict[str, str] = {}
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


# The columns each check reads (checks.py); the records' other fields stay None.
_AUDIT_FIELDS = (
    "table_name",  # the metrics name it
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
    "seconds",
)
_QUALITY_FIELDS = ("audit_run", "expectation", "success", "observed", "checked_at")
_INGEST_FIELDS = ("ingest_run", "freshness_seconds", "committed_at", "watermark", "events_read")
# What the run's metrics add (orchestration.metrics).
_INGEST_METRIC_FIELDS = ("table_name", *_INGEST_FIELDS, "quarantined", "inserts", "updates", "deletes", "total_seconds")


def _audit_from_history(lake, name: str, cfg: TableConfig, run_id: str, ac: AlertingConfig) -> Alert | None:
    results = meta_rows(lake, "audit_results", AuditResult, "table_name", name, _AUDIT_FIELDS)
    quality = meta_rows(lake, "quality_results", QualityResult, "table_name", name, _QUALITY_FIELDS) or []
    audit_metrics(_latest(r for r in results or [] if r.audit_run == run_id))
    return check_audit(cfg, run_id, ac, results or [], quality)


def _latest(rows: Iterable[AuditResult]) -> list[AuditResult]:
    """The newest row per shard (a retried audit records its shards again)."""
    newest: dict[str, AuditResult] = {}
    for r in sorted(rows, key=lambda r: _when(r.audited_at)):
        newest[r.shard] = r
    return list(newest.values())


def _when(at: datetime | None) -> float:
    return at.timestamp() if at is not None else 0.0


_SHARD_FRESHNESS_FIELDS = (
    "table_name",  # the metrics name it
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
    shard_rows = meta_rows(lake, "freshness", ShardFreshness, "table_name", name, _SHARD_FRESHNESS_FIELDS) or []
    rows = meta_rows(lake, "ingest_runs", IngestMetrics, "table_name", name, _INGEST_METRIC_FIELDS) or []
    this_run = [r for r in shard_rows if r.ingest_run == run_id]
    freshness_metrics(this_run)
    # A rerun of the interval records the run again: its newest row.
    ingest_metrics(sorted((r for r in rows if r.ingest_run == run_id), key=lambda r: _when(r.committed_at))[-1:])
    if this_run:
        return check_shard_freshness(cfg, run_id, ac, shard_rows)
    return check_freshness(cfg, run_id, ac, rows)


def _stamp(alert: Alert, context: dict[str, Any] | None, run_id: str | None) -> None:
    """Where the alert comes from: the task instance in the Airflow context, and the run."""
    ti = (context or {}).get("ti") or (context or {}).get("task_instance")
    alert.dag_id, alert.task_id, alert.run_id = getattr(ti, "dag_id", None), getattr(ti, "task_id", None), run_id


def notify_wal(
    result: CaptureResult,
    members: list[TableConfig],
    lake,
    context: dict[str, Any] | None = None,
) -> Alert | None:
    """Called by the capture task after the run is confirmed and recorded. Never raises: a capture
    does not fail because of its slot's size or an alert channel."""
    if result.reused:
        return None
    manifest = result.manifest
    try:
        ac = load_alerting()
        try:
            assert manifest.endpoint is not None  # every capture manifest names its endpoint
            history = (
                meta_rows(
                    lake,
                    "capture_runs",
                    CaptureRun,
                    "endpoint",
                    manifest.endpoint,
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
