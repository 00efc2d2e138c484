"""Serving exports: copies a lake table (a table's current table or a derived tree) into a
key-value store (Redis, DynamoDB) that applications read: a full export writes a new version and
switches an alias to it atomically; later runs upsert and delete only the changed keys. Reads the
lake only; the store's secret is resolved at run time from its connection.

One DAG per export of include/exports/*.yaml (`cdc_export__<export>`), run once per partition key of
its source table's asset events (dag_parts.on_assets) or on the export's own `schedule`. Details: docs/serving-export.md.
"""

from datetime import timedelta

from airflow.sdk import DAG
from cdc_lakehouse.jobs.export import ExportMode, ExportParams
from cdc_lakehouse.orchestration.dag_docs import export_doc
from cdc_lakehouse.orchestration.dag_parts import (
    START_DATE,
    asset,
    dag_tags,
    default_args,
    load_configs,
    mode_param,
    on_assets,
    spark_task,
    timetable,
)
from cdc_lakehouse.serving.config import resolve_source

tables, derived, exports = load_configs()

for ecfg in exports.exports.values():
    source = resolve_source(ecfg, tables.tables, derived.derived).table
    with DAG(
        dag_id=f"cdc_export__{ecfg.name}",
        schedule=timetable(ecfg.schedule) if ecfg.schedule else on_assets(asset(source)),
        start_date=START_DATE,
        catchup=False,
        max_active_runs=1,
        default_args=default_args(ecfg),
        tags=dag_tags("export", ecfg),
        doc_md=f"{__doc__}\n{export_doc(ecfg, source)}",
        description=f"Serving export of {source} into {ecfg.store.kind} namespace {ecfg.store.namespace}",
        params={
            "mode": mode_param(
                ExportMode,
                "auto: incremental; full: a new version; rollback: alias back to the previous "
                "version, held there; resume: release the hold",
            )
        },
    ) as dag:
        spark_task(
            task_id="export",
            job="export",
            params=ExportParams(exports=(ecfg.name,)),
            source_conn_ids=[],  # reads the lake only
            pool=ecfg.pool,
            templates={"mode": "{{ params.mode }}"},
            store_conns=[(ecfg.store.kind, ecfg.store.conn_id)],
            inlets=[asset(source)],
            execution_timeout=timedelta(hours=2),
        )
    globals()[dag.dag_id] = dag
