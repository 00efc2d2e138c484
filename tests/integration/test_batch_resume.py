"""Multi-table runs killed between each pair of their commits converge (issue #19, lake.batches).

Real PostgreSQL, capture, Spark and Iceberg. The kill is the failpoint CDC_TEST_FAIL_AT raising
in this process (runtime.failpoints; a subprocess per kill would cost a Spark start each); the
rerun must not apply a committed table again and must finish what the killed run left undone.
"""

from __future__ import annotations

import random

import pytest
from cdc_lakehouse.columns import LSN_COL, OP_COL, SEQ_COL, SHARD_COL
from cdc_lakehouse.lake.batches import BATCH_PROP, BatchId, batch_snapshots
from cdc_lakehouse.lake.snapshots import current_ancestors
from cdc_lakehouse.landing.format import Manifest, landing_spark_schema
from cdc_lakehouse.runtime.failpoints import FAIL_ENV, FailpointHit
from cdc_lakehouse.watermark import WATERMARK_PROP
from pyspark.sql import functions as F

from tests.helpers import assert_lake_equals_source, landing_root
from tests.integration.test_derived_tree import (
    apply_batch,
    assert_tree_is_reference,
    derive,
    random_batch,
    tree_cfg,
    tree_source,  # noqa: F401 (a fixture)
)

# The ingest's commits in order: changelog, current table, run record, freshness. A kill after
# each of the first three is a kill between a pair of consecutive commits.
INGEST_KILLS = ["ingest_changelog_committed", "ingest_merge_committed", "ingest_run_record_committed"]


def batch_of_current_position(spark, table: str) -> BatchId:
    """The batch id of the commit that holds the table's current watermark."""
    for snap in current_ancestors(spark, table):
        summary = snap.summary
        if summary.get(WATERMARK_PROP) is not None:
            assert summary.get(BATCH_PROP), f"{table}: its current position was committed without a batch id"
            return BatchId(summary.get(BATCH_PROP))
    raise AssertionError(f"{table} has no watermark")


def landing_events(spark, lake, cfg, manifest: Manifest) -> set[tuple[str, int, int]]:
    """(shard, commit LSN, seq) of every change event of the table in a capture run's files."""
    entry = next(e for e in manifest.tables if e.table == cfg.source.table)
    files = [str(landing_root(lake) / entry.dir / f.name) for f in entry.files]
    shard = {schema: name for _, schema, name in cfg.shards()}
    rows = (
        spark.read.schema(landing_spark_schema())
        .parquet(*files)
        .filter(F.col("source.table") == cfg.source.table)
        .select("source.schema", "source.commit_lsn", "source.seq")
        .collect()
    )
    return {(shard[r["schema"]], int(r["commit_lsn"]), int(r["seq"])) for r in rows}


def changelog_events(spark, lake, cfg):
    """The changelog's change rows with their event's source seq (a key change is two rows of one
    event: _cdc_seq 2n and 2n+1, ingest.reduce). Not the bootstrap's rows ('r') and per-shard
    markers ('t'); the workload here truncates nothing."""
    cl = spark.table(lake.qualified(cfg.changelog_table)).filter(~F.col(OP_COL).isin("r", "t"))
    return cl.select(SHARD_COL, LSN_COL, F.floor(F.col(SEQ_COL) / 2).alias("seq"), SEQ_COL)


