"""DAG policy tests: the DagBag of this repository imports cleanly, cheaply, and every DAG
carries what operating it needs (docs, tags, owner, retries with backoff, writer pools)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DAGS = ROOT / "dags"
TABLES = ROOT / "include" / "tables"
DERIVED = ROOT / "include" / "derived"


def _env(**extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
    }
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def dagbag():
    os.environ.setdefault("CDC_TABLES_DIR", str(TABLES))  # DERIVED is its sibling: settings.derived_dir
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS))


def test_no_import_errors(dagbag):
    assert dagbag.import_errors == {}, dagbag.import_errors


def test_every_table_has_its_four_dags(dagbag):
    from cdc_lakehouse.config import load_table_configs

    cs = load_table_configs(TABLES)
    assert cs.tables, "the demo configs should load"
    for name, cfg in cs.tables.items():
        ingest = f"cdc_ingest_group__{cfg.ingest.group}" if cfg.ingest.group else f"cdc_ingest__{name}"
        for dag_id in (ingest, f"cdc_bootstrap__{name}", f"cdc_maintenance__{name}", f"cdc_audit__{name}"):
            assert dag_id in dagbag.dags, f"{dag_id} missing from {sorted(dagbag.dags)}"


def _dag_ids() -> list[str]:
    from tests.dag_files import dags_of

    # and the example change-feed consumer, a DAG file of its own (dags/cdc_feed_block_counts.py)
    return sorted([*dags_of(TABLES, DERIVED), "cdc_feed__block_counts"])


@pytest.mark.parametrize("dag_id", _dag_ids())
def test_dag_policy(dagbag, dag_id):
    _assert_policy(dag_id, dagbag.dags[dag_id])


def _assert_policy(dag_id, dag) -> None:
    from cdc_lakehouse.orchestration.alerts import CdcFailureNotifier

    doc = dag.doc_md or ""
    assert "## What it does" in doc and "## How to" in doc, (
        f"{dag_id}: doc_md must say what it does and how to operate it"
    )
    if dag_id != "cdc_config_check":  # #53: what triggers it, what it consumes, what needs approval
        assert all(f"- **{k}**: " in doc for k in ("Triggered by", "Reads", "Writes", "Approval")), (dag_id, doc[:600])
    assert dag.tags and "cdc" in dag.tags, f"{dag_id}: tags {dag.tags}"
    assert dag.max_active_runs == 1, f"{dag_id}: runs of one table must not overlap"
    assert not dag.catchup or dag_id.startswith("cdc_ingest"), dag_id
    for task in dag.tasks:
        assert task.owner and task.owner != "airflow", f"{dag_id}.{task.task_id}: owner"
        assert task.retries >= 1 and task.retry_exponential_backoff, f"{dag_id}.{task.task_id}: retries"
        assert task.on_failure_callback, f"{dag_id}.{task.task_id}: no failure alert"
        notifiers = [c for c in task.on_failure_callback if isinstance(c, CdcFailureNotifier)]
        assert notifiers and notifiers[0].tables, f"{dag_id}.{task.task_id}: the CDC failure notifier is not wired"
    if dag_id.startswith(("cdc_ingest", "cdc_audit")):  # the freshness / audit-streak alerts
        check = dag.get_task("check_alerts")
        assert check.is_teardown and check.upstream_task_ids == {"ingest" if "ingest" in dag_id else "audit"}


def test_a_table_keeping_a_history_gets_a_rebuild_dag(tmp_path):
    """#55: `cdc_history__<table>` for a table with `history: {enabled: true}` only: one task
    running the history job's rebuild in the table's writer pool, with the DAG policy's docs,
    owner, retries and alerts."""
    from cdc_lakehouse.config import load_table_configs
    from cdc_lakehouse.orchestration.dag_parts import table_pool

    from tests.dag_files import dags_of, tables_keeping_a_history

    dags = dags_of(tables_keeping_a_history(tmp_path), DERIVED)
    assert sorted(d for d in dags if d.startswith("cdc_history")) == ["cdc_history__block"]
    dag = dags["cdc_history__block"]
    _assert_policy("cdc_history__block", dag)
    (task,) = dag.tasks
    cfg = load_table_configs(tmp_path).tables["block"]
    assert task.pool == table_pool(cfg) and dag.schedule is None
    args = [str(a) for a in task.application_args]
    assert task.job == "history" and args[:4] == ["--tables", "block", "--mode", "rebuild"], args


def test_writers_of_one_table_share_a_single_slot_pool(dagbag):
    """Ingest, bootstrap and maintenance of a table never run at once: they queue on one pool."""
    from cdc_lakehouse.config import load_table_configs
    from cdc_lakehouse.orchestration.dag_parts import pools, table_pool

    cs = load_table_configs(TABLES)
    declared = pools(str(TABLES))
    for name, cfg in cs.tables.items():
        pool = table_pool(cfg)
        assert declared[pool]["slots"] == 1
        writers = [
            t
            for d in (f"cdc_bootstrap__{name}", f"cdc_maintenance__{name}")
            for t in dagbag.dags[d].tasks
            if t.pool == pool
        ]
        assert writers, f"{name}: no writer task uses pool {pool}"


def test_derived_tables_run_on_their_inputs_assets(dagbag):
    """A derived DAG per derived config: scheduled by either input's current-table asset, reading
    those assets, producing its output's asset, in its own one-slot pool, with a mode param."""
    from cdc_lakehouse.config import load_table_configs
    from cdc_lakehouse.derived.config import load_derived_configs
    from cdc_lakehouse.orchestration.dag_parts import asset, pools

    cs = load_table_configs(TABLES)
    ds = load_derived_configs(DERIVED, cs.tables)
    assert "block_tree" in ds.derived and not ds.errors, ds.errors
    declared = pools(str(TABLES), str(DERIVED))
    for name, dcfg in ds.derived.items():
        dag = dagbag.dags[f"cdc_derived__{name}"]
        inputs = {asset(cs.tables[t].current_table) for t in dcfg.input_names}
        condition = dag.timetable.asset_condition
        assert type(dag.timetable).__name__ == "PartitionedAssetTimetable", dag.timetable
        assert type(condition).__name__ == "AssetAny" and set(condition.objects) == inputs, condition
        (task,) = dag.tasks
        assert task.task_id == "derive" and task.job == "derive"
        assert set(task.inlets) == inputs and task.outlets == [asset(dcfg.output_table)]
        assert task.pool == dcfg.pool == f"cdc_derived__{name}" and declared[task.pool]["slots"] == 1
        assert task.application_args[:2] == ["--derived", name]
        assert task.application_args[-2:] == ["--mode", "{{ params.mode }}"]
        mode = dag.params.get_param("mode")
        assert mode.value == "auto" and mode.schema["enum"] == ["auto", "full"]
        assert "derived" in dag.tags and task.source_conn_ids == []
        # Its compaction and expiry share the pool: never beside a derive run.
        (maint,) = dagbag.dags[f"cdc_maintenance__{name}"].tasks
        assert maint.job == "maintenance" and maint.pool == dcfg.pool
        assert maint.application_args[:2] == ["--derived", name]


