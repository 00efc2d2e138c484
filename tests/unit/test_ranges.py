"""lake.ranges: the one rule every reader of ranges (feed, serving export, derived tree) follows
to decide whether the changelog between two snapshots names every changed key (pure logic)."""

from __future__ import annotations

import pytest
from cdc_lakehouse.lake.ranges import SnapshotInfo, between, effective_watermark, key_range
from cdc_lakehouse.lake.writers import BY_NAME, INGEST, WRITER_PROP, WRITERS
from cdc_lakehouse.watermark import Watermark

SRC = {"system_identifier": "1", "timeline": 1}


def wm(endpoint: str = "e", **lsns: int) -> Watermark:
    shards = {s: {"lsn": n, "endpoint": endpoint, "source": SRC} for s, n in lsns.items()}
    return Watermark.from_dict({"v": 1, "shards": shards})


def chain(*snaps: tuple) -> dict[int, SnapshotInfo]:
    """(id, operation, watermark, writer), oldest first, each the parent of the next."""
    out, parent = {}, None
    for sid, op, w, writer in snaps:
        out[sid] = SnapshotInfo(sid, parent, op, w, writer)
        parent = sid
    return out


def test_ingest_commits_and_compactions_read_the_changelog_between_effective_watermarks():
    snaps = chain(
        (1, "append", wm(a=10, b=5), "bootstrap"),
        (2, "overwrite", wm(a=20, b=5), "ingest"),
        (3, "replace", None, None),  # a compaction: no watermark, no writer, no changed row
        (4, "overwrite", wm(a=30, b=9), "ingest"),
        (5, "replace", None, None),
    )
    r = key_range(snaps, 2, 5)
    assert (r.mode, r.lo_watermark, r.hi_watermark) == ("changelog", {"a": 20, "b": 5}, {"a": 30, "b": 9}), r
    # Bounds without a watermark of their own (serving and derived pin the current snapshot) take
    # their nearest ancestor's.
    r = key_range(snaps, 3, 5)
    assert (r.mode, r.lo_watermark, r.hi_watermark) == ("changelog", {"a": 20, "b": 5}, {"a": 30, "b": 9}), r
    assert key_range(snaps, 4, 4).mode == "changelog"  # nothing between: an empty changelog range
    assert effective_watermark(snaps, 5) == wm(a=30, b=9)
    assert [s.snapshot_id for s in between(snaps, 2, 5)] == [3, 4, 5] and between(snaps, 5, 2) is None


@pytest.mark.parametrize("writer", [w.name for w in WRITERS if w is not INGEST] + [None, "some-tool"])
def test_every_other_writer_and_no_writer_at_all_is_diffed(writer):
    # With the watermark restated (a repair) or without one (a replay, a backfill, a chunk, a manual
    # UPDATE): the changelog between the watermarks may miss the rows such a commit changed.
    for restated in (wm(a=20), None):
        snaps = chain(
            (1, "append", wm(a=10), "bootstrap"),
            (2, "overwrite", wm(a=20), "ingest"),
            (3, "overwrite", restated, writer),
            (4, "overwrite", wm(a=30), "ingest"),
        )
        for lo, hi in ((2, 3), (2, 4), (1, 4)):
            r = key_range(snaps, lo, hi)
            assert r.mode == "diff" and f"snapshot 3 (overwrite, {WRITER_PROP}={writer or 'none'})" in r.reason, r
        assert key_range(snaps, 3, 4).mode == "changelog"  # after it: ingest commits again


def test_only_the_ingest_promises_its_changes():
    assert [w.name for w in WRITERS if w.names_its_changes] == ["ingest"]
    assert set(BY_NAME) >= {"ingest", "repair", "replay", "backfill", "bootstrap", "chunked-bootstrap"}


def test_expired_rolled_back_moved_left_and_backfilling_ranges():
    snaps = chain((5, "append", wm(a=50), "ingest"), (6, "overwrite", wm(a=60), "ingest"))
    r = key_range(snaps, 1, 6)
    assert r.mode == "full" and "expired" in r.reason and r.hi_watermark == {"a": 60}
    assert key_range(snaps, None, 6).mode == "full"
    rolled = dict(snaps)
    rolled[7] = SnapshotInfo(7, 5, "overwrite", wm(a=55), "ingest")  # the current line branches at 5
    assert "not an ancestor" in key_range(rolled, 6, 7).reason
    back = chain((1, "append", wm(a=50), "ingest"), (2, "overwrite", wm(a=40), "ingest"))
    assert "moved back" in key_range(back, 1, 2).reason
    moved = chain((1, "append", wm(a=50), "ingest"), (2, "overwrite", wm("other", a=60), "ingest"))
    assert "another server" in key_range(moved, 1, 2).reason

    # A failover (#52): the position moves onto a promoted standby's timeline, whose history left
    # the old one at or after it: the range still reads the changelog; past it, it does not.
    def on(source: dict, **lsns: int) -> Watermark:
        return Watermark.from_dict(
            {"v": 1, "shards": {s: {"lsn": n, "endpoint": "e", "source": source} for s, n in lsns.items()}}
        )

    promoted = {**SRC, "timeline": SRC["timeline"] + 1, "history": {str(SRC["timeline"]): 50}}
    failover = chain((1, "append", wm(a=50), "ingest"), (2, "overwrite", on(promoted, a=60), "ingest"))
    assert key_range(failover, 1, 2).mode == "changelog"
    lossy = chain((1, "append", wm(a=55), "ingest"), (2, "overwrite", on(promoted, a=60), "ingest"))
    assert "another server" in key_range(lossy, 1, 2).reason
    left = chain((1, "append", wm(a=50, b=1), "ingest"), (2, "overwrite", wm(a=60), "ingest"))
    assert "left the table" in key_range(left, 1, 2).reason
    pending = chain(
        (1, "append", wm(a=50), "ingest"),
        (2, "overwrite", Watermark.from_dict({**wm(a=60).to_dict(), "backfill": [{}]}), "ingest"),
    )
    assert "backfill" in key_range(pending, 1, 2).reason
    unplaced = chain((1, "append", None, None), (2, "replace", None, None))
    assert "no watermark" in key_range(unplaced, 1, 2).reason
    with pytest.raises(ValueError, match="snapshot 9"):
        key_range(snaps, 5, 9)


def test_snapshot_info_reads_the_writer_and_the_watermark_from_a_summary():
    s = SnapshotInfo.of(3, 2, "overwrite", {"cdc.watermark": '{"v":1,"shards":{}}', WRITER_PROP: "repair"})
    assert (s.watermark.to_dict(), s.writer, s.names_its_changes) == ({"v": 1, "shards": {}}, "repair", False)
    assert SnapshotInfo.of(3, None, "replace", None).names_its_changes
