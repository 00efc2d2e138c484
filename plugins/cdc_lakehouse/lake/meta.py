"""lake.meta: the pipeline's own Iceberg tables in the meta namespace (Spark driver): quarantine,
per-run figures of capture, ingest, audit and maintenance, audit mismatches, quality results and
per-shard freshness (lake.freshness).
Created (and given columns added by later releases) by ensure_meta_tables; appended by meta_append."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cdc_lakehouse.identifiers import spark_ident
from cdc_lakehouse.lake.ingest_metrics import IngestMetrics
from cdc_lakehouse.lake.meta_rows import (
    AuditMismatch,
    AuditResult,
    BootstrapChunk,
    CaptureRun,
    MaintenanceStats,
    MetaRow,
    PointTable,
    QualityResult,
    QuarantinedEvent,
    ShardFreshness,
    columns,
    row_values,
)
from cdc_lakehouse.lake.tables import create_table_sql, ensure_namespace
from cdc_lakehouse.settings import LakeSettings

if TYPE_CHECKING:
    from collections.abc import Sequence

    from pyspark.sql import SparkSession

# --- meta tables ----------------------------------------------------------------------------------

# Table -> the record whose fields are its columns (lake.meta_rows; ingest_runs: IngestMetrics),
# and its partitioning.
META_RECORDS: dict[str, tuple[type, str]] = {
    "quarantine": (QuarantinedEvent, "PARTITIONED BY (table_name)"),
    "ingest_runs": (IngestMetrics, "PARTITIONED BY (table_name)"),
    "capture_runs": (CaptureRun, ""),
    "audit_results": (AuditResult, "PARTITIONED BY (table_name)"),
    "audit_mismatches": (AuditMismatch, "PARTITIONED BY (table_name)"),
    "quality_results": (QualityResult, "PARTITIONED BY (table_name)"),
    # Per table and shard, one row per ingest run: see lake.freshness.
    "freshness": (ShardFreshness, "PARTITIONED BY (table_name)"),
    # One row per completed chunk of a chunked bootstrap (bootstrap.chunked); the newest row of a
    # (table, shard) is where a killed or paused bootstrap resumes.
    "bootstrap_progress": (BootstrapChunk, "PARTITIONED BY (table_name)"),
    "maintenance_runs": (MaintenanceStats, "PARTITIONED BY (table_name)"),
    # One row per table of each consistent point of an endpoint (lake.points).
    "consistent_points": (PointTable, ""),
}
# Table -> (its (column, Spark SQL type) list, its partitioning), generated from META_RECORDS.
META_TABLES: dict[str, tuple[list[tuple[str, str]], str]] = {
    name: (columns(record), part) for name, (record, part) in META_RECORDS.items()
}


def ensure_meta_tables(spark: SparkSession, lake: LakeSettings) -> None:
    ensure_namespace(spark, lake, lake.meta_namespace)
    for name, (cols, part) in META_TABLES.items():
        table = lake.qualified(lake.meta_table(name))
        spark.sql(
            create_table_sql(
                table,
                cols,
                part,
                {
                    "format-version": "2",
                    "write.metadata.delete-after-commit.enabled": "true",
                    "commit.retry.num-retries": "20",
                },
            )
        )
        # Columns added by later releases reach tables created by earlier ones.
        have = set(spark.table(table).columns)
        for c, t in cols:
            if c not in have:
                spark.sql(f"ALTER TABLE {table} ADD COLUMN {spark_ident(c)} {t}")


def append_rows(
    spark: SparkSession,
    table: str,
    rows: Sequence[MetaRow],
    columns: list[tuple[str, str]],
    props: dict[str, str] | None = None,
) -> None:
    """Append rows built on the driver; props become snapshot properties of the commit."""
    if not rows:
        return
    schema = ", ".join(f"{spark_ident(c)} {t}" for c, t in columns)
    names = [c for c, _ in columns]
    df = spark.createDataFrame([row_values(r, names) for r in rows], schema)
    # A few rows from the driver: no shuffle to cluster them by partition first (Iceberg's
    # default for a partitioned table, a Spark job of its own); the fanout writer takes them as they come.
    w = df.writeTo(table).option("distribution-mode", "none").option("fanout-enabled", "true")
    for k, v in (props or {}).items():
        w = w.option(f"snapshot-property.{k}", v)
    w.append()


def meta_append(
    spark: SparkSession, lake: LakeSettings, name: str, rows: Sequence[MetaRow], props: dict[str, str] | None = None
) -> None:
    """Append `rows` (records of the table's META_RECORDS entry) to cdc_meta's table `name`."""
    append_rows(spark, lake.qualified(lake.meta_table(name)), rows, META_TABLES[name][0], props)
