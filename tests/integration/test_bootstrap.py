"""Snapshot bootstrap against a live source: no gap and no overlap with the change stream."""

from __future__ import annotations

import threading

import pytest
from cdc_lakehouse.lake.snapshots import read_watermark
from cdc_lakehouse.maintenance.verify import content_checksum
from cdc_lakehouse.source.errors import PreflightError

from tests.helpers import assert_lake_equals_source


@pytest.mark.core
def test_bootstrap_under_concurrent_writes_hands_off_without_gap(source, spark, lake):
    """Several shards load while a workload keeps writing; after the ingest the lake equals the
    source exactly, every row and every column (the handoff position is the snapshot's)."""
    s = source
    s.capture()  # the slot exists before the snapshot
    stop = threading.Event()
    errors: list[BaseException] = []
    steps = []

    def writer():
        try:
            while not stop.is_set():
                steps.append(s.wl.step(150, pk_changes=1))
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        r = s.bootstrap(s.block)
    finally:
        stop.set()
        t.join(timeout=120)
    assert not errors, errors
    assert len(steps) >= 2, "the workload should have written while the bootstrap ran"
    wm = read_watermark(spark, lake.qualified(s.block.current_table))
    assert set(wm.shards) == {shard for _, _, shard in s.block.shards()}
    assert r.rows > 0
    m = s.capture()
    s.ingest(s.block, m.manifest.run_id)
    assert_lake_equals_source(spark, lake, s.block, s.dsn)


def test_rebootstrap_is_idempotent_and_can_target_one_shard(source, spark, lake):
    s = source
    s.capture()
    s.bootstrap(s.block)
    cur = lake.qualified(s.block.current_table)
    cols = [f.name for f in spark.table(cur).schema.fields if not f.name.startswith("_cdc_")]
    first = content_checksum(spark, cur, cols)
    s.bootstrap(s.block)
    assert content_checksum(spark, cur, cols) == first, "a second bootstrap must give the same table"
    # One shard only: its rows are replaced, the other shard's rows and watermark are untouched.
    shards = [shard for _, _, shard in s.block.shards()]
    wm_before = read_watermark(spark, cur)
    s.execute("UPDATE s1.block SET version = version + 100 WHERE id IN (SELECT id FROM s1.block LIMIT 7)")
    s.bootstrap(s.block, shards=[shards[1]])
    wm_after = read_watermark(spark, cur)
    assert wm_after.shards[shards[0]] == wm_before.shards[shards[0]]
    assert wm_after.shards[shards[1]].lsn > wm_before.shards[shards[1]].lsn
    assert_lake_equals_source(spark, lake, s.block, s.dsn)


def test_preflight_stops_before_writing(source, spark, lake):
    s = source
    s.capture()
    missing = s.block.model_copy(update={"source": s.block.source.model_copy(update={"table": "nope"})})
    with pytest.raises(PreflightError) as exc:
        s.bootstrap(missing)
    assert "nope" in str(exc.value)
    # A declared key that is not unique in the source.
    s.execute(
        "CREATE TABLE s0.dupkey (id int, v text)",
        "CREATE TABLE s1.dupkey (id int, v text)",
        "INSERT INTO s0.dupkey VALUES (1, 'a'), (1, 'b')",
        "ALTER TABLE s0.dupkey REPLICA IDENTITY FULL",
        "ALTER TABLE s1.dupkey REPLICA IDENTITY FULL",
    )
    dup = s.block.model_copy(
        update={"name": s.block.name + "_dup", "source": s.block.source.model_copy(update={"table": "dupkey"})}
    )
    with pytest.raises(PreflightError) as exc:
        s.bootstrap(dup)
    assert "unique" in str(exc.value) and "primary_key" in str(exc.value)
    assert not spark.catalog.tableExists(lake.qualified(dup.current_table)), "nothing may be written"
