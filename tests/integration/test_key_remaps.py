"""Cascading key changes in one batch (issue #19), against real PostgreSQL, Spark and Iceberg.

Every moved row has a large `content` stored out of line, so PostgreSQL sends it as an unchanged
TOAST value with each key change and each later update that leaves it alone: the value must follow
the row through the whole chain, in LSN order, and the lake must end equal to the source."""

from __future__ import annotations

import logging
import math

from pyspark.sql import functions as F

from tests.helpers import assert_lake_equals_source

# 2.5 kB of distinct text per row and tag: out of line (STORAGE EXTERNAL), so unchanged = unsent.
BIG = "(SELECT string_agg(md5(g::text || {tag}), '') FROM generate_series(1, 80) g)"
FAR = 500_000_000  # new keys far above the workload's, inside the shard's id range


def _toast(s, ids: list[int], tag: str) -> None:
    """A batch of its own giving each row a large content, applied, so the table holds them."""
    s.execute(f"UPDATE s0.block SET content = {BIG.format(tag=f'id::text || {tag!r}')} WHERE id IN ({_in(ids)})")
    r = s.ingest(s.block, s.capture().manifest.run_id, run="toast")
    assert r.metrics.status == "ok"


def _in(ids: list[int]) -> str:
    return ", ".join(str(int(i)) for i in ids)


def _chain_sql(start: int, first_new: int, n: int, other: int) -> str:
    """One transaction: `start` moves n times through first_new, first_new + 1, ...; after each move
    an update of the new key and of `other`, both leaving content alone."""
    return (
        f"DO $$ DECLARE k bigint := {int(start)}; BEGIN FOR i IN 0..{int(n) - 1} LOOP "
        f"UPDATE s0.block SET id = {int(first_new)} + i WHERE id = k; k := {int(first_new)} + i; "
        "UPDATE s0.block SET version = version + 1 WHERE id = k; "
        f"UPDATE s0.block SET version = version + 1 WHERE id = {int(other)}; END LOOP; END $$"
    )


def _remap_stats(caplog) -> list:
    return [r.remap for r in caplog.records if hasattr(r, "remap")]


def _content(spark, lake, s, key: int) -> str:
    row = spark.table(lake.qualified(s.block.current_table)).filter(F.col("id") == key).collect()
    assert len(row) == 1, f"key {key}: {len(row)} rows"
    return row[0]["content"]


def test_chains_of_1_2_100_and_1000_keep_toast_values_in_log_passes(source, spark, lake, caplog):
    s = source
    s.capture()
    s.bootstrap(s.block)
    a = s.wl.first_id["s0"]
    starts, other = [a, a + 1, a + 2, a + 3], a + 4
    _toast(s, [*starts, other], "c")
    before = {k: _content(spark, lake, s, k) for k in starts}
    caplog.set_level(logging.INFO, logger="cdc_lakehouse.ingest.toast")
    lengths = [1, 2, 100, 1000]
    ends, sql = {}, []
    for i, (k, n) in enumerate(zip(starts, lengths)):
        first = a + FAR + i * 10_000
        # The chain of 1000 spans 10 transactions (10 commits), the others one each.
        for j in range(0, n, 100):
            sql.append(_chain_sql(k if j == 0 else first + j - 1, first + j, min(100, n - j), other))
        ends[k] = first + n - 1
    s.execute(*sql)
    r = s.ingest(s.block, s.capture().manifest.run_id, run="chains")
    assert r.metrics.quarantined == 0 and r.metrics.status == "ok"
    assert_lake_equals_source(spark, lake, s.block, s.dsn)
    for k, end in ends.items():
        assert _content(spark, lake, s, end) == before[k]
    stats = _remap_stats(caplog)
    assert len(stats) == 1 and stats[0].unresolved == 0 and stats[0].links >= 1103
    # Pointer jumping: passes grow with log2 of the longest chain (1000), not with its length.
    assert 1 <= stats[0].passes <= math.ceil(math.log2(1000)) + 1, stats[0]


def test_swaps_cycles_and_a_bulk_shift_end_equal_to_the_source(source, spark, lake, caplog):
    s = source
    s.capture()
    s.bootstrap(s.block)
    a = s.wl.first_id["s0"]
    swap, cyc = [a, a + 1], [a + 2, a + 3, a + 4, a + 5]
    hi = s.wl.next_id["s0"] - 1  # the highest key: the shift moves it to a free one
    shift = list(range(hi - 199, hi + 1))  # 200 keys shifted by one
    tmp = a + FAR
    _toast(s, [*swap, *cyc, *shift], "s")
    before = {k: _content(spark, lake, s, k) for k in [*swap, *cyc, *shift]}
    caplog.set_level(logging.INFO, logger="cdc_lakehouse.ingest.toast")
    up = "UPDATE s0.block SET version = version + 1 WHERE id = {}"
    s.execute(
        # swap a <-> a+1 through a temporary key (the primary key allows no other way)
        f"BEGIN; UPDATE s0.block SET id = {tmp} WHERE id = {a}; UPDATE s0.block SET id = {a} WHERE id = {a + 1}; "
        f"UPDATE s0.block SET id = {a + 1} WHERE id = {tmp}; COMMIT",
        up.format(a),
        # a cycle through 4 keys (c0 -> c1 -> c2 -> c3 -> c0), twice round, updates in between
        *[
            f"BEGIN; UPDATE s0.block SET id = {tmp} WHERE id = {cyc[3]}; {up.format(tmp)}; "
            + "; ".join(f"UPDATE s0.block SET id = {cyc[i + 1]} WHERE id = {cyc[i]}" for i in (2, 1, 0))
            + f"; UPDATE s0.block SET id = {cyc[0]} WHERE id = {tmp}; {up.format(cyc[0])}; COMMIT"
            for _ in range(2)
        ],
        # UPDATE ... SET id = id + 1 over 200 keys: one transaction, highest key first, since a
        # non-deferrable key is checked row by row (a deferrable one cannot be the replica identity)
        f"DO $$ DECLARE r record; BEGIN FOR r IN SELECT id FROM s0.block WHERE id BETWEEN {shift[0]} AND "
        f"{shift[-1]} ORDER BY id DESC LOOP UPDATE s0.block SET id = r.id + 1 WHERE id = r.id; END LOOP; END $$",
        up.format(shift[0] + 1),
    )
    r = s.ingest(s.block, s.capture().manifest.run_id, run="remaps")
    assert r.metrics.quarantined == 0 and r.metrics.status == "ok"
    assert_lake_equals_source(spark, lake, s.block, s.dsn)
    assert _content(spark, lake, s, a) == before[a + 1] and _content(spark, lake, s, a + 1) == before[a]
    # Twice round c0 -> c1 -> c2 -> c3 -> c0: each key holds the row two places behind it.
    assert [_content(spark, lake, s, cyc[(i + 2) % 4]) for i in range(4)] == [before[k] for k in cyc]
    assert all(_content(spark, lake, s, k + 1) == before[k] for k in shift)
    assert _remap_stats(caplog)[0].unresolved == 0
