"""End-to-end audit: the lake holds exactly the source's keys (and values), across runs.

Per shard, the source's rows are reduced to (key, row hash) and compared with the lake's
current table, which stands at the table's watermark. Both sides hash the same canonical
text of each value (epoch microseconds for timestamps, days for dates, trimmed decimals,
JSON for arrays), so value drift is caught, not only missing and extra keys.

  full      every (key, hash) from the source, compared in Spark (partitioned JDBC reads)
  checksum  count and hash-sum per key bucket computed inside PostgreSQL and in Spark; keys
            are fetched only for buckets that differ (data-diff's idea)

Keys changed at the source after the watermark are in flight, not mismatches. They are
known exactly: the pending landing runs, plus a peek at the capture slot (every change
not yet captured, decoded without consuming it). A key that still mismatches in
`consecutive_mismatches` audits in a row fails the audit; with `repair` on, it is re-read
from the source and merged through the ingest's LSN-guarded path at the watermark's LSN,
so any later change still wins.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from . import source as src
from .config import COMMIT_TS_COL, LSN_COL, OP_COL, SEQ_COL, SHARD_COL, TableConfig
from .events import cast_text, landing_spark_schema
from .identifiers import pg_ident, pg_qualified, spark_ident
from .lake import (
    INGESTED_COL,
    LSN_EVENT_COL,
    RUN_COL,
    UNAVAILABLE_COL,
    XID_COL,
    HadoopFS,
    SparkLanding,
    changelog_columns,
    conform_to,
    meta_append,
    read_watermark,
    source_columns_of,
    sql_with_commit_properties,
    table_exists,
    watermark_json,
    with_commit_retries,
)
from .settings import LakeSettings, SourceEndpoint, source_uri

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

SEP = "\x1f"
NULL = "\\N"


class AuditFailed(RuntimeError):
    pass


# --- canonical text of a value, in PostgreSQL and in Spark -------------------------------------
#
# Both sides must print every value the lake can hold identically, or the audit reports (and with
# repair on, "repairs" every hour) rows that are equal. Text renderings of floats and decimals
# differ between the two engines (scientific notation, 15 vs 17 digits, overflow of a fixed
# decimal), so floats compare by their IEEE bits and decimals in plain notation without trailing
# zeros. Infinite dates and timestamps (the lake cannot hold them) print as text instead of
# failing the query. Arrays compare element by element with the element's canonical form.


def pg_canonical(col: str, lake_type: str, pg_type: str = "") -> str:
    return f"coalesce({_pg_canon(pg_ident(col), lake_type, pg_type)}, E'\\\\N')"


def _pg_canon(q: str, lake_type: str, pg_type: str) -> str:
    t = lake_type.replace(" ", "")
    if t.startswith("array<"):
        elem = _pg_canon("u.e", t[6:-1], pg_type.removesuffix("[]"))
        return (
            f"CASE WHEN {q} IS NULL THEN NULL ELSE '[' || coalesce((SELECT string_agg(coalesce({elem}, "
            f"E'\\\\N'), ',' ORDER BY u.o) FROM unnest({q}) WITH ORDINALITY AS u(e, o)), '') || ']' END"
        )
    if t.startswith("decimal"):
        return f"trim_scale({q}::numeric)::text"
    if t == "double":
        return (
            f"CASE WHEN {q}::float8 = 'NaN'::float8 THEN 'NaN' "
            f"ELSE (('x' || encode(float8send({q}::float8), 'hex'))::bit(64)::bigint)::text END"
        )
    if t == "float":
        return (
            f"CASE WHEN {q}::float4 = 'NaN'::float4 THEN 'NaN' "
            f"ELSE (('x' || encode(float4send({q}::float4), 'hex'))::bit(32)::int)::text END"
        )
    if t == "date":
        return f"CASE WHEN isfinite({q}) THEN ({q} - date '1970-01-01')::text ELSE {q}::text END"
    if t in ("timestamp", "timestamp_ntz"):
        return f"CASE WHEN isfinite({q}) THEN (extract(epoch from {q}) * 1000000)::bigint::text ELSE {q}::text END"
    if t == "binary":
        return f"encode({q}, 'hex')"
    return src.pg_text(q, pg_type)


def spark_canonical(col: Column, lake_type: str) -> Column:
    from pyspark.sql import functions as F

    return F.coalesce(_spark_canon(col, lake_type), F.lit(NULL))


def _spark_canon(col: Column, lake_type: str) -> Column:
    from pyspark.sql import functions as F

    t = lake_type.replace(" ", "")
    if t.startswith("array<"):
        elem = t[6:-1]
        items = F.transform(col, lambda e: spark_canonical(e, elem))
        return F.when(col.isNotNull(), F.concat(F.lit("["), F.array_join(items, ","), F.lit("]")))
    m = re.match(r"^decimal\((\d+),(\d+)\)$", t)
    if m:
        # format_number prints the exact decimal in plain notation (cast to string may print 1E-18).
        e = F.regexp_replace(F.format_number(col, int(m.group(2))), ",", "")
        e = F.regexp_replace(F.regexp_replace(e, r"(\.[0-9]*[1-9])0+$", "$1"), r"\.0*$", "")
        return F.when(e == "-0", F.lit("0")).otherwise(e)
    if t in ("double", "float"):
        cls, fn = ("java.lang.Double", "doubleToLongBits") if t == "double" else ("java.lang.Float", "floatToIntBits")
        # reflect() cannot take NULL for a primitive argument: NULLs stay NULL before it.
        return (
            F.when(col.isNull(), F.lit(None).cast("string"))
            .when(F.isnan(col), F.lit("NaN"))
            .otherwise(F.reflect(F.lit(cls), F.lit(fn), col))
        )
    if t == "date":
        return F.datediff(col, F.lit("1970-01-01").cast("date")).cast("string")
    if t == "timestamp":
        return F.unix_micros(col).cast("string")
    if t == "timestamp_ntz":
        return F.unix_micros(col.cast("timestamp")).cast("string")
    if t == "binary":
        return F.lower(F.hex(col))
    return col.cast("string")


def pg_row_hash(columns: list[tuple[str, str]], pg_types: dict[str, str] | None = None) -> str:
    pg_types = pg_types or {}
    return "md5(concat_ws(chr(31), " + ", ".join(pg_canonical(c, t, pg_types.get(c, "")) for c, t in columns) + "))"


def spark_row_hash(columns: list[tuple[str, str]]) -> Column:
    from pyspark.sql import functions as F

    return F.md5(F.concat_ws(SEP, *[spark_canonical(F.col(c), t) for c, t in columns]))


def pg_bucket(key_cols: list[tuple[str, str]], buckets: int) -> str:
    k = "concat_ws(chr(31), " + ", ".join(pg_canonical(c, t) for c, t in key_cols) + ")"
    return f"((('x' || substr(md5({k}), 1, 7))::bit(28)::int) % {buckets})"


def spark_bucket(key_cols: list[tuple[str, str]], buckets: int) -> Column:
    from pyspark.sql import functions as F

    k = F.concat_ws(SEP, *[spark_canonical(F.col(c), t) for c, t in key_cols])
    return F.pmod(F.conv(F.substring(F.md5(k), 1, 7), 16, 10).cast("bigint"), F.lit(buckets)).cast("int")


def pg_hash_num(h: str) -> str:
    return f"(('x' || substr({h}, 1, 15))::bit(60)::bigint)"


def spark_hash_num(h: Column) -> Column:
    from pyspark.sql import functions as F

    return F.conv(F.substring(h, 1, 15), 16, 10).cast("decimal(38,0)")


# --- reading both sides -----------------------------------------------------------------------------


def _jdbc_props(ep: SourceEndpoint, fetch: int, snapshot: str | None = None) -> dict[str, str]:
    init = (
        "SET TimeZone='UTC'; SET DateStyle='ISO'; SET IntervalStyle='iso_8601'; SET extra_float_digits=3; "
        "SET bytea_output='hex'"
    )
    if snapshot:
        # Every range of every shard on this database reads the same exported snapshot.
        init = f"SET TRANSACTION ISOLATION LEVEL REPEATABLE READ; SET TRANSACTION SNAPSHOT '{snapshot}'; " + init
    props = {"user": ep.user, "driver": "org.postgresql.Driver", "fetchsize": str(fetch), "sessionInitStatement": init}
    if ep.password:
        props["password"] = ep.password
    return props


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

    from .bootstrap import _ranges

    keys = ", ".join(f"{pg_ident(c)}::text AS {pg_ident(c)}" for c, _ in key_cols)
    bucket = pg_bucket(key_cols, buckets)
    frames = []
    for pred in _ranges(ep, schema, cfg.source.table, max(2, cfg.bootstrap.partitions_per_shard)):
        conds = [p for p in (pred, f"{bucket} IN ({', '.join(map(str, only_buckets))})" if only_buckets else "") if p]
        where = f" WHERE {' AND '.join(conds)}" if conds else ""
        q = (
            f"(SELECT {keys}, {pg_row_hash(columns, pg_types)} AS _h, {bucket} AS _b "
            f"FROM {pg_qualified(schema, cfg.source.table)}{where}) q"
        )
        frames.append(spark.read.jdbc(ep.jdbc_url(), q, properties=_jdbc_props(ep, cfg.bootstrap.fetch_size, snapshot)))
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
    conn = psycopg2.connect(ep.dsn(), options=src.SESSION_OPTIONS, application_name="cdc_lakehouse audit")
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


# --- in flight ---------------------------------------------------------------------------------------


def inflight_from_landing(
    spark: SparkSession, lake: LakeSettings, cfg: TableConfig, wm: dict[str, Any], key_cols: list[tuple[str, str]]
) -> DataFrame | None:
    """Keys of captured events the table has not applied yet (commit LSN >= its watermark)."""
    from functools import reduce

    from pyspark.sql import functions as F

    from .ingest import plan_landing

    plan = plan_landing(SparkLanding(spark, lake.landing_uri), cfg, wm, None, check_files=False)
    files = [f for f in plan.files if HadoopFS(spark).exists(f)]
    if not files:
        return None
    shard_pairs = []
    for g, schema, shard in cfg.shards():
        shard_pairs += [F.lit(f"{g.endpoint_id}/{schema}"), F.lit(shard)]
    shard = F.create_map(*shard_pairs)[F.concat_ws("/", "source.endpoint", "source.schema")]
    floor = F.create_map(*[x for s, v in wm["shards"].items() for x in (F.lit(s), F.lit(int(v["lsn"])))])
    ev = (
        spark.read.schema(landing_spark_schema())
        .parquet(*files)
        .filter(F.col("source.table") == cfg.source.table)
        .withColumn(SHARD_COL, shard)
        .filter(F.col(SHARD_COL).isNotNull() & (F.col("source.commit_lsn") >= floor[F.col(SHARD_COL)]))
    )
    parts = []
    for image in ("after", "before"):
        parts.append(
            ev.filter(F.col(image).isNotNull()).select(
                SHARD_COL, *[cast_text(F.col(image)[c], t).alias(c) for c, t in key_cols]
            )
        )
    trunc = [r[0] for r in ev.filter(F.col("op") == "t").select(SHARD_COL).distinct().collect()]
    out = reduce(lambda a, b: a.unionByName(b), parts).withColumn("_all", F.lit(False))
    if trunc:
        out = out.unionByName(
            spark.createDataFrame([(s,) for s in trunc], f"{SHARD_COL} string").select(
                SHARD_COL, *[F.lit(None).cast(t).alias(c) for c, t in key_cols], F.lit(True).alias("_all")
            )
        )
    return out


def inflight_from_slot(
    spark: SparkSession,
    cfg: TableConfig,
    endpoint_id: str,
    ep: SourceEndpoint,
    shards: dict[str, str],
    key_cols: list[tuple[str, str]],
    chunk: int = 100_000,
    attempts: int = 5,
) -> DataFrame | None:
    """Keys changed after the last capture: peek the slot (decode without consuming)."""
    import psycopg2

    from .pgoutput import Change, Relation, Truncate, decode

    slot = src.slot_name(endpoint_id)
    key_names = [c for c, _ in key_cols]
    rows: list[tuple] = []
    frames = []
    schema_str = f"{SHARD_COL} string, " + ", ".join(f"{c} string" for c in key_names) + ", _all boolean"
    for attempt in range(attempts):
        conn = psycopg2.connect(ep.dsn(), options=src.SESSION_OPTIONS, application_name="cdc_lakehouse audit peek")
        try:
            rels: dict[int, Relation] = {}
            with conn.cursor(name="cdc_peek") as cur:
                cur.itersize = 10_000
                cur.execute(
                    "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, 'proto_version', '1', "
                    "'publication_names', %s)",
                    (slot, src.PUBLICATION),
                )
                for (data,) in cur:
                    m = decode(bytes(data))
                    if isinstance(m, Relation):
                        rels[m.oid] = m
                    elif isinstance(m, Change):
                        r = rels.get(m.relid)
                        if r is None or r.name != cfg.source.table or r.schema not in shards:
                            continue
                        idx = [r.names.index(k) for k in key_names if k in r.names]
                        for tup in (m.new, m.old):
                            if tup is not None and len(idx) == len(key_names):
                                rows.append((shards[r.schema], *[tup[i] for i in idx], False))
                    elif isinstance(m, Truncate):
                        for relid in m.relids:
                            r = rels.get(relid)
                            if r is not None and r.name == cfg.source.table and r.schema in shards:
                                rows.append((shards[r.schema], *[None] * len(key_names), True))
                    if len(rows) >= chunk:
                        frames.append(spark.createDataFrame(rows, schema_str))
                        rows = []
            break
        except psycopg2.errors.ObjectInUse:
            conn.rollback()
            time.sleep(2 * (attempt + 1))  # a capture holds the slot; it finishes in seconds
        finally:
            conn.close()
    else:
        # Without the slot's pending changes, keys changed since the last capture would count as
        # mismatches (and, with repair on, be "repaired" with a value the stream then rewrites).
        raise AuditFailed(
            f"{cfg.name}: cannot compute the keys in flight: capture slot {slot} stayed in use through {attempts} "
            "attempts (a long capture?). No verdict was recorded; the audit's retry or next run will try again"
        )
    if rows:
        frames.append(spark.createDataFrame(rows, schema_str))
    if not frames:
        return None
    from functools import reduce

    from pyspark.sql import functions as F

    df = reduce(lambda a, b: a.unionByName(b), frames)
    return df.select(SHARD_COL, *[cast_text(F.col(c), t).alias(c) for c, t in key_cols], "_all")


# --- the audit ------------------------------------------------------------------------------------------


def export_snapshots(endpoints: dict[str, tuple[SourceEndpoint, dict[str, str]]]) -> dict[str, tuple[Any, str]]:
    """endpoint id -> (open connection holding it, exported snapshot name)."""
    import psycopg2

    out = {}
    for endpoint_id, (ep, _) in endpoints.items():
        conn = psycopg2.connect(ep.dsn(), options=src.SESSION_OPTIONS, application_name="cdc_lakehouse audit snapshot")
        conn.set_session(isolation_level="REPEATABLE READ")
        with conn.cursor() as cur:
            cur.execute("SELECT pg_export_snapshot()")
            out[endpoint_id] = (conn, cur.fetchone()[0])
    return out


def _compare(src_df: DataFrame, lake_df: DataFrame, key: list[str]) -> DataFrame:
    from pyspark.sql import functions as F

    j = src_df.alias("s").join(lake_df.alias("l"), key, "full_outer")
    kind = (
        F.when(F.col("s._h").isNull(), F.lit("extra"))
        .when(F.col("l._h").isNull(), F.lit("missing"))
        .when(F.col("s._h") != F.col("l._h"), F.lit("different"))
    )
    return j.select(*key, kind.alias("kind")).filter(F.col("kind").isNotNull())


def audit_table(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    *,
    audit_run: str,
    mode: str | None = None,
    repair: bool | None = None,
    log=print,
) -> dict[str, Any]:
    from functools import reduce

    import psycopg2
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    t0 = time.time()
    now = datetime.now(UTC)
    cur = lake.qualified(cfg.current_table)
    if not table_exists(spark, cur):
        raise AuditFailed(f"{cfg.name}: {cur} does not exist; bootstrap it first")
    wm = read_watermark(spark, cur) or {"shards": {}}
    lake_cols = source_columns_of(spark, cur, cfg)
    types = dict(lake_cols)
    key_cols = [(k, types[k]) for k in cfg.primary_key]
    key = [SHARD_COL, *cfg.primary_key]
    lake_df = spark.table(cur)
    if cfg.deletes == "soft":
        lake_df = lake_df.filter(~F.col(cfg.soft_delete_columns.flag))
    mode = mode or cfg.audit.mode
    buckets = cfg.audit.buckets

    # The source side: columns each shard still has (a column dropped under keep_null is NULL in
    # the lake, so it is left out of both hashes) and, in checksum mode, its bucket sums, which
    # PostgreSQL computes while Spark hashes the lake below.
    shard_info: list[tuple[str, str, SourceEndpoint, list[tuple[str, str]]]] = []  # schema, shard, source, columns
    pg_types: dict[str, dict[str, str]] = {}  # shard -> column -> PostgreSQL type
    estimates: list[float] = []
    endpoints: dict[str, tuple[SourceEndpoint, dict[str, str]]] = {}
    shard_endpoint: dict[str, str] = {}
    for g, schema, shard in cfg.shards():
        ep = SourceEndpoint.from_uri(source_uri(g.conn_id), g.database)
        conn = psycopg2.connect(ep.dsn())
        try:
            with conn.cursor() as cu:
                info = src.describe_table(cu, schema, cfg.source.table)
                if info is not None:
                    # The planner's row estimate (-1: never analyzed) picks the mode in auto.
                    cu.execute(
                        "SELECT reltuples FROM pg_class WHERE oid = %s::regclass",
                        (pg_qualified(schema, cfg.source.table),),
                    )
                    estimates.append(float(cu.fetchone()[0]))
        finally:
            conn.close()
        if info is None:
            raise AuditFailed(f"{cfg.name}: source table {schema}.{cfg.source.table} is missing on {ep.label}")
        shard_info.append((schema, shard, ep, [(c, t) for c, t in lake_cols if c in info.column_names]))
        pg_types[shard] = {c.name: c.pg_type for c in info.columns}
        endpoints.setdefault(g.endpoint_id, (ep, {}))[1][schema] = shard
        shard_endpoint[shard] = g.endpoint_id
    # One lake hash for every shard: over the columns all shards have. While a schema change is
    # rolling out shard by shard, the new column is compared once every shard has it.
    cols = [c for c in lake_cols if all(c in shard_cols for *_, shard_cols in shard_info)]
    timings: dict[str, float] = {"describe": time.time() - t0}

    def count_lake() -> dict[str, int]:  # reads the shard column only
        return {r[0]: r[1] for r in lake_df.groupBy(SHARD_COL).count().collect()}

    lake_counts: dict[str, int] = {}
    if mode == "auto":
        if min(estimates) < 0:  # some shard was never analyzed: count the lake instead
            lake_counts = count_lake()
        total = sum(lake_counts.values()) if lake_counts else sum(estimates)
        mode = "checksum" if total >= cfg.audit.checksum_min_rows else "full"
    # One snapshot per source database, taken before the keys in flight are computed: every
    # change the snapshot sees but the lake does not is then in the landing or still in the slot.
    snapshots = export_snapshots(endpoints)
    snap = {shard: snapshots[e][1] for shard, e in shard_endpoint.items()}
    pool = ThreadPoolExecutor(max_workers=max(1, cfg.bootstrap.max_connections_per_host))
    pending_sums = (
        {
            shard: pool.submit(
                source_bucket_sums, cfg, schema, ep, key_cols, cols, buckets, pg_types[shard], snap[shard]
            )
            for schema, shard, ep, _ in shard_info
        }
        if mode == "checksum"
        else {}
    )

    # The lake side: (shard, key, row hash, bucket). Not cached: each use reads only what it needs
    # (one shard's files, or the key columns), which is cheaper than holding a hash per key.
    lake_h = lake_df.select(
        SHARD_COL,
        *[c for c, _ in key_cols],
        spark_row_hash(cols).alias("_h"),
        spark_bucket(key_cols, buckets).alias("_b"),
    )
    lake_sums: dict[str, dict[int, tuple[int, str]]] = {}
    t = time.time()
    if mode == "checksum":
        for r in (
            lake_h.groupBy(SHARD_COL, "_b")
            .agg(F.count(F.lit(1)).alias("n"), F.sum(spark_hash_num(F.col("_h"))).alias("s"))
            .collect()
        ):
            lake_sums.setdefault(r[SHARD_COL], {})[r["_b"]] = (r["n"], str(r["s"]))
        lake_counts = {shard: sum(n for n, _ in b.values()) for shard, b in lake_sums.items()}
        timings["lake_bucket_sums"] = time.time() - t
    elif not lake_counts:
        lake_counts = count_lake()
        timings["lake_count"] = time.time() - t

    t = time.time()
    mismatches = []
    per_shard: dict[str, dict[str, Any]] = {}
    inflight_frames = []
    for schema, shard, ep, _ in shard_info:
        st = {"mode": mode, "buckets_compared": 0, "buckets_differing": 0}
        lh = lake_h.filter(F.col(SHARD_COL) == shard)
        if mode == "full":
            s = source_hashes(
                spark, cfg, shard, schema, ep, key_cols, cols, buckets, pg_types=pg_types[shard], snapshot=snap[shard]
            )
            st["source_rows"] = None
            mismatches.append(_compare(s.drop("_b"), lh.drop("_b"), key))
        else:
            src_sums = pending_sums[shard].result()
            shard_sums = lake_sums.get(shard, {})
            differing = sorted(b for b in set(src_sums) | set(shard_sums) if src_sums.get(b) != shard_sums.get(b))
            st.update(
                source_rows=sum(n for n, _ in src_sums.values()),
                buckets_compared=buckets,
                buckets_differing=len(differing),
            )
            if differing:
                only = differing if len(differing) < buckets // 2 else None
                s = source_hashes(
                    spark, cfg, shard, schema, ep, key_cols, cols, buckets, only, pg_types[shard], snap[shard]
                )
                lsub = lh.filter(F.col("_b").isin(differing)) if only else lh
                mismatches.append(_compare(s.drop("_b"), lsub.drop("_b"), key))
        per_shard[shard] = st
    pool.shutdown(cancel_futures=True)
    timings["source_sums_wait"] = time.time() - t
    t = time.time()
    # In flight: pending landing events and changes the slot has not delivered yet.
    lf = inflight_from_landing(spark, lake, cfg, wm, key_cols)
    if lf is not None:
        inflight_frames.append(lf)
    for endpoint_id, (ep, shards) in endpoints.items():
        pf = inflight_from_slot(spark, cfg, endpoint_id, ep, shards, key_cols)
        if pf is not None:
            inflight_frames.append(pf)
    diff = reduce(lambda a, b: a.unionByName(b), mismatches) if mismatches else None
    if diff is not None:
        diff = diff.persist(StorageLevel.MEMORY_AND_DISK)
        if inflight_frames:
            infl = reduce(lambda a, b: a.unionByName(b), inflight_frames)
            whole = [r[0] for r in infl.filter("_all").select(SHARD_COL).distinct().collect()]
            keys_if = infl.filter(~F.col("_all")).select(*key).distinct()
            flagged = diff.join(keys_if.withColumn("_if", F.lit(True)), key, "left").withColumn(
                "_if", F.coalesce(F.col("_if"), F.col(SHARD_COL).isin(whole) if whole else F.lit(False))
            )
        else:
            flagged = diff.withColumn("_if", F.lit(False))
        flagged = flagged.persist(StorageLevel.MEMORY_AND_DISK)
        counts = flagged.groupBy(SHARD_COL, "kind", "_if").count().collect()
    else:
        flagged, counts = None, []
    for conn, _ in snapshots.values():  # the source side is read: release the snapshots
        conn.close()
    quarantined = quarantine_reasons(spark, lake, cfg, flagged, lake_cols) if counts else {}
    timings["in_flight_and_compare"] = time.time() - t
    t = time.time()
    for r in counts:
        st = per_shard[r[SHARD_COL]]
        name = "in_flight" if r["_if"] else r["kind"]
        st[name] = st.get(name, 0) + r["count"]

    # Persistence across audits: keys (not in flight) seen again extend their streak.
    persistent, streak_df = _track(spark, lake, cfg, flagged, key, now, audit_run)
    do_repair = cfg.audit.repair if repair is None else repair
    repaired = 0
    if do_repair and persistent:
        repaired = repair_keys(spark, lake, cfg, streak_df, key_cols, lake_cols, wm, audit_run, log)
    timings["track_and_repair"] = time.time() - t
    t = time.time()
    quality = quality_checks(
        spark,
        lake,
        cfg,
        lake_df.select(SHARD_COL, *cfg.primary_key, LSN_COL),
        wm,
        per_shard,
        lake_counts,
        audit_run,
        now,
        log,
    )
    timings["quality"] = time.time() - t
    samples = {}
    if flagged is not None and persistent:
        for r in streak_df.limit(cfg.audit.sample_keys * 4).collect():
            samples.setdefault(r[SHARD_COL], []).append({"kind": r["kind"], **{k: r[k] for k in cfg.primary_key}})
    rows = []
    for shard, st in per_shard.items():
        p = persistent.get(shard, 0)
        verdict = (
            "fail" if p else ("mismatch_pending" if any(st.get(k) for k in ("missing", "extra", "different")) else "ok")
        )
        rows.append(
            {
                "table_name": cfg.name,
                "audit_run": audit_run,
                "shard": shard,
                "mode": st["mode"],
                "source_rows": st.get("source_rows"),
                "lake_rows": lake_counts.get(shard, 0),
                "missing": st.get("missing", 0),
                "extra": st.get("extra", 0),
                "different": st.get("different", 0),
                "in_flight": st.get("in_flight", 0),
                "persistent": p,
                "buckets_compared": st["buckets_compared"],
                "buckets_differing": st["buckets_differing"],
                "sample_keys": json.dumps(samples.get(shard, [])[: cfg.audit.sample_keys], default=str),
                "watermark_lsn": (wm["shards"].get(shard) or {}).get("lsn"),
                "repaired": repaired if p else 0,
                "verdict": verdict,
                "seconds": time.time() - t0,
                "audited_at": now,
            }
        )
    meta_append(spark, lake, "audit_results", rows)
    failed_quality = [q for q in quality if not q["success"]]
    verdict = "fail" if (persistent and not repaired) or failed_quality else "ok"
    lines = []
    for r in rows:
        lines.append(
            f"  {r['shard']}: source {r['source_rows'] if r['source_rows'] is not None else '-'} lake "
            f"{r['lake_rows']} missing {r['missing']} extra {r['extra']} different {r['different']} "
            f"in flight {r['in_flight']} persistent {r['persistent']} -> {r['verdict']}"
            + (f" sample {r['sample_keys']}" if r["persistent"] else "")
        )
    for q in failed_quality:
        lines.append(f"  quality: {q['expectation']} failed (observed {q['observed']})")
    for reason, n in quarantined.items():
        lines.append(f"  {n} mismatched key(s) have events in {lake.meta_table('quarantine')}: {reason}")
    msg = (
        f"audit {cfg.name} ({mode}): {'FAIL' if verdict == 'fail' else 'ok'}"
        + (f", repaired {repaired} key(s) — the next audit confirms" if repaired else "")
        + "\n"
        + "\n".join(lines)
    )
    log(msg)
    return {
        "verdict": verdict,
        "message": msg,
        "mode": mode,
        "shards": per_shard,
        "persistent": persistent,
        "repaired": repaired,
        "quality": quality,
        "quarantine_reasons": quarantined,
        "seconds": time.time() - t0,
        "timings": {k: round(v, 1) for k, v in timings.items()},
    }


def quarantine_reasons(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    flagged: DataFrame | None,
    lake_cols: list[tuple[str, str]],
) -> dict[str, int]:
    """Why mismatched keys differ, when the ingest quarantined their newest event (a value the
    lake cannot hold, a malformed event): reason -> number of keys."""
    from .ingest import open_quarantine_keys

    if flagged is None:
        return {}
    key = [SHARD_COL, *cfg.primary_key]
    q = open_quarantine_keys(spark, lake, cfg, lake_cols)
    rows = flagged.filter("NOT _if").join(q, key).groupBy("_q_reason").count().collect()
    return {r["_q_reason"]: int(r["count"]) for r in rows}


def _track(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    flagged: DataFrame | None,
    key: list[str],
    now: datetime,
    audit_run: str,
) -> tuple[dict[str, int], DataFrame | None]:
    """Update the mismatch streaks; returns shards -> keys at or over the limit, and those keys.

    A retry of the same audit run (the Airflow task's retry) does not extend a streak: only
    distinct audits count as consecutive."""
    from pyspark.sql import functions as F

    table = lake.qualified(lake.meta_table("audit_mismatches"))
    prev = spark.table(table).filter((F.col("table_name") == cfg.name) & ~F.col("resolved"))
    kj = F.to_json(F.struct(*[F.col(k) for k in cfg.primary_key]))
    if flagged is not None:
        cur = flagged.filter(~F.col("_if")).select(
            F.lit(cfg.name).alias("table_name"),
            F.col(SHARD_COL).alias("shard"),
            kj.alias("key_json"),
            "kind",
            *[F.col(k) for k in cfg.primary_key],
        )
    else:
        cur = None
    limit = cfg.audit.consecutive_mismatches
    if cur is None:
        merged = None
    else:
        p = prev.select("shard", "key_json", "kind", "first_seen", "times_seen", "last_audit_run")
        again = F.coalesce(F.col("last_audit_run") == F.lit(audit_run), F.lit(False))
        merged = cur.join(p, ["shard", "key_json", "kind"], "left").select(
            "table_name",
            "shard",
            "key_json",
            "kind",
            *cfg.primary_key,
            F.coalesce("first_seen", F.lit(now)).alias("first_seen"),
            F.lit(now).alias("last_seen"),
            (F.coalesce("times_seen", F.lit(0)) + F.when(again, 0).otherwise(1)).cast("int").alias("times_seen"),
            F.lit(audit_run).alias("last_audit_run"),
        )
        # Materialized now: evaluated lazily after the rewrite below it would count itself twice.
        merged = merged.localCheckpoint(eager=True)
    # Replace this table's streaks with the new set (keys absent now are resolved and dropped).
    spark.sql(f"DELETE FROM {table} WHERE table_name = '{cfg.name}'")
    if merged is not None:
        merged.select(
            "table_name",
            "shard",
            "key_json",
            "kind",
            "first_seen",
            "last_seen",
            "times_seen",
            F.lit(False).alias("resolved"),
            "last_audit_run",
        ).writeTo(table).append()
        over = merged.filter(F.col("times_seen") >= limit)
        counts = {r["shard"]: r["count"] for r in over.groupBy("shard").count().collect()}
        return counts, over.withColumnRenamed("shard", SHARD_COL)
    return {}, None


def repair_keys(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    keys_df: DataFrame,
    key_cols,
    lake_cols,
    wm: dict[str, Any],
    audit_run: str,
    log=print,
) -> int:
    """Re-read the mismatched keys from the source and merge them at the watermark's LSN (seq 0):
    newer than the lake's row, older than any event still to come."""
    import psycopg2
    from pyspark.sql import functions as F

    from .ingest import _merge_sql

    keys = keys_df.select(SHARD_COL, *cfg.primary_key).distinct().limit(cfg.audit.max_repair_keys).collect()
    by_shard: dict[str, list[tuple]] = {}
    for r in keys:
        by_shard.setdefault(r[SHARD_COL], []).append(tuple(r[k] for k in cfg.primary_key))
    found_rows: list[tuple] = []
    names = [c for c, _ in lake_cols]
    for g, schema, shard in cfg.shards():
        if shard not in by_shard:
            continue
        ep = SourceEndpoint.from_uri(source_uri(g.conn_id), g.database)
        kcols = ", ".join(pg_ident(k) for k in cfg.primary_key)
        conn = psycopg2.connect(ep.dsn(), options=src.SESSION_OPTIONS)
        try:
            with conn.cursor() as cur:
                info = src.describe_table(cur, schema, cfg.source.table)
                pg_types = {c.name: c.pg_type for c in info.columns} if info else {}
                # A column the lake keeps after the source dropped it (keep_null) reads as NULL.
                sel = ", ".join(
                    src.text_select(c, pg_types[c], t) if c in pg_types else "NULL::text" for c, t in lake_cols
                )
                # Keys travel as JSON records and are cast to the source's own types (index-friendly).
                rec = ", ".join(f"{pg_ident(k)} text" for k in cfg.primary_key)
                casts = ", ".join(f"v.{pg_ident(k)}::{pg_types.get(k, 'text')}" for k in cfg.primary_key)
                sql = (
                    f"SELECT {sel} FROM {pg_qualified(schema, cfg.source.table)} WHERE ({kcols}) IN "
                    f"(SELECT {casts} FROM jsonb_to_recordset(%s::jsonb) AS v({rec}))"
                )
                ks = by_shard[shard]
                for i in range(0, len(ks), 1000):
                    chunk = [dict(zip(cfg.primary_key, (str(v) for v in k))) for k in ks[i : i + 1000]]
                    cur.execute(sql, (json.dumps(chunk),))
                    for row in cur.fetchall():
                        found_rows.append((shard, *row))
        finally:
            conn.close()
    schema = f"{SHARD_COL} string, " + ", ".join(f"{spark_ident(c)} string" for c in names)
    found = spark.createDataFrame(found_rows, schema) if found_rows else spark.createDataFrame([], schema)
    typed = found.select(SHARD_COL, *[cast_text(F.col(c), t).alias(c) for c, t in lake_cols])
    lsn = F.create_map(*[x for s, v in wm["shards"].items() for x in (F.lit(s), F.lit(int(v["lsn"])))])
    upserts = typed.withColumn(OP_COL, F.lit("u"))
    present = typed.select(SHARD_COL, *cfg.primary_key)
    gone = (
        keys_df.select(SHARD_COL, *cfg.primary_key).distinct().join(present, [SHARD_COL, *cfg.primary_key], "left_anti")
    )
    for c, t in lake_cols:
        if c not in cfg.primary_key:
            gone = gone.withColumn(c, F.lit(None).cast(t))
    batch = upserts.unionByName(gone.withColumn(OP_COL, F.lit("d")).select(*upserts.columns))
    batch = (
        batch.withColumn(LSN_COL, lsn[F.col(SHARD_COL)])
        .withColumn(SEQ_COL, F.lit(0).cast("bigint"))
        .withColumn(COMMIT_TS_COL, F.current_timestamp())
    ).persist()
    n = batch.count()
    if n == 0:
        return 0
    cl = lake.qualified(cfg.changelog_table)
    cl_rows = (
        batch.withColumn(OP_COL, F.when(F.col(OP_COL) == "u", F.lit("r")).otherwise(F.col(OP_COL)))
        .withColumn(LSN_EVENT_COL, F.col(LSN_COL))
        .withColumn(XID_COL, F.lit(None).cast("bigint"))
        .withColumn(UNAVAILABLE_COL, F.lit(None).cast("array<string>"))
        .withColumn(RUN_COL, F.lit(f"repair-{audit_run}"))
        .withColumn(INGESTED_COL, F.current_timestamp())
        .select(*[c for c, _ in changelog_columns(lake_cols)])
    )
    cl_rows = conform_to(cl_rows, spark.table(cl).schema)
    cwm = read_watermark(spark, cl)
    with_commit_retries(
        lambda: cl_rows.writeTo(cl).option("snapshot-property.cdc.watermark", watermark_json(cwm)).append(),
        what=f"{cfg.name} repair changelog",
    )
    view = f"cdc_repair_{cfg.name}"
    batch.select(SHARD_COL, *names, OP_COL, LSN_COL, SEQ_COL, COMMIT_TS_COL).createOrReplaceTempView(view)
    cur_t = lake.qualified(cfg.current_table)
    sql = _merge_sql(cfg, cur_t, view, [SHARD_COL, *names, OP_COL, LSN_COL, SEQ_COL, COMMIT_TS_COL], [])
    with_commit_retries(
        lambda: sql_with_commit_properties(spark, sql, {"cdc.watermark": watermark_json(wm), "cdc.repair": audit_run}),
        what=f"{cfg.name} repair merge",
    )
    log(f"audit {cfg.name}: repaired {n} key(s) from the source ({batch.filter(F.col(OP_COL) == 'd').count()} deleted)")
    batch.unpersist()
    return n


# --- Great Expectations ---------------------------------------------------------------------------------


def quality_checks(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    lake_df: DataFrame,
    wm: dict[str, Any],
    per_shard: dict[str, dict[str, Any]],
    lake_counts: dict[str, int],
    audit_run: str,
    now: datetime,
    log=print,
) -> list[dict[str, Any]]:
    """Great Expectations 1.x on the lake table; results go to cdc_meta.quality_results and a JSON
    report next to the warehouse, whose path the task log prints."""
    import great_expectations as gx
    import great_expectations.expectations as gxe

    ctx = gx.get_context(mode="ephemeral")
    ds = ctx.data_sources.add_spark(f"lake_{cfg.name}")
    asset = ds.add_dataframe_asset(cfg.name)
    bd = asset.add_batch_definition_whole_dataframe("current")
    suite = gx.ExpectationSuite(name=f"cdc_{cfg.name}")
    suite.add_expectation(gxe.ExpectCompoundColumnsToBeUnique(column_list=[SHARD_COL, *cfg.primary_key]))
    for k in [*cfg.primary_key, LSN_COL]:
        suite.add_expectation(gxe.ExpectColumnValuesToNotBeNull(column=k))
    source_total = sum(st["source_rows"] for st in per_shard.values() if st.get("source_rows") is not None) or None
    if source_total is None:
        source_total = sum(
            lake_counts.get(s, 0) + st.get("missing", 0) - st.get("extra", 0) for s, st in per_shard.items()
        )
    in_flight = sum(st.get("in_flight", 0) for st in per_shard.values())
    slack = int(source_total * cfg.audit.row_count_tolerance) + in_flight
    suite.add_expectation(
        gxe.ExpectTableRowCountToBeBetween(min_value=max(0, source_total - slack), max_value=source_total + slack)
    )
    # GX makes a dozen passes over the frame: cache it (key columns and LSN only, small), and
    # BASIC results skip the queries that list sample rows of passing expectations.
    lake_df = lake_df.persist()
    try:
        results = [
            _gx_rows(bd.get_batch(batch_parameters={"dataframe": lake_df}).validate(suite, result_format="BASIC"))
        ]
    finally:
        lake_df.unpersist()
    # Freshness from the heartbeats: how old is the newest source commit the lake is known to hold.
    ts = [datetime.fromisoformat(v["ts"]) for v in wm.get("shards", {}).values() if v.get("ts")]
    fresh_min = (now - min(ts)).total_seconds() / 60 if ts else None
    fdf = spark.createDataFrame([(fresh_min,)], "freshness_minutes double")
    fasset = ds.add_dataframe_asset(f"{cfg.name}_freshness")
    fsuite = gx.ExpectationSuite(name=f"cdc_{cfg.name}_freshness")
    fsuite.add_expectation(
        gxe.ExpectColumnValuesToBeBetween(
            column="freshness_minutes", min_value=0, max_value=cfg.audit.freshness_sla_minutes
        )
    )
    fsuite.add_expectation(gxe.ExpectColumnValuesToNotBeNull(column="freshness_minutes"))
    fres = (
        fasset.add_batch_definition_whole_dataframe("f").get_batch(batch_parameters={"dataframe": fdf}).validate(fsuite)
    )
    results.append(_gx_rows(fres))
    flat = [r for rs in results for r in rs]
    rows = [
        {
            "table_name": cfg.name,
            "audit_run": audit_run,
            "expectation": r["expectation"],
            "success": r["success"],
            "observed": r["observed"],
            "details": r["details"],
            "checked_at": now,
        }
        for r in flat
    ]
    meta_append(spark, lake, "quality_results", rows)
    report = f"{lake.warehouse.rstrip('/')}/_quality/{cfg.name}/{audit_run.replace(':', '_').replace('+', '_')}.json"
    try:
        _write_text(spark, report, json.dumps(flat, indent=2, default=str))
        log(f"audit {cfg.name}: Great Expectations report {report}")
    except Exception as exc:  # noqa: BLE001
        log(f"audit {cfg.name}: could not store the Great Expectations report: {exc}")
    return flat


def _gx_rows(result) -> list[dict[str, Any]]:
    out = []
    for r in result.results:
        cfg = r.expectation_config
        observed = r.result.get("observed_value", r.result.get("unexpected_count"))
        out.append(
            {
                "expectation": f"{cfg.type}({json.dumps({k: v for k, v in cfg.kwargs.items() if k != 'batch_id'}, default=str)})",
                "success": bool(r.success),
                "observed": json.dumps(observed, default=str),
                "details": json.dumps(
                    {
                        k: v
                        for k, v in r.result.items()
                        if k in ("unexpected_count", "unexpected_percent", "partial_unexpected_list")
                    },
                    default=str,
                ),
            }
        )
    return out


def _write_text(spark: SparkSession, uri: str, text: str) -> None:
    fs = HadoopFS(spark)
    path, hfs = fs._fs(uri)
    out = hfs.create(path, True)
    try:
        out.write(bytearray(text.encode("utf-8")))
    finally:
        out.close()
