"""Daily maintenance with Iceberg's own Spark procedures, and the latest-per-key view.

Each procedure commits atomically (or not at all), so a failed run leaves the table valid.
Snapshot expiry never removes the snapshot that carries the table's newest watermark: the
ingest reads it from the current snapshot's ancestry.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.lake.commits import ConcurrentWriterError
from cdc_lakehouse.lake.meta import meta_append
from cdc_lakehouse.lake.snapshots import current_snapshot
from cdc_lakehouse.lake.tables import table_exists, table_stats
from cdc_lakehouse.lake.watermark import WATERMARK_PROP, read_watermark
from cdc_lakehouse.landing.format import MANIFEST_DIR, manifest_path
from cdc_lakehouse.landing.reader import SparkLanding
from cdc_lakehouse.runtime.phases import PhaseClock, SparkJobs
from cdc_lakehouse.settings import LakeSettings
from cdc_lakehouse.views import publish_latest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)


def _ts(dt: datetime) -> str:
    return dt.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


def content_checksum(spark: SparkSession, table: str, columns: list[str]) -> str:
    """Order-independent checksum of a table's rows (count and sum of row hashes)."""
    from pyspark.sql import functions as F

    h = F.xxhash64(*[F.col(c) for c in columns])
    r = spark.table(table).agg(F.count(F.lit(1)).alias("n"), F.sum(h.cast("decimal(38,0)")).alias("s")).collect()[0]
    return f"{r['n']}:{r['s']}"


def watermark_snapshot_time(spark: SparkSession, table: str) -> datetime | None:
    rows = spark.sql(
        f"SELECT h.made_current_at t FROM {table}.snapshots s JOIN {table}.history h ON s.snapshot_id = h.snapshot_id "
        f"WHERE h.is_current_ancestor AND s.summary['{WATERMARK_PROP}'] IS NOT NULL "
        "ORDER BY h.made_current_at DESC LIMIT 1"
    ).collect()
    return rows[0]["t"].replace(tzinfo=UTC) if rows else None


def compact(
    spark: SparkSession, lake: LakeSettings, table: str, cfg: TableConfig, *, sort: bool, format_version: int
) -> dict[str, Any]:
    """rewrite_data_files (+ position deletes, manifests) through CALL statements."""
    cat = lake.catalog_name
    name = table.split(".", 1)[1]
    out = _rewrite_data_files(spark, cat, name, cfg, sort)
    if format_version == 2:
        out.update(_rewrite_delete_files(spark, cat, name, cfg))
    spark.sql(f"CALL {cat}.system.rewrite_manifests('{name}')").collect()
    return out


