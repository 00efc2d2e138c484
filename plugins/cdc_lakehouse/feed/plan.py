"""Which range a feed read covers and how its changed keys are found: pure Python over the
table's snapshots (SnapshotInfo), shared by the Spark and the pyiceberg readers.

The upper bound is always a snapshot carrying a `cdc.watermark` (a complete position), never a
wall-clock time: the newest one among the current snapshot's ancestors, or the one an Airflow
asset event named. The changelog names every changed key only while the table moved forward by
ingest commits; otherwise (the same cases as serving's `_changelog_range`) the read diffs the two
snapshots, and when the offset's snapshot no longer exists it returns every live row (full)."""

from __future__ import annotations

from cdc_lakehouse.feed.models import FeedError, FeedOffset, FeedRange, SnapshotInfo
from cdc_lakehouse.lake.watermark import Watermark


def complete_head(table: str, snaps: dict[int, SnapshotInfo], current: int | None, upto: int | None) -> SnapshotInfo:
    """The snapshot a read goes up to: `upto` (it must carry a watermark), else the newest
    ancestor of the current snapshot that carries one."""
    if upto is not None:
        snap = snaps.get(upto)
        if snap is None or snap.watermark is None:
            why = "does not exist (expired?)" if snap is None else "carries no cdc.watermark (not a complete position)"
            raise FeedError(
                f"{table}: snapshot {upto} asked for as the feed's upper bound {why}; "
                "read without an upper bound (the newest complete snapshot) instead"
            )
        return snap
    sid = current
    while sid is not None and sid in snaps:
        if snaps[sid].watermark is not None:
            return snaps[sid]
        sid = snaps[sid].parent_id
    raise FeedError(
        f"{table}: no snapshot carries a cdc.watermark yet, so nothing is complete to read; "
        "bootstrap the table (cdc_bootstrap__<table>) first"
    )


def plan_range(
    table: str, consumer: str, snaps: dict[int, SnapshotInfo], current: int | None, since: FeedOffset | None, upto=None
) -> FeedRange:
    """The range after `since` up to the complete head, and the way to compute it."""
    head = complete_head(table, snaps, current, upto)
    hi = Watermark.from_dict(head.watermark).shard_lsns()

    def rng(mode, reason, lo=None):
        return FeedRange(table, consumer, since, head.snapshot_id, hi, mode, reason, lo or {})

    if since is None:
        return rng("full", "first read of this consumer: every live row")
    if since.snapshot_id == head.snapshot_id:
        return rng("noop", "no complete snapshot after the offset")
    if since.snapshot_id not in snaps:
        return rng("full", f"the offset's snapshot {since.snapshot_id} was expired: replace the consumer's state")
    if upto is not None and _is_ancestor(snaps, head.snapshot_id, since.snapshot_id):
        # An older Asset event (or a manual bound) behind what the consumer already read: reading
        # "back" to it would undo changes the consumer has applied.
        return rng("noop", f"the offset is already past snapshot {upto}")
    lo_snap = snaps[since.snapshot_id]
    reason = _changelog_unusable(snaps, lo_snap, head)
    lo = Watermark.from_dict(lo_snap.watermark).shard_lsns() if lo_snap.watermark else {}
    return rng("diff", reason, lo) if reason else rng("changelog", "ingest commits only", lo)


def _is_ancestor(snaps: dict[int, SnapshotInfo], older: int, newer: int) -> bool:
    sid = snaps[newer].parent_id if newer in snaps else None
    while sid is not None and sid in snaps:
        if sid == older:
            return True
        sid = snaps[sid].parent_id
    return False


def _changelog_unusable(snaps: dict[int, SnapshotInfo], lo: SnapshotInfo, hi: SnapshotInfo) -> str | None:
    """Why the changelog between lo's and hi's watermarks may miss a changed key, or None."""
    if lo.watermark is None:
        return "the offset's snapshot carries no watermark"
    return _history_unusable(snaps, lo, hi) or _positions_unusable(lo, hi)


def _history_unusable(snaps: dict[int, SnapshotInfo], lo: SnapshotInfo, hi: SnapshotInfo) -> str | None:
    sid, chain = hi.snapshot_id, []
    while sid is not None and sid != lo.snapshot_id:
        snap = snaps.get(sid)
        if snap is None:
            break
        chain.append(snap)
        sid = snap.parent_id
    if sid != lo.snapshot_id:
        return "the offset's snapshot is not an ancestor of the head (the table was rolled back)"
    for snap in chain:
        # A compaction (replace) changes no row; any other commit without a watermark (a backfill
        # MERGE, an audit repair, a manual write) changed rows below the watermark.
        if snap.watermark is None and snap.operation != "replace":
            return f"snapshot {snap.snapshot_id} ({snap.operation}) changed rows without moving the watermark"
        if snap.watermark is not None and "backfill" in snap.watermark:
            return f"snapshot {snap.snapshot_id} has a pending column backfill"
    return None


def _positions_unusable(lo: SnapshotInfo, hi: SnapshotInfo) -> str | None:
    lo_wm, hi_wm = Watermark.from_dict(lo.watermark), Watermark.from_dict(hi.watermark)
    for shard, pos in lo_wm.shards.items():
        now = hi_wm.shards.get(shard)
        if now is None:
            return f"shard {shard} left the table"
        if now.lsn < pos.lsn or (now.endpoint, now.source) != (pos.endpoint, pos.source):
            # positions of two servers never compare: a moved or re-bootstrapped shard
            return f"shard {shard} moved back or to another server (re-bootstrap or move)"
    return None