@pytest.mark.parametrize("point", INGEST_KILLS)
def test_ingest_killed_between_each_pair_of_commits_converges(source, spark, lake, monkeypatch, point):
    s = source
    s.capture()
    s.bootstrap(s.block)
    s.wl.step(500, pk_changes=2)
    m = s.capture()
    cur, cl = lake.qualified(s.block.current_table), lake.qualified(s.block.changelog_table)
    monkeypatch.setenv(FAIL_ENV, point)
    with pytest.raises(FailpointHit):
        s.ingest(s.block, m.manifest.run_id, run="killed")
    monkeypatch.delenv(FAIL_ENV)
    s.ingest(s.block, m.manifest.run_id, run="rerun")

    assert_lake_equals_source(spark, lake, s.block, s.dsn)
    # The changelog: every event of the run once, nothing else, no row twice.
    ev = changelog_events(spark, lake, s.block)
    twice = ev.groupBy(SHARD_COL, LSN_COL, SEQ_COL).count().filter("count > 1").limit(5).collect()
    assert not twice, f"the changelog got an event twice: {twice}"
    got = {(r[SHARD_COL], int(r[LSN_COL]), int(r["seq"])) for r in ev.select(SHARD_COL, LSN_COL, "seq").collect()}
    want = landing_events(spark, lake, s.block, m.manifest)
    assert len(want) > 200 and got == want, (sorted(want - got)[:5], sorted(got - want)[:5])
    # Each table committed the batch exactly once.
    batch = batch_of_current_position(spark, cur)
    meta = [lake.qualified(lake.meta_table(n)) for n in ("ingest_runs", "freshness")]
    counts = {t: batch_snapshots(spark, t, batch) for t in (cl, cur, *meta)}
    assert set(counts.values()) == {1}, counts
    # One run record for the batch, with the figures of the run that applied it; one freshness row per shard.
    runs = (
        spark.table(meta[0])
        .filter((F.col("table_name") == s.block.name) & F.array_contains("landing_runs", m.manifest.run_id))
        .collect()
    )
    assert len(runs) == 1 and runs[0]["updates"] > 0 and runs[0]["events_read"] >= len(want), runs
    fresh = spark.table(meta[1]).filter(
        (F.col("table_name") == s.block.name) & (F.col("ingest_run") == runs[0]["ingest_run"])
    )
    assert sorted(r["shard"] for r in fresh.collect()) == sorted(n for _, _, n in s.block.shards())
    # A run killed after its MERGE is recorded under its own name (the rerun finished it).
    if point != "ingest_changelog_committed":
        assert runs[0]["ingest_run"] == "killed"


def test_derived_tree_killed_between_its_two_commits_commits_each_once(tree_source, unique, monkeypatch):  # noqa: F811
    """The unresolved table's commit is not repeated by the rerun of the same batch."""
    s = tree_source
    spark, lake = s.spark, s.lake
    cfg = tree_cfg(s, f"batch_{unique}")
    derive(s, cfg)
    rng = random.Random(int(unique, 16))
    from devstack.workload import ID_STRIDE

    next_id = {schema: s.wl.shard_no(schema) * ID_STRIDE + 201 for schema in s.schemas}
    apply_batch(s, *random_batch(s, rng, next_id))
    unresolved = lake.qualified(cfg.unresolved_table)
    before = sum(1 for _ in current_ancestors(spark, unresolved))
    monkeypatch.setenv(FAIL_ENV, "derive_unresolved_committed")
    with pytest.raises(FailpointHit):
        derive(s, cfg)
    monkeypatch.delenv(FAIL_ENV)
    assert sum(1 for _ in current_ancestors(spark, unresolved)) == before + 1
    assert derive(s, cfg).mode == "incremental"
    assert_tree_is_reference(s, cfg)
    batch = batch_of_current_position(spark, lake.qualified(cfg.output_table))
    assert batch_snapshots(spark, unresolved, batch) == 1
    assert batch_snapshots(spark, lake.qualified(cfg.output_table), batch) == 1
    assert sum(1 for _ in current_ancestors(spark, unresolved)) == before + 1  # the rerun did not commit it again


