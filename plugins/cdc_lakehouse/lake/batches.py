"""lake.batches: runs that write several tables commit each table once per batch.

A run that writes several tables (the ingest: changelog, current table, run record, freshness;
a derived tree: unresolved nodes, output) cannot commit them atomically: Iceberg commits one
table at a time. Each of those commits carries the run's batch id in the `cdc.batch-id`
snapshot property. A run killed between two commits is resumed by a later run of the same
batch at the first table that has no snapshot carrying the id; a table that has one is never
written again for that batch.

The id is derived from what the batch applies (its scope, the position it starts from and the
position it ends at), never from the run's name or the clock, so a retry of the same data
recognises its own earlier commits. Looking for it reads snapshot summaries (lake.snapshots:
the table's metadata file by pyiceberg, or its snapshots metadata table), never its data.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cdc_lakehouse.lake.snapshots import current_ancestors
from cdc_lakehouse.lake.tables import table_exists
from cdc_lakehouse.runtime.failpoints import crash_point
from cdc_lakehouse.watermark import WATERMARK_PROP

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

BATCH_PROP = "cdc.batch-id"
# A commit that holds several batches' rows (a group run's metadata rows: ingest.records) lists
# their ids, comma-separated.
BATCH_IDS_PROP = "cdc.batch-ids"
# What a batch's later steps need to be finished by another process (the ingest's run record):
# JSON, in the commit that makes the batch's data visible.
BATCH_STATE_PROP = "cdc.batch-state"
# Commit times are set by the committing process's clock; a resume in another process compares
# them with a margin, so a skewed clock cannot hide a commit.
CLOCK_SKEW_MS = 10 * 60 * 1000


@dataclass(frozen=True)
class BatchId:
    """A batch's id: the same for every attempt at the same data."""

    value: str

    @classmethod
    def of(cls, scope: str, start: Any, end: Any) -> BatchId:
        """scope (e.g. 'ingest:<table>'), and the JSON-able positions the batch starts and ends at."""
        text = json.dumps([scope, start, end], separators=(",", ":"), sort_keys=True, default=str)
        return cls(hashlib.sha256(text.encode()).hexdigest()[:32])

    def props(self) -> dict[str, str]:
        """The snapshot property each of the batch's commits carries."""
        return {BATCH_PROP: self.value}


def committed(
    spark: SparkSession, table: str, batch: BatchId, *, since_ms: int | None = None, positioned: bool = False
) -> bool:
    """Whether a snapshot of `table` (the current one or an ancestor) carries the batch id.

    positioned: every batch commit of the table carries a `cdc.watermark` (the changelog, the
    current table, a derived table), so only the newest snapshot carrying one, the table's last
    known position, can be this batch's: a later batch would have moved the position past it.

    since_ms: the commit time of the batch's first known commit elsewhere; older snapshots
    cannot hold it, so the search stops there (tables shared by every run, such as cdc_meta's,
    have long histories). When expired snapshots cut the history before that point, the answer
    is True: the commit cannot be disproved, and writing it again would repeat it."""
    if not table_exists(spark, table):
        return False
    floor = None if since_ms is None else since_ms - CLOCK_SKEW_MS
    last = None
    for last in current_ancestors(spark, table):
        summary = last.summary
        if batch.value in batch_ids(summary):
            return True
        if positioned and summary.get(WATERMARK_PROP) is not None:
            return False
        if floor is not None and int(last.timestamp_ms) < floor:
            return False
    if last is not None and last.parent_id is not None:  # expired snapshots cut the history here
        log.warning("%s: history expired before batch %s could be found; taken as committed", table, batch.value)
        return floor is not None
    return False


def batch_ids(summary: dict[str, str]) -> set[str]:
    """The batches a snapshot commits (BATCH_PROP, BATCH_IDS_PROP)."""
    ids = set(filter(None, summary.get(BATCH_IDS_PROP, "").split(",")))
    return ids | ({summary[BATCH_PROP]} if BATCH_PROP in summary else set())


def batches_since(table: str, snapshots: Iterable[Any], since_ms: int) -> set[str] | None:
    """Every batch id that `snapshots` (a table's current snapshot, then its ancestors) carry
    since since_ms (less the clock skew): what a commit of many batches' rows checks once, where
    committed() would walk the history per batch. None when expired snapshots cut the history
    before that point: nothing can be disproved, and committed() takes every batch as committed
    then."""
    found: set[str] = set()
    last = None
    for last in snapshots:
        found |= batch_ids(last.summary)
        if int(last.timestamp_ms) < since_ms - CLOCK_SKEW_MS:
            return found
    if last is not None and last.parent_id is not None:
        log.warning("%s: history expired before %d; its batches are taken as committed", table, since_ms)
        return None
    return found


def batch_snapshots(spark: SparkSession, table: str, batch: BatchId) -> int:
    """How many of the table's current ancestors carry the batch id (tests: exactly one)."""
    return sum(1 for snap in current_ancestors(spark, table) if batch.value in batch_ids(snap.summary))


@dataclass(frozen=True)
class BatchStep:
    """One table's commit in a batch. `commit(props)` must make exactly one Iceberg commit of
    `table` carrying props (write options `snapshot-property.<k>`, or lake.commits.
    with_commit_properties around the write)."""

    name: str  # also the failpoint `<name>_committed` after it
    table: str
    commit: Callable[[dict[str, str]], Any]
    since_ms: int | None = None  # see committed()
    positioned: bool = False  # see committed()


def commit_once(spark: SparkSession, batch: BatchId, step: BatchStep) -> bool:
    """Commit the step unless its table already has the batch; True if this call committed."""
    if committed(spark, step.table, batch, since_ms=step.since_ms, positioned=step.positioned):
        log.info("batch %s: %s already committed to %s; not applied again", batch.value, step.name, step.table)
        return False
    step.commit(batch.props())
    crash_point(f"{step.name}_committed")
    return True
