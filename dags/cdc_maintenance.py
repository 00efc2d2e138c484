"""Maintenance: keeps the lake's tables fit with Iceberg's own Spark procedures (compaction,
position-delete and manifest rewrites, snapshot expiry that never drops a watermark's or a held
snapshot, orphan-file removal); for a table, also rebuilds its latest-per-key view.

One DAG per table of include/tables/*.yaml (`cdc_maintenance__<table>`, in the table's writer
pool) and one per derived table of include/derived/*.yaml (`cdc_maintenance__<derived>`: its
output and unresolved tables, in its pool), on their `maintenance.schedule`. Before/after
figures go to lake.cdc_meta.maintenance_runs.
"""

from datetime import timedelta

from airflow.sdk import DAG
from cdc_lakehouse.jobs.maintenance import MaintenanceParams
from cdc_lakehouse.orchestration.dag_docs import derived_maintenance_doc, maintenance_doc
from cdc_lakehouse.orchestration.dag_parts import (
    START_DATE,
    asset,
    dag_tags,
    default_args,
    load_configs,
    spark_task,
    table_pool,
    timetable,
)

tables, derived, _ = load_configs()

for cfg in tables.tables.values():
    with DAG(
        dag_id=f"cdc_maintenance__{cfg.name}",
        schedule=timetable(cfg.maintenance.schedule),
        start_date=START_DATE,
        catchup=False,
        max_active_runs=1,
        default_args=default_args(cfg),
        tags=dag_tags("maintenance", cfg),
        doc_md=f"{__doc__}\n{maintenance_doc(cfg)}",
        description=f"Daily maintenance of {cfg.name}",
    ) as dag:
        spark_task(
            task_id="maintenance",
            job="maintenance",
            params=MaintenanceParams(tables=(cfg.name,)),
            source_conn_ids=[],
            pool=table_pool(cfg),
            templates={"run_id": "{{ ts_nodash }}"},
            inlets=[asset(cfg.current_table), asset(cfg.changelog_table)],
            outlets=[asset(cfg.latest_view)] if cfg.maintenance.latest_view != "none" else [],
            execution_timeout=timedelta(hours=6),
        )
    globals()[dag.dag_id] = dag

for dcfg in derived.derived.values():
    with DAG(
        dag_id=f"cdc_maintenance__{dcfg.name}",
        schedule=timetable(dcfg.maintenance.schedule),
        start_date=START_DATE,
        catchup=False,
        max_active_runs=1,
        default_args=default_args(dcfg),
        tags=dag_tags("maintenance", dcfg),
        doc_md=f"{__doc__}\n{derived_maintenance_doc(dcfg)}",
        description=f"Daily maintenance of derived table {dcfg.name}",
    ) as dag:
        spark_task(
            task_id="maintenance",
            job="maintenance",
            params=MaintenanceParams(derived=(dcfg.name,)),
            source_conn_ids=[],
            pool=dcfg.pool,
            templates={"run_id": "{{ ts_nodash }}"},
            inlets=[asset(dcfg.output_table)],
            execution_timeout=timedelta(hours=6),
        )
    globals()[dag.dag_id] = dag
