"""Quarantine replay against real PostgreSQL, Spark and Iceberg: events quarantined because a value
did not fit the lake column are applied once the column is widened, through the ingest's
LSN-guarded merge; newer rows of the same keys and keys deleted since are left alone; events that
still fail stay with their reason; a replay killed after its merge converges when run again, and a
replay with nothing to apply is a no-op."""

from __future__ import annotations

from cdc_lakehouse.columns import COMMIT_TS_COL, LSN_COL, SHARD_COL
from cdc_lakehouse.feed.arrow import load_catalog_for
from cdc_lakehouse.ingest.ingest_table import start_position
from cdc_lakehouse.ingest.replay import decide, merge_replayed, read_quarantined, replay_quarantine, revalidate
from cdc_lakehouse.lake.commits import current_snapshot_id
from cdc_lakehouse.lake.snapshots import read_watermark
from cdc_lakehouse.lake.tables import source_columns_of
from cdc_lakehouse.orchestration.approvals import quarantine_holds
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual

from tests.helpers import append_malformed, assert_lake_equals_source, source_df


def _quarantine(spark, lake, cfg):
    qt = lake.qualified(lake.meta_table("quarantine"))
    spark.sql(f"REFRESH TABLE {qt}")
    return spark.table(qt).filter(F.col("table_name") == cfg.name)


def _lenient(cfg, **update):
    budget = cfg.ingest.error_budget.model_copy(update={"max_quarantined": 100, "max_fraction": 1.0})
    return cfg.model_copy(update={"ingest": cfg.ingest.model_copy(update={"error_budget": budget}), **update})


def _kill_after_merge(spark, lake, cfg) -> int:
    """The replay's phases up to its MERGE, as a replay killed before it resolves the quarantine."""
    cur = lake.qualified(cfg.current_table)
    wm, lake_cols = start_position(spark, cfg, cur), source_columns_of(spark, cur, cfg)
    q, _ = read_quarantined(spark, lake, cfg)
    d = decide(spark, lake, cfg, revalidate(q, cfg, lake_cols), lake_cols)
    merge_replayed(spark, cfg, cur, wm, lake_cols, d.apply, "killed")
    return d.rows_changed


def _lake_equals_source_except(spark, lake, cfg, dsn, key_out: int) -> None:
    cur = lake.qualified(cfg.current_table)
    spark.sql(f"REFRESH TABLE {cur}")
    cols = source_columns_of(spark, cur, cfg)
    expected = source_df(spark, cfg, dsn, cols).filter(F.col("id") != key_out)
    actual = spark.table(cur).filter(F.col("id") != key_out).select(SHARD_COL, *[c for c, _ in cols])
    assertDataFrameEqual(actual, expected)


def _narrow_then_wide(s, lake):
    """Configs whose lake score column is narrower than the source's numeric(12,4) (bigger values
    do not fit) and as wide; the table bootstrapped narrow. Returns (narrow, wide, current table)."""
    narrow = _lenient(s.block, column_types={"score": "decimal(8,4)"})
    wide = _lenient(s.block)
    s.capture()
    s.bootstrap(narrow)
    return narrow, wide, lake.qualified(narrow.current_table)


