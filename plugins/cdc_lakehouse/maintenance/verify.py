"""What maintenance must leave as it found it: the rows, and the position the table's writer reads
back. Proved from snapshot metadata (only rewrites committed while it ran, which Iceberg commits
only when the live rows are unchanged); a row checksum before and after on request
(maintenance.verify_content)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cdc_lakehouse.lake.commits import ConcurrentWriterError
from cdc_lakehouse.lake.snapshots import current_snapshot
from cdc_lakehouse.lake.tables import TableStats, table_stats
from cdc_lakehouse.maintenance.targets import Target

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@dataclass(frozen=True)
class Observed:
    """What maintenance must leave as it found it (content, position) and what it improves (stats)."""

    stats: TableStats
    snapshot_id: int | None
    position: Any  # the target's position (watermark, feed offsets) as its writer reads it
    checksum: str | None = None  # maintenance.verify_content only


def content_checksum(spark: SparkSession, table: str, columns: list[str]) -> str:
    """Order-independent checksum of a table's rows (count and sum of row hashes)."""
    from pyspark.sql import functions as F

    h = F.xxhash64(*[F.col(c) for c in columns])
    r = spark.table(table).agg(F.count(F.lit(1)).alias("n"), F.sum(h.cast("decimal(38,0)")).alias("s")).collect()[0]
    return f"{r['n']}:{r['s']}"


def observe(spark: SparkSession, target: Target) -> Observed:
    snap = current_snapshot(spark, target.table)
    checksum = None
    if target.settings.verify_content:  # two full reads per table: an end-to-end check of the rewrite
        checksum = content_checksum(spark, target.table, [f.name for f in spark.table(target.table).schema.fields])
    return Observed(
        table_stats(spark, target.table),
        snap.snapshot_id if snap is not None else None,
        target.read_position(spark, target.table),
        checksum,
    )


def only_rewrites_since(spark: SparkSession, target: Target, since: int | None) -> int | None:
    """Every snapshot committed after `since` on the table's current line is a rewrite ('replace':
    rewrite_data_files, rewrite_position_delete_files, rewrite_manifests), which Iceberg commits
    only when the live rows are unchanged. Metadata only: no data is read. A data commit by another
    writer, or a rollback that dropped `since` from the line, fails the run. Returns the head it
    checked from, so the next check starts exactly there."""
    from cdc_lakehouse.lake.snapshots import current_ancestors

    head = None
    for snap in current_ancestors(spark, target.table):
        head = snap.snapshot_id if head is None else head
        if snap.snapshot_id == since:
            return head
        if snap.operation != "replace":
            raise ConcurrentWriterError(
                f"{target.owner}: {target.table} got a '{snap.operation}' commit (snapshot {snap.snapshot_id}) "
                f"while maintenance ran: another writer was active. The DAGs' writers of it never run at once "
                f"({target.writers}); check that no job outside them writes the table"
            )
    if since is not None:
        raise ConcurrentWriterError(
            f"{target.owner}: snapshot {since} of {target.table} left the current line while maintenance ran "
            "(a rollback or a stray writer); check the table's history before re-running"
        )
    return head


def check_unchanged(target: Target, before: Observed, after: Observed) -> None:
    """Fails the run if the rows (when checksummed) or the position changed."""
    if after.checksum != before.checksum:
        raise RuntimeError(
            f"{target.owner}: content of {target.table} changed during maintenance "
            f"({before.checksum} -> {after.checksum}) though only rewrites were committed; keep the "
            "pre-maintenance snapshot (time travel) and report it: a rewrite must not change rows"
        )
    if after.position != before.position:
        raise RuntimeError(
            f"{target.owner}: the position ({target.position_prop}) of {target.table} changed during maintenance"
        )
