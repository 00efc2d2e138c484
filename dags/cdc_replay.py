"""Quarantine replay: a table's quarantined events, re-validated against its config as it is now
(after the fix: a widened column type, a corrected rule), are merged where they pass; the others
stay quarantined with their reason. The LSN guard keeps every newer change.

One DAG per table of include/tables/*.yaml (`cdc_replay__<table>`), triggered by hand (no
schedule), in the table's writer pool. `review` counts what is quarantined and by which reason;
when there is something to replay, `approve` waits for a person in the UI (Required Actions):
review >> approve >> replay; a rejection writes nothing. The CLI's `quarantine replay T` does the
same replay without the approval.
"""

from datetime import timedelta

from airflow.sdk import DAG
from cdc_lakehouse.jobs.replay import ReplayParams
from cdc_lakehouse.orchestration.approvals import replay_approval
from cdc_lakehouse.orchestration.dag_docs import replay_doc
from cdc_lakehouse.orchestration.dag_parts import (
    START_DATE,
    dag_tags,
    default_args,
    load_configs,
    spark_task,
    table_pool,
)

tables, _, _ = load_configs()

for cfg in tables.tables.values():
    with DAG(
        dag_id=f"cdc_replay__{cfg.name}",
        schedule=None,
        start_date=START_DATE,
        catchup=False,
        max_active_runs=1,
        default_args=default_args(cfg),
        tags=dag_tags("replay", cfg),
        doc_md=f"{__doc__}\n{replay_doc(cfg)}",
        description=f"Quarantine replay of {cfg.name} into {cfg.current_table}, after an approval",
    ) as dag:
        replay_approval(cfg) >> spark_task(
            task_id="replay",
            job="replay",
            params=ReplayParams(tables=(cfg.name,)),
            source_conn_ids=[],  # reads the landing zone and the lake only
            pool=table_pool(cfg),
            templates={"replay_run": "{{ run_id }}"},
            trigger_rule="none_failed_min_one_success",  # after the approval, or without one
            execution_timeout=timedelta(hours=2),
        )
    globals()[dag.dag_id] = dag
