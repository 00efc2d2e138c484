"""The maintenance of one table, as named phases: per target, compact, check, expire, check,
observe; then (a replicated table) the latest-per-key view and landing retention.

Each of Iceberg's procedures commits atomically (or not at all), so a failed run leaves the table
valid. Before and after each target, the run records its stats in cdc_meta.maintenance_runs.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from cdc_lakehouse.config import OutputMaintenanceConfig, TableConfig
from cdc_lakehouse.lake.meta import meta_append
from cdc_lakehouse.lake.meta_rows import MaintenanceStats
from cdc_lakehouse.lake.tables import TableStats, table_exists
from cdc_lakehouse.maintenance.expiry import expire
from cdc_lakehouse.maintenance.landing_retention import prune_landing
from cdc_lakehouse.maintenance.result import (
    Expired,
    MaintenanceResult,
    Rewritten,
    TableMaintenanceResult,
    TargetMaintenance,
)
from cdc_lakehouse.maintenance.rewrite import compact
from cdc_lakehouse.maintenance.targets import Target, derived_targets, feed_output_target, table_targets
from cdc_lakehouse.maintenance.verify import Observed, check_unchanged, observe, only_rewrites_since
from cdc_lakehouse.runtime.phases import PhaseClock, SparkJobs
from cdc_lakehouse.settings import LakeSettings
from cdc_lakehouse.views.publish import publish_latest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from cdc_lakehouse.derived.config import TreeConfig

log = logging.getLogger(__name__)


def maintain_table(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    *,
    run_id: str,
    now: datetime | None = None,
    consumers: list[TableConfig] | None = None,
) -> TableMaintenanceResult:
    """Compaction, expiry and orphan cleanup of both tables, the latest view, and landing retention.

    `consumers`: every valid table config (landing runs are shared by the tables of an endpoint);
    default: this table alone. Progress goes to this package's loggers. The result carries the Spark
    jobs the run took (`spark_jobs`, `spark_job_sites`): the figure to watch for repeated scans."""
    now = now or datetime.now(UTC)
    with SparkJobs(spark, f"maintenance {cfg.name} {run_id}") as jobs:
        cur = lake.qualified(cfg.current_table)
        if not table_exists(spark, cur):
            raise RuntimeError(f"{cfg.name}: {cur} does not exist; bootstrap it first (cdc_bootstrap__{cfg.name})")
        targets = maintain_targets(spark, lake, cfg.name, table_targets(lake, cfg), run_id, now)
        latest_rows = publish_latest(spark, lake, cfg)
        removed = prune_landing(spark, lake, cfg, consumers or [cfg], now)
    return TableMaintenanceResult(
        cfg.name,
        run_id,
        targets,
        jobs.count,
        spark_metadata_jobs=jobs.metadata,
        spark_job_sites=jobs.sites,
        latest_rows=latest_rows,
        latest_mode=None if latest_rows is None else cfg.maintenance.latest_view,
        landing_runs_removed=removed,
    )


def maintain_derived(
    spark: SparkSession, lake: LakeSettings, dcfg: TreeConfig, *, run_id: str, now: datetime | None = None
) -> MaintenanceResult:
    """Compaction (every delete file applied), expiry and orphan cleanup of a derived table's
    output and unresolved tables (maintenance.targets.derived_targets)."""
    targets = derived_targets(lake, dcfg)
    if not table_exists(spark, targets[0].table):  # a run creates the unresolved table first
        raise RuntimeError(f"{dcfg.name}: {targets[0].table} does not exist; run cdc_derived__{dcfg.name} first")
    with SparkJobs(spark, f"maintenance {dcfg.name} {run_id}") as jobs:
        done = maintain_targets(spark, lake, dcfg.name, targets, run_id, now or datetime.now(UTC))
    return MaintenanceResult(dcfg.name, run_id, done, jobs.count)


def maintain_feed_output(
    spark: SparkSession,
    lake: LakeSettings,
    consumer: str,
    output: str,
    settings: OutputMaintenanceConfig,
    *,
    run_id: str,
    now: datetime | None = None,
) -> MaintenanceResult:
    """Compaction, expiry and orphan cleanup of a feed consumer's exactly-once Iceberg output
    (`namespace.table`); expiry keeps the newest snapshot carrying its offsets (feed.offsets)."""
    table = lake.qualified(output)
    if not table_exists(spark, table):
        raise RuntimeError(f"feed consumer {consumer}: {table} does not exist; run the consumer first")
    target = feed_output_target(lake, consumer, output, settings)
    with SparkJobs(spark, f"maintenance {consumer} {run_id}") as jobs:
        done = maintain_targets(spark, lake, consumer, [target], run_id, now or datetime.now(UTC))
    return MaintenanceResult(consumer, run_id, done, jobs.count)


def maintain_targets(
    spark: SparkSession, lake: LakeSettings, owner: str, targets: list[Target], run_id: str, now: datetime
) -> dict[str, TargetMaintenance]:
    """Each target compacted and expired in turn, by its kind; before/after rows to
    cdc_meta.maintenance_runs."""
    result: dict[str, TargetMaintenance] = {}
    rows: list[MaintenanceStats] = []
    clock = PhaseClock()
    for target in targets:
        with clock.phase(target.kind):
            before, after, rewritten, expired = _maintain_target(spark, lake, target, now)
        secs = clock.seconds[target.kind]
        rows += [_stats_row(target, run_id, phase, o, secs, now) for phase, o in (("before", before), ("after", after))]
        result[target.kind] = TargetMaintenance(
            before=before.stats, after=after.stats, seconds=secs, **rewritten, **expired
        )
        _log_target(target, before.stats, after.stats, secs)
    meta_append(spark, lake, "maintenance_runs", rows)
    return result


def _maintain_target(
    spark: SparkSession, lake: LakeSettings, target: Target, now: datetime
) -> tuple[Observed, Observed, Rewritten, Expired]:
    """Compact and expire one table; fails if another writer committed meanwhile."""
    # The catalog caches loaded tables: another process (the ingest's spark-submit) may have
    # committed since this session last read it, and a stale "before" would look like a
    # concurrent writer.
    spark.sql(f"REFRESH TABLE {target.table}")
    before = observe(spark, target)
    comp = compact(spark, lake, target)
    # Checked before expiry too: expiry may drop `before`'s snapshot from the line.
    checked = only_rewrites_since(spark, target, before.snapshot_id)
    exp = expire(spark, lake, target, now)
    only_rewrites_since(spark, target, checked)
    after = observe(spark, target)
    check_unchanged(target, before, after)
    return before, after, comp, exp


def _stats_row(target: Target, run_id: str, phase: str, o: Observed, secs: float, now: datetime) -> MaintenanceStats:
    """One row of cdc_meta.maintenance_runs."""
    st = o.stats
    return MaintenanceStats(
        table_name=target.owner,
        run_id=run_id,
        target=target.kind,
        phase=phase,
        data_files=st["data_files"],
        avg_file_bytes=st["avg_file_bytes"],
        delete_files=st["delete_files"],
        snapshots=st["snapshots"],
        total_bytes=st["total_bytes"],
        records=st["records"],
        checksum=o.checksum,
        seconds=secs,
        at=now,
    )


def _log_target(target: Target, before: TableStats, after: TableStats, secs: float) -> None:
    log.info(
        "maintenance %s %s: data files %s -> %s, delete files %s -> %s, snapshots %s -> %s, "
        "avg file %.0f KiB -> %.0f KiB in %.1fs",
        target.owner,
        target.kind,
        before["data_files"],
        after["data_files"],
        before["delete_files"],
        after["delete_files"],
        before["snapshots"],
        after["snapshots"],
        before["avg_file_bytes"] / 1024,
        after["avg_file_bytes"] / 1024,
        secs,
    )
