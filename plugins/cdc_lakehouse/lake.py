"""Spark-side plumbing for the lake: table DDL, watermarks, commit properties, file access.

The watermark of a table is JSON in the `cdc.watermark` snapshot property, written in the
same commit as the data it describes:

    {"v": 1, "shards": {"<shard>": {"lsn": <int>, "ts": "<iso>"}}, "runs": {"<endpoint>": "<run_id>"}}

`lsn` is exclusive: every source transaction of that shard whose commit LSN is below it is
in the table, and none at or above it. Bootstrap sets it to the snapshot's consistent
point; each ingest moves it to the end of the last capture run it applied.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from .config import COMMIT_TS_COL, LSN_COL, OP_COL, SEQ_COL, SHARD_COL, TableConfig
from .identifiers import spark_ident
from .settings import LakeSettings

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

WATERMARK_PROP = "cdc.watermark"

# Changelog-only metadata columns.
LSN_EVENT_COL = "_cdc_lsn"
XID_COL = "_cdc_xid"
UNAVAILABLE_COL = "_cdc_unavailable"
RUN_COL = "_cdc_run_id"
INGESTED_COL = "_cdc_ingested_at"


# --- files through Hadoop's FileSystem (local paths, s3a://, hdfs:// alike) -----------------


def spark_uri(uri: str) -> str:
    return "s3a://" + uri[len("s3://") :] if uri.startswith("s3://") else uri


class HadoopFS:
    def __init__(self, spark: SparkSession):
        self.jvm = spark._jvm
        self.conf = spark._jsc.hadoopConfiguration()

    def _fs(self, uri: str):
        path = self.jvm.org.apache.hadoop.fs.Path(spark_uri(uri))
        return path, path.getFileSystem(self.conf)

    def exists(self, uri: str) -> bool:
        path, fs = self._fs(uri)
        return bool(fs.exists(path))

    def size(self, uri: str) -> int | None:
        path, fs = self._fs(uri)
        return int(fs.getFileStatus(path).getLen()) if fs.exists(path) else None

    def list_names(self, uri: str) -> list[str]:
        path, fs = self._fs(uri)
        if not fs.exists(path):
            return []
        return sorted(st.getPath().getName() for st in fs.listStatus(path))

    def read_text(self, uri: str) -> str:
        path, fs = self._fs(uri)
        stream = fs.open(path)
        try:
            reader = self.jvm.java.io.BufferedReader(self.jvm.java.io.InputStreamReader(stream, "UTF-8"))
            lines = []
            line = reader.readLine()
            while line is not None:
                lines.append(line)
                line = reader.readLine()
            return "\n".join(lines)
        finally:
            stream.close()

    def delete(self, uri: str, recursive: bool = True) -> bool:
        path, fs = self._fs(uri)
        return bool(fs.delete(path, recursive))


class SparkLanding:
    """Read-only view of the landing zone for Spark jobs (manifests + file URIs)."""

    def __init__(self, spark: SparkSession, uri: str):
        self.fs = HadoopFS(spark)
        self.uri = spark_uri(uri.rstrip("/"))

    def file_uri(self, rel: str) -> str:
        return f"{self.uri}/{rel}"

    def list_names(self, rel: str) -> list[str]:
        return self.fs.list_names(self.file_uri(rel))

    def read_json(self, rel: str) -> Any:
        return json.loads(self.fs.read_text(self.file_uri(rel)))

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.file_uri(rel))


# --- commits that carry snapshot properties ---------------------------------------------------


def sql_with_commit_properties(spark: SparkSession, sql: str, props: dict[str, str]) -> None:
    """Run a row-level SQL command (MERGE/DELETE/UPDATE) whose Iceberg commit carries props.

    SQL has no write options, so this goes through Iceberg's CommitMetadata, a thread-local
    set around the command. py4j's pinned-thread mode runs our callback's Spark calls on the
    same JVM thread that set it.
    """
    from pyspark.java_gateway import ensure_callback_server_started

    jvm = spark._jvm
    ensure_callback_server_started(spark.sparkContext._gateway)
    jmap = jvm.java.util.HashMap()
    for k, v in props.items():
        jmap.put(k, v)
    failure: list[BaseException] = []

    class _Run:
        def call(self):
            try:
                spark.sql(sql)
            except BaseException as exc:  # re-raised below with its Python type
                failure.append(exc)
                raise

        class Java:
            implements = ["java.util.concurrent.Callable"]

    try:
        jvm.org.apache.iceberg.spark.CommitMetadata.withCommitProperties(
            jmap, _Run(), jvm.java.lang.RuntimeException().getClass()
        )
    except Exception:
        if failure:
            raise failure[0] from None
        raise


def is_commit_conflict(exc: BaseException) -> bool:
    text = str(exc)
    return any(
        s in text
        for s in (
            "CommitFailedException",
            "ValidationException: Found conflicting",
            "Found new conflicting",
            "Cannot commit",
            "CommitStateUnknownException",
        )
    )


def with_commit_retries(fn, *, attempts: int = 5, what: str = "commit", log=print):
    """Retry fn on Iceberg commit conflicts (a concurrent writer won); fn must recompute from scratch."""
    for i in range(1, attempts + 1):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001
            if i == attempts or not is_commit_conflict(exc):
                raise
            wait = min(30.0, 0.5 * 2**i)
            log(f"{what}: commit conflict ({type(exc).__name__}); retry {i}/{attempts - 1} in {wait:.1f}s")
            time.sleep(wait)


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


class ConcurrentWriterError(RuntimeError):
    """Another writer committed to the table since this run read its watermark."""


def fenced_commit(
    spark: SparkSession, table: str, expected: dict[str, Any] | None, new: dict[str, Any], commit, *, what: str
) -> bool:
    """Commit only while the table's watermark is still the one this run started from.

    Optimistic concurrency on the watermark: a zombie driver, a manual job or a second deployment
    that committed in between makes this run stop before it appends rows twice or moves the
    watermark back. Checked again before every retry, so a commit whose outcome was unknown
    (CommitStateUnknownException) is resolved first: if it landed, it is not repeated. Returns
    False when an earlier attempt of this very commit had already landed.

    Residual window: between the check and Iceberg's own commit (milliseconds); Airflow's
    per-table pool keeps our own writers out of it."""

    def attempt() -> bool:
        now = read_watermark(spark, table)
        if now == new:
            return False
        if now != expected:
            raise ConcurrentWriterError(
                f"{what}: {table} was committed by another writer since this run started (watermark "
                f"{watermark_json(expected or {})} -> {watermark_json(now or {})}); nothing was written by this "
                "run. Check for a second deployment, a manual job or a run that outlived its task, then rerun"
            )
        commit()
        return True

    return with_commit_retries(attempt, what=what)


def conform_to(df: DataFrame, table_schema) -> DataFrame:
    """df with exactly the table's columns, in its order; columns df lacks are NULL.

    Writers use this because a table can hold columns the batch does not: the changelog keeps a
    column dropped from the current table (schema_changes.dropped_columns: drop), and a column
    kept under keep_null no longer exists at the source that a bootstrap or repair reads."""
    from pyspark.sql import functions as F

    have = set(df.columns)
    return df.select(
        *[F.col(f.name) if f.name in have else F.lit(None).cast(f.dataType).alias(f.name) for f in table_schema.fields]
    )


def add_column(spark: SparkSession, table: str, name: str, typ: str) -> bool:
    """ADD COLUMN unless the table already has it (a column dropped and added back at the source
    is still in the changelog). False when it was already there."""
    spark.sql(f"REFRESH TABLE {table}")
    if name in spark.table(table).columns:
        return False
    spark.sql(f"ALTER TABLE {table} ADD COLUMN {spark_ident(name)} {typ}")
    return True


def table_exists(spark: SparkSession, table: str) -> bool:
    return bool(spark.catalog.tableExists(table))


# --- DDL -----------------------------------------------------------------------------------------


def _partition_sql(cfg: TableConfig, time_partition: bool = False) -> str:
    if time_partition:
        return f"PARTITIONED BY (days({COMMIT_TS_COL}))"
    parts = []
    for p in cfg.lake.partition_by:
        parts.append(p if "(" in p else spark_ident(p))
    return f"PARTITIONED BY ({', '.join(parts)})" if parts else ""


def table_properties(cfg: TableConfig, changelog: bool = False) -> dict[str, str]:
    mode = "merge-on-read" if changelog else cfg.lake.write_mode
    props = {
        "format-version": str(cfg.lake.format_version),
        "write.merge.mode": mode,
        "write.update.mode": mode,
        "write.delete.mode": mode,
        "write.target-file-size-bytes": str(cfg.lake.target_file_size_mb * 1024 * 1024),
        "write.parquet.compression-codec": "zstd",
        "write.metadata.delete-after-commit.enabled": "true",
        "write.metadata.previous-versions-max": "100",
        "commit.retry.num-retries": "10",
        "history.expire.max-snapshot-age-ms": str(cfg.maintenance.snapshot_retention_hours * 3600 * 1000),
        "history.expire.min-snapshots-to-keep": str(cfg.maintenance.min_snapshots_to_keep),
        "cdc.table": cfg.name,
        "cdc.primary-key": ",".join(cfg.primary_key),
    }
    if not changelog:
        props.update(cfg.lake.properties)
    return props


def sql_string(value: object) -> str:
    """A Spark SQL string literal: single-quoted, backslash and single quote backslash-escaped
    (Spark's default parser reads backslash escapes in string literals)."""
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def props_sql(props: dict[str, str]) -> str:
    body = ", ".join(f"{sql_string(k)}={sql_string(v)}" for k, v in sorted(props.items()))
    return f"TBLPROPERTIES ({body})"


def current_table_columns(cfg: TableConfig, source_columns: list[tuple[str, str]]) -> list[tuple[str, str]]:
    cols = [(SHARD_COL, "string")] + list(source_columns)
    cols += [(OP_COL, "string"), (LSN_COL, "bigint"), (SEQ_COL, "bigint"), (COMMIT_TS_COL, "timestamp")]
    if cfg.deletes == "soft":
        cols += [(cfg.soft_delete_columns.flag, "boolean"), (cfg.soft_delete_columns.timestamp, "timestamp")]
    return cols


def changelog_columns(source_columns: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return (
        [(SHARD_COL, "string")]
        + list(source_columns)
        + [
            (OP_COL, "string"),
            (LSN_COL, "bigint"),
            (SEQ_COL, "bigint"),
            (COMMIT_TS_COL, "timestamp"),
            (LSN_EVENT_COL, "bigint"),
            (XID_COL, "bigint"),
            (UNAVAILABLE_COL, "array<string>"),
            (RUN_COL, "string"),
            (INGESTED_COL, "timestamp"),
        ]
    )


def create_table_sql(
    name: str,
    columns: list[tuple[str, str]],
    partition: str,
    props: dict[str, str],
    *,
    replace: bool = False,
    not_null: tuple[str, ...] = (),
) -> str:
    cols = ", ".join(f"{spark_ident(c)} {t}{' NOT NULL' if c in not_null else ''}" for c, t in columns)
    verb = "CREATE OR REPLACE TABLE" if replace else "CREATE TABLE IF NOT EXISTS"
    return f"{verb} {name} ({cols}) USING iceberg {partition} {props_sql(props)}"


def ensure_namespace(spark: SparkSession, lake: LakeSettings, namespace: str) -> None:
    spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {lake.catalog_name}.{namespace}")


def create_lake_tables(
    spark: SparkSession, lake: LakeSettings, cfg: TableConfig, source_columns: list[tuple[str, str]]
) -> None:
    """Current table and changelog, if they do not exist yet."""
    ensure_namespace(spark, lake, cfg.lake.namespace)
    cur = lake.qualified(cfg.current_table)
    spark.sql(
        create_table_sql(
            cur,
            current_table_columns(cfg, source_columns),
            _partition_sql(cfg),
            table_properties(cfg),
            not_null=(SHARD_COL, *cfg.primary_key),
        )
    )
    order = ", ".join(spark_ident(c) for c in [SHARD_COL, *cfg.sort_by_columns] if c)
    spark.sql(f"ALTER TABLE {cur} WRITE ORDERED BY {order}")
    spark.sql(f"ALTER TABLE {cur} SET IDENTIFIER FIELDS {', '.join(spark_ident(c) for c in cfg.lake_key)}")
    cl = lake.qualified(cfg.changelog_table)
    spark.sql(
        create_table_sql(
            cl,
            changelog_columns(source_columns),
            _partition_sql(cfg, time_partition=True),
            table_properties(cfg, changelog=True),
        )
    )


def source_columns_of(spark: SparkSession, table: str, cfg: TableConfig) -> list[tuple[str, str]]:
    """(name, Spark type) of the source columns in a lake table, in order."""
    meta = {
        SHARD_COL,
        OP_COL,
        LSN_COL,
        SEQ_COL,
        COMMIT_TS_COL,
        LSN_EVENT_COL,
        XID_COL,
        UNAVAILABLE_COL,
        RUN_COL,
        INGESTED_COL,
    }
    if cfg.deletes == "soft":
        meta |= {cfg.soft_delete_columns.flag, cfg.soft_delete_columns.timestamp}
    return [(f.name, f.dataType.simpleString()) for f in spark.table(table).schema.fields if f.name not in meta]


# --- meta tables ----------------------------------------------------------------------------------

META_TABLES: dict[str, tuple[list[tuple[str, str]], str]] = {
    "quarantine": (
        [
            ("table_name", "string"),
            ("shard", "string"),
            ("reason", "string"),
            ("raw", "string"),
            ("commit_lsn", "bigint"),
            ("seq", "bigint"),
            ("landing_run", "string"),
            ("landing_file", "string"),
            ("ingest_run", "string"),
            ("quarantined_at", "timestamp"),
        ],
        "PARTITIONED BY (table_name)",
    ),
    "ingest_runs": (
        [
            ("table_name", "string"),
            ("ingest_run", "string"),
            ("interval_end", "string"),
            ("landing_runs", "array<string>"),
            ("events_read", "bigint"),
            ("duplicates", "bigint"),
            ("already_applied", "bigint"),
            ("inserts", "bigint"),
            ("updates", "bigint"),
            ("deletes", "bigint"),
            ("stale_skipped", "bigint"),
            ("truncates", "bigint"),
            ("quarantined", "bigint"),
            ("changelog_rows", "bigint"),
            ("data_files_added", "bigint"),
            ("data_files_removed", "bigint"),
            ("delete_files_added", "bigint"),
            ("bytes_written", "bigint"),
            ("bytes_removed", "bigint"),
            ("changed_rows_bytes", "bigint"),
            ("write_amplification", "double"),
            ("lag_seconds_max", "double"),
            ("lag_seconds_min", "double"),
            ("freshness_seconds", "double"),
            ("watermark", "string"),
            ("write_mode", "string"),
            ("apply_seconds", "double"),
            ("total_seconds", "double"),
            ("started_at", "timestamp"),
            ("committed_at", "timestamp"),
            ("status", "string"),
            ("error", "string"),
        ],
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


def append_rows(spark: SparkSession, table: str, rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> None:
    if not rows:
        return
    schema = ", ".join(f"{spark_ident(c)} {t}" for c, t in columns)
    df = spark.createDataFrame([tuple(r.get(c) for c, _ in columns) for r in rows], schema)
    df.writeTo(table).append()


def meta_append(spark: SparkSession, lake: LakeSettings, name: str, rows: list[dict[str, Any]]) -> None:
    append_rows(spark, lake.qualified(lake.meta_table(name)), rows, META_TABLES[name][0])


def current_snapshot_id(spark: SparkSession, table: str) -> int | None:
    rows = spark.sql(
        f"SELECT snapshot_id FROM {table}.history WHERE is_current_ancestor ORDER BY made_current_at DESC LIMIT 1"
    ).collect()
    return rows[0][0] if rows else None


def snapshot_summary(spark: SparkSession, table: str) -> dict[str, str]:
    """Summary of the table's current snapshot."""
    sid = current_snapshot_id(spark, table)
    if sid is None:
        return {}
    rows = spark.sql(f"SELECT summary FROM {table}.snapshots WHERE snapshot_id = {int(sid)}").collect()
    return dict(rows[0]["summary"]) if rows else {}


def table_stats(spark: SparkSession, table: str) -> dict[str, Any]:
    """Files, delete files, snapshots and bytes of a table's current state."""
    f = spark.sql(
        f"SELECT count(*) n, coalesce(sum(file_size_in_bytes), 0) b, coalesce(sum(record_count), 0) r "
        f"FROM {table}.data_files"
    ).collect()[0]
    d = spark.sql(f"SELECT count(*) n FROM {table}.delete_files").collect()[0]
    s = spark.sql(f"SELECT count(*) n FROM {table}.snapshots").collect()[0]
    return {
        "data_files": int(f["n"]),
        "total_bytes": int(f["b"]),
        "records": int(f["r"]),
        "avg_file_bytes": float(f["b"]) / f["n"] if f["n"] else 0.0,
        "delete_files": int(d["n"]),
        "snapshots": int(s["n"]),
    }


def df_columns(df: DataFrame) -> list[str]:
    return list(df.columns)
