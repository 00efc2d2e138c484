"""Deadlines: an ingest run still unfinished when its tables' freshness bound passes (#53).

Each ingest DAG carries an Airflow 3.3 DeadlineAlert. Its reference is the run's logical date:
the start of the run's data interval, which is about where the previous run left the lake
fresh to. Its interval is the strictest freshness bound of the DAG's tables (`alerts.freshness_sla`,
else include/alerting.yaml's default, else `audit.freshness_sla_minutes`). A run not finished by
then means the lake is behind by more than the bound. The scheduler marks the run's deadline
missed (the run's page in the UI shows it) and has the executor call
`freshness_deadline_missed`. That sends a `freshness` alert through the tables' channels.

The check_alerts teardown alerts on the freshness an ingest measured once it committed. The
deadline covers what that check never sees: a run that hangs, waits for its pool slot or
never gets a worker. Backfill runs (past intervals) get no alert: their deadline had passed
before they were created, and a run that failed has had its task_failed alert already.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from cdc_lakehouse.config import TableConfig, load_table_configs, switched_on
from cdc_lakehouse.orchestration.alerts.alert import Alert, fmt_seconds
from cdc_lakehouse.orchestration.alerts.config import (
    AlertConfigError,
    AlertingConfig,
    channels_for,
    load_alerting,
    rules_for,
)
from cdc_lakehouse.orchestration.alerts.delivery import deliver
from cdc_lakehouse.settings import tables_dir

log = logging.getLogger(__name__)


def alerting_or_defaults() -> AlertingConfig:
    """include/alerting.yaml, or the defaults where it is invalid."""
    try:
        return load_alerting()
    except AlertConfigError as exc:  # reported by cdc_config_check; the tables' own bounds still apply
        log.error("alerting config invalid, deadlines use the tables' own bounds: %s", exc)
        return AlertingConfig()


def freshness_bound(cfgs: list[TableConfig], ac: AlertingConfig | None = None) -> float:
    """The strictest freshness bound (seconds) of these tables; 0: none set (alerts off)."""
    ac = ac or alerting_or_defaults()
    bounds = [b for b in (rules_for(c, ac).freshness_sla for c in cfgs) if b > 0]
    return min(bounds, default=0.0)


DEADLINES_ENV = "CDC_DEADLINES"  # "off": the ingest DAGs carry no deadline


def deadlines_wanted(argv: Sequence[str] = sys.argv, environ: Mapping[str, str] = os.environ) -> bool:
    """False with CDC_DEADLINES=off, and under `airflow dags test`: Airflow 3.3.2's DAG.test()
    fails a successful run of a DAG that has a deadline (apache/airflow#73428, fix proposed in
    #73430), and nothing processes deadlines there anyway (the scheduler does). `make demo`
    runs the CLI's function in its own process and sets CDC_DEADLINES=off."""
    if not switched_on(environ, DEADLINES_ENV):
        return False
    args = list(argv[1:])
    return not any(args[i : i + 2] == ["dags", "test"] for i in range(len(args)))


def freshness_deadline(cfgs: list[TableConfig], ac: AlertingConfig | None = None) -> Any:
    """The ingest DAG's `deadline` (None when no table has a freshness bound, or deadlines are
    not wanted in this process: deadlines_wanted)."""
    from airflow.sdk.definitions.callback import SyncCallback
    from airflow.sdk.definitions.deadline import DeadlineAlert, DeadlineReference

    bound = freshness_bound(cfgs, ac)
    if not bound or not deadlines_wanted():
        return None
    return DeadlineAlert(
        reference=DeadlineReference.DAGRUN_LOGICAL_DATE,
        interval=timedelta(seconds=bound),
        callback=SyncCallback(
            f"{__name__}.freshness_deadline_missed",
            kwargs={"tables": [c.name for c in cfgs], "bound_seconds": bound},
        ),
        name="freshness",
    )


def deadline_alert(tables: list[str], bound_seconds: float, context: Mapping[str, Any]) -> Alert:
    """The `freshness` alert of an ingest run that missed its deadline (context: what Airflow
    hands a deadline callback: the run as the REST API shows it, and the deadline)."""
    run = context.get("dag_run") or {}
    deadline = context.get("deadline") or {}
    what = ", ".join(tables)
    return Alert(
        "freshness",
        f"{what}: ingest run not finished {fmt_seconds(bound_seconds)} after its interval began",
        list(tables),
        {
            "table": what,
            "run": run.get("dag_run_id"),
            "run state": run.get("state"),
            "interval began": run.get("logical_date") or run.get("data_interval_start"),
            "deadline": deadline.get("deadline_time"),
            "bound": f"{fmt_seconds(bound_seconds)} ({bound_seconds:.0f} s, alerts.freshness_sla)",
        },
        "the lake is behind its sources by more than the bound until this run finishes. Open the run: a "
        "capture or ingest still running (its log), a task waiting for the table's pool slot (a long "
        "bootstrap, audit or maintenance holds it), or a task queued for want of a worker.",
        figure=None,
        threshold=bound_seconds,
        dag_id=run.get("dag_id"),
        run_id=run.get("dag_run_id"),
    )


def freshness_deadline_missed(
    tables: list[str], bound_seconds: float, context: Mapping[str, Any] | None = None
) -> None:
    """The deadline's callback, run by the executor: the alert through the tables' channels."""
    context = context or {}
    run = context.get("dag_run") or {}
    if run.get("run_type") == "backfill":
        log.info("deadline of backfill run %s passed before it was created: no alert", run.get("dag_run_id"))
        return
    if run.get("state") == "failed":
        # Airflow 3.3 keeps a failed run's deadline (apache/airflow#60927); its task_failed
        # alert has already gone out, with the error and what to do.
        log.info(
            "run %s failed before its deadline: its failure alert stands, no freshness alert", run.get("dag_run_id")
        )
        return
    ac = alerting_or_defaults()
    cs = load_table_configs(tables_dir())
    deliver(
        deadline_alert(tables, bound_seconds, context),
        channels_for([cs.tables[t] for t in tables if t in cs.tables], ac),
        None,
        ac,
    )
