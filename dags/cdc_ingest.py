"""Incremental ingest: each source endpoint's committed changes are captured into the landing
zone, then one Spark job applies them to the lake (changelog append, LSN-guarded MERGE into the
current table, the watermark in the same commit), then the freshness alerts are checked.

One DAG per table of include/tables/*.yaml (`cdc_ingest__<table>`), or one per ingest group
(`cdc_ingest_group__<group>`: the tables with that `ingest.group`, in one Spark application), on
the table's `ingest.schedule`. Each run covers its data interval; reruns converge. Its current
and changelog tables' asset events carry the interval's start as their partition key and trigger
the derived, export and feed DAGs downstream, one run per key; the endpoint's
asset (`cdc://points/<endpoint>`) announces its newest consistent point across tables
(lake.points). A run not finished when its tables' freshness bound passes (counted from the
start of its interval) misses its deadline: shown on the run, and alerted as `freshness`.
A source column dropped with no decision in the YAML waits for a person: ingest >> review_dropped
>> decide_dropped (keep or drop) >> record_dropped >> ingest_again.
"""

from datetime import timedelta

from airflow.sdk import DAG
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.jobs.ingest import IngestParams
from cdc_lakehouse.orchestration.alerts.deadlines import alerting_or_defaults, freshness_deadline
from cdc_lakehouse.orchestration.approvals import asks_dropped, dropped_column_decision
from cdc_lakehouse.orchestration.dag_docs import group_doc, ingest_doc
from cdc_lakehouse.orchestration.dag_parts import (
    INGEST_RUN,
    START_DATE,
    alert_check_task,
    announce_snapshots,
    capture_tasks,
    conn_ids,
    dag_tags,
    default_args,
    endpoint_ids,
    group_pool,
    ingest_groups,
    ingest_outlets,
    load_configs,
    spark_task,
    table_pool,
    timetable,
)


def ingest_task(task_id: str, cfgs: list[TableConfig], pool: str, hours: int):
    """The Spark job applying the landed changes of `cfgs` (a group's: in one application)."""
    return spark_task(
        task_id=task_id,
        job="ingest",
        params=IngestParams(
            tables=tuple(c.name for c in cfgs),
            parallel=max(c.ingest.parallel_tables for c in cfgs) if len(cfgs) > 1 else 1,
            undecided_drop="ask" if asks_dropped(cfgs) else "stop",
        ),
        source_conn_ids=conn_ids(cfgs),
        pool=pool,
        templates=INGEST_RUN,
        outlets=ingest_outlets(cfgs),
        post_execute=announce_snapshots(cfgs),
        execution_timeout=timedelta(hours=hours),
    )


tables, _, _ = load_configs()
alerting = alerting_or_defaults()

for cfg in tables.tables.values():
    if cfg.ingest.group:
        continue  # ingested by its group's DAG, below
    with DAG(
        dag_id=f"cdc_ingest__{cfg.name}",
        schedule=timetable(cfg.ingest.schedule),
        start_date=START_DATE,
        catchup=False,
        max_active_runs=1,
        default_args=default_args(cfg),
        tags=dag_tags("ingest", cfg),
        doc_md=f"{__doc__}\n{ingest_doc(cfg)}",
        description=f"Hourly CDC ingest of {cfg.name} into {cfg.current_table}",
        deadline=freshness_deadline([cfg], alerting),
    ) as dag:
        captures = capture_tasks(endpoint_ids([cfg]))
        ingest = ingest_task("ingest", [cfg], table_pool(cfg), hours=2)
        captures >> ingest >> alert_check_task("freshness", [cfg.name])
        if decision := dropped_column_decision([cfg]):  # a dropped column waits for keep/drop
            review, recorded = decision
            ingest >> review
            recorded >> ingest_task("ingest_again", [cfg], table_pool(cfg), hours=2)
    globals()[dag.dag_id] = dag

for group, cfgs in ingest_groups(tables).items():
    names = [c.name for c in cfgs]
    with DAG(
        dag_id=f"cdc_ingest_group__{group}",
        schedule=timetable(cfgs[0].ingest.schedule),
        start_date=START_DATE,
        catchup=False,
        max_active_runs=1,
        default_args=default_args(cfgs[0], tables=names),
        tags=dag_tags("ingest", group=group),
        doc_md=f"{__doc__}\n{group_doc(group, cfgs)}",
        description=f"CDC ingest of {len(cfgs)} tables in one Spark application",
        deadline=freshness_deadline(cfgs, alerting),
    ) as dag:
        captures = capture_tasks(endpoint_ids(cfgs))
        ingest = ingest_task("ingest", cfgs, group_pool(group), hours=3)
        captures >> ingest >> alert_check_task("freshness", names)
        if decision := dropped_column_decision(cfgs):  # a dropped column waits for keep/drop
            review, recorded = decision
            ingest >> review
            recorded >> ingest_task("ingest_again", cfgs, group_pool(group), hours=3)
    globals()[dag.dag_id] = dag
