"""Derived trees: places every node of a table in its tree (root, depth, ancestor path, effective
grants) and keeps the result in the lake, incrementally from the output's watermark; nodes that
cannot be placed go to an unresolved table and are retried every run. Reads the lake only.

One DAG per derived table of include/derived/*.yaml (`cdc_derived__<derived>`), run once per partition
key of its input tables' asset events (dag_parts.on_assets: a re-run of one ingest interval,
one more run). Its compaction and expiry:
`cdc_maintenance__<derived>` (dags/cdc_maintenance.py). Details: docs/derived-trees.md.
"""

import functools
import operator
from datetime import timedelta

from airflow.sdk import DAG
from cdc_lakehouse.jobs.derive import DeriveMode, DeriveParams
from cdc_lakehouse.orchestration.dag_docs import derived_doc
from cdc_lakehouse.orchestration.dag_parts import (
    START_DATE,
    asset,
    dag_tags,
    default_args,
    load_configs,
    mode_param,
    on_assets,
    spark_task,
)

tables, derived, _ = load_configs()

for dcfg in derived.derived.values():
    inputs = [tables.tables[n] for n in dict.fromkeys(dcfg.input_names)]
    inlets = [asset(t.current_table) for t in inputs]
    with DAG(
        dag_id=f"cdc_derived__{dcfg.name}",
        # Asset-driven (AssetAny): a new snapshot of either input's current table triggers a run,
        # one per partition key (the interval the input's ingest applied).
        schedule=on_assets(functools.reduce(operator.or_, inlets)),
        start_date=START_DATE,
        catchup=False,
        max_active_runs=1,
        default_args=default_args(dcfg),
        tags=dag_tags("derived", dcfg),
        doc_md=f"{__doc__}\n{derived_doc(dcfg, inputs)}",
        description=f"Derived tree {dcfg.output_table} from {', '.join(t.current_table for t in inputs)}",
        params={"mode": mode_param(DeriveMode, "auto: incremental; full: recompute all")},
    ) as dag:
        spark_task(
            task_id="derive",
            job="derive",
            params=DeriveParams(derived=(dcfg.name,)),
            source_conn_ids=[],  # reads the lake only, never a source
            pool=dcfg.pool,
            templates={"mode": "{{ params.mode }}"},
            inlets=inlets,
            outlets=[asset(dcfg.output_table)],
            execution_timeout=timedelta(hours=2),
        )
    globals()[dag.dag_id] = dag