def _rewrite_data_files(spark: SparkSession, cat: str, name: str, cfg: TableConfig, sort: bool) -> dict[str, Any]:
    opts = {
        "min-input-files": str(cfg.maintenance.min_input_files),
        "target-file-size-bytes": str(cfg.lake.target_file_size_mb * 1024 * 1024),
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
    strategy = "'sort'" if sort else "'binpack'"
    r = spark.sql(
        f"CALL {cat}.system.rewrite_data_files(table => '{name}', strategy => {strategy}, options => map({omap}))"
    ).collect()
    return {"rewritten_data_files": int(r[0][0]), "added_data_files": int(r[0][1])} if r else {}


def _rewrite_delete_files(spark: SparkSession, cat: str, name: str, cfg: TableConfig) -> dict[str, Any]:
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
        log.info("maintenance %s: rewrite_position_delete_files skipped (apache/iceberg#14619)", cfg.name)
        return {"rewritten_delete_files": None}
    return {"rewritten_delete_files": int(r[0][0])} if r else {}


def expire(spark: SparkSession, lake: LakeSettings, table: str, cfg: TableConfig, now: datetime) -> dict[str, Any]:
    cat = lake.catalog_name
    name = table.split(".", 1)[1]
    older = now - timedelta(hours=cfg.maintenance.snapshot_retention_hours)
    keep = watermark_snapshot_time(spark, table)
    if keep is not None and keep <= older:
        older = keep - timedelta(milliseconds=1)  # the watermark's snapshot must survive
    r = spark.sql(
        f"CALL {cat}.system.expire_snapshots(table => '{name}', older_than => TIMESTAMP '{_ts(older)}', "
        f"retain_last => {cfg.maintenance.min_snapshots_to_keep})"
    ).collect()
    orphans_before = now - timedelta(hours=cfg.maintenance.orphan_file_age_hours)
    o = spark.sql(
        f"CALL {cat}.system.remove_orphan_files(table => '{name}', older_than => TIMESTAMP '{_ts(orphans_before)}')"
    ).collect()
    return {"expired_data_files": int(r[0][0]) if r else 0, "orphan_files_removed": len(o)}


def prune_landing(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    consumers: list[TableConfig],
    now: datetime,
) -> dict[str, Any]:
    """Remove landing runs of cfg's endpoints that every consuming table has applied and that are
    older than the retention (the longest any consumer asks for).

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
    return {"landing_runs_removed": removed}


def _prune_endpoint(
    landing: SparkLanding, cfg: TableConfig, endpoint: str, floor: int, hours: int, now: datetime
) -> list[str]:
    """Remove the endpoint's runs ending at or below floor and older than `hours`, except its newest;
    returns their ids."""
    from cdc_lakehouse.landing.reader import list_manifests

    cutoff = now - timedelta(hours=hours)
    removed = []
    for m in list_manifests(landing, endpoint)[:-1]:
        if m["end_lsn"] > floor or datetime.fromisoformat(m["finished_at"]) > cutoff:
            continue
        for entry in m.get("tables", []):
            landing.fs.delete(landing.file_uri(entry["dir"]))
        # The manifest last: a crash in between leaves a manifest below every consumer's
        # position, which no ingest reads, and the next run removes it.
        landing.fs.delete(landing.file_uri(manifest_path(endpoint, m["run_id"])), recursive=False)
        removed.append(m["run_id"])
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
            wm = read_watermark(spark, table) or {}
            for _, shard in shards:
                pos = (wm.get("shards") or {}).get(shard)
                if pos is None:
                    continue
                floor = pos["lsn"] if floor is None else min(floor, pos["lsn"])
    return floor


@dataclass(frozen=True)
class _Observed:
    """What maintenance must leave as it found it (content, watermark) and what it improves (stats)."""

    stats: dict[str, Any]
    snapshot_id: int | None
    watermark: dict[str, Any] | None
    checksum: str | None = None  # maintenance.verify_content only


def _only_rewrites_since(spark: SparkSession, cfg: TableConfig, target: str, since: int | None) -> int | None:
    """Every snapshot committed after `since` on the table's current line is a rewrite ('replace':
    rewrite_data_files, rewrite_position_delete_files, rewrite_manifests), which Iceberg commits
    only when the live rows are unchanged. Metadata only: no data is read. A data commit by another
    writer, or a rollback that dropped `since` from the line, fails the run. Returns the head it
    checked from, so the next check starts exactly there."""
    from cdc_lakehouse.lake.snapshots import current_ancestors

    head = None
    for snap in current_ancestors(spark, target):
        head = snap.snapshot_id if head is None else head
        if snap.snapshot_id == since:
            return head
        if snap.operation != "replace":
            raise ConcurrentWriterError(
                f"{cfg.name}: {target} got a '{snap.operation}' commit (snapshot {snap.snapshot_id}) while "
                "maintenance ran: another writer was active. The DAGs' writers of a table share its one-slot "
                f"Airflow pool ({cfg.pool}, imported by scripts/airflow_init.sh); check that no job outside "
                "them writes the table"
            )
    if since is not None:
        raise ConcurrentWriterError(
            f"{cfg.name}: snapshot {since} of {target} left the current line while maintenance ran "
            "(a rollback or a stray writer); check the table's history before re-running"
        )
    return head


def maintain_table(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    *,
    run_id: str,
    now: datetime | None = None,
    consumers: list[TableConfig] | None = None,
) -> dict[str, Any]:
    """Compaction, expiry and orphan cleanup of both tables, the latest view, and landing retention.

    `consumers`: every valid table config (landing runs are shared by the tables of an endpoint);
    default: this table alone. Progress goes to this module's logger. The result carries the Spark
    jobs the run took (`spark_jobs`, `spark_job_sites`): the figure to watch for repeated scans."""
    with SparkJobs(spark, f"maintenance {cfg.name} {run_id}") as jobs:
        result = _maintain_table(spark, lake, cfg, run_id, now or datetime.now(UTC), consumers)
    return {**result, "spark_jobs": jobs.count, "spark_job_sites": jobs.sites}


def _maintain_table(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    run_id: str,
    now: datetime,
    consumers: list[TableConfig] | None,
) -> dict[str, Any]:
    cur = lake.qualified(cfg.current_table)
    cl = lake.qualified(cfg.changelog_table)
    if not table_exists(spark, cur):
        raise RuntimeError(f"{cfg.name}: {cur} does not exist; bootstrap it first (cdc_bootstrap__{cfg.name})")
    result: dict[str, Any] = {"table": cfg.name, "run_id": run_id}
    rows: list[dict[str, Any]] = []
    clock = PhaseClock()
    for target, kind in ((cur, "current"), (cl, "changelog")):
        with clock.phase(kind):
            before, after, done = _maintain_target(spark, lake, cfg, target, kind == "current", now)
        secs = clock.seconds[kind]
        rows += [
            _stats_row(cfg, run_id, kind, phase, o, secs, now) for phase, o in (("before", before), ("after", after))
        ]
        result[kind] = {"before": before.stats, "after": after.stats, **done, "seconds": secs}
        _log_target(cfg, kind, before.stats, after.stats, secs)
    result.update(publish_latest(spark, lake, cfg))
    result.update(prune_landing(spark, lake, cfg, consumers or [cfg], now))
    meta_append(spark, lake, "maintenance_runs", rows)
    return result


def _maintain_target(
    spark: SparkSession, lake: LakeSettings, cfg: TableConfig, target: str, is_current: bool, now: datetime
) -> tuple[_Observed, _Observed, dict[str, Any]]:
    """Compact and expire one table; fails if another writer committed meanwhile."""
    # The catalog caches loaded tables: another process (the ingest's spark-submit) may have
    # committed since this session last read it, and a stale "before" would look like a
    # concurrent writer.
    spark.sql(f"REFRESH TABLE {target}")
    before = _observe(spark, cfg, target)
    comp = compact(
        spark,
        lake,
        target,
        cfg,
        sort=is_current and cfg.maintenance.compaction == "sort",
        format_version=cfg.lake.format_version if is_current else 2,
    )
    # Checked before expiry too: expiry may drop `before`'s snapshot from the line.
    checked = _only_rewrites_since(spark, cfg, target, before.snapshot_id)
    exp = expire(spark, lake, target, cfg, now)
    _only_rewrites_since(spark, cfg, target, checked)
    after = _observe(spark, cfg, target)
    if after.checksum != before.checksum:
        raise RuntimeError(
            f"{cfg.name}: content of {target} changed during maintenance "
            f"({before.checksum} -> {after.checksum}) though only rewrites were committed; keep the "
            "pre-maintenance snapshot (time travel) and report it: a rewrite must not change rows"
        )
    if after.watermark != before.watermark:
        raise RuntimeError(f"{cfg.name}: the watermark of {target} changed during maintenance")
    return before, after, {**comp, **exp}


def _observe(spark: SparkSession, cfg: TableConfig, target: str) -> _Observed:
    snap = current_snapshot(spark, target)
    checksum = None
    if cfg.maintenance.verify_content:  # two full reads per table: an end-to-end check of the rewrite
        checksum = content_checksum(spark, target, [f.name for f in spark.table(target).schema.fields])
    return _Observed(
        table_stats(spark, target),
        snap.snapshot_id if snap is not None else None,
        read_watermark(spark, target),
        checksum,
    )


def _stats_row(
    cfg: TableConfig, run_id: str, kind: str, phase: str, o: _Observed, secs: float, now: datetime
) -> dict[str, Any]:
    """One row of cdc_meta.maintenance_runs."""
    st = o.stats
    return {
        "table_name": cfg.name,
        "run_id": run_id,
        "target": kind,
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


def _log_target(cfg: TableConfig, kind: str, before: dict[str, Any], after: dict[str, Any], secs: float) -> None:
    log.info(
        "maintenance %s %s: data files %s -> %s, delete files %s -> %s, snapshots %s -> %s, "
        "avg file %.0f KiB -> %.0f KiB in %.1fs",
        cfg.name,
        kind,
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
