"""Incremental ingest against real PostgreSQL, Spark and Iceberg: exactly the source's rows, every column."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pytest
from cdc_lakehouse.ingest.errors import ErrorBudgetExceeded, SchemaChangeError
from cdc_lakehouse.ingest.ingest_table import ingest_table
from cdc_lakehouse.jobs.runner import run_tables
from cdc_lakehouse.lake.snapshots import read_watermark
from cdc_lakehouse.landing.errors import LandingGap
from cdc_lakehouse.orchestration.approvals import record_dropped, review_dropped
from cdc_lakehouse.settings import SourceEndpoint
from pyspark.sql import functions as F

from tests.conftest import ROOT
from tests.helpers import append_malformed, as_text_run, assert_lake_equals_source, duplicate_file, landing_root


def quarantined(spark, lake, table):
    return spark.table(lake.qualified(lake.meta_table("quarantine"))).filter(F.col("table_name") == table)


def test_random_workload_converges_exactly(source, spark, lake):
    """Updates with recency skew, inserts, deletes, key changes, TOAST-unchanged updates, duplicated and
    out-of-order landing files, injected malformed events, a rerun of an old interval and a replay."""
    s = source
    s.capture()
    s.bootstrap(s.block)
    s.bootstrap(s.perm)
    runs = []
    for i in range(4):
        s.wl.step(1200, pk_changes=2)
        m = s.capture()
        runs.append(m.manifest.run_id)
        if i == 1:
            duplicate_file(lake, s.endpoint, m.manifest.run_id, "block")
        if i == 2:
            # (The unknown-op event names a key no row has: a quarantined event of a real key holds
            # back that key's later TOAST-unchanged events, which test_nothing_lost covers.)
            append_malformed(
                lake,
                s.endpoint,
                m.manifest.run_id,
                "block",
                [
                    {"op": "x", "after": [("id", "999999999"), ("space_id", "1")]},
                    {"after": [("id", "not-a-number"), ("space_id", "1")]},
                    {"op": "d", "before": [("space_id", "1")], "after": None},
                ],
            )
        for cfg in (s.block, s.perm):
            r = s.ingest(cfg, m.manifest.run_id, run=f"i{i}")
            assert r.metrics.status == "ok"
        if i == 1:
            assert r.metrics.duplicates == 0  # permission had no duplicates; block's are checked below
    metrics = (
        spark.table(lake.qualified(lake.meta_table("ingest_runs")))
        .filter(F.col("table_name") == s.block.name)
        .orderBy("committed_at")
        .collect()
    )
    assert metrics[1]["duplicates"] > 0 and metrics[2]["quarantined"] == 3
    # Updates dominate even after the batch keeps one event per key (hot keys change several times).
    assert sum(m["updates"] for m in metrics) > 3 * sum(m["inserts"] for m in metrics)
    wm_before = read_watermark(spark, lake.qualified(s.block.current_table))
    # A rerun of an old interval and a replay of everything: nothing changes.
    assert s.ingest(s.block, runs[1], run="rerun").metrics.events_read == 0
    snap = spark.table(lake.qualified(s.block.current_table)).count()
    assert read_watermark(spark, lake.qualified(s.block.current_table)) == wm_before
    assert spark.table(lake.qualified(s.block.current_table)).count() == snap
    n = assert_lake_equals_source(spark, lake, s.block, s.dsn)
    assert n > 2900
    assert_lake_equals_source(spark, lake, s.perm, s.dsn)
    reasons = sorted(r["reason"] for r in quarantined(spark, lake, s.block.name).collect())
    assert len(reasons) == 3
    assert any("unknown op 'x'" in r for r in reasons)
    assert any("column id: value 'not-a-number' does not fit bigint" in r for r in reasons)
    assert any("missing key column id" in r for r in reasons)
    assert quarantined(spark, lake, s.perm.name).count() == 0
    # The soft-deleted keys are flagged, with the time of the delete.
    deleted = spark.table(lake.qualified(s.perm.current_table)).filter("is_deleted")
    assert deleted.count() > 0 and deleted.filter("deleted_at IS NULL").count() == 0


def sql_executions(spark) -> list[dict]:
    """The SQL executions the Spark application ran, with their physical plans (the status REST
    API of the driver's UI: the same on Spark Connect as on a classic session)."""
    import json
    import urllib.request

    from cdc_lakehouse.runtime.phases import status_api

    url = f"{status_api(spark)}/sql?details=true&planDescription=true&offset=0&length=1000000"
    with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 - the local driver's own UI
        return json.load(r)


def merge_plans(spark, after: int, table: str) -> list[str]:
    """Physical plans of the row-level writes (MERGE) into `table` Spark ran after execution id
    `after` (the server's other clients, another test worker's, run theirs too)."""
    # The listener bus records an execution's end asynchronously: wait until none of this
    # table's is running (the other worker's may always be).
    for _ in range(100):
        execs = [e for e in sql_executions(spark) if e["id"] > after and table in (e.get("planDescription") or "")]
        if all(e.get("status") != "RUNNING" for e in execs):
            break
        time.sleep(0.1)
    return [e["planDescription"] for e in execs if "WriteDelta" in e["planDescription"]]


def last_execution(spark) -> int:
    return max((e["id"] for e in sql_executions(spark)), default=-1)


def table_side_shuffled(plan: str, table: str) -> bool:
    """Whether, in the plan's final tree, an exchange sits between the scan of `table` and the join."""
    # The main query's final tree: the first one (adaptive subqueries print their own after it).
    main = plan.split("===== Subqueries =====", maxsplit=1)[0]
    tree = main.split("== Final Plan ==", maxsplit=1)[-1].split("== Initial Plan ==", maxsplit=1)[0].splitlines()
    at = next(i for i, line in enumerate(tree) if f"BatchScan {table}" in line)
    depth = len(tree[at]) - len(tree[at].lstrip(" :+-"))
    for line in reversed(tree[:at]):
        d = len(line) - len(line.lstrip(" :+-"))
        if d < depth:  # an ancestor
            if "Join" in line:
                return False
            if "Exchange" in line or "ShuffleQueryStage" in line:
                return True
            depth = d
    raise AssertionError(f"no join above {table} in:\n" + "\n".join(tree))


@pytest.mark.core
@pytest.mark.parametrize("merge_join", ["shuffle", "colocated"])
def test_toast_chains_truncate_and_pk_changes_in_one_batch(source, spark, lake, merge_join):
    """Both ways of joining the batch to the table (ingest.merge_join), on the same hard cases; the
    colocated MERGE must not shuffle the table's rows."""
    s = source
    s.block = s.block.model_copy(update={"ingest": s.block.ingest.model_copy(update={"merge_join": merge_join})})
    s.capture()
    s.bootstrap(s.block)
    big = "x" * 4000
    s.execute(
        f"UPDATE s0.block SET content = '{big}' WHERE id = {s.wl.first_id['s0']}",
        # Unchanged TOAST in every later event: values must come from the earlier ones or the table.
        f"UPDATE s0.block SET version = 50 WHERE id = {s.wl.first_id['s0']}",
        f"UPDATE s0.block SET id = 777 WHERE id = {s.wl.first_id['s0']}",
        "UPDATE s0.block SET version = 51 WHERE id = 777",
        f"UPDATE s0.block SET version = 60 WHERE id = {s.wl.first_id['s0'] + 1}",
        "INSERT INTO s1.block (id, space_id, type, content, created_at, updated_at) "
        "VALUES (5, 1, 'text', repeat('y', 5000), now(), now())",
        "UPDATE s1.block SET version = 9 WHERE id = 5",
        "DELETE FROM s1.block WHERE id = 5",
        "INSERT INTO s1.block (id, space_id, type, created_at, updated_at) VALUES (5, 1, 'page', now(), now())",
    )
    m = s.capture()
    since = last_execution(spark)
    r = s.ingest(s.block, m.manifest.run_id)
    assert r.metrics.quarantined == 0 and r.metrics.merge_join == merge_join
    assert_lake_equals_source(spark, lake, s.block, s.dsn)
    assert spark.table(lake.qualified(s.block.current_table)).filter("id = 777").first()["content"] == big
    (plan,) = merge_plans(spark, since, lake.qualified(s.block.current_table))
    assert table_side_shuffled(plan, lake.qualified(s.block.current_table)) == (merge_join == "shuffle"), plan
    # The staged batch is gone.
    staged = spark.sql(f"SHOW TABLES IN {lake.catalog_name}.{lake.meta_namespace} LIKE 'merge_batch_*'").collect()
    assert staged == []
    s.execute(
        "TRUNCATE s1.block",
        "INSERT INTO s1.block (id, space_id, type, created_at, updated_at) VALUES (6, 1, 'page', now(), now())",
    )
    m = s.capture()
    # Batches staged by runs killed before their drop: this table's older than a day (with or
    # without a zone in the timestamp, or from before the timestamp) go; a recent one (a run maybe
    # still going) and another table's stay.
    day_ago = datetime.now(UTC) - timedelta(hours=25)
    left = {
        f"merge_batch_{s.block.name}_{'a' * 12}": day_ago.isoformat(),
        f"merge_batch_{s.block.name}_{'b' * 12}": None,
        f"merge_batch_{s.block.name}_{'e' * 12}": day_ago.replace(tzinfo=None).isoformat(),
        f"merge_batch_{s.block.name}_{'c' * 12}": datetime.now(UTC).isoformat(),
        f"merge_batch_{s.block.name}_x_{'d' * 12}": day_ago.isoformat(),
    }
    kept = list(left)[3:]
    try:
        for name, staged in left.items():
            props = f"TBLPROPERTIES ('cdc.staged-at' = '{staged}')" if staged else ""
            spark.sql(f"CREATE TABLE {lake.qualified(lake.meta_table(name))} (id bigint) USING iceberg {props}")
        s.ingest(s.block, m.manifest.run_id)
        assert_lake_equals_source(spark, lake, s.block, s.dsn)
        s1 = [n for _, schema, n in s.block.shards() if schema == "s1"][0]
        assert spark.table(lake.qualified(s.block.current_table)).filter(F.col("_cdc_shard") == s1).count() == 1
        ns = f"{lake.catalog_name}.{lake.meta_namespace}"
        staged = spark.sql(f"SHOW TABLES IN {ns} LIKE 'merge_batch_{s.block.name}*'").collect()
        assert sorted(r.tableName for r in staged) == sorted(kept)
    finally:
        for name in left:
            spark.sql(f"DROP TABLE IF EXISTS {lake.qualified(lake.meta_table(name))} PURGE")


def test_error_budget_stops_the_run_and_keeps_everything(source, spark, lake):
    s = source
    s.capture()
    strict = s.block.model_copy(
        update={
            "ingest": s.block.ingest.model_copy(
                update={"error_budget": s.block.ingest.error_budget.model_copy(update={"max_quarantined": 1})}
            )
        }
    )
    s.bootstrap(strict)
    s.execute("UPDATE s0.block SET version = 2 WHERE id IN (SELECT id FROM s0.block LIMIT 5)")
    m = s.capture()
    append_malformed(lake, s.endpoint, m.manifest.run_id, "block", [{"op": "x"}, {"op": "y"}])
    wm = read_watermark(spark, lake.qualified(strict.current_table))
    with pytest.raises(ErrorBudgetExceeded) as exc:
        s.ingest(strict, m.manifest.run_id)
    assert "2 of" in str(exc.value) and "unknown op" in str(exc.value) and "error_budget" in str(exc.value)
    assert read_watermark(spark, lake.qualified(strict.current_table)) == wm  # nothing applied
    assert quarantined(spark, lake, strict.name).count() == 2
    lenient = strict.model_copy(
        update={
            "ingest": strict.ingest.model_copy(
                update={
                    "error_budget": strict.ingest.error_budget.model_copy(
                        update={"max_quarantined": 10, "max_fraction": 1.0}
                    )
                }
            )
        }
    )
    s.ingest(lenient, m.manifest.run_id)  # a wider budget accepts it; the quarantine is not duplicated
    assert quarantined(spark, lake, strict.name).count() == 2
    assert_lake_equals_source(spark, lake, s.block, s.dsn)


@pytest.mark.core
def test_schema_changes_additive_incompatible_and_isolated(source, spark, lake):
    s = source
    s.capture()
    s.bootstrap(s.block)
    s.bootstrap(s.perm)
    s.wl.add_column("note", "varchar(40)")
    s.execute("UPDATE s0.block SET note = 'hi' WHERE id IN (SELECT id FROM s0.block ORDER BY id LIMIT 3)")
    m = s.capture()
    r = s.ingest(s.block, m.manifest.run_id)
    assert spark.table(lake.qualified(s.block.current_table)).filter("note = 'hi'").count() == 3
    # The run's figures are its MERGE's, not those of the backfill's closing commit (no files).
    assert (
        r.metrics.updates == 3
        and r.metrics.bytes_written > 0
        and r.metrics.data_files_added + r.metrics.delete_files_added > 0
    ), r
    assert_lake_equals_source(spark, lake, s.block, s.dsn)
    # A dropped column the table keeps: this table stops, naming the column and the choices ...
    s.execute(
        "ALTER TABLE s0.block DROP COLUMN score",
        "ALTER TABLE s1.block DROP COLUMN score",
        "UPDATE s0.block SET version = 3 WHERE id IN (SELECT id FROM s0.block LIMIT 2)",
        "INSERT INTO s0.permission VALUES (1, 1, 'edit', now())",
    )
    m = s.capture()
    results, failures = run_tables(
        "ingest",
        spark,
        lake,
        [s.block, s.perm],
        lambda sp, lk, c: ingest_table(sp, lk, c, upto_run=m.manifest.run_id, ingest_run="x"),
    )
    assert [name for name, _ in failures] == [s.block.name]
    err = str(failures[0][1])
    assert isinstance(failures[0][1], SchemaChangeError)
    assert "'score' was dropped" in err and "keep_null" in err and "drop" in err
    assert results[s.perm.name]["status"] == "ok"  # ... while the other table keeps running
    # #53: asked in Airflow instead (the DAG's undecided_drop=ask), the table waits: not a
    # failure, nothing applied, the column recorded as pending for the decide_dropped approval.
    before = spark.table(lake.qualified(s.block.current_table)).count()
    results, failures = run_tables(
        "ingest",
        spark,
        lake,
        [s.block],
        lambda sp, lk, c: ingest_table(sp, lk, c, upto_run=m.manifest.run_id, ingest_run="x2", ask_dropped=True),
    )
    assert not failures and results[s.block.name]["status"] == "waiting", results
    assert "decide_dropped" in results[s.block.name]["reason"]
    found = review_dropped([s.block], lake)
    assert found.pending == {s.block.current_table: {"score": ["s0"]}}, found  # s1 changed no row since
    assert "keep_null" in found.body() and "score" in found.subject()
    assert spark.table(lake.qualified(s.block.current_table)).count() == before
    # Choosing keep_null (as the approval's record_dropped does) lets it continue, and later runs
    # read the choice from the table.
    assert record_dropped([s.block], "keep_null", lake) == {f"{s.block.name}.score": "keep_null"}
    assert review_dropped([s.block], lake).pending == {}
    ingest_table(spark, lake, s.block, upto_run=m.manifest.run_id, ingest_run="y", ask_dropped=True)
    cur = spark.table(lake.qualified(s.block.current_table))
    assert "score" in cur.columns
    assert_lake_equals_source(spark, lake, s.block, s.dsn, skip=("score",))  # the batch is applied


def test_missing_landing_file_is_an_error_unless_skipped(source, spark, lake):
    s = source
    s.capture()
    s.bootstrap(s.block)
    s.execute("UPDATE s0.block SET version = 7 WHERE id IN (SELECT id FROM s0.block LIMIT 3)")
    m = s.capture()
    entry = next(e for e in m.manifest.tables if e.table == "block")
    (landing_root(lake) / entry.dir / entry.files[0].name).unlink()
    with pytest.raises(LandingGap) as exc:
        s.ingest(s.block, m.manifest.run_id)
    assert "missing" in str(exc.value) and "missing_landing_files: skip" in str(exc.value)
    skip = s.block.model_copy(update={"ingest": s.block.ingest.model_copy(update={"missing_landing_files": "skip"})})
    r = s.ingest(skip, m.manifest.run_id)
    assert r.metrics.status == "ok_with_gaps"


@pytest.mark.slow
@pytest.mark.parametrize("point", ["ingest_before_changelog", "ingest_after_changelog", "ingest_after_merge"])
def test_killed_run_leaves_a_valid_table_and_the_next_run_converges(source, spark, lake, point, tmp_path):
    s = source
    s.capture()
    s.bootstrap(s.block)
    s.wl.step(600, pk_changes=1)
    m = s.capture()
    cfg_file = tmp_path / f"{s.block.name}.yaml"
    import yaml

    cfg_file.write_text(yaml.safe_dump(s.block.model_dump(mode="json")))
    env = {
        **os.environ,
        "CDC_TEST_CRASH_AT": point,
        "PYTHONPATH": str(ROOT / "plugins"),
        "CDC_CATALOG_PASSWORD": "",
        "CDC_SPARK_DRIVER_MEMORY": "2g",
    }
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "spark_jobs" / "ingest.py"),
            "--tables",
            s.block.name,
            "--config-dir",
            str(tmp_path),
            "--upto-run",
            m.manifest.run_id,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r.returncode == 137, r.stderr[-3000:]
    cur = lake.qualified(s.block.current_table)
    spark.sql(f"REFRESH TABLE {cur}")  # the killed process committed: drop this session's cached state
    assert spark.table(cur).count() > 0  # readable
    s.ingest(s.block, m.manifest.run_id, run="after-crash")
    assert_lake_equals_source(spark, lake, s.block, s.dsn)
    cl = spark.table(lake.qualified(s.block.changelog_table))
    # A change event is (shard, commit LSN, seq); the bootstrap's 'r' rows share one position per shard.
    event = ["_cdc_shard", "_cdc_commit_lsn", "_cdc_seq", *s.block.primary_key]
    twice = cl.groupBy(*event).count().filter("count > 1").limit(5).collect()
    assert not twice, f"the changelog got an event twice: {twice}"


