"""Snapshot expiry and orphan cleanup. Expiry never removes the snapshot that carries the table's
newest position (the `cdc.watermark` of a table or derived output, the `cdc.feed.offsets` of a
feed output): its writer reads it from the current snapshot's ancestry. Nor does it remove what a
consumer holds (lake.holds): the held snapshot and every snapshot after it stay, until the hold's
max lag runs out."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from cdc_lakehouse.lake.holds import range_floor_ms, sweep
from cdc_lakehouse.maintenance.result import Expired
from cdc_lakehouse.maintenance.targets import Target
from cdc_lakehouse.runtime.phases import metadata_reads
from cdc_lakehouse.settings import LakeSettings
from cdc_lakehouse.watermark import WATERMARK_PROP

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def _ts(dt: datetime) -> str:
    return dt.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


def position_snapshot_time(spark: SparkSession, table: str, prop: str = WATERMARK_PROP) -> datetime | None:
    """When the newest snapshot on the current line carrying `prop` was committed. Its commit
    time, not when it became current: expire_snapshots compares `older_than` with commit times,
    and a fenced commit (lake.commits) is committed on a branch before main is moved to it."""
    with metadata_reads(spark):
        rows = spark.sql(
            f"SELECT s.committed_at t FROM {table}.snapshots s JOIN {table}.history h ON s.snapshot_id = h.snapshot_id "
            f"WHERE h.is_current_ancestor AND s.summary['{prop}'] IS NOT NULL "
            "ORDER BY h.made_current_at DESC LIMIT 1"
        ).collect()
    return rows[0]["t"].replace(tzinfo=UTC) if rows else None


def expire(spark: SparkSession, lake: LakeSettings, target: Target, now: datetime) -> Expired:
    """expire_snapshots older than the retention, never the position's snapshot nor anything a
    live consumer hold keeps (lake.holds); then remove_orphan_files."""
    cat = lake.catalog_name
    # The whole name, catalog first: given `namespace.table`, Iceberg first looks the namespace up
    # as a catalog and logs a WARN with a stack trace (CatalogNotFoundException) on every call.
    name = target.table
    m = target.settings
    older = now - timedelta(hours=m.snapshot_retention_hours)
    held = sweep(spark, target.table, now)
    keep = [position_snapshot_time(spark, target.table, target.position_prop)]
    # Every snapshot from the oldest held one on (from the position below it, if it carries none),
    # not just the tagged one: the consumer's next run then reads the history between its two
    # snapshots (its range rule), not a diff of two tables.
    floor = range_floor_ms(spark, target.table, held.kept, target.position_prop)
    keep.append(None if floor is None else datetime.fromtimestamp(floor / 1000, UTC))
    oldest = min((k for k in keep if k is not None), default=None)
    if oldest is not None and oldest <= older:
        older = oldest - timedelta(milliseconds=1)  # the position's and the held snapshots survive
    r = spark.sql(
        f"CALL {cat}.system.expire_snapshots(table => '{name}', older_than => TIMESTAMP '{_ts(older)}', "
        f"retain_last => {m.min_snapshots_to_keep})"
    ).collect()
    # Files' ages are wall-clock ages: a run for a later `now` (a test, a catch-up) must not take
    # an in-flight write's new files for orphans.
    orphans_before = min(now, datetime.now(UTC)) - timedelta(hours=m.orphan_file_age_hours)
    o = spark.sql(
        f"CALL {cat}.system.remove_orphan_files(table => '{name}', older_than => TIMESTAMP '{_ts(orphans_before)}')"
    ).collect()
    return Expired(
        expired_data_files=int(r[0][0]) if r else 0,
        orphan_files_removed=len(o),
        holds_kept=[h.name for h in held.kept],
        holds_dropped=[h.name for h in held.dropped],
    )