def test_exports_run_on_their_source_asset_with_the_store_secret_resolved_at_run_time(dagbag):
    """An export DAG per export config: scheduled by its source's asset, in its own one-slot pool,
    with a mode param (auto, full, rollback) and the store connection named, not resolved."""
    from cdc_lakehouse.config import load_table_configs
    from cdc_lakehouse.derived.config import load_derived_configs
    from cdc_lakehouse.orchestration.dag_parts import asset, pools
    from cdc_lakehouse.serving.config import load_export_configs, resolve_source

    cs = load_table_configs(TABLES)
    ds = load_derived_configs(DERIVED, cs.tables)
    es = load_export_configs(ROOT / "include" / "exports", cs.tables, ds.derived)
    assert "block_tree_serving" in es.exports and not es.errors, es.errors
    declared = pools(str(TABLES), str(DERIVED))
    for name, ecfg in es.exports.items():
        dag = dagbag.dags[f"cdc_export__{name}"]
        source = asset(resolve_source(ecfg, cs.tables, ds.derived).table)
        assert type(dag.timetable).__name__ == "PartitionedAssetTimetable", dag.timetable
        assert dag.timetable.asset_condition == source, dag.timetable
        (task,) = dag.tasks
        assert task.job == "export" and task.inlets == [source]
        assert task.pool == ecfg.pool and declared[task.pool]["slots"] == 1
        assert task.application_args == ["--exports", name, "--mode", "{{ params.mode }}"]
        assert task.store_conns == [(ecfg.store.kind, ecfg.store.conn_id)] and task.source_conn_ids == []
        assert dag.params.get_param("mode").schema["enum"] == ["auto", "full", "rollback", "resume"]
        assert "rollback" in dag.doc_md and "full" in dag.doc_md


