"""History rebuild: a table's history (every version of every row, docs/history-tables.md)
rebuilt from its changelog in one commit. The ingest keeps the history after each batch; this is
for a history dropped or damaged by hand, or a change of how versions are made.

One DAG per table of include/tables/*.yaml with `history: {enabled: true}`
(`cdc_history__<table>`), triggered by hand (no schedule), in the table's writer pool.
"""

from datetime import timedelta

from airflow.sdk import DAG
from cdc_lakehouse.jobs.history import HistoryParams
from cdc_lakehouse.orchestration.dag_docs import history_doc
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
    if not cfg.history.enabled:
        continue
    with DAG(
        dag_id=f"cdc_history__{cfg.name}",
        schedule=None,
        start_date=START_DATE,
        catchup=False,
        max_active_runs=1,
        default_args=default_args(cfg),
        tags=dag_tags("history", cfg),
        doc_md=f"{__doc__}\n{history_doc(cfg)}",
        description=f"Rebuild of {cfg.history_table} from {cfg.changelog_table}",
    ) as dag:
        spark_task(
            task_id="rebuild",
            job="history",
            params=HistoryParams(tables=(cfg.name,), mode="rebuild"),
            source_conn_ids=[],  # reads the lake only
            pool=table_pool(cfg),
            execution_timeout=timedelta(hours=6),
        )
    globals()[dag.dag_id] = dag
