"""Two writers that overlap inside the write (issue #34): a zombie driver, a manual job or a second
deployment passes every check before the write, exactly like the run it overlaps.

Real PostgreSQL, capture, Spark and Iceberg. Writer A runs in a thread on its own session of the
suite's SparkContext (its own catalog cache and temporary views, as another process would have)
and is held at the point between its write and its publish (runtime.failpoints.hold_at on
lake.commits.publish_point); writer B runs to the end meanwhile; then A is released. Exactly one of
them commits: A either recognises the batch B committed (same batch: it converges) or fails with
ConcurrentWriterError (a different batch), and no event is applied twice.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from cdc_lakehouse.audit.audit_table import audit_table
from cdc_lakehouse.bootstrap.bootstrap_table import bootstrap_table
from cdc_lakehouse.columns import LSN_COL, OP_COL, SEQ_COL, SHARD_COL
from cdc_lakehouse.derived.derive_tree import derive_tree
from cdc_lakehouse.feed.consumer import block_counts
from cdc_lakehouse.feed.models import OffsetConflictError
from cdc_lakehouse.ingest.ingest_table import ingest_table
from cdc_lakehouse.lake.batches import batch_snapshots
from cdc_lakehouse.lake.commits import ConcurrentWriterError, publish_point
from cdc_lakehouse.lake.snapshots import read_watermark
from cdc_lakehouse.lake.tables import schema_point
from cdc_lakehouse.runtime.failpoints import hold_at
from cdc_lakehouse.runtime.session import REMOTE_ENV
from pyspark.sql import functions as F

from tests.conftest import make_config
from tests.helpers import assert_lake_equals_source, suite_spark_session
from tests.integration.conftest import Source
from tests.integration.test_batch_resume import batch_of_current_position
from tests.integration.test_chunked_bootstrap import _chunked
from tests.integration.test_derived_tree import (
    assert_tree_is_reference,
    derive,
    lake_tree,
    tree_cfg,
    tree_source,  # noqa: F401 (a fixture)
)
from tests.integration.test_feed import lake_counts, source_counts


class Writer(threading.Thread):
    """Writer A: `fn` in a thread; its result or its error kept for the test."""

    def __init__(self, fn: Callable[[], Any]):
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            self.error = exc


@contextmanager
def overlapping(table: str, fn_a: Callable[[], Any], point: str | None = None) -> Iterator[Writer]:
    """Start writer A and hold it between its write to `table` and the publish (or at failpoint
    `point`); the block is writer B; A is released when the block ends and joined."""
    with hold_at(point or publish_point(table)) as hold:
        a = Writer(fn_a)
        a.start()
        while not hold.reached.wait(0.5):
            assert a.is_alive(), f"writer A ended before its publish of {table}: {a.error!r}"
        yield a
        hold.release.set()
        a.join(600)
    assert not a.is_alive(), "writer A did not finish after its release"


def session_of_its_own(lake):
    """Writer A's session: another session of the suite's Spark Connect server, whose catalog keeps
    no table cache. A cached table would make A's write start from the snapshot A loaded before it
    was held, and Iceberg's own validation of a MERGE would then see B's commit; a zombie whose
    stall outlasts the cache's 30 s expiry (or a deployment with cache-enabled=false) loads B's
    snapshot instead, and only a fence at publish time stops it."""
    other = suite_spark_session(lake, os.environ[REMOTE_ENV])
    other.conf.set(f"spark.sql.catalog.{lake.catalog_name}.cache-enabled", "false")
    return other


def changelog_twice(spark, table: str) -> list:
    """Change events the changelog holds more than once (the bootstrap's rows and truncates aside)."""
    spark.sql(f"REFRESH TABLE {table}")
    cl = spark.table(table).filter(~F.col(OP_COL).isin("r", "t"))
    return cl.groupBy(SHARD_COL, LSN_COL, SEQ_COL).count().filter("count > 1").limit(5).collect()


@pytest.fixture
def small(pg, source_uri, spark, lake, unique):
    s = Source(pg, spark, lake, unique, blocks=40)
    yield s
    s.close()


def _ingest_a(s: Source, spark_a, upto: str):
    return lambda: ingest_table(spark_a, s.lake, s.block, upto_run=upto, ingest_run="A")


def _batches_a_and_b(s: Source, b_batch: str, steps: int) -> tuple[str, str]:
    """The capture runs writer A applies up to, and writer B: the same one, or a newer one."""
    s.wl.step(steps)
    m1 = s.capture().manifest.run_id
    if b_batch == "same":
        return m1, m1
    s.wl.step(steps)
    return m1, s.capture().manifest.run_id


# --- ingest: the changelog append and the MERGE ----------------------------------------------------


@pytest.mark.parametrize("b_batch", ["same", "newer"])
@pytest.mark.parametrize("held_at", ["changelog", "merge"])
def test_ingest_writers_overlapping_inside_a_commit_apply_each_event_once(small, spark, lake, held_at, b_batch):
    """A holds between its write and its publish of the changelog append or of the MERGE; B runs
    the same batch (A converges) or a newer one (A fails). The changelog holds every event once,
    the watermark never moves back, and each table carries the batch that won once."""
    s = small
    s.capture()
    s.bootstrap(s.block)
    cur, cl = lake.qualified(s.block.current_table), lake.qualified(s.block.changelog_table)
    m1, upto_b = _batches_a_and_b(s, b_batch, 30)
    cl_rows = spark.table(cl).count()
    with overlapping(cl if held_at == "changelog" else cur, _ingest_a(s, session_of_its_own(s.lake), m1)) as a:
        b_result = s.ingest(s.block, upto_b, run="B")
    assert not changelog_twice(spark, cl), "the changelog got an event twice"
    assert read_watermark(spark, cur).runs[s.endpoint] == upto_b  # never moved back
    assert read_watermark(spark, cl).runs[s.endpoint] == upto_b
    batch = batch_of_current_position(spark, cur)
    assert (batch_snapshots(spark, cl, batch), batch_snapshots(spark, cur, batch)) == (1, 1)
    assert_lake_equals_source(spark, lake, s.block, s.dsn)
    if b_batch == "same":
        assert a.error is None, f"A should recognise the batch B committed: {a.error!r}"
        batch_rows = spark.table(cl).count() - cl_rows
        assert_batch_counted_once(spark, lake, s.block, a.result.metrics, b_result.metrics, batch_rows)
    else:
        assert isinstance(a.error, ConcurrentWriterError), repr(a.error)
        assert (cl if held_at == "changelog" else cur) in str(a.error) and "another writer" in str(a.error)
    # The next batch starts where the winner ended: nothing is applied again.
    s.wl.step(20)
    s.ingest(s.block, s.capture().manifest.run_id, run="next")
    assert not changelog_twice(spark, cl)
    assert_lake_equals_source(spark, lake, s.block, s.dsn)


def assert_batch_counted_once(spark, lake, cfg, a, b, batch_rows: int) -> None:
    """Two runs of one batch: B published the MERGE and reports it; A reports no row applied
    (#51: both reported the batch's counts, so the run history and the metrics counted it twice,
    and a late classification gave negative inserts). The changelog's rows are counted by the
    run whose append landed; the run history adds up to the batch once."""
    assert (a.status, a.inserts, a.updates, a.deletes, a.stale_skipped) == ("already_applied", 0, 0, 0, 0), a
    assert b.status == "ok" and b.inserts + b.updates + b.deletes > 0 and min(b.inserts, b.updates, b.deletes) >= 0, b
    assert a.changelog_rows + b.changelog_rows == batch_rows, (a.changelog_rows, b.changelog_rows, batch_rows)
    history = lake.qualified(lake.meta_table("ingest_runs"))
    spark.sql(f"REFRESH TABLE {history}")  # A committed its record from its own session
    runs = spark.table(history).filter(F.col("table_name") == cfg.name)
    got = runs.filter(F.col("ingest_run").isin("A", "B")).agg(
        F.count("*"), F.sum("inserts"), F.sum("updates"), F.sum("deletes"), F.sum("changelog_rows")
    )
    assert tuple(got.first()) == (2, b.inserts, b.updates, b.deletes, batch_rows)


def test_ingest_writers_adding_the_same_column_converge(small, spark, lake):
    """Two runs of a batch that adds a column: A is held just before its ALTER TABLE while B
    applies the whole batch. A's ALTER then fails (the column exists); A finds the table as it
    wanted it and goes on, and converges reporting that it applied nothing (#51: it ended with a
    raw SparkException, "Cannot add column, name already exists")."""
    s = small
    s.capture()
    s.bootstrap(s.block)
    cur, cl = lake.qualified(s.block.current_table), lake.qualified(s.block.changelog_table)
    s.execute(*(f"ALTER TABLE {sch}.block ADD COLUMN extra_note text" for sch in ("s0", "s1")))
    s.execute("UPDATE s0.block SET extra_note = 'x' WHERE id IN (SELECT id FROM s0.block ORDER BY id LIMIT 3)")
    s.wl.step(10)
    m1 = s.capture().manifest.run_id
    with overlapping(cur, _ingest_a(s, session_of_its_own(s.lake), m1), point=schema_point(cur)) as a:
        b_result = s.ingest(s.block, m1, run="B")
    assert a.error is None, f"A should find the column B added and converge: {a.error!r}"
    assert a.result.metrics.status == "already_applied" and b_result.metrics.status == "ok"
    assert "extra_note" in spark.table(cur).columns and "extra_note" in spark.table(cl).columns
    assert not changelog_twice(spark, cl)
    assert_lake_equals_source(spark, lake, s.block, s.dsn)


@pytest.mark.parametrize("b_batch", ["same", "newer"])
def test_an_ingest_held_before_its_backfill_converges_with_the_writer_that_finished_it(small, spark, lake, b_batch):
    """A batch adds a column with a volatile default (its old rows re-read from the source): A
    commits its MERGE with the backfill pending and is held there, while B finishes the backfill
    (the pending mark in the watermark) and applies the same batch or a newer one. A's backfill
    then converges: its values are the rows' current ones and the mark is cleared already. It
    never writes back the watermark it started from, and every row holds the source's value."""
    s = small
    s.capture()
    s.bootstrap(s.block)
    cur, cl = lake.qualified(s.block.current_table), lake.qualified(s.block.changelog_table)
    s.execute(*(f"ALTER TABLE {sch}.block ADD COLUMN drift float8 DEFAULT random()" for sch in ("s0", "s1")))
    m1, upto_b = _batches_a_and_b(s, b_batch, 10)
    with overlapping(cur, _ingest_a(s, session_of_its_own(s.lake), m1), point="ingest_after_merge") as a:
        b_result = s.ingest(s.block, upto_b, run="B")
        b_mark = read_watermark(spark, cur)
    assert b_result.metrics.status == "ok" and b_mark.backfill is None, b_mark
    # A's MERGE applied the batch before B started: A converges and reports it (#51: with B on a
    # newer batch A's backfill ended with a ConcurrentWriterError saying nothing was published).
    assert a.error is None, repr(a.error)
    assert a.result.metrics.status == "ok" and a.result.metrics.events_read > 0, a.result.metrics
    assert read_watermark(spark, cur) == b_mark, "A wrote back the watermark it started from"
    assert not changelog_twice(spark, cl)
    assert_lake_equals_source(spark, lake, s.block, s.dsn)
    # The metadata tables: B recorded A's batch (resume_batch: its MERGE had landed without a
    # record), and A, released, found it recorded. Each run is in the history once, and A's
    # freshness rows once per shard.
    assert recorded_runs(spark, lake, s.block.name, "ingest_runs") == {"A": 1, "B": 1}
    assert recorded_runs(spark, lake, s.block.name, "freshness") == {"A": 2, "B": 2}


def recorded_runs(spark, lake, table_name: str, meta: str) -> dict[str, int]:
    """Rows per ingest run of writers A and B in a metadata table."""
    t = lake.qualified(lake.meta_table(meta))
    spark.sql(f"REFRESH TABLE {t}")  # A committed from its own session
    rows = spark.table(t).filter((F.col("table_name") == table_name) & F.col("ingest_run").isin("A", "B"))
    return {r["ingest_run"]: r["count"] for r in rows.groupBy("ingest_run").count().collect()}


def test_a_repair_overlapping_an_ingest_leaves_the_position_where_the_ingest_put_it(small, spark, lake):
    """An audit's repair held just before its MERGE while an ingest commits a batch: the repair
    compared the keys at a position the table has left, and its MERGE restates that position's
    watermark. It is fenced like the ingest's commits (#51: it wrote the older watermark back,
    and the next ingest would have applied the batch's events again): nothing of it is written,
    the next audit repairs what still mismatches."""
    s = small
    s.capture()
    cfg = s.block.model_copy(
        update={"audit": s.block.audit.model_copy(update={"repair": True, "consecutive_mismatches": 1, "mode": "full"})}
    )
    s.bootstrap(cfg)
    cur, cl = lake.qualified(cfg.current_table), lake.qualified(cfg.changelog_table)
    spark.sql(f"UPDATE {cur} SET version = -1 WHERE id IN (SELECT id FROM {cur} ORDER BY id LIMIT 2)")
    s.wl.step(20)
    m1 = s.capture().manifest.run_id
    spark_a = session_of_its_own(s.lake)
    with overlapping(cur, lambda: audit_table(spark_a, lake, cfg, audit_run="held"), point="audit_repair_merge") as a:
        s.ingest(cfg, m1, run="B")
        moved = read_watermark(spark, cur)
    assert a.error is None, repr(a.error)
    assert a.result.repaired == 0 and "FAIL" in a.result.message, a.result.message
    assert read_watermark(spark, cur) == moved and read_watermark(spark, cl).runs[s.endpoint] == m1
    assert not changelog_twice(spark, cl)
    r = audit_table(spark, lake, cfg, audit_run="next")  # the batch may have rewritten a damaged key
    assert 1 <= r.repaired == sum(r.persistent.values()) <= 2, r.message
    assert_lake_equals_source(spark, lake, cfg, s.dsn)


# --- the feed consumer's exactly-once output --------------------------------------------------------


@pytest.mark.parametrize("b_range", ["same", "newer"])
def test_feed_consumers_overlapping_inside_the_output_commit_apply_a_range_once(small, spark, lake, unique, b_range):
    s = small
    s.capture()
    s.bootstrap(s.block)
    output = f"feed_t.overlap_{unique}"
    out = lake.qualified(output)
    block_counts(spark, lake, s.block, output=output)
    s.wl.step(30)
    s.ingest(s.block, s.capture().manifest.run_id, run="i1")
    spark_a = session_of_its_own(lake)
    with overlapping(out, lambda: block_counts(spark_a, lake, s.block, output=output)) as a:
        if b_range == "newer":
            s.wl.step(30)
            s.ingest(s.block, s.capture().manifest.run_id, run="i2")
        b = block_counts(spark, lake, s.block, output=output)
        assert b.committed, b
    assert lake_counts(s, output) == source_counts(s), "a range was applied twice or not at all"
    batch = batch_of_current_position_feed(spark, out)
    assert batch_snapshots(spark, out, batch) == 1
    if b_range == "same":
        assert a.error is None and a.result.committed is False, (a.error, a.result)
    else:
        assert isinstance(a.error, OffsetConflictError), repr(a.error)
        assert out in str(a.error) and "block_counts" in str(a.error)


def batch_of_current_position_feed(spark, table: str):
    from cdc_lakehouse.lake.batches import BATCH_PROP, BatchId
    from cdc_lakehouse.lake.snapshots import current_snapshot, summary_of

    return BatchId(summary_of(current_snapshot(spark, table))[BATCH_PROP])


# --- the derived tree's output ------------------------------------------------------------------------


def _first_child(s: Source, schema: str) -> tuple[int, int]:
    """(a node with a parent, a root of another tree in the same shard)."""
    import psycopg2

    conn = psycopg2.connect(s.dsn)
    with conn.cursor() as cur:
        cur.execute(f"SELECT id, parent_id FROM {schema}.block WHERE parent_id IS NOT NULL ORDER BY id LIMIT 1")
        node, parent = cur.fetchone()
        cur.execute(f"SELECT max(id) FROM {schema}.block WHERE parent_id IS NULL AND id <> {parent}")
        (other,) = cur.fetchone()
    conn.close()
    return node, other


@pytest.mark.parametrize("b_inputs", ["same", "newer"])
def test_derived_runs_overlapping_inside_the_output_commit_commit_once(tree_source, unique, b_inputs):  # noqa: F811
    """B commits the same inputs (A converges) or newer ones that move the subtree A recomputed
    (A fails, and its stale rows never land over B's)."""
    from tests.integration.test_derived_tree import apply_batch

    s = tree_source
    spark, lake = s.spark, s.lake
    cfg = tree_cfg(s, f"ovl_{unique}")
    derive(s, cfg)
    schema = s.schemas[0]
    node, other = _first_child(s, schema)
    apply_batch(s, f"UPDATE {schema}.block SET parent_id = NULL WHERE id = {node}")  # A: node becomes a root
    spark_a = session_of_its_own(lake)
    tables = {s.block.name: s.block, s.perm.name: s.perm}
    out = lake.qualified(cfg.output_table)
    with overlapping(out, lambda: derive_tree(spark_a, lake, cfg, tables)) as a:
        if b_inputs == "newer":
            apply_batch(s, f"UPDATE {schema}.block SET parent_id = {other} WHERE id = {node}")  # B: under `other`
        assert derive(s, cfg).mode == "incremental"
    assert_tree_is_reference(s, cfg)
    batch = batch_of_current_position(spark, out)
    assert batch_snapshots(spark, out, batch) == 1
    full = tree_cfg(s, f"ovl_full_{unique}")
    derive(s, full, full=True)
    assert lake_tree(s, cfg) == lake_tree(s, full)
    if b_inputs == "same":
        assert a.error is None, repr(a.error)
    else:
        assert isinstance(a.error, ConcurrentWriterError), repr(a.error)
        assert out in str(a.error)


# --- the chunked bootstrap's round ----------------------------------------------------------------


def test_chunked_bootstraps_overlapping_inside_a_round_apply_each_chunk_once(small, spark, lake):
    """A holds inside its first round (written, not published); B bootstraps the table to the end;
    A fails. Every key's chunk row is in the changelog once."""
    s = small
    cfg = _chunked(s, f"ckov_{s.db[-8:]}", 15)
    s.capture()
    cl = lake.qualified(cfg.changelog_table)
    ends = {s.endpoint: s.tables()}
    spark_a = session_of_its_own(lake)
    with overlapping(cl, lambda: bootstrap_table(spark_a, lake, cfg, run_id="A", all_endpoint_tables=ends)) as a:
        r = bootstrap_table(spark, lake, cfg, run_id="B", all_endpoint_tables=ends)
        assert r.done, r
    spark.sql(f"REFRESH TABLE {cl}")
    rows = spark.table(cl).filter(F.col(OP_COL) == "r")
    twice = rows.groupBy(SHARD_COL, "id").count().filter("count > 1").limit(5).collect()
    assert not twice, f"a chunk was applied twice: {twice}"
    assert rows.count() == sum(s.wl.row_counts().values())
    assert isinstance(a.error, ConcurrentWriterError), repr(a.error)
    assert cl in str(a.error) and "another chunked bootstrap (run B)" in str(a.error)
    s.ingest(cfg, s.capture().manifest.run_id)
    assert_lake_equals_source(spark, lake, cfg, s.dsn)


# --- metadata tables -----------------------------------------------------------------------------


def test_two_runs_quarantining_the_same_events_at_once_add_them_once(spark, lake, unique):
    """Two runs of one batch (a second deployment, a manual run) quarantine its malformed events at
    the same moment, each from its own session. Before #51 the quarantine's insert-only MERGE was a
    plain append, never validated: every event landed twice and both runs reported it. Now one run
    adds them and reports them, the other finds them there and reports 0."""
    from cdc_lakehouse.columns import RUN_COL
    from cdc_lakehouse.ingest.quarantine import write_quarantine
    from cdc_lakehouse.ingest.validate import FILE, RAW, REASONS
    from cdc_lakehouse.lake.meta import ensure_meta_tables

    cfg = make_config(f"qr_{unique}", ["s0"])
    ensure_meta_tables(spark, lake)
    q = lake.qualified(lake.meta_table("quarantine"))
    sessions = (spark, session_of_its_own(lake))
    schema = (
        f"`{SHARD_COL}` string, `{REASONS}` array<string>, `{RAW}` string, `{LSN_COL}` bigint, _seq_raw bigint, "
        f"`{RUN_COL}` string, `{FILE}` string"
    )
    for attempt in range(2):  # each a batch of its own
        events = [("s0", [f"bad value {i}"], f"raw {i}", 1000 * attempt + i, 0, "r1", f"f{i}.json") for i in range(20)]
        barrier, added = threading.Barrier(2), [-1, -1]

        def quarantine(i: int, events=events, barrier=barrier, added=added) -> None:
            bad = sessions[i].createDataFrame(events, schema)
            barrier.wait()  # both MERGEs start together
            added[i] = write_quarantine(sessions[i], lake, cfg, bad, f"run{i}")

        writers = [threading.Thread(target=quarantine, args=(i,)) for i in (0, 1)]
        for w in writers:
            w.start()
        for w in writers:
            w.join(300)
        spark.sql(f"REFRESH TABLE {q}")
        rows = spark.table(q).filter((F.col("table_name") == cfg.name) & (F.col("commit_lsn") >= 1000 * attempt))
        kept = rows.filter(F.col("commit_lsn") < 1000 * attempt + 1000).groupBy("commit_lsn").count()
        assert (kept.count(), kept.filter("count > 1").count()) == (20, 0), f"attempt {attempt}: an event twice"
        assert sorted(added) == [0, 20], f"attempt {attempt}: runs reported {added}"


def test_two_runs_recording_the_same_batch_at_once_record_it_once(spark, lake, unique):
    """Two runs of one batch (a run that outlived its task and the next run's resume_batch, or a
    second deployment) write its run record and freshness rows at the same moment, each from its
    own session. Before #51 the check that the batch was not recorded yet and the append were two
    steps: both checks passed, and the batch was in cdc_meta.ingest_runs twice and its freshness
    rows twice per shard. Now the append is published only while the table is as checked, and the
    loser checks again and finds the batch there."""
    from datetime import UTC, datetime

    from cdc_lakehouse.ingest.records import TableRecords, write_records
    from cdc_lakehouse.lake.batches import BatchId
    from cdc_lakehouse.lake.ingest_metrics import IngestMetrics
    from cdc_lakehouse.lake.meta import ensure_meta_tables
    from cdc_lakehouse.lake.meta_rows import ShardFreshness

    ensure_meta_tables(spark, lake)
    name, shards = f"rec_{unique}", ("s0", "s1")
    runs, fresh = (lake.qualified(lake.meta_table(t)) for t in ("ingest_runs", "freshness"))
    sessions = (spark, session_of_its_own(lake))
    for attempt in range(2):  # each a batch of its own
        run, now = f"r{attempt}", datetime.now(UTC)
        record = TableRecords(
            table_name=name,
            batch=BatchId.of(f"ingest:{name}", attempt, attempt + 1),
            since_ms=int(now.timestamp() * 1000),
            run=IngestMetrics(table_name=name, ingest_run=run, write_mode="merge").meta_row(),
            freshness=[
                ShardFreshness(
                    table_name=name, shard=s, endpoint="e0", source_schema="public", ingest_run=run, updated_at=now
                )
                for s in shards
            ],
        )
        barrier, errors = threading.Barrier(2), []

        def write(i: int, record=record, barrier=barrier, errors=errors) -> None:
            barrier.wait()  # both checks, then both appends
            try:
                write_records(sessions[i], lake, [record])
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                errors.append(exc)

        writers = [threading.Thread(target=write, args=(i,)) for i in (0, 1)]
        for w in writers:
            w.start()
        for w in writers:
            w.join(300)
        assert not errors, errors
        counts = []
        for table in (runs, fresh):
            spark.sql(f"REFRESH TABLE {table}")
            counts.append(
                spark.table(table).filter((F.col("table_name") == name) & (F.col("ingest_run") == run)).count()
            )
        assert counts == [1, len(shards)], f"attempt {attempt}: (run records, freshness rows) {counts}"


# --- the fence itself -------------------------------------------------------------------------------


def test_a_fenced_write_must_go_to_its_branch_and_killed_runs_branches_are_dropped(spark, lake, unique, monkeypatch):
    """A table without a snapshot can be fenced on; a write that bypasses the branch it was given
    is refused (it would not be fenced); a branch a killed run left is dropped by a later writer
    once it is a day old, and a younger one (maybe a run still going) is kept."""
    import json

    import cdc_lakehouse.lake.commits as commits
    from cdc_lakehouse.lake.snapshots import branch_names
    from cdc_lakehouse.watermark import WATERMARK_PROP, Watermark

    spark.sql("CREATE NAMESPACE IF NOT EXISTS lake.fence_t")
    table = f"lake.fence_t.f_{unique}"
    spark.sql(f"CREATE TABLE {table} (id bigint) USING iceberg TBLPROPERTIES ('format-version' = '2')")

    def append(target: str, n: int) -> None:
        df = spark.createDataFrame([(n,)], "id bigint")
        df.writeTo(target).option(f"snapshot-property.{WATERMARK_PROP}", json.dumps({"n": n})).append()

    def at(n: int) -> Watermark:  # the position append(_, n) commits, as the fence reads it back
        return Watermark.from_dict({"n": n})

    assert commits.fenced_commit(spark, table, None, at(1), lambda t: append(t, 1), what="first")
    with pytest.raises(RuntimeError, match="did not commit its new position to .*branch_cdc_w_"):
        commits.fenced_commit(spark, table, at(1), at(2), lambda t: append(table, 2), what="bypass")
    old, young = "cdc_w_20000101000000_0badbeef", commits.BRANCH_PREFIX + "29990101000000_0000beef"
    for name in (old, young, "audit"):
        spark.sql(f"ALTER TABLE {table} CREATE BRANCH {name}")
    monkeypatch.setattr(commits, "_swept", {})
    assert not commits.fenced_commit(spark, table, at(1), at(2), lambda t: append(t, 2), what="again")
    assert branch_names(spark, table) == sorted(["main", young, "audit"])
    assert sorted(r["id"] for r in spark.table(table).collect()) == [1, 2]  # the bypass landed, unfenced
