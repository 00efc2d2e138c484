"""lake.points: the rule that finds the positions where every table of an endpoint is complete."""

from __future__ import annotations

from cdc_lakehouse.lake.points import TableHistory, consistent_points, latest_point
from cdc_lakehouse.lake.ranges import SnapshotInfo
from cdc_lakehouse.watermark import Watermark

E = "ep1"
SRC = {"system": "7001", "timeline": 1, "database": "notion"}


def wm(lsns: dict[str, int], run: str | None = None, source=SRC, endpoint=E, **extra) -> Watermark:
    shards = {s: {"lsn": n, "endpoint": endpoint, "source": source} for s, n in lsns.items()}
    return Watermark.from_dict({"v": 1, "shards": shards, "runs": {E: run} if run else {}, **extra})


def history(table: str, chain: list[Watermark | None], shards=("s0", "s1")) -> TableHistory:
    """Snapshots 1..n of `table` in a line, the last current; ids offset per table."""
    base = 100 * (sum(map(ord, table)) % 50)
    snaps = {}
    for i, w in enumerate(chain, start=1):
        snaps[base + i] = SnapshotInfo(base + i, base + i - 1 if i > 1 else None, "overwrite", w, "ingest")
    return TableHistory(table, snaps, base + len(chain), frozenset(shards))


def test_the_newest_position_both_tables_reached_is_the_point():
    block = history("block", [wm({"s0": 10, "s1": 10}, "r1"), wm({"s0": 20, "s1": 20}, "r2")])
    perm = history("perm", [wm({"s0": 10, "s1": 10}, "r1")])  # its ingest of r2 has not run yet
    p = latest_point(E, [block, perm])
    assert p is not None and p.lsn == 10 and p.run_id == "r1"
    assert p.snapshots == {"block": min(block.snaps), "perm": min(perm.snaps)}
    assert p.as_of_sql("block") == f"SELECT * FROM block VERSION AS OF {min(block.snaps)}"


def test_every_point_newest_first_and_the_first_commit_at_a_position():
    # a later commit at the same position (an audit repair) holds values read after it
    block = history("block", [wm({"s0": 10, "s1": 10}, "r1"), wm({"s0": 10, "s1": 10}, "r1"), wm({"s0": 20, "s1": 20})])
    perm = history("perm", [wm({"s0": 10, "s1": 10}), wm({"s0": 20, "s1": 20})])
    points = consistent_points(E, [block, perm])
    assert [p.lsn for p in points] == [20, 10]
    assert points[1].snapshots["block"] == min(block.snaps)


def test_rows_read_from_the_source_past_a_position_spoil_it():
    # a column backfill's chunk of s0 read up to 25, committed between the ingests at 20 and 30
    block = history("block", [wm({"s0": 10, "s1": 10}), wm({"s0": 20, "s1": 20}), None, wm({"s0": 30, "s1": 30})])
    chunk = min(block.snaps) + 2
    block.snaps[chunk] = SnapshotInfo(chunk, chunk - 1, "overwrite", None, "column-backfill", {"s0": 25})
    perm = history("perm", [wm({"s0": 10, "s1": 10}), wm({"s0": 20, "s1": 20}), wm({"s0": 30, "s1": 30})])
    assert [p.lsn for p in consistent_points(E, [block, perm])] == [30, 20, 10]  # 20 came before the chunk
    block.snaps[chunk] = SnapshotInfo(chunk, chunk - 1, "overwrite", None, "column-backfill", {"s0": 35})
    assert [p.lsn for p in consistent_points(E, [block, perm])] == [20, 10]  # 30 is below what it read


def test_shards_at_different_positions_make_no_point():
    # a bootstrap left s1 ahead; the tables meet only once every shard stands at one position
    block = history("block", [wm({"s0": 10, "s1": 15}), wm({"s0": 20, "s1": 20})])
    perm = history("perm", [wm({"s0": 10, "s1": 15})])
    assert latest_point(E, [block, perm]) is None


def test_incomplete_snapshots_never_count():
    pending = wm({"s0": 20, "s1": 20}, backfill=[{"shard": "s0", "columns": ["c"]}])
    block = history("block", [wm({"s0": 10, "s1": 10}), pending, None])  # None: a commit with no watermark
    perm = history("perm", [wm({"s0": 10, "s1": 10}), wm({"s0": 20, "s1": 20})])
    assert latest_point(E, [block, perm]).lsn == 10


def test_positions_of_two_servers_never_meet():
    other = {"system": "7002", "timeline": 1, "database": "notion"}
    block = history("block", [wm({"s0": 10, "s1": 10})])
    perm = history("perm", [wm({"s0": 10, "s1": 10}, source=other)])
    assert latest_point(E, [block, perm]) is None


def test_a_missing_shard_or_another_endpoints_shard_is_no_point():
    block = history("block", [wm({"s0": 10})])  # s1 never bootstrapped
    perm = history("perm", [wm({"s0": 10, "s1": 10})])
    assert latest_point(E, [block, perm]) is None
    moved = history("block", [wm({"s0": 10, "s1": 10}, endpoint="ep2")])
    assert latest_point(E, [moved, perm]) is None


def test_only_the_current_line_counts():
    block = history("block", [wm({"s0": 10, "s1": 10}), wm({"s0": 20, "s1": 20})])
    block = TableHistory(block.table, block.snaps, min(block.snaps), block.shards)  # rolled back to the first
    perm = history("perm", [wm({"s0": 10, "s1": 10}), wm({"s0": 20, "s1": 20})])
    assert latest_point(E, [block, perm]).lsn == 10


def test_a_table_with_a_subset_of_the_shards():
    block = history("block", [wm({"s0": 10, "s1": 10}), wm({"s0": 20, "s1": 20})])
    space = history("space", [wm({"s1": 20})], shards=("s1",))
    assert latest_point(E, [block, space]).lsn == 20
    assert latest_point(E, []) is None
