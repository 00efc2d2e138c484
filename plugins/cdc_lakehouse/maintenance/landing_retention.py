"""Landing retention: a replicated table's maintenance removes the landing runs of its endpoints
that every table consuming them has applied and that are older than the retention."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.lake.snapshots import read_watermark
from cdc_lakehouse.lake.tables import table_exists
from cdc_lakehouse.landing.format import MANIFEST_DIR, manifest_path
from cdc_lakehouse.landing.reader import SparkLanding
from cdc_lakehouse.settings import LakeSettings

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)


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
