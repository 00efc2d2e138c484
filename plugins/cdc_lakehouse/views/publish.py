"""Publishing the latest-per-key view in the catalog, by the table's maintenance.latest_view:
an Iceberg table replaced atomically (CREATE OR REPLACE ... AS SELECT), or an Iceberg view (its
SQL text), or none. Switching modes drops what the other mode left under the name."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from cdc_lakehouse.columns import SHARD_COL
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.lake.tables import props_sql, table_exists
from cdc_lakehouse.settings import LakeSettings
from cdc_lakehouse.views.latest import latest_rows, latest_sql

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

logger = logging.getLogger(__name__)


def publish_latest(spark: SparkSession, lake: LakeSettings, cfg: TableConfig) -> int | None:
    """As an Iceberg table replaced atomically (CREATE OR REPLACE ... AS SELECT), or as an Iceberg
    view (maintenance.latest_view); returns its rows, None when there is none."""
    name = lake.qualified(cfg.latest_view)
    mode = cfg.maintenance.latest_view
    if mode == "none":
        return None
    t = time.time()
    df = latest_rows(spark, lake, cfg)
    if mode == "table":
        if _is_view(spark, name):
            spark.sql(f"DROP VIEW {name}")
        view = f"cdc_latest_{cfg.name}"
        df.createOrReplaceTempView(view)
        part = f"PARTITIONED BY ({SHARD_COL})" if SHARD_COL in cfg.lake.partition_by else ""
        props = props_sql({"format-version": "2", "cdc.table": cfg.name, "cdc.kind": "latest-per-key"})
        spark.sql(f"CREATE OR REPLACE TABLE {name} USING iceberg {part} {props} AS SELECT * FROM {view}")
        rows = spark.table(name).count()
    else:
        if table_exists(spark, name) and not _is_view(spark, name):
            spark.sql(f"DROP TABLE {name}")
        spark.sql(f"CREATE OR REPLACE VIEW {name} AS {latest_sql(spark, lake, cfg)}")
        rows = spark.table(name).count()
    logger.info(f"maintenance {cfg.name}: latest-per-key {mode} {name}: {rows} rows in {time.time() - t:.1f}s")
    return rows


def _is_view(spark: SparkSession, name: str) -> bool:
    cat, ns, tbl = name.split(".")
    try:
        return any(r["viewName"] == tbl for r in spark.sql(f"SHOW VIEWS IN {cat}.{ns}").collect())
    except Exception:  # noqa: BLE001 - catalogs without views
        return False