def test_source_endpoint_parsing():
    ep = SourceEndpoint.from_uri("postgresql://u%40x:p%2Fw@h:5433/db", database="other")
    assert (ep.user, ep.password, ep.host, ep.port, ep.database) == ("u@x", "p/w", "h", 5433, "other")
    assert "p/w" not in repr(ep)


# Spark jobs one table's ingest may start on the common path (no quarantine, no schema change):
# 54 measured on 2026-11-24 (~400 events, 2 shards); 40 once snapshot metadata was read through
# Iceberg's Java API; 12 with the fused plan of issue #16 (ingest.batch): the plan materialized
# once (2: its shuffle and the result), the changelog append (1), the classification's broadcast
# and scan (2), the MERGE (4, as many as a plain Spark MERGE of the same batch), the run record
# (1), the freshness rows (1; +1 on a table's first run). #16 set the goal at 5, which the MERGE
# alone nearly takes. A ratchet: lower it when the ingest gets cheaper; never raise it without
# saying why in the commit.
# 13 since the table-side TOAST fill (ingest.ingest_table.fill_from_table): a batch with unchanged TOAST
# values the batch cannot supply (this test's workload has them) broadcasts the values the
# classification fetched (+1). In exchange the MERGE no longer carries the TOAST columns through
# its shuffle of the whole table: 37.7 -> 25.7 s at 20M rows (docs/benchmarks-history.md).
# 18 on Spark Connect (2026-11-26, Spark 4.1.3; the suite's session is a Connect client): a
# materialized plan costs 4 jobs where a classic session's localCheckpoint cost 2 (runtime.phases.
# materialize persists and runs a no-op write so Connect delivers the plan's observations, then
# checkpoints the persisted rows), twice (the batch, the classification: +4), and the MERGE runs 5
# jobs (+1). Reads of snapshot metadata through the metadata tables, a job each (18 per ingest on
# Connect, none through the Java API a classic session used), are held apart to their own ratchet:
# 0 since pyiceberg reads the snapshots where it has the lake's catalog (lake.snapshots).
# 13 per table in a group run (issue #56, 2026-11-28), its records apart: a group commits the run
# records and freshness rows of all its tables once (ingest.records: RECORDS_JOB_BUDGET, about 2
# jobs, +1 on a table's first run, when its freshness rows are not yet in the metadata), and the
# MERGE no longer clusters its rows by partition (ingest.ingest_table.MERGE_CONF: -1).
# 12 (2026-11-28 afternoon): the batch and the classification each computed once into a checkpoint
# and counted in one observed pass over it (3 each on Connect: the checkpoint's two jobs, the
# counted pass), the changelog append (1), the MERGE (4: the fetched TOAST values' broadcast, the
# two sides' shuffles, the write), and the run's finish (1). #56 asks for 8. SparkJobs.sites names
# each job's phase.
# 11 (2026-11-29 night): a batch of at most ingest.batch.SINGLE_TASK_ROWS landed rows (this one's
# 389) is computed in one task, so its checkpoint is one job, not a shuffle's two.
# 10 (2026-11-30): a table's first run read the freshness table for its previous rows (the
# record phase's one job); pyiceberg reads them now (lake.freshness.latest_freshness). Left, for
# #56's 8: the checkpoint and the counted pass of the batch and of the classification (Spark
# Connect delivers no observed metrics to a checkpoint, and a persisted plan observed by the
# no-op write that fills its cache takes as many jobs and 3.07 s against 1.58 s for 200k events:
# bench/observe_bench.py, docs/benchmarks-history.md), and the MERGE's two shuffles: its target
# scan reports no size to the planner, so even a table of 400 rows is not broadcast (a plain join
# of the same table is).
# 8 (2026-11-30 night), #56's target: the batch's and the classification's checkpoints are made
# lazily and filled by the observed pass that counts them (runtime.phases.checkpoint_counted): one
# job each where the eager checkpoint and the count took two. Left: the batch (1), the changelog
# append (1), the classification (2: the broadcast of the batch's keys, run by adaptive execution
# when the checkpoint is made, then the counted pass that fills it), the MERGE (4).
INGEST_JOB_BUDGET = 8
# The two appends (runs, freshness). A metadata table's first commit no longer takes a job for its
# empty first snapshot (lake.commits.commit_empty_snapshot): run alone, this test took 4.
RECORDS_JOB_BUDGET = 2
INGEST_METADATA_READ_BUDGET = 0