def test_replay_after_a_widening_applies_what_fits_and_never_overwrites_newer(source, spark, lake):
    s = source
    narrow, wide, cur = _narrow_then_wide(s, lake)
    ids = [r[0] for r in s.pg.execute("SELECT id FROM s0.block ORDER BY id LIMIT 5", dbname=s.db)]
    k1, k2, k3, k4, k5 = ids
    s.execute(
        f"UPDATE s0.block SET score = 123456.5, content = 'fixed ' || id WHERE id IN ({k1}, {k2}, {k3}, {k4})",
        # k5's content is long (stored out of line): a later update that leaves it alone sends no value.
        f"UPDATE s0.block SET score = 123456.5, content = repeat('long ', 2000) WHERE id = {k5}",
    )
    m = s.capture()
    append_malformed(
        lake,
        s.endpoint,
        m.manifest.run_id,
        "block",
        [
            {"op": "x", "after": [("id", "999999999"), ("space_id", "1")]},
            {"after": [("id", "not-a-number"), ("space_id", "1")]},
        ],
    )
    r = s.ingest(narrow, m.manifest.run_id, run="q1")
    assert r.metrics.quarantined == 7 and r.metrics.updates == 0, r
    reasons = [x["reason"] for x in _quarantine(spark, lake, narrow).collect()]
    assert sum("column score: value '123456.5000' does not fit decimal(8,4)" in x for x in reasons) == 5, reasons

    # Later changes of those keys: k2 updated (a newer row), k3 deleted, k5 updated without its
    # TOAST value, which the table cannot give (its row predates the quarantined event): held back.
    # The wide config's ingest widens the lake column (decimal(8,4) -> decimal(12,4), additive).
    s.execute(
        f"UPDATE s0.block SET score = 5, content = 'newer' WHERE id = {k2}",
        f"DELETE FROM s0.block WHERE id = {k3}",
        f"UPDATE s0.block SET version = version + 1 WHERE id = {k5}",
    )
    r = s.ingest(wide, s.capture().manifest.run_id, run="q2")
    assert r.metrics.updates == 1 and r.metrics.deletes == 1 and r.metrics.quarantined == 1, r
    assert dict(source_columns_of(spark, cur, wide))["score"] == "decimal(12,4)"
    held = _quarantine(spark, lake, wide).filter(F.col("landing_file").isNull()).collect()
    assert len(held) == 1 and "depend on quarantined event" in held[0]["reason"], held
    wm = read_watermark(spark, cur)

    # Killed after the MERGE: k1, k4 and k5 are in the table, their events still in quarantine.
    assert _kill_after_merge(spark, lake, wide) == 3
    assert _quarantine(spark, lake, wide).count() == 8
    # What cdc_replay__<table>'s review shows before its approval (#53), read by pyiceberg.
    holds = quarantine_holds(load_catalog_for(lake), lake, wide.name)
    assert (holds.replayable, holds.held) == (7, 1), holds
    assert "does not fit decimal(8,4)" in holds.by_reason[0][0] and holds.by_reason[0][1] == 5, holds
    assert sum(n for _, n in holds.by_reason) == 7
    res = replay_quarantine(spark, lake, wide, replay_run="rp1")
    # k2's event is older than its row, k3's older than its delete: resolved without effect.
    assert (res.examined, res.resolved, res.rows_changed, res.still_quarantined) == (7, 5, 0, 2), res
    assert res.held_untouched == 1
    q = _quarantine(spark, lake, wide)
    left = sorted(x["reason"] for x in q.filter(F.col("landing_file").isNotNull()).collect())
    assert len(left) == 2 and "unknown op 'x'" in left[1] and "'not-a-number' does not fit bigint" in left[0], left
    assert [x["reason"] for x in q.filter(F.col("landing_file").isNull()).collect()] == [held[0]["reason"]]

    # The source's rows: k1 and k4 carry the replayed values, k2 its newer one, k3 stays deleted.
    # k5 is at its replayed state (score and long content), not its newest: that update stays held
    # (never a mix of the two). The changelog is not compared: replay does not append to it.
    _lake_equals_source_except(spark, lake, wide, s.dsn, k5)
    rows = {r["id"]: r for r in spark.table(cur).filter(F.col("id").isin(ids)).collect()}
    assert sorted(rows) == sorted([k1, k2, k4, k5])
    assert str(rows[k1]["score"]) == "123456.5000" and rows[k1]["content"] == f"fixed {k1}"
    assert str(rows[k2]["score"]) == "5.0000" and rows[k2]["content"] == "newer"
    src_v5 = s.pg.execute(f"SELECT version FROM s0.block WHERE id = {k5}", dbname=s.db)[0][0]
    assert str(rows[k5]["score"]) == "123456.5000" and rows[k5]["content"] == "long " * 2000
    assert rows[k5]["version"] == src_v5 - 1
    assert rows[k1][COMMIT_TS_COL] is not None and rows[k1][LSN_COL] < wm.shards[rows[k1][SHARD_COL]].lsn
    assert read_watermark(spark, cur) == wm  # the watermark did not move, backwards or forwards

    # A second replay: nothing to apply, nothing committed to the table, the quarantine unchanged.
    snap = current_snapshot_id(spark, cur)
    assert quarantine_holds(load_catalog_for(lake), lake, wide.name).replayable == 2
    res = replay_quarantine(spark, lake, wide, replay_run="rp2")
    assert (res.examined, res.resolved, res.rows_changed, res.still_quarantined) == (2, 0, 0, 2), res
    assert current_snapshot_id(spark, cur) == snap
    assert sorted(x["reason"] for x in _quarantine(spark, lake, wide).collect()) == sorted([*left, held[0]["reason"]])

    # The normal ingest carries on from the same watermark; k5's next full row catches it up.
    s.execute(
        f"UPDATE s0.block SET score = 7 WHERE id = {k1}",
        f"UPDATE s0.block SET content = 'short again' WHERE id = {k5}",
    )
    r = s.ingest(wide, s.capture().manifest.run_id, run="q3")
    assert r.metrics.updates == 2 and r.metrics.quarantined == 0, r
    assert_lake_equals_source(spark, lake, wide, s.dsn, check_changelog=False)


