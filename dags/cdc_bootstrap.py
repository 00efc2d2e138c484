"""Snapshot bootstrap: loads a table's every shard (or the shards given) from a consistent
snapshot of the source, and sets its watermark where the incremental ingest continues, so there
is no gap and no overlap. Also the way back after a dropped or invalidated replication slot.
With the `columns` param it fills only those columns of the rows the lake has, online.

One DAG per table of include/tables/*.yaml (`cdc_bootstrap__<table>`), triggered by hand (no
schedule). It shares the table's writer pool with the ingest and the maintenance. When the
table already holds rows at a complete position, the run first waits for a person to approve
in the UI (Required Actions): review >> approve >> bootstrap; a rejection writes nothing.

One DAG per source endpoint (`cdc_recover__<endpoint>`), triggered by hand: after the endpoint's
slot was lost, the bootstrap of its shards of every table on it, one table after another.
"""

from datetime import timedelta

from airflow.sdk import DAG, Param
from cdc_lakehouse.jobs.bootstrap import BootstrapParams
from cdc_lakehouse.orchestration.approvals import rebootstrap_approval
from cdc_lakehouse.orchestration.dag_docs import bootstrap_doc, recover_doc
from cdc_lakehouse.orchestration.dag_parts import (
    START_DATE,
    announce_snapshots,
    asset,
    configs_by_endpoint,
    conn_ids,
    dag_tags,
    default_args,
    endpoint_ids,
    load_configs,
    spark_task,
    table_pool,
)

tables, _, _ = load_configs()

for cfg in tables.tables.values():
    with DAG(
        dag_id=f"cdc_bootstrap__{cfg.name}",
        schedule=None,
        start_date=START_DATE,
        catchup=False,
        max_active_runs=1,
        default_args=default_args(cfg),
        tags=dag_tags("bootstrap", cfg),
        doc_md=f"{__doc__}\n{bootstrap_doc(cfg)}",
        description=f"Snapshot bootstrap of {cfg.name} (all shards, or those in the 'shards' param)",
        params={
            "shards": Param([], type="array", description="shards to (re-)bootstrap; empty = all"),
            # Chunked mode (bootstrap.mode): pause after about N chunks; the next run resumes there.
            "pause_after_chunks": Param(
                0,
                type="integer",
                minimum=0,
                description="chunked mode: stop cleanly at the end of the round (one chunk per shard) "
                "in which this many chunks completed (0 = to the end); trigger again to resume after "
                "the last completed chunk",
            ),
            # After the endpoint's slot was lost: its shards only, in the snapshot mode.
            "endpoint": Param(
                "",
                type="string",
                enum=["", *endpoint_ids([cfg])],
                description="only the shards read through this endpoint (its slot was lost); not with shards",
            ),
            # A one-column backfill instead (bootstrap/column.py): only these columns of the rows
            # the lake has, from the source, in chunks between WAL markers; resumes like chunked mode.
            "columns": Param(
                [],
                type="array",
                description="fill only these columns of the existing rows from the source, online "
                "(a column newly consumed, given a volatile default, or to repair); empty = a bootstrap",
            ),
        },
    ) as dag:
        rebootstrap_approval(cfg) >> spark_task(
            task_id="bootstrap",
            job="bootstrap",
            params=BootstrapParams(tables=(cfg.name,)),
            source_conn_ids=conn_ids([cfg]),
            pool=table_pool(cfg),
            templates={
                "shards": "{{ params.shards | join(',') }}",
                "run_id": "{{ ts_nodash }}",
                "pause_after_chunks": "{{ params.pause_after_chunks }}",
                "columns": "{{ params.columns | join(',') }}",
                "endpoints": "{{ params.endpoint }}",
            },
            outlets=[asset(cfg.current_table), asset(cfg.changelog_table)],
            post_execute=announce_snapshots([cfg]),
            execution_timeout=timedelta(hours=24),
            trigger_rule="none_failed_min_one_success",  # after the approval, or without one
        )
    globals()[dag.dag_id] = dag


for endpoint, members in configs_by_endpoint(tables).items():
    with DAG(
        dag_id=f"cdc_recover__{endpoint}",
        schedule=None,
        start_date=START_DATE,
        catchup=False,
        max_active_runs=1,
        max_active_tasks=1,  # one table after another: one snapshot at a time on the source
        default_args=default_args(members[0], tables=[c.name for c in members]),
        tags=[*dag_tags("bootstrap"), f"endpoint:{endpoint}"],
        doc_md=f"{__doc__}\n{recover_doc(endpoint, members)}",
        description=f"Re-bootstrap endpoint {endpoint}'s shards of every table on it, after its slot was lost",
    ) as dag:
        for cfg in members:
            spark_task(
                task_id=f"bootstrap__{cfg.name}",
                job="bootstrap",
                params=BootstrapParams(tables=(cfg.name,), endpoints=(endpoint,)),
                source_conn_ids=conn_ids([cfg]),
                pool=table_pool(cfg),
                templates={"run_id": "{{ ts_nodash }}"},
                outlets=[asset(cfg.current_table), asset(cfg.changelog_table)],
                post_execute=announce_snapshots([cfg]),
                execution_timeout=timedelta(hours=24),
            )
    globals()[dag.dag_id] = dag
