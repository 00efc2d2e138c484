"""feed.plan: which range a read covers and how (pure logic over snapshot summaries)."""

from __future__ import annotations

import pytest
from cdc_lakehouse.feed.models import FeedError, FeedOffset, SnapshotInfo
from cdc_lakehouse.feed.plan import plan_range
from cdc_lakehouse.lake.holds import ConsumerLagError
from cdc_lakehouse.watermark import Watermark

SRC = {"system_identifier": "1", "timeline": 1}


def wm(**lsns: int) -> Watermark:
    return Watermark.from_dict(
        {"v": 1, "shards": {s: {"lsn": n, "endpoint": "e", "source": SRC} for s, n in lsns.items()}}
    )


def chain(*snaps: tuple) -> dict[int, SnapshotInfo]:
    """(id, operation, watermark[, writer]) oldest first; the writer defaults to the ingest for a
    commit with a watermark and to none (a compaction, or a stray writer) for one without."""
    out, parent = {}, None
    for sid, op, w, *writer in snaps:
        out[sid] = SnapshotInfo(sid, parent, op, w, writer[0] if writer else ("ingest" if w else None))
        parent = sid
    return out


def off(sid: int) -> FeedOffset:
    return FeedOffset(consumer="c", table="n.t", snapshot_id=sid, watermark={})


def test_ingest_commits_use_the_changelog_up_to_the_newest_complete_snapshot():
    snaps = chain((1, "append", wm(a=10)), (2, "overwrite", wm(a=20)), (3, "replace", None), (4, "append", None))
    snaps[4] = SnapshotInfo(4, 3, "append", None)  # e.g. a failed run's changelog-only commit elsewhere
    r = plan_range("n.t", "c", snaps, 3, off(1))
    assert (r.mode, r.snapshot_id, r.lo_watermark, r.watermark) == ("changelog", 2, {"a": 10}, {"a": 20})
    assert r.offset.snapshot_id == 2
    assert plan_range("n.t", "c", snaps, 3, off(2)).mode == "noop"
    assert plan_range("n.t", "c", snaps, 3, None).mode == "full"
    # An older asset event's bound behind the offset never reads back
    late = chain((1, "append", wm(a=10)), (2, "overwrite", wm(a=20)), (3, "overwrite", wm(a=30)))
    assert plan_range("n.t", "c", late, 3, off(3), upto=2).mode == "noop"
    assert plan_range("n.t", "c", late, 3, off(1), upto=2).snapshot_id == 2


def test_other_writers_rollbacks_and_moves_fall_back_to_a_diff():
    # An audit repair as audit.repair commits it: the watermark restated, its rows at the watermark.
    repaired = chain((1, "append", wm(a=10)), (2, "overwrite", wm(a=10), "repair"))
    r = plan_range("n.t", "c", repaired, 2, off(1))
    assert (r.mode, r.snapshot_id) == ("diff", 2) and "cdc.writer=repair" in r.reason, r
    # A replay (no watermark), then an ingest: the range that holds both is diffed.
    replayed = chain((1, "append", wm(a=10)), (2, "overwrite", None, "replay"), (3, "overwrite", wm(a=30)))
    assert plan_range("n.t", "c", replayed, 3, off(1)).mode == "diff"
    # A commit naming no writer (a manual UPDATE) is never trusted, with or without a watermark.
    stray = chain((1, "append", wm(a=10)), (2, "overwrite", wm(a=10), None), (3, "overwrite", wm(a=30)))
    assert "cdc.writer=none" in plan_range("n.t", "c", stray, 3, off(1)).reason
    rolled = chain((1, "append", wm(a=10)), (2, "overwrite", wm(a=20)))
    rolled[3] = SnapshotInfo(3, 1, "overwrite", wm(a=15))  # current branches from 1; the offset is at 2
    assert "ancestor" in plan_range("n.t", "c", rolled, 3, off(2)).reason
    other = Watermark.from_dict({"shards": {"a": {"lsn": 5, "endpoint": "other"}}})
    moved = chain((1, "append", wm(a=10)), (2, "overwrite", other))
    assert plan_range("n.t", "c", moved, 2, off(1)).mode == "diff"


def test_an_expired_offset_is_an_error_naming_consumer_table_and_fix_not_a_silent_resync():
    expired = chain((5, "append", wm(a=50)))
    with pytest.raises(ConsumerLagError) as err:
        plan_range("n.t", "c", expired, 5, off(1))
    msg = str(err.value)
    assert "feed consumer c of n.t" in msg and "snapshot 1" in msg and "cdc_consumer_feed_c" in msg, msg
    assert "since=None" in msg and "mode=full" in msg, msg
    # The reset the message asks for: a read without an offset, which replaces the consumer's state.
    assert plan_range("n.t", "c", expired, 5, None).replaces_state


def test_bounds_must_be_complete_snapshots():
    snaps = chain((1, "append", wm(a=10)), (2, "append", None))
    with pytest.raises(FeedError, match="n.t: snapshot 2 .*no cdc.watermark"):
        plan_range("n.t", "c", snaps, 2, None, upto=2)
    with pytest.raises(FeedError, match="bootstrap the table"):
        plan_range("n.t", "c", chain((1, "append", None)), 1, None)