def test_a_replay_overlapping_an_ingest_applies_nothing(source, spark, lake):
    """A replay held between its MERGE's write and its publish while an ingest commits a batch:
    the ingest may have changed a key the replay would overwrite, so the replay's commit is
    fenced on the watermark it read, checked when it is published (#51: the check ran before the
    write only). It fails naming the other writer and applies nothing; run again, it applies."""
    import threading

    from cdc_lakehouse.lake.commits import ConcurrentWriterError, publish_point
    from cdc_lakehouse.runtime.failpoints import hold_at

    from tests.integration.test_overlapping_writers import session_of_its_own

    s = source
    narrow, wide, cur = _narrow_then_wide(s, lake)
    k1, k2 = [r[0] for r in s.pg.execute("SELECT id FROM s0.block ORDER BY id LIMIT 2", dbname=s.db)]
    # content set too: a quarter of the workload's rows hold a long (TOASTed) content, which an
    # update leaving it alone sends as unavailable, and the replay then keeps the event (a flake
    # that depended on the source's seed).
    s.execute(f"UPDATE s0.block SET score = 123456.5, content = 'fixed ' || id WHERE id = {k1}")
    assert s.ingest(narrow, s.capture().manifest.run_id, run="n1").metrics.quarantined == 1
    s.execute(f"UPDATE s0.block SET version = version + 1 WHERE id = {k2}")
    s.ingest(wide, s.capture().manifest.run_id, run="w1")  # widens score: the event now fits
    errors: list[BaseException] = []
    spark_a = session_of_its_own(lake)  # as another process would: its own catalog cache

    def replay() -> None:
        try:
            replay_quarantine(spark_a, lake, wide, replay_run="held")
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            errors.append(exc)

    with hold_at(publish_point(cur)) as hold:
        a = threading.Thread(target=replay, daemon=True)
        a.start()
        while not hold.reached.wait(0.5):
            assert a.is_alive(), f"the replay ended before its publish: {errors!r}"
        s.execute(f"UPDATE s0.block SET version = version + 1 WHERE id = {k2}")
        s.ingest(wide, s.capture().manifest.run_id, run="w2")
        hold.release.set()
        a.join(600)
    assert len(errors) == 1 and isinstance(errors[0], ConcurrentWriterError), errors
    assert "quarantine replay" in str(errors[0]) and "another writer" in str(errors[0])
    spark.sql(f"REFRESH TABLE {cur}")
    assert str(spark.table(cur).filter(F.col("id") == k1).first()["score"]) != "123456.5000"
    assert _quarantine(spark, lake, wide).count() == 1  # still there, with its event
    res = replay_quarantine(spark, lake, wide, replay_run="again")
    assert (res.resolved, res.rows_changed) == (1, 1), res
    assert_lake_equals_source(spark, lake, wide, s.dsn, check_changelog=False)