def test_ingest_stays_within_its_spark_job_budget(source, spark, lake, monkeypatch):
    """Counted through Spark's status tracker, so a new count() or collect() in the ingest shows.
    Also: the checkpoints the ingest kept are gone from the server when it returns, not when
    Python collects their frames (runtime.phases.releasing_kept)."""
    from cdc_lakehouse.ingest.ingest_table import ingest_table
    from cdc_lakehouse.ingest.records import RunRecords
    from cdc_lakehouse.runtime import phases
    from cdc_lakehouse.runtime.phases import SparkJobs
    from pyspark.sql.connect.dataframe import DataFrame
    from pyspark.sql.connect.plan import CachedRemoteRelation

    s = source
    s.capture()
    s.bootstrap(s.block)
    s.wl.step(600)
    m = s.capture()
    records = RunRecords()
    made: list[str] = []  # the server's ids of the ingest's checkpoints (a spy: _kept still runs)
    kept = phases._kept
    monkeypatch.setattr(phases, "_kept", lambda df, **kw: made.append(df._plan._relation_id) or kept(df, **kw))
    r = ingest_table(spark, lake, s.block, upto_run=m.manifest.run_id, ingest_run="budget", records=records)
    monkeypatch.undo()
    assert len(made) >= 2, made  # the batch and the classification
    for relation_id in made:
        gone = CachedRemoteRelation(relation_id, spark)
        try:
            with pytest.raises(Exception, match=f"No DataFrame with id {relation_id}"):
                DataFrame(gone, spark).count()
        finally:
            gone._relation_id = None  # not to be dropped again when collected
    assert r.metrics.status == "ok" and r.metrics.quarantined == 0 and r.metrics.updates > 0, r
    print(f"ingest of {r.metrics.events_read} events: {r.spark_jobs} Spark jobs (budget {INGEST_JOB_BUDGET})")
    print("\n".join(r.spark_job_sites))
    print(f"metadata reads: {r.spark_metadata_jobs} (budget {INGEST_METADATA_READ_BUDGET})")
    assert 0 < r.spark_jobs <= INGEST_JOB_BUDGET, r.spark_jobs
    assert r.spark_metadata_jobs <= INGEST_METADATA_READ_BUDGET, r.spark_metadata_jobs
    with SparkJobs(spark, "records") as jobs:
        assert records.commit(spark, lake) == 1
    print(f"records: {jobs.count} Spark jobs (budget {RECORDS_JOB_BUDGET}): {jobs.sites}")
    assert jobs.count is not None and jobs.count <= RECORDS_JOB_BUDGET, jobs.sites


def test_a_landing_written_as_text_then_typed_ingests_into_one_table_equal_to_the_source(source, spark, lake):
    """An upgrade with runs in flight (issue #56): runs the capture wrote as text (format 1) before
    it typed values where they enter (format 2) are still read, alone, and in one batch with
    typed runs; the table ends equal to the source, every type of the block table included."""
    s = source
    s.capture()
    s.bootstrap(s.block)
    runs = []
    for _ in range(4):
        s.wl.step(400, pk_changes=2)
        runs.append(s.capture().manifest.run_id)
    as_text_run(lake, s.endpoint, runs[0])
    as_text_run(lake, s.endpoint, runs[1])
    for upto in (runs[0], runs[2], runs[3]):  # text alone; text and typed in one batch; typed alone
        r = s.ingest(s.block, upto, run=f"u{upto}")
        assert r.metrics.status == "ok" and r.metrics.quarantined == 0 and r.metrics.events_read > 0, r
    assert_lake_equals_source(spark, lake, s.block, s.dsn)