def test_a_group_records_its_tables_in_one_commit_and_a_killed_group_loses_none(source, spark, lake, monkeypatch):
    """A group run (one job over many tables) commits each metadata table once for all its tables
    (issue #56); killed before or between those commits, each table's next run records what the
    group did not, and no batch is recorded twice."""
    from cdc_lakehouse.ingest.ingest_table import ingest_table
    from cdc_lakehouse.ingest.records import RunRecords
    from cdc_lakehouse.lake.batches import BATCH_IDS_PROP

    s = source
    s.capture()
    s.bootstrap(s.block)
    s.bootstrap(s.perm)
    meta = [lake.qualified(lake.meta_table(n)) for n in ("ingest_runs", "freshness")]

    def group(run: str, kill: str | None = None) -> None:
        s.wl.step(300)
        upto = s.capture().manifest.run_id
        records = RunRecords()
        for cfg in (s.block, s.perm):
            ingest_table(spark, lake, cfg, upto_run=upto, ingest_run=run, records=records)
        if kill == "before_records":
            return  # the group's process died before its records
        if kill:
            monkeypatch.setenv(FAIL_ENV, kill)
            with pytest.raises(FailpointHit):
                records.commit(spark, lake)
            monkeypatch.delenv(FAIL_ENV)
            return
        records.commit(spark, lake)

    def heads() -> list[dict[str, str]]:
        return [next(current_ancestors(spark, t)).summary for t in meta]

    group("g1")
    assert all(len(h[BATCH_IDS_PROP].split(",")) == 2 for h in heads()), heads()  # both tables, one commit
    group("g2", kill="ingest_run_record_committed")
    group("g3", kill="before_records")
    for cfg in (s.block, s.perm):  # each table's next run records the group's last batch of it
        s.ingest(cfg, s.capture().manifest.run_id, run="next")
    for cfg in (s.block, s.perm):
        runs = spark.table(meta[0]).filter(F.col("table_name") == cfg.name).groupBy("ingest_run").count().collect()
        assert {r["ingest_run"]: r["count"] for r in runs} == {"g1": 1, "g2": 1, "g3": 1, "next": 1}, runs
        fresh = spark.table(meta[1]).filter(F.col("table_name") == cfg.name).groupBy("ingest_run").count().collect()
        shards = len(list(cfg.shards()))
        assert {r["ingest_run"]: r["count"] for r in fresh} == {
            "g1": shards,
            "g2": shards,
            "g3": shards,
            "next": shards,
        }


def test_a_group_run_ingests_its_tables_at_once_each_on_a_session_of_its_own(source, spark, lake):
    """A group's tables run `parallel` at once (jobs.runner.run_tables, issue #56): each worker on a
    Spark session of its own, so a table's session settings never reach another's statements;
    every table lands exactly, a failing one stops none of the others, and the group's records
    are still one commit per metadata table."""
    import threading

    from cdc_lakehouse.ingest.ingest_table import ingest_table
    from cdc_lakehouse.ingest.records import RunRecords
    from cdc_lakehouse.jobs.runner import run_tables
    from cdc_lakehouse.lake.batches import BATCH_IDS_PROP

    s = source
    s.capture()
    s.bootstrap(s.block)
    s.bootstrap(s.perm)
    s.wl.step(300, pk_changes=2)
    upto = s.capture().manifest.run_id
    never = s.block.model_copy(update={"name": f"{s.block.name}_never_bootstrapped"})
    records = RunRecords()
    seen: dict[str, tuple[str, str | None]] = {}
    both_running = threading.Barrier(2, timeout=120)

    def fn(session, lk, cfg):
        if cfg.name != never.name:
            # The two tables are in flight together (a sequential run would time out here), and a
            # setting one of them makes in its session is not the other's.
            both_running.wait()
            session.conf.set("cdc.test.owner", cfg.name)
            both_running.wait()
            seen[cfg.name] = (session.session_id, session.conf.get("cdc.test.owner"))
        return ingest_table(session, lk, cfg, upto_run=upto, ingest_run="par", records=records)

    results, failures = run_tables("ingest", spark, lake, [s.block, never, s.perm], fn, parallel=3)
    assert [r["table"] for r in results.values()] == [s.block.name, never.name, s.perm.name]
    assert [name for name, _ in failures] == [never.name], failures
    assert "cdc_bootstrap__" in results[never.name]["error"]
    assert {name: owner for name, (_, owner) in seen.items()} == {s.block.name: s.block.name, s.perm.name: s.perm.name}
    sessions = {sid for sid, _ in seen.values()}
    assert len(sessions) == 2 and spark.session_id not in sessions, seen
    for cfg in (s.block, s.perm):
        assert results[cfg.name]["status"] == "ok" and results[cfg.name]["events_read"] > 0, results[cfg.name]
        assert_lake_equals_source(spark, lake, cfg, s.dsn)
    assert records.commit(spark, lake) == 2
    for meta in ("ingest_runs", "freshness"):
        head = next(current_ancestors(spark, lake.qualified(lake.meta_table(meta))))
        assert len(head.summary[BATCH_IDS_PROP].split(",")) == 2, head.summary
