"""Which range a feed read covers and how its changed keys are found: pure Python over the
table's snapshots (SnapshotInfo), shared by the Spark and the pyiceberg readers.

The upper bound is always a snapshot carrying a `cdc.watermark` (a complete position), never a
wall-clock time: the newest one among the current snapshot's ancestors, or the one an Airflow
asset event named. Whether the changelog names every changed key is lake.ranges' rule, the one
serving exports and derived trees use: only across ingest commits (and compactions); otherwise
the read diffs the two snapshots. When the offset's snapshot no longer exists (the consumer lagged
past its hold, lake.holds) it raises ConsumerLagError: a resync is the consumer's decision (a read
without an offset), never one the feed takes for it."""

from __future__ import annotations

from cdc_lakehouse.feed.models import FeedError, FeedOffset, FeedRange, SnapshotInfo
from cdc_lakehouse.lake.holds import lag_error
from cdc_lakehouse.lake.ranges import is_ancestor, key_range
from cdc_lakehouse.watermark import Watermark

# What a consumer whose offset's snapshot is gone does: it asks for the resync itself.
RESET_FIX = (
    "reset the consumer: read once without an offset (since=None: every live row, FeedRange.replaces_state) "
    "and replace its state with what it reads; for a DAG built by feed_consumer_dag, trigger "
    "cdc_feed__{consumer} with mode=full"
)


def complete_head(
    table: str, snaps: dict[int, SnapshotInfo], current: int | None, upto: int | None
) -> tuple[SnapshotInfo, Watermark]:
    """The snapshot a read goes up to, and its watermark: `upto` (it must carry one), else the
    newest ancestor of the current snapshot that carries one."""
    if upto is not None:
        snap = snaps.get(upto)
        if snap is None or snap.watermark is None:
            why = "does not exist (expired?)" if snap is None else "carries no cdc.watermark (not a complete position)"
            raise FeedError(
                f"{table}: snapshot {upto} asked for as the feed's upper bound {why}; "
                "read without an upper bound (the newest complete snapshot) instead"
            )
        return snap, snap.watermark
    sid = current
    while sid is not None and sid in snaps:
        wm = snaps[sid].watermark
        if wm is not None:
            return snaps[sid], wm
        sid = snaps[sid].parent_id
    raise FeedError(
        f"{table}: no snapshot carries a cdc.watermark yet, so nothing is complete to read; "
        "bootstrap the table (cdc_bootstrap__<table>) first"
    )


def plan_range(
    table: str, consumer: str, snaps: dict[int, SnapshotInfo], current: int | None, since: FeedOffset | None, upto=None
) -> FeedRange:
    """The range after `since` up to the complete head, and the way to compute it."""
    head, head_wm = complete_head(table, snaps, current, upto)
    hi = head_wm.shard_lsns()

    def rng(mode, reason, lo=None):
        return FeedRange(table, consumer, since, head.snapshot_id, hi, mode, reason, lo or {})

    if since is None:
        return rng("full", "first read of this consumer: every live row")
    if since.snapshot_id == head.snapshot_id:
        return rng("noop", "no complete snapshot after the offset")
    if since.snapshot_id not in snaps:
        raise lag_error("feed", consumer, table, since.snapshot_id, None, RESET_FIX.format(consumer=consumer))
    if upto is not None and is_ancestor(snaps, head.snapshot_id, since.snapshot_id):
        # An older Asset event (or a manual bound) behind what the consumer already read: reading
        # "back" to it would undo changes the consumer has applied.
        return rng("noop", f"the offset is already past snapshot {upto}")
    keys = key_range(snaps, since.snapshot_id, head.snapshot_id)
    return rng(keys.mode, keys.reason, keys.lo_watermark)