def test_parse_imports_nothing_heavy():
    """DAG parsing must not import Spark, pyiceberg, Great Expectations or pandas."""
    code = textwrap.dedent(f"""
        import sys
        from airflow.dag_processing.dagbag import DagBag
        bag = DagBag(dag_folder={str(DAGS)!r})
        assert not bag.import_errors, bag.import_errors
        assert "cdc_derived__block_tree" in bag.dags, sorted(bag.dags)
        assert "cdc_export__block_tree_serving" in bag.dags, sorted(bag.dags)
        heavy = sorted(m for m in ("pyspark", "pyiceberg", "great_expectations", "pandas", "psycopg2",
                                   "redis", "fastavro") if m in sys.modules)
        print("HEAVY=" + ",".join(heavy))
    """)
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=_env(CDC_TABLES_DIR=str(TABLES), CDC_DERIVED_DIR=str(DERIVED)),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    heavy = [line for line in r.stdout.splitlines() if line.startswith("HEAVY=")][-1]
    assert heavy == "HEAVY=", f"parse-time imports: {heavy}"


def test_a_broken_config_is_an_import_error_naming_the_field(tmp_path):
    """One bad YAML: cdc_config_check.py fails to import with the file, the field and the fix,
    while the DAGs of the good configs still load."""
    for f in TABLES.glob("*.yaml"):
        (tmp_path / f.name).write_text(f.read_text())
    (tmp_path / "broken.yaml").write_text(
        textwrap.dedent("""
        name: broken
        source: {table: "bad;name", shards: [{conn_id: cdc_source_local, schemas: [s0]}]}
        primary_key: []
    """)
    )
    out = _dagbag_in_subprocess(CDC_TABLES_DIR=str(tmp_path))
    errors = out["errors"]
    assert len(errors) == 1 and next(iter(errors)).endswith("cdc_config_check.py"), errors
    msg = next(iter(errors.values()))
    assert "broken.yaml" in msg and "primary_key" in msg and "source.table" in msg, msg
    assert "cdc_ingest__block" in out["dags"] and "cdc_bootstrap__broken" not in out["dags"]


def test_a_broken_derived_config_is_an_import_error_naming_the_field(tmp_path):
    """A derived file naming a table that is not configured: cdc_config_check.py names the file,
    the field and the fix; the good derived config and every table DAG still load."""
    for f in DERIVED.glob("*.yaml"):
        (tmp_path / f.name).write_text(f.read_text())
    (tmp_path / "broken.yaml").write_text("name: broken_tree\nnodes: {table: blocks}\n")
    out = _dagbag_in_subprocess(CDC_TABLES_DIR=str(TABLES), CDC_DERIVED_DIR=str(tmp_path))
    errors = out["errors"]
    assert len(errors) == 1 and next(iter(errors)).endswith("cdc_config_check.py"), errors
    msg = next(iter(errors.values()))
    assert "broken.yaml" in msg and "nodes.table" in msg and "not a configured table" in msg and "Fix:" in msg, msg
    assert "cdc_derived__block_tree" in out["dags"] and "cdc_ingest__block" in out["dags"]
    assert "cdc_derived__broken_tree" not in out["dags"]


