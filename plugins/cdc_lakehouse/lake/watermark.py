"""lake.watermark: split out of lake.py."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

WATERMARK_PROP = "cdc.watermark"


# --- watermarks --------------------------------------------------------------------------------


def read_watermark(spark: SparkSession, table: str) -> dict[str, Any] | None:
    """The newest `cdc.watermark` among the current snapshot and its ancestors."""
    # Iceberg's catalog caches loaded tables; another process (a killed run, maintenance) may have
    # committed since, and a stale watermark would re-apply events the table already has.
    spark.sql(f"REFRESH TABLE {table}")
    rows = spark.sql(
        f"SELECT s.summary['{WATERMARK_PROP}'] AS wm FROM {table}.snapshots s "
        f"JOIN {table}.history h ON s.snapshot_id = h.snapshot_id "
        f"WHERE h.is_current_ancestor AND s.summary['{WATERMARK_PROP}'] IS NOT NULL "
        "ORDER BY h.made_current_at DESC LIMIT 1"
    ).collect()
    return json.loads(rows[0]["wm"]) if rows else None


def watermark_json(wm: dict[str, Any]) -> str:
    return json.dumps(wm, separators=(",", ":"), sort_keys=True)
