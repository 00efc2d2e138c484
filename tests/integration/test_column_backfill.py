"""One-column backfill, online (bootstrap/column.py), against real PostgreSQL, capture, Spark and
Iceberg: two columns of every lake row lost (as after a quarantine or a bad repair), filled back
from the source in small chunks while a writer keeps changing the source, with a kill between a
chunk's MERGE and its progress row, a pause, and an ingest between the runs. The lake then
equals the source, every column of every row, and the progress rows say where each run was."""

from __future__ import annotations

import threading

import pytest
from cdc_lakehouse.bootstrap import column
from cdc_lakehouse.bootstrap.column import backfill_columns, progress_key

from tests.helpers import assert_lake_equals_source
from tests.integration.conftest import HeldCommit, Source

COLUMNS = ["score", "tags"]


class Killed(Exception):
    pass


@pytest.fixture
def fill_source(pg, source_uri, spark, lake, unique):
    s = Source(pg, spark, lake, unique, blocks=300)
    s.block = s.block.model_copy(
        update={"bootstrap": s.block.bootstrap.model_copy(update={"chunk_rows": 120})}
    )  # 3 chunks per shard
    yield s
    s.close()


def test_columns_filled_online_under_writes_with_a_kill_and_a_pause(fill_source, spark, lake, monkeypatch):
    s = fill_source
    cfg, cur = s.block, lake.qualified(s.block.current_table)
    s.capture()
    s.bootstrap(cfg)
    spark.sql(f"UPDATE {cur} SET score = NULL, tags = NULL")  # the values to bring back
    lost = spark.table(cur).where("score IS NULL AND tags IS NULL").count()

    stop = threading.Event()

    def write() -> None:  # updates (score changes with every one), inserts, deletes, all shards
        while not stop.wait(0.3):
            s.wl.step(20)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        # Killed after its third chunk's MERGE, before that chunk's progress row.
        calls = [0]
        record = column.record_progress

        def dying_record(*a, **kw):
            calls[0] += 1
            if calls[0] == 3:
                raise Killed
            record(*a, **kw)

        monkeypatch.setattr(column, "record_progress", dying_record)
        with pytest.raises(Killed):
            backfill_columns(spark, lake, cfg, COLUMNS, run_id="fill1")
        monkeypatch.undo()

        # Resumed after the last recorded chunk, then paused after one more. Between that chunk's
        # read and its MERGE, a row of it changes at the source and the ingest applies the change:
        # the MERGE must leave that newer row alone (the LSN guard).
        merge = column.merge_chunk
        raced = []

        def racing_merge(spark_, cfg_, cur_, chunk, *a, **kw):
            if not raced:
                key = int(chunk.rows.column("id")[0].as_py())
                schema = chunk.shard.rsplit(".", 1)[-1]
                s.execute(f"UPDATE {schema}.block SET score = 4242.5, tags = ARRAY['raced'] WHERE id = {key}")
                assert s.ingest(cfg, s.capture().manifest.run_id).metrics.status == "ok"
                raced.append((chunk.shard, key))
            merge(spark_, cfg_, cur_, chunk, *a, **kw)

        monkeypatch.setattr(column, "merge_chunk", racing_merge)
        r = backfill_columns(spark, lake, cfg, COLUMNS, run_id="fill1", should_stop=lambda _state: True)
        monkeypatch.undo()
        assert r.paused and r.resumed and r.chunks >= 1 and raced, r
        ((shard, key),) = raced
        row = spark.table(cur).where(f"_cdc_shard = '{shard}' AND id = {key}").collect()
        assert [(float(x["score"]), x["tags"]) for x in row] == [(4242.5, ["raced"])], row
        assert s.ingest(cfg, s.capture().manifest.run_id).metrics.status == "ok"  # the stream, between runs

        r = backfill_columns(spark, lake, cfg, COLUMNS, run_id="fill1")
        assert not r.paused and r.resumed and r.rows_read > 0, r
    finally:
        stop.set()
        writer.join(60)
    assert s.ingest(cfg, s.capture().manifest.run_id).metrics.status == "ok"
    assert lost > 500
    assert_lake_equals_source(spark, lake, cfg, s.dsn)

    progress = spark.sql(
        f"SELECT shard, max(chunk) AS last, bool_or(done) AS done FROM {lake.qualified(lake.meta_table('bootstrap_progress'))} "
        f"WHERE table_name = '{progress_key(cfg, COLUMNS)}' GROUP BY shard"
    ).collect()
    assert {p["shard"] for p in progress} == {shard for _, _, shard in cfg.shards()}
    assert all(p["done"] and p["last"] >= 2 for p in progress), progress

    # A finished backfill run again is a new one (a repair): from the first chunk, nothing to change.
    shard = cfg.shards()[0][2]
    again = backfill_columns(spark, lake, cfg, COLUMNS, run_id="fill2", shards=[shard])
    assert not again.resumed and again.chunks >= 3 and set(again.shards) == {shard}, again
    assert_lake_equals_source(spark, lake, cfg, s.dsn, check_changelog=False)


def test_a_commit_below_the_low_marker_not_visible_yet_is_not_overwritten(
    pg, source_uri, spark, lake, unique, monkeypatch
):
    """An update of a filled column whose commit record lies below a chunk's low marker L but which
    is not visible yet when the chunk is read (its COMMIT waits for a synchronous standby), and
    that the ingest applies before the chunk's MERGE: its row then sits below L, so the MERGE sets
    it, with the value the read found. The reader waits after L until such commits are visible."""
    s = Source(pg, spark, lake, unique, blocks=30)
    try:
        cfg, schema = s.block, s.schemas[0]
        victim = s.wl.next_id[schema] - 1
        s.capture()
        s.bootstrap(cfg)
        real = column.merge_chunk
        held = HeldCommit(pg, s.dsn, f"UPDATE {schema}.block SET score = 4242 WHERE id = {victim}")

        def ingest_then_merge(*args, **kwargs):  # between the chunk's read and its MERGE
            held.release()
            s.ingest(cfg, s.capture().manifest.run_id)
            return real(*args, **kwargs)

        monkeypatch.setattr(column, "merge_chunk", ingest_then_merge)
        with held:
            r = backfill_columns(spark, lake, cfg, ["score"], run_id="held")
        monkeypatch.undo()
        assert r.chunks == 2 and not r.paused, r
        assert spark.table(lake.qualified(cfg.current_table)).filter(f"id = {victim}").first()["score"] == 4242
        assert_lake_equals_source(spark, lake, cfg, s.dsn)
    finally:
        s.close()
