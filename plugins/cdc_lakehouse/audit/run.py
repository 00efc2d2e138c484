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
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from cdc_lakehouse.config import LSN_COL, SHARD_COL, TableConfig
from cdc_lakehouse.identifiers import pg_qualified
from cdc_lakehouse.lake.meta import meta_append
from cdc_lakehouse.lake.tables import source_columns_of, table_exists
from cdc_lakehouse.lake.watermark import read_watermark
from cdc_lakehouse.settings import LakeSettings, SourceEndpoint, source_uri
from cdc_lakehouse.source.catalog import describe_table

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
from cdc_lakehouse.audit.compare import compare, export_snapshots, source_bucket_sums, source_hashes
from cdc_lakehouse.audit.errors import AuditFailed
from cdc_lakehouse.audit.hashing import spark_bucket, spark_hash_num, spark_row_hash
from cdc_lakehouse.audit.inflight import inflight_from_landing, inflight_from_slot
from cdc_lakehouse.audit.quality import quality_checks
from cdc_lakehouse.audit.repair import repair_keys


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
                info = describe_table(cu, schema, cfg.source.table)
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
            mismatches.append(compare(s.drop("_b"), lh.drop("_b"), key))
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
                mismatches.append(compare(s.drop("_b"), lsub.drop("_b"), key))
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
    from cdc_lakehouse.ingest.quarantine import open_quarantine_keys

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
