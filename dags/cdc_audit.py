"""Source-vs-lake audit: compares every source shard's primary keys (or per-bucket counts and
hashes) with the lake's current table as of its watermark, runs the Great Expectations checks,
optionally repairs persistent mismatches through the ingest's LSN-guarded path, then checks the
audit-streak alerts.

One DAG per table of include/tables/*.yaml (`cdc_audit__<table>`), on the table's
`audit.schedule`; results in lake.cdc_meta.audit_results and lake.cdc_meta.quality_results.
A repair of more persistent keys than `approvals.repair_above_keys` is left for a person:
audit >> review >> approve >> repair; a rejection fails the run, the mismatches stay.
"""

from datetime import timedelta

from airflow.sdk import DAG
from cdc_lakehouse.jobs.audit import AuditParams
from cdc_lakehouse.orchestration.approvals import repair_approval
from cdc_lakehouse.orchestration.dag_docs import audit_doc
from cdc_lakehouse.orchestration.dag_parts import (
    START_DATE,
    alert_check_task,
    asset,
    conn_ids,
    dag_tags,
    default_args,
    load_configs,
    spark_task,
    table_pool,
    timetable,
)

tables, _, _ = load_configs()

for cfg in tables.tables.values():
    with DAG(
        dag_id=f"cdc_audit__{cfg.name}",
        schedule=timetable(cfg.audit.schedule),
        start_date=START_DATE,
        catchup=False,
        max_active_runs=1,
        default_args=default_args(cfg),
        tags=dag_tags("audit", cfg),
        doc_md=f"{__doc__}\n{audit_doc(cfg)}",
        description=f"Hourly source-vs-lake audit of {cfg.name}",
    ) as dag:
        audit = spark_task(
            task_id="audit",
            job="audit",
            params=AuditParams(tables=(cfg.name,)),
            source_conn_ids=conn_ids([cfg]),
            pool=table_pool(cfg),
            templates={"audit_run": "{{ run_id }}"},
            inlets=[asset(cfg.current_table)],
            execution_timeout=timedelta(hours=1),
        )
        audit >> alert_check_task("audit", [cfg.name])
        (
            audit
            >> repair_approval(cfg)
            >> spark_task(
                task_id="repair",
                job="audit",
                params=AuditParams(tables=(cfg.name,), repair="approved"),
                source_conn_ids=conn_ids([cfg]),
                pool=table_pool(cfg),
                templates={"audit_run": "{{ run_id }}__repair"},
                inlets=[asset(cfg.current_table)],
                trigger_rule="none_failed_min_one_success",  # after the approval
                execution_timeout=timedelta(hours=1),
            )
        )
    globals()[dag.dag_id] = dag
