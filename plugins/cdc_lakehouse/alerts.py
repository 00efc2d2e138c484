"""Failure callbacks: every failed CDC task raises an alert that names the table and the cause.

The alert is a log line at ERROR level and a JSON line in $AIRFLOW_HOME/cdc_alerts.jsonl,
where a team's own notifier (Slack, PagerDuty, email) can pick it up; tables with
`alert_emails` also get Airflow's failure email when SMTP is configured.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

log = logging.getLogger("cdc_lakehouse.alerts")


def alert_record(context: dict[str, Any]) -> dict[str, Any]:
    ti = context.get("task_instance") or context.get("ti")
    dag_id = getattr(ti, "dag_id", None) or getattr(context.get("dag"), "dag_id", "?")
    table = dag_id.split("__", 1)[1] if "__" in dag_id else None
    exc = context.get("exception")
    return {
        "at": datetime.now(UTC).isoformat(),
        "dag_id": dag_id,
        "task_id": getattr(ti, "task_id", None),
        "run_id": context.get("run_id"),
        "try_number": getattr(ti, "try_number", None),
        "table": table,
        "error": str(exc)[:4000] if exc else None,
    }


def on_task_failure(context: dict[str, Any]) -> None:
    rec = alert_record(context)
    log.error("CDC ALERT %s.%s (table %s): %s", rec["dag_id"], rec["task_id"], rec["table"], rec["error"])
    home = os.environ.get("AIRFLOW_HOME")
    if home:
        try:
            with open(Path(home) / "cdc_alerts.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
        except OSError as exc:
            log.warning("could not record the alert: %s", exc)
