"""Both sides of the comparison: the source's (key, row hash) or bucket sums, read under one
exported snapshot per database, and the join that names each mismatch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cdc_lakehouse.audit.hashing import pg_bucket, pg_hash_num, pg_row_hash
from cdc_lakehouse.columns import SHARD_COL
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.identifiers import pg_ident, pg_qualified
from cdc_lakehouse.lake.casts import cast_text
from cdc_lakehouse.settings import SourceEndpoint
from cdc_lakehouse.source.session import SESSION_OPTIONS, jdbc_properties

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


def source_hashes(
    spark: SparkSession,
    cfg: TableConfig,
    shard: str,
    schema: str,
    ep: SourceEndpoint,
    key_cols: list[tuple[str, str]],
    columns: list[tuple[str, str]],
    buckets: int,
    only_buckets: list[int] | None = None,
    pg_types: dict[str, str] | None = None,
    snapshot: str | None = None,
) -> DataFrame:
    """(shard, key..., _h, _b) of one source shard, read in ctid ranges by Spark (bounded memory)."""
    from functools import reduce

    from pyspark.sql import functions as F

    from cdc_lakehouse.bootstrap.snapshot import ctid_ranges

    keys = ", ".join(f"{pg_ident(c)}::text AS {pg_ident(c)}" for c, _ in key_cols)
    bucket = pg_bucket(key_cols, buckets)
    frames = []
    for pred in ctid_ranges(ep, schema, cfg.source.table, max(2, cfg.bootstrap.partitions_per_shard)):
        conds = [p for p in (pred, f"{bucket} IN ({', '.join(map(str, only_buckets))})" if only_buckets else "") if p]
        where = f" WHERE {' AND '.join(conds)}" if conds else ""
        q = (
            f"(SELECT {keys}, {pg_row_hash(columns, pg_types)} AS _h, {bucket} AS _b "
            f"FROM {pg_qualified(schema, cfg.source.table)}{where}) q"
        )
        frames.append(
            spark.read.jdbc(ep.jdbc_url(), q, properties=jdbc_properties(ep, cfg.bootstrap.fetch_size, snapshot))
        )
    df = reduce(lambda a, b: a.unionByName(b), frames).coalesce(cfg.bootstrap.max_connections_per_host)
    return df.select(F.lit(shard).alias(SHARD_COL), *[cast_text(F.col(c), t).alias(c) for c, t in key_cols], "_h", "_b")


def source_bucket_sums(
    cfg: TableConfig,
    schema: str,
    ep: SourceEndpoint,
    key_cols,
    columns,
    buckets: int,
    pg_types: dict[str, str] | None = None,
    snapshot: str | None = None,
):
    """Per-bucket count and hash sum, computed inside PostgreSQL: only `buckets` rows travel."""
    import psycopg2

    h = pg_row_hash(columns, pg_types)
    sql = (
        f"SELECT b, count(*), sum({pg_hash_num('h')})::text FROM (SELECT {pg_bucket(key_cols, buckets)} AS b, "
        f"{h} AS h FROM {pg_qualified(schema, cfg.source.table)}) q GROUP BY b"
    )
    conn = psycopg2.connect(ep.dsn(), options=SESSION_OPTIONS, application_name="cdc_lakehouse audit")
    try:
        with conn.cursor() as cur:
            if snapshot:
                cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                cur.execute("SET TRANSACTION SNAPSHOT %s", (snapshot,))
            # The planner cannot know there are only `buckets` groups and sorts every row for a
            # GroupAggregate; a HashAggregate is 2.5x faster (18.7 s -> 7.3 s for 2.5M rows).
            cur.execute("SET LOCAL enable_sort = off")
            cur.execute(sql)
            return {int(b): (int(n), s) for b, n, s in cur.fetchall()}
    finally:
        conn.close()


def export_snapshots(endpoints: dict[str, tuple[SourceEndpoint, dict[str, str]]]) -> dict[str, tuple[Any, str]]:
    """endpoint id -> (open connection holding it, exported snapshot name). On a failure the ones
    already open are closed."""
    import psycopg2

    out: dict[str, tuple[Any, str]] = {}
    try:
        for endpoint_id, (ep, _) in endpoints.items():
            conn = psycopg2.connect(ep.dsn(), options=SESSION_OPTIONS, application_name="cdc_lakehouse audit snapshot")
            out[endpoint_id] = (conn, "")
            conn.set_session(isolation_level="REPEATABLE READ")
            with conn.cursor() as cur:
                cur.execute("SELECT pg_export_snapshot()")
                row = cur.fetchone()
                assert row is not None  # a SELECT without FROM returns one row
                out[endpoint_id] = (conn, row[0])
    except BaseException:
        release_snapshots(out)
        raise
    return out


def release_snapshots(snapshots: dict[str, tuple[Any, str]]) -> None:
    """Close the snapshot connections (closing twice is harmless)."""
    for conn, _ in snapshots.values():
        conn.close()


def compare(src_df: DataFrame, lake_df: DataFrame, key: list[str]) -> DataFrame:
    """(key..., kind) of every key whose hash differs: missing from the lake, extra in it, or different."""
    from pyspark.sql import functions as F

    j = src_df.alias("s").join(lake_df.alias("l"), key, "full_outer")
    kind = (
        F.when(F.col("s._h").isNull(), F.lit("extra"))
        .when(F.col("l._h").isNull(), F.lit("missing"))
        .when(F.col("s._h") != F.col("l._h"), F.lit("different"))
    )
    return j.select(*key, kind.alias("kind")).filter(F.col("kind").isNotNull())
