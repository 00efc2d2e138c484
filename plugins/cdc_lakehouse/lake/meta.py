"""lake.meta: the pipeline's own Iceberg tables in the meta namespace (Spark driver): quarantine,
per-run figures of capture, ingest, audit and maintenance, audit mismatches, quality results and
per-shard freshness (lake.freshness).
Created (and given columns added by later releases) by ensure_meta_tables; appended by meta_append."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cdc_lakehouse.identifiers import spark_ident
from cdc_lakehouse.ingest.metrics import INGEST_RUN_COLUMNS
from cdc_lakehouse.lake.columns import COMMIT_LSN, RUN_ID, SHARD
from cdc_lakehouse.lake.tables import create_table_sql, ensure_namespace
from cdc_lakehouse.settings import LakeSettings

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# --- meta tables ----------------------------------------------------------------------------------

META_TABLES: dict[str, tuple[list[tuple[str, str]], str]] = {
    "quarantine": (
        [
            ("table_name", "string"),
            (SHARD.quarantine, SHARD.type),  # the metadata columns it carries, under their names here
            ("reason", "string"),
            ("raw", "string"),
            (COMMIT_LSN.quarantine, COMMIT_LSN.type),
            ("seq", "bigint"),  # the source's seq (not _cdc_seq)
            (RUN_ID.quarantine, RUN_ID.type),
            ("landing_file", "string"),
            ("ingest_run", "string"),
            ("quarantined_at", "timestamp"),
        ],
        "PARTITIONED BY (table_name)",
    ),
    "ingest_runs": (
        list(INGEST_RUN_COLUMNS),  # one definition: the fields of ingest.metrics.IngestMetrics
        "PARTITIONED BY (table_name)",
    ),
    "capture_runs": (
        [
            ("endpoint", "string"),
            ("run_id", "string"),
            ("events", "bigint"),
            ("bytes", "bigint"),
            ("transactions", "bigint"),
            ("capped", "boolean"),
            ("start_lsn", "bigint"),
            ("end_lsn", "bigint"),
            ("retained_wal_bytes", "bigint"),
            ("lag_bytes", "bigint"),
            ("seconds", "double"),
            ("started_at", "timestamp"),
            ("finished_at", "timestamp"),
        ],
        "",
    ),
    "audit_results": (
        [
            ("table_name", "string"),
            ("audit_run", "string"),
            ("shard", "string"),
            ("mode", "string"),
            ("source_rows", "bigint"),
            ("lake_rows", "bigint"),
            ("missing", "bigint"),
            ("extra", "bigint"),
            ("different", "bigint"),
            ("in_flight", "bigint"),
            ("persistent", "bigint"),
            ("buckets_compared", "bigint"),
            ("buckets_differing", "bigint"),
            ("sample_keys", "string"),
            ("watermark_lsn", "bigint"),
            ("repaired", "bigint"),
            ("verdict", "string"),
            ("seconds", "double"),
            ("audited_at", "timestamp"),
        ],
        "PARTITIONED BY (table_name)",
    ),
    "audit_mismatches": (
        [
            ("table_name", "string"),
            ("shard", "string"),
            ("key_json", "string"),
            ("kind", "string"),
            ("first_seen", "timestamp"),
            ("last_seen", "timestamp"),
            ("times_seen", "int"),
            ("resolved", "boolean"),
            ("last_audit_run", "string"),
        ],
        "PARTITIONED BY (table_name)",
    ),
    "quality_results": (
        [
            ("table_name", "string"),
            ("audit_run", "string"),
            ("expectation", "string"),
            ("success", "boolean"),
            ("observed", "string"),
            ("details", "string"),
            ("checked_at", "timestamp"),
        ],
        "PARTITIONED BY (table_name)",
    ),
    # Per table and shard, one row per ingest run: see lake.freshness.
    "freshness": (
        [
            ("table_name", "string"),
            ("shard", "string"),
            ("endpoint", "string"),
            ("source_schema", "string"),
            ("last_source_commit_lsn", "bigint"),
            ("last_source_commit_ts", "timestamp"),
            ("last_heartbeat_lsn", "bigint"),
            ("last_heartbeat_ts", "timestamp"),
            ("watermark_lsn", "bigint"),
            ("fresh_to", "timestamp"),
            ("lake_snapshot_id", "bigint"),
            ("lake_committed_at", "timestamp"),
            ("freshness_seconds", "double"),
            ("ingest_run", "string"),
            ("updated_at", "timestamp"),
        ],
        "PARTITIONED BY (table_name)",
    ),
    # One row per completed chunk of a chunked bootstrap (bootstrap.chunked); the newest row of a
    # (table, shard) is where a killed or paused bootstrap resumes.
    "bootstrap_progress": (
        [
            ("table_name", "string"),
            ("shard", "string"),
            ("run_id", "string"),
            ("chunk", "bigint"),
            ("last_key", "string"),  # JSON list of the chunk's last key, as the source prints it
            ("low_lsn", "bigint"),
            ("high_lsn", "bigint"),
            ("rows", "bigint"),  # rows read in this chunk
            ("rows_total", "bigint"),  # rows read for the shard so far
            ("chunks_done", "bigint"),
            ("chunks_total", "bigint"),  # estimate (pg_class.reltuples / chunk_rows)
            ("done", "boolean"),
            ("xact_seconds", "double"),  # how long the chunk's read transaction was open
            ("started_at", "timestamp"),
            ("updated_at", "timestamp"),
        ],
        "PARTITIONED BY (table_name)",
    ),
    "maintenance_runs": (
        [
            ("table_name", "string"),
            ("run_id", "string"),
            ("target", "string"),
            ("phase", "string"),
            ("data_files", "bigint"),
            ("avg_file_bytes", "double"),
            ("delete_files", "bigint"),
            ("snapshots", "bigint"),
            ("total_bytes", "bigint"),
            ("records", "bigint"),
            ("checksum", "string"),
            ("seconds", "double"),
            ("at", "timestamp"),
        ],
        "PARTITIONED BY (table_name)",
    ),
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
    rows: list[dict[str, Any]],
    columns: list[tuple[str, str]],
    props: dict[str, str] | None = None,
) -> None:
    """Append rows built on the driver; props become snapshot properties of the commit."""
    if not rows:
        return
    schema = ", ".join(f"{spark_ident(c)} {t}" for c, t in columns)
    df = spark.createDataFrame([tuple(r.get(c) for c, _ in columns) for r in rows], schema)
    # A few rows from the driver: no shuffle to cluster them by partition first (Iceberg's
    # default for a partitioned table, a Spark job of its own); the fanout writer takes them as they come.
    w = df.writeTo(table).option("distribution-mode", "none").option("fanout-enabled", "true")
    for k, v in (props or {}).items():
        w = w.option(f"snapshot-property.{k}", v)
    w.append()


def meta_append(
    spark: SparkSession, lake: LakeSettings, name: str, rows: list[dict[str, Any]], props: dict[str, str] | None = None
) -> None:
    append_rows(spark, lake.qualified(lake.meta_table(name)), rows, META_TABLES[name][0], props)
