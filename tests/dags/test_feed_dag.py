"""The example change-feed consumer DAG and the ingest's Asset events (cdc_lakehouse.feed)."""

from __future__ import annotations

from tests.dags.test_dag_integrity import TABLES, dagbag  # noqa: F401 - the module's DagBag fixture


def test_feed_consumer_dag_runs_on_the_block_asset_and_keeps_the_dag_policy(dagbag):  # noqa: F811
    from cdc_lakehouse.config import load_table_configs
    from cdc_lakehouse.orchestration.alerts import CdcFailureNotifier
    from cdc_lakehouse.orchestration.dag_parts import FEED_UPTO, asset
    from cdc_lakehouse.orchestration.tasks import AnnounceLakeSnapshots

    block = load_table_configs(TABLES).tables["block"]
    dag = dagbag.dags["cdc_feed__block_counts"]
    assert "## What it does" in dag.doc_md and "## How to" in dag.doc_md
    assert "cdc" in dag.tags and dag.max_active_runs == 1 and not dag.catchup
    assert dag.timetable.asset_condition == asset(block.current_table)
    task = dag.get_task("consume")
    assert task.job == "feed_block_counts" and task.source_conn_ids == []
    assert task.application_args[-2:] == ["--upto", FEED_UPTO]
    assert ["--mode", "{{ params.mode }}"] == task.application_args[6:8] and "--max-lag-hours" in task.application_args
    assert dag.params.get_param("mode").schema["enum"] == ["auto", "full"]
    assert task.owner != "airflow" and task.retries >= 1 and task.retry_exponential_backoff
    assert [c for c in task.on_failure_callback if isinstance(c, CdcFailureNotifier)]
    assert task.outlets == [asset("feed.block_counts")]
    # Its output's maintenance: in the same DAG run, after the consume (so never beside one), and
    # only when a tick of its schedule passed (maintenance_due).
    maint = dag.get_task("maintenance")
    assert maint.job == "maintenance" and maint.application_args[:4] == [
        "--feed-output",
        "feed.block_counts",
        "--consumer",
        "block_counts",
    ]
    assert maint.upstream_task_ids == {"maintenance_due"}
    assert dag.get_task("maintenance_due").upstream_task_ids == {"consume"}
    ingest = f"cdc_ingest_group__{block.ingest.group}" if block.ingest.group else "cdc_ingest__block"
    hook = dagbag.dags[ingest].get_task("ingest")._post_execute_hook.then  # inside KeyOutletEvents
    assert isinstance(hook, AnnounceLakeSnapshots) and block.current_table in hook.assets
