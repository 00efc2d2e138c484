"""Failed tasks: every CDC task's on_failure_callback (CdcFailureNotifier), after its retries."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from airflow.sdk.bases.notifier import BaseNotifier

from cdc_lakehouse.config import load_table_configs
from cdc_lakehouse.orchestration.alerts.alert import Alert
from cdc_lakehouse.orchestration.alerts.config import AlertConfigError, AlertingConfig, channels_for, load_alerting
from cdc_lakehouse.orchestration.alerts.delivery import deliver
from cdc_lakehouse.secrecy import redact
from cdc_lakehouse.settings import tables_dir

if TYPE_CHECKING:
    from airflow.sdk import Context

log = logging.getLogger(__name__)

_FIXES = {
    "capture": "read the task log: the error names the source connection, the slot or the preflight problem. "
    "Nothing is confirmed on the slot before the run's manifest is durable, so clearing the task "
    "after the fix loses nothing. A slot dropped or invalidated (SlotLostError, not retried): trigger "
    "cdc_recover__{endpoint}, which re-bootstraps the endpoint's shards and replaces the slot.",
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


def failure_alert(context: Mapping[str, Any], tables: list[str] | None = None) -> Alert:
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
        table=tables[0] if len(tables) == 1 else "<table>", endpoint=endpoint or "<endpoint>"
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

    def notify(self, context: Context) -> None:
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


def on_task_failure(context: Context) -> None:
    """Plain-callable form of CdcFailureNotifier (tables from the DAG id)."""
    CdcFailureNotifier().notify(context)
