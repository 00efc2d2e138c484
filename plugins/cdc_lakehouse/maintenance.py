"""Daily maintenance with Iceberg's own Spark procedures, and the latest-per-key view.

Targets: a replicated table's current table and changelog (maintain_table), a derived table's
output and unresolved tables (maintain_derived), a feed consumer's Iceberg output
(maintain_feed_output). Without it the outputs only grow: a derived table is merge-on-read (delete
files with every incremental run), a feed output gets small files and snapshots with every run.

Each procedure commits atomically (or not at all), so a failed run leaves the table valid.
Snapshot expiry never removes the snapshot that carries the table's newest position (the
`cdc.watermark` of a table or derived output, the `cdc.feed.offsets` of a feed output): its
writer reads it from the current snapshot's ancestry. Nor does it remove what a consumer holds
(lake.holds): the held snapshot and every snapshot after it stay, until the hold's max lag runs out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from cdc_lakehouse.config import BaseMaintenanceConfig, OutputMaintenanceConfig, TableConfig
from cdc_lakehouse.lake.commits import ConcurrentWriterError
from cdc_lakehouse.lake.holds import range_floor_ms, sweep
from cdc_lakehouse.lake.meta import meta_append
from cdc_lakehouse.lake.snapshots import current_snapshot
from cdc_lakehouse.lake.tables import table_exists, table_stats
from cdc_lakehouse.lake.watermark import WATERMARK_PROP, read_watermark
from cdc_lakehouse.landing.format import MANIFEST_DIR, manifest_path
from cdc_lakehouse.landing.reader import SparkLanding
from cdc_lakehouse.runtime.phases import PhaseClock, SparkJobs, metadata_reads
from cdc_lakehouse.settings import LakeSettings
from cdc_lakehouse.views.publish import publish_latest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from cdc_lakehouse.derived.config import TreeConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """One Iceberg table maintenance compacts and expires, and what it must leave as it found it."""

    owner: str  # the config it belongs to: messages, cdc_meta.maintenance_runs.table_name
    kind: str  # current | changelog | output | unresolved | feed_output (maintenance_runs.target)
    table: str  # catalog-qualified
    settings: BaseMaintenanceConfig
    target_file_bytes: int
    sort: bool
    format_version: int
    writers: str  # what keeps its writers apart (named when another writer is caught)
    # The snapshot property carrying the table's position, and how its writer reads the position
    # back: expiry keeps its newest carrier, and maintenance must leave the position unchanged.
    position_prop: str = WATERMARK_PROP
    read_position: Callable[[SparkSession, str], Any] = read_watermark


@dataclass(frozen=True)
class TargetMaintenance:
    """One table compacted and expired. The rewrite counts are what Iceberg's procedures reported:
    None when a procedure was not run (position deletes of a format-1 table) or reported nothing."""

    before: dict[str, Any]  # lake.tables.table_stats before the run, and after it
    after: dict[str, Any]
    expired_data_files: int
    orphan_files_removed: int
    holds_kept: list[str]  # consumer holds (lake.holds) kept, and dropped (past their max lag)
    holds_dropped: list[str]
    seconds: float
    rewritten_data_files: int | None = None
    added_data_files: int | None = None
    rewritten_delete_files: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}


@dataclass(frozen=True)
class MaintenanceResult:
    """What one maintenance run did: each target table by its kind (output and unresolved for a
    derived table, feed_output for a feed consumer's output)."""

    table: str  # the owner: the derived table's config name, or the feed consumer
    run_id: str
    targets: dict[str, TargetMaintenance]
    spark_jobs: int | None  # None: not known (no Spark UI to count them on)

    def to_dict(self) -> dict[str, Any]:
        """For the job's result line: the targets by kind at the top level."""
        targets = {kind: t.to_dict() for kind, t in self.targets.items()}
        return {"table": self.table, "run_id": self.run_id, **targets, "spark_jobs": self.spark_jobs}


@dataclass(frozen=True)
class TableMaintenanceResult(MaintenanceResult):
    """A replicated table's maintenance: its current table and changelog, its latest-per-key view
    and its endpoints' landing retention."""

    spark_metadata_jobs: int | None  # of the Spark jobs, reads of Iceberg metadata tables
    spark_job_sites: list[str]  # what started each job, in order
    latest_rows: int | None  # rows in the latest-per-key view (None: maintenance.latest_view none)
    latest_mode: str | None  # table | view
    landing_runs_removed: dict[str, list[str]]  # endpoint -> landing runs removed

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.update(spark_metadata_jobs=self.spark_metadata_jobs, spark_job_sites=self.spark_job_sites)
        if self.latest_rows is not None:
            out.update(latest_rows=self.latest_rows, latest_mode=self.latest_mode)
        return {**out, "landing_runs_removed": self.landing_runs_removed}


def _ts(dt: datetime) -> str:
    return dt.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


def content_checksum(spark: SparkSession, table: str, columns: list[str]) -> str:
    """Order-independent checksum of a table's rows (count and sum of row hashes)."""
    from pyspark.sql import functions as F

    h = F.xxhash64(*[F.col(c) for c in columns])
    r = spark.table(table).agg(F.count(F.lit(1)).alias("n"), F.sum(h.cast("decimal(38,0)")).alias("s")).collect()[0]
    return f"{r['n']}:{r['s']}"


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


def compact(spark: SparkSession, lake: LakeSettings, target: Target) -> dict[str, Any]:
    """rewrite_data_files (+ position deletes, manifests) through CALL statements."""
    cat = lake.catalog_name
    name = target.table.split(".", 1)[1]
    out = _rewrite_data_files(spark, cat, name, target)
    if target.format_version == 2:
        out.update(_rewrite_delete_files(spark, cat, name, target))
    spark.sql(f"CALL {cat}.system.rewrite_manifests('{name}')").collect()
    return out


def _rewrite_data_files(spark: SparkSession, cat: str, name: str, target: Target) -> dict[str, Any]:
    opts = {
        "min-input-files": str(target.settings.min_input_files),
        "target-file-size-bytes": str(target.target_file_bytes),
        # Any data file with deletes attached is worth rewriting on a CDC table.
        "delete-file-threshold": "1",
        "partial-progress.enabled": "true",
        "remove-dangling-deletes": "true",
        # Rewritten files get a new sequence number, so the delete files they absorbed become
        # dangling and are dropped. Safe because maintenance never overlaps the table's ingest
        # (shared pool); with the default, delete files stay behind until the next rewrite.
        "use-starting-sequence-number": "false",
    }
    omap = ", ".join(f"'{k}', '{v}'" for k, v in opts.items())
    strategy = "'sort'" if target.sort else "'binpack'"
    r = spark.sql(
        f"CALL {cat}.system.rewrite_data_files(table => '{name}', strategy => {strategy}, options => map({omap}))"
    ).collect()
    return {"rewritten_data_files": int(r[0][0]), "added_data_files": int(r[0][1])} if r else {}


def _rewrite_delete_files(spark: SparkSession, cat: str, name: str, target: Target) -> dict[str, Any]:
    """Position delete files rewritten; None when Iceberg cannot (the data file rewrite covered it)."""
    try:
        r = spark.sql(
            f"CALL {cat}.system.rewrite_position_delete_files(table => '{name}', options => map('rewrite-all', 'true'))"
        ).collect()
    except Exception as exc:  # noqa: BLE001
        if "Invalid partition field parent" not in str(exc):
            raise
        # Iceberg 1.10 fails here on tables with list columns (apache/iceberg#14619). The data
        # file rewrite above already applied every delete file (delete-file-threshold=1) and
        # removed the dangling ones, so only small leftover delete files stay until a fixed release.
        log.info("maintenance %s: rewrite_position_delete_files skipped (apache/iceberg#14619)", target.owner)
        return {"rewritten_delete_files": None}
    return {"rewritten_delete_files": int(r[0][0])} if r else {}


def expire(spark: SparkSession, lake: LakeSettings, target: Target, now: datetime) -> dict[str, Any]:
    """expire_snapshots older than the retention, never the position's snapshot nor anything a
    live consumer hold keeps (lake.holds); then remove_orphan_files."""
    cat = lake.catalog_name
    name = target.table.split(".", 1)[1]
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
    return {
        "expired_data_files": int(r[0][0]) if r else 0,
        "orphan_files_removed": len(o),
        "holds_kept": [h.name for h in held.kept],
        "holds_dropped": [h.name for h in held.dropped],
    }


def prune_landing(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    consumers: list[TableConfig],
    now: datetime,
) -> dict[str, list[str]]:
    """Remove landing runs of cfg's endpoints that every consuming table has applied and that are
    older than the retention (the longest any consumer asks for); returns them by endpoint.

    A run is kept while any table with a valid config reading the endpoint is below its end (both
    its current table and its changelog), and the endpoint's newest run is always kept (the next
    capture reads its schemas and position). A table whose config is broken for longer than the
    retention finds a landing gap when it comes back, which stops it with the re-bootstrap fix."""
    from cdc_lakehouse.landing.reader import shard_endpoints

    landing = SparkLanding(spark, lake.landing_uri)
    removed: dict[str, list[str]] = {}
    for endpoint in sorted(shard_endpoints(cfg)):
        floor = _applied_floor(spark, lake, endpoint, consumers)
        if floor is None:
            continue
        hours = max(c.maintenance.landing_retention_hours for c in consumers if endpoint in shard_endpoints(c))
        runs = _prune_endpoint(landing, cfg, endpoint, floor, hours, now)
        if runs:
            removed[endpoint] = runs
    return removed


def _prune_endpoint(
    landing: SparkLanding, cfg: TableConfig, endpoint: str, floor: int, hours: int, now: datetime
) -> list[str]:
    """Remove the endpoint's runs ending at or below floor and older than `hours`, except its newest;
    returns their ids."""
    from cdc_lakehouse.landing.reader import list_manifests

    cutoff = now - timedelta(hours=hours)
    removed = []
    for m in list_manifests(landing, endpoint)[:-1]:
        assert m.finished_at is not None  # a capture run's manifest always says when it finished
        if m.end_lsn > floor or datetime.fromisoformat(m.finished_at) > cutoff:
            continue
        for entry in m.tables:
            landing.fs.delete(landing.file_uri(entry.dir))
        # The manifest last: a crash in between leaves a manifest below every consumer's
        # position, which no ingest reads, and the next run removes it.
        landing.fs.delete(landing.file_uri(manifest_path(endpoint, m.run_id)), recursive=False)
        removed.append(m.run_id)
    if removed:
        log.info(
            "maintenance %s: removed %d landing run(s) of %s applied by every table and older than %s h (%s)",
            cfg.name,
            len(removed),
            endpoint,
            hours,
            landing.file_uri(f"{endpoint}/{MANIFEST_DIR}"),
        )
    return removed


def _applied_floor(spark: SparkSession, lake: LakeSettings, endpoint: str, consumers: list[TableConfig]) -> int | None:
    """The lowest position any consuming table holds for a shard on the endpoint (None: unknown)."""
    from cdc_lakehouse.landing.reader import shard_endpoints

    floor = None
    for c in consumers:
        shards = shard_endpoints(c).get(endpoint)
        if not shards:
            continue
        for table in (lake.qualified(c.current_table), lake.qualified(c.changelog_table)):
            if not table_exists(spark, table):
                continue  # never bootstrapped: it starts from a snapshot, not from the landing
            wm = read_watermark(spark, table)
            for _, shard in shards:
                pos = wm.shards.get(shard) if wm is not None else None
                if pos is None:
                    continue
                floor = pos.lsn if floor is None else min(floor, pos.lsn)
    return floor


@dataclass(frozen=True)
class _Observed:
    """What maintenance must leave as it found it (content, position) and what it improves (stats)."""

    stats: dict[str, Any]
    snapshot_id: int | None
    position: Any  # the target's position (watermark, feed offsets) as its writer reads it
    checksum: str | None = None  # maintenance.verify_content only


def _only_rewrites_since(spark: SparkSession, target: Target, since: int | None) -> int | None:
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


def table_targets(lake: LakeSettings, cfg: TableConfig) -> list[Target]:
    """A replicated table's current table (its configured compaction) and changelog (bin-pack)."""
    size = cfg.lake.target_file_size_mb * 1024 * 1024
    writers = f"they share the one-slot Airflow pool {cfg.pool}, imported by scripts/airflow_init.sh"
    sort = cfg.maintenance.compaction == "sort"
    return [
        Target(
            cfg.name,
            "current",
            lake.qualified(cfg.current_table),
            cfg.maintenance,
            size,
            sort,
            cfg.lake.format_version,
            writers,
        ),
        Target(cfg.name, "changelog", lake.qualified(cfg.changelog_table), cfg.maintenance, size, False, 2, writers),
    ]


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
    default: this table alone. Progress goes to this module's logger. The result carries the Spark
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
    output and unresolved tables. Both carry the tree's watermark: expiry keeps its newest carrier
    on each (the next run finds the unresolved snapshot matching the output's watermark there)."""
    from cdc_lakehouse.derived.run import read_tree_watermark

    m = dcfg.maintenance
    size = m.target_file_size_mb * 1024 * 1024
    pool = f"they share the one-slot Airflow pool {dcfg.pool}"
    targets = [
        Target(dcfg.name, kind, lake.qualified(t), m, size, False, 2, pool, read_position=read_tree_watermark)
        for kind, t in (("output", dcfg.output_table), ("unresolved", dcfg.unresolved_table))
    ]
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
    from cdc_lakehouse.feed.offsets import OFFSETS_PROP, output_offsets

    table = lake.qualified(output)
    if not table_exists(spark, table):
        raise RuntimeError(f"feed consumer {consumer}: {table} does not exist; run the consumer first")
    target = Target(
        consumer,
        "feed_output",
        table,
        settings,
        settings.target_file_size_mb * 1024 * 1024,
        False,
        2,
        f"the consumer's runs and this maintenance are tasks of one DAG, cdc_feed__{consumer}, one run at a time",
        OFFSETS_PROP,
        lambda s, t: output_offsets(s, t, consumer),
    )
    with SparkJobs(spark, f"maintenance {consumer} {run_id}") as jobs:
        done = maintain_targets(spark, lake, consumer, [target], run_id, now or datetime.now(UTC))
    return MaintenanceResult(consumer, run_id, done, jobs.count)


def maintain_targets(
    spark: SparkSession, lake: LakeSettings, owner: str, targets: list[Target], run_id: str, now: datetime
) -> dict[str, TargetMaintenance]:
    """Each target compacted and expired in turn, by its kind; before/after rows to
    cdc_meta.maintenance_runs."""
    result: dict[str, TargetMaintenance] = {}
    rows: list[dict[str, Any]] = []
    clock = PhaseClock()
    for target in targets:
        with clock.phase(target.kind):
            before, after, done = _maintain_target(spark, lake, target, now)
        secs = clock.seconds[target.kind]
        rows += [_stats_row(target, run_id, phase, o, secs, now) for phase, o in (("before", before), ("after", after))]
        result[target.kind] = TargetMaintenance(before=before.stats, after=after.stats, seconds=secs, **done)
        _log_target(target, before.stats, after.stats, secs)
    meta_append(spark, lake, "maintenance_runs", rows)
    return result


def _maintain_target(
    spark: SparkSession, lake: LakeSettings, target: Target, now: datetime
) -> tuple[_Observed, _Observed, dict[str, Any]]:
    """Compact and expire one table; fails if another writer committed meanwhile."""
    # The catalog caches loaded tables: another process (the ingest's spark-submit) may have
    # committed since this session last read it, and a stale "before" would look like a
    # concurrent writer.
    spark.sql(f"REFRESH TABLE {target.table}")
    before = _observe(spark, target)
    comp = compact(spark, lake, target)
    # Checked before expiry too: expiry may drop `before`'s snapshot from the line.
    checked = _only_rewrites_since(spark, target, before.snapshot_id)
    exp = expire(spark, lake, target, now)
    _only_rewrites_since(spark, target, checked)
    after = _observe(spark, target)
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
    return before, after, {**comp, **exp}


def _observe(spark: SparkSession, target: Target) -> _Observed:
    snap = current_snapshot(spark, target.table)
    checksum = None
    if target.settings.verify_content:  # two full reads per table: an end-to-end check of the rewrite
        checksum = content_checksum(spark, target.table, [f.name for f in spark.table(target.table).schema.fields])
    return _Observed(
        table_stats(spark, target.table),
        snap.snapshot_id if snap is not None else None,
        target.read_position(spark, target.table),
        checksum,
    )


def _stats_row(target: Target, run_id: str, phase: str, o: _Observed, secs: float, now: datetime) -> dict[str, Any]:
    """One row of cdc_meta.maintenance_runs."""
    st = o.stats
    return {
        "table_name": target.owner,
        "run_id": run_id,
        "target": target.kind,
        "phase": phase,
        "data_files": st["data_files"],
        "avg_file_bytes": st["avg_file_bytes"],
        "delete_files": st["delete_files"],
        "snapshots": st["snapshots"],
        "total_bytes": st["total_bytes"],
        "records": st["records"],
        "checksum": o.checksum,
        "seconds": secs,
        "at": now,
    }


def _log_target(target: Target, before: dict[str, Any], after: dict[str, Any], secs: float) -> None:
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