def _dagbag_in_subprocess(**env: str) -> dict:
    """Import errors and DAG ids of the dags/ folder, parsed in a fresh interpreter with env."""
    import json

    code = textwrap.dedent(f"""
        import json
        from airflow.dag_processing.dagbag import DagBag
        bag = DagBag(dag_folder={str(DAGS)!r})
        print("RESULT=" + json.dumps({{"errors": bag.import_errors, "dags": sorted(bag.dags)}}))
    """)
    r = subprocess.run(
        [sys.executable, "-c", code], env=_env(**env), capture_output=True, text=True, timeout=300, check=False
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads([line for line in r.stdout.splitlines() if line.startswith("RESULT=")][-1][len("RESULT=") :])


def test_every_asset_event_carries_its_runs_partition_key_and_every_consumer_takes_it(dagbag):
    """#53: each task with outlets keys its asset events (KeyOutletEvents, after any post_execute
    of its own), and each DAG scheduled on our assets is partition-aware: Airflow queues a DAG
    that is not for no event that carries a key, so one plain consumer would never run."""
    from cdc_lakehouse.orchestration.tasks import KeyOutletEvents

    producers = [t for d in dagbag.dags.values() for t in d.tasks if t.outlets]
    assert {t.dag_id.split("__")[0] for t in producers} >= {"cdc_ingest", "cdc_bootstrap", "cdc_derived", "cdc_feed"}
    for t in producers:
        assert isinstance(t._post_execute_hook, KeyOutletEvents), (t.dag_id, t.task_id)
    consumers = [d for d in dagbag.dags.values() if "Asset" in type(d.timetable).__name__]
    assert {d.dag_id.split("__")[0] for d in consumers} == {"cdc_derived", "cdc_export", "cdc_feed"}
    for d in consumers:
        assert type(d.timetable).__name__ == "PartitionedAssetTimetable", (d.dag_id, d.timetable)


def test_partitioned_assets_and_approvals_off_give_plain_schedules_unkeyed_events_no_questions():
    """CDC_PARTITIONED_ASSETS=off, for a deployment whose own DAGs consume ours unpartitioned;
    CDC_APPROVALS=off, for an unattended one."""
    import json

    code = textwrap.dedent(f"""
        import json
        from airflow.dag_processing.dagbag import DagBag
        bag = DagBag(dag_folder={str(DAGS)!r})
        print("RESULT=" + json.dumps({{
            "errors": bag.import_errors,
            "timetables": sorted({{type(d.timetable).__name__ for d in bag.dags.values()}}),
            "hooks": sorted({{type(t._post_execute_hook).__name__ for d in bag.dags.values() for t in d.tasks
                             if t.outlets}}),
            "decide": sorted({{t.task_id for d in bag.dags.values() for t in d.tasks if "dropped" in t.task_id}}),
        }}))
    """)
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=_env(CDC_PARTITIONED_ASSETS="off", CDC_APPROVALS="off", CDC_TABLES_DIR=str(TABLES)),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads([line for line in r.stdout.splitlines() if line.startswith("RESULT=")][-1][len("RESULT=") :])
    assert not got["errors"] and "PartitionedAssetTimetable" not in got["timetables"], got
    assert "AssetTriggeredTimetable" in got["timetables"] and "KeyOutletEvents" not in got["hooks"], got
    assert got["decide"] == [], got  # CDC_APPROVALS=off: no keep/drop question either


def test_an_ingest_asks_keep_or_drop_for_a_dropped_column_then_runs_again(dagbag):
    """#53: ingest >> review_dropped >> decide_dropped (a HITLOperator: keep_null or drop) >>
    record_dropped >> ingest_again, and the ingest job is told to wait for it (undecided_drop=ask)."""
    from cdc_lakehouse.config import load_table_configs

    cs = load_table_configs(TABLES)
    for cfg in cs.tables.values():
        dag_id = f"cdc_ingest_group__{cfg.ingest.group}" if cfg.ingest.group else f"cdc_ingest__{cfg.name}"
        dag = dagbag.dags[dag_id]
        decide = dag.get_task("decide_dropped")
        assert type(decide).__name__ == "HITLOperator" and decide.options == ["keep_null", "drop"]
        assert dag.get_task("review_dropped").upstream_task_ids == {"ingest"}
        assert decide.upstream_task_ids == {"review_dropped"}
        assert dag.get_task("record_dropped").upstream_task_ids == {"decide_dropped"}
        again = dag.get_task("ingest_again")
        assert again.upstream_task_ids == {"record_dropped"} and again.pool == dag.get_task("ingest").pool
        for task in (dag.get_task("ingest"), again):
            args = task.application_args
            assert args[args.index("--undecided-drop") + 1] == "ask", args
