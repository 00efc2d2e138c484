"""Lake table DDL and plumbing (Spark driver): create the current table and the changelog,
their properties, add columns, conform a batch to a table's schema, table stats.

Column lists come from the metadata column registry (cdc_lakehouse.columns) around the source's columns.
The watermark is in cdc_lakehouse.watermark, commit properties and fencing in lake.commits.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, TypedDict

from cdc_lakehouse.columns import BY_NAME, CHANGELOG, COMMIT_TS_COL, CURRENT, METADATA_NAMES, SHARD_COL, ddl_of
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.identifiers import spark_ident
from cdc_lakehouse.lake.snapshots import catalog_table_exists, catalog_table_properties
from cdc_lakehouse.runtime.failpoints import crash_point
from cdc_lakehouse.runtime.phases import metadata_reads
from cdc_lakehouse.settings import LakeSettings

if TYPE_CHECKING:
    from collections.abc import Sequence

    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.types import StructType

log = logging.getLogger(__name__)


def conform_to(df: DataFrame, table_schema: StructType) -> DataFrame:
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
    return alter_table(spark, table, f"ADD COLUMN {spark_ident(name)} {typ}")


class SchemaChangeFailed(RuntimeError):
    """A schema change the table does not have after it failed; the message names the fix."""


_DDL = re.compile(r"^(?P<verb>ADD|ALTER|DROP) COLUMN (?P<name>`(?:[^`]|``)*`)(?: (?:TYPE )?(?P<type>.+))?$")


def schema_point(table: str) -> str:
    """The failpoint just before a schema change of `table` (tests hold a writer there)."""
    return f"schema_change:{table}"


def alter_table(spark: SparkSession, table: str, stmt: str) -> bool:
    """`ALTER TABLE table stmt` (ADD COLUMN, ALTER COLUMN .. TYPE, DROP COLUMN); True when this call
    made the change. Two runs of one batch apply the same change: the later one fails (the column
    exists already, or Iceberg asks for a metadata refresh) and finds the table as it wanted it,
    so it goes on (False). Any other failure is raised naming the table, the change and the fix
    (#51: a raw SparkException gave an operator nothing to act on)."""
    crash_point(schema_point(table))
    try:
        spark.sql(f"ALTER TABLE {table} {stmt}")
        return True
    except Exception as exc:  # noqa: BLE001 - pyspark's error classes differ between Connect and classic
        first = exc
    spark.sql(f"REFRESH TABLE {table}")
    if has_change(spark, table, stmt):
        log.info("%s: %s was made by another writer meanwhile; going on", table, stmt)
        return False
    try:  # a metadata refresh was all it needed
        spark.sql(f"ALTER TABLE {table} {stmt}")
        return True
    except Exception as exc:  # noqa: BLE001
        raise SchemaChangeFailed(
            f"{table}: schema change `{stmt}` failed ({str(first).splitlines()[0]}; again after a refresh: "
            f"{str(exc).splitlines()[0]}). If another writer (a second deployment, a manual job) is changing the "
            "table, stop it and rerun; otherwise apply the change by hand and rerun"
        ) from exc


def has_change(spark: SparkSession, table: str, stmt: str) -> bool:
    """Whether the table already is as `stmt` would leave it."""
    m = _DDL.match(stmt)
    if m is None:
        return False
    name = m["name"][1:-1].replace("``", "`")
    fields = {f.name: f.dataType.simpleString() for f in spark.table(table).schema.fields}
    if m["verb"] == "DROP":
        return name not in fields
    want = (m["type"] or "").strip().lower().replace(" ", "")
    return name in fields and fields[name].replace(" ", "") == want


def table_exists(spark: SparkSession, table: str) -> bool:
    """From pyiceberg where this process reads the catalog with it: Spark's tableExists answers
    from the session's cached copy, True for a table another session has dropped
    (tests/integration/test_snapshot_reads.py); the two cost about the same."""
    known = catalog_table_exists(table)
    return bool(spark.catalog.tableExists(table)) if known is None else known


# --- DDL -----------------------------------------------------------------------------------------


def partition_sql(cfg: TableConfig, time_partition: bool = False, also: Sequence[str] = ()) -> str:
    """The table's PARTITIONED BY clause (the changelog's: by day), `also` columns after its own."""
    if time_partition:
        return f"PARTITIONED BY (days({COMMIT_TS_COL}))"
    parts = []
    for p in [*cfg.lake.partition_by, *also]:
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


def table_property(spark: SparkSession, table: str, key: str) -> str | None:
    """One property of a table, None when it has none. From pyiceberg where this process reads the
    catalog with it: the current metadata, where SHOW TBLPROPERTIES is a request answered from the
    session's cached copy (32 ms per ingest on the local Spark Connect server)."""
    props = catalog_table_properties(table)
    if props is None:
        props = {r.key: r.value for r in spark.sql(f"SHOW TBLPROPERTIES {table}").collect()}
    return props.get(key)


def sql_string(value: object) -> str:
    """A Spark SQL string literal: single-quoted, backslash and single quote backslash-escaped
    (Spark's default parser reads backslash escapes in string literals)."""
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def props_sql(props: dict[str, str]) -> str:
    body = ", ".join(f"{sql_string(k)}={sql_string(v)}" for k, v in sorted(props.items()))
    return f"TBLPROPERTIES ({body})"


def current_table_columns(cfg: TableConfig, source_columns: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(name, Spark type) of the current table: metadata columns (cdc_lakehouse.columns) around the source's."""
    cols = ddl_of(CURRENT, leading=True) + list(source_columns) + ddl_of(CURRENT, leading=False)
    if cfg.deletes == "soft":
        cols += [(cfg.soft_delete_columns.flag, "boolean"), (cfg.soft_delete_columns.timestamp, "timestamp")]
    return cols


def null_metadata(name: str) -> Column:
    """A NULL of a metadata column's type (cdc_lakehouse.columns): for rows no event produced, such as
    snapshot, repair and backfill rows (`_cdc_xid`, `_cdc_unavailable`)."""
    from pyspark.sql import functions as F

    return F.lit(None).cast(BY_NAME[name].type)


def changelog_columns(source_columns: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(name, Spark type) of the changelog: metadata columns (cdc_lakehouse.columns) around the source's."""
    return ddl_of(CHANGELOG, leading=True) + list(source_columns) + ddl_of(CHANGELOG, leading=False)


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
            partition_sql(cfg),
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
            partition_sql(cfg, time_partition=True),
            table_properties(cfg, changelog=True),
        )
    )


def source_columns_of(spark: SparkSession, table: str, cfg: TableConfig) -> list[tuple[str, str]]:
    """(name, Spark type) of the source columns in a lake table, in order."""
    meta = set(METADATA_NAMES)
    if cfg.deletes == "soft":
        meta |= {cfg.soft_delete_columns.flag, cfg.soft_delete_columns.timestamp}
    return [(f.name, f.dataType.simpleString()) for f in spark.table(table).schema.fields if f.name not in meta]


class TableStats(TypedDict):
    """A table's files and snapshots (`table_stats`): what maintenance reports before and after."""

    data_files: int
    total_bytes: int
    records: int
    avg_file_bytes: float
    delete_files: int
    snapshots: int


def table_stats(spark: SparkSession, table: str) -> TableStats:
    """Files, delete files, snapshots and bytes of a table's current state (one metadata query)."""
    with metadata_reads(spark):
        f = spark.sql(
            f"SELECT count_if(content = 0) n, coalesce(sum(if(content = 0, file_size_in_bytes, 0)), 0) b, "
            f"coalesce(sum(if(content = 0, record_count, 0)), 0) r, count_if(content <> 0) d, "
            f"(SELECT count(*) FROM {table}.snapshots) s FROM {table}.files"
        ).collect()[0]
    return TableStats(
        data_files=int(f["n"]),
        total_bytes=int(f["b"]),
        records=int(f["r"]),
        avg_file_bytes=float(f["b"]) / f["n"] if f["n"] else 0.0,
        delete_files=int(f["d"]),
        snapshots=int(f["s"]),
    )
