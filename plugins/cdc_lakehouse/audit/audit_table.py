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
import logging
import time  # noqa: F401 - tests patch audit.audit_table.time.sleep to skip the slot peek's back-off
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import cached_property, reduce
from typing import TYPE_CHECKING, Any, Literal

from cdc_lakehouse.audit.compare import (
    compare,
    export_snapshots,
    release_snapshots,
    source_bucket_sums,
    source_hashes,
)
from cdc_lakehouse.audit.errors import AuditFailed
from cdc_lakehouse.audit.hashing import spark_bucket, spark_hash_num, spark_row_hash
from cdc_lakehouse.audit.inflight import inflight_from_landing, inflight_from_slot
from cdc_lakehouse.audit.quality import preload_great_expectations, quality_checks
from cdc_lakehouse.audit.repair import repair_keys
from cdc_lakehouse.audit.result import AuditResult, QualityCheck, ShardStats
from cdc_lakehouse.columns import LSN_COL, SHARD_COL
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.identifiers import pg_qualified
from cdc_lakehouse.lake.meta import meta_append
from cdc_lakehouse.lake.meta_rows import (
    AuditResult as ShardAudit,  # a row; audit.result.AuditResult is the run's result
)
from cdc_lakehouse.lake.snapshots import read_watermark
from cdc_lakehouse.lake.tables import source_columns_of, table_exists
from cdc_lakehouse.runtime.phases import PhaseClock, SparkJobs, as_count, local_checkpoint, observed_counts
from cdc_lakehouse.settings import LakeSettings, SourceEndpoint, source_uri
from cdc_lakehouse.source.catalog import describe_table
from cdc_lakehouse.watermark import Watermark

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, Row, SparkSession

logger = logging.getLogger(__name__)

Snapshots = dict[str, tuple[Any, str]]  # endpoint id -> (connection holding it, exported snapshot)


@dataclass
class _Shard:
    schema: str
    shard: str
    endpoint_id: str
    ep: SourceEndpoint
    columns: list[tuple[str, str]]  # the lake's columns this shard still has
    pg_types: dict[str, str]  # column -> PostgreSQL type
    estimate: float  # the planner's row estimate; -1: never analyzed


@dataclass
class _Table:
    """The table as the audit sees it: the lake side at its watermark and every source shard."""

    cfg: TableConfig
    wm: Watermark
    lake_cols: list[tuple[str, str]]
    key_cols: list[tuple[str, str]]
    lake_df: DataFrame  # live rows only (soft deletes filtered out)
    shards: list[_Shard]
    cols: list[tuple[str, str]]  # the columns both hashes cover
    # (shard, key..., LSN, row hash, bucket) of the live rows, persisted: the audit's one read of
    # the lake table, which the counts, the comparison and Great Expectations all take from.
    lake_h: DataFrame | None = None

    @property
    def hashes(self) -> DataFrame:
        """lake_h, which _audit_table sets before anything reads it."""
        assert self.lake_h is not None
        return self.lake_h

    @property
    def key(self) -> list[str]:
        return [SHARD_COL, *self.cfg.primary_key]

    @cached_property
    def endpoints(self) -> dict[str, tuple[SourceEndpoint, dict[str, str]]]:
        """endpoint id -> (endpoint, schema -> shard): one snapshot and one slot per database."""
        out: dict[str, tuple[SourceEndpoint, dict[str, str]]] = {}
        for s in self.shards:
            out.setdefault(s.endpoint_id, (s.ep, {}))[1][s.schema] = s.shard
        return out


def audit_table(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    *,
    audit_run: str,
    mode: str | None = None,
    repair: bool | None = None,
    repair_limit: int | None = None,
) -> AuditResult:
    """One audit of one table, phase by phase; it records a row per shard in cdc_meta.audit_results.
    The result carries the Spark jobs it took (`spark_jobs`), the figure AUDIT_JOB_BUDGET holds.

    repair_limit: a repair of more persistent keys than this is not done but left for a person to
    approve (result.repair_pending; cdc_audit__<table>'s approval, orchestration/approvals.py)."""
    with SparkJobs(spark, f"audit {cfg.name} {audit_run}") as jobs:
        r = _audit_table(spark, lake, cfg, audit_run=audit_run, mode=mode, repair=repair, limit=repair_limit)
    return replace(r, spark_jobs=jobs.count, spark_job_sites=jobs.sites)


def _audit_table(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    *,
    audit_run: str,
    mode: str | None,
    repair: bool | None,
    limit: int | None,
) -> AuditResult:
    clock = PhaseClock()
    now = datetime.now(UTC)
    preload_great_expectations()
    with clock.phase("describe"):
        t = _describe(spark, lake, cfg)
    t.lake_h = _lake_hashes(t)
    try:
        return _audit_loaded(spark, lake, t, audit_run, mode, (repair, limit), clock, now)
    finally:
        t.lake_h.unpersist()


def _audit_loaded(
    spark: SparkSession,
    lake: LakeSettings,
    t: _Table,
    audit_run: str,
    mode: str | None,
    repair_and_limit: tuple[bool | None, int | None],
    clock: PhaseClock,
    now: datetime,
) -> AuditResult:
    cfg = t.cfg
    repair, limit = repair_and_limit
    mode, lake_counts = _choose_mode(t, mode or cfg.audit.mode)
    per_shard, flagged, counts, lake_counts, unflushed = _compare_with_source(spark, lake, t, mode, lake_counts, clock)
    with clock.phase("in_flight_and_compare"):
        quarantined = quarantine_reasons(spark, lake, cfg, flagged, t.lake_cols) if counts else {}
    with clock.phase("track_and_repair"):
        _tally(per_shard, counts)
        persistent, streak_df = _track(spark, lake, cfg, flagged, now, audit_run, unflushed)
        do_repair = cfg.audit.repair if repair is None else repair
        repaired = pending = 0
        if do_repair and persistent and streak_df is not None:
            if limit is not None and sum(persistent.values()) > limit:
                pending = sum(persistent.values())  # for a person to approve: nothing repaired here
            else:
                repaired = repair_keys(spark, lake, cfg, streak_df, t.key_cols, t.lake_cols, t.wm, audit_run)
    with clock.phase("quality"):
        # A fresh read of the live rows, not the comparison's cache: with the cache, GX counted
        # fewer rows than the comparison on seed 22 of test_random_e2e (447 against 452), not
        # yet explained; until it is, the checks read the table again (persisted for GX's passes).
        live = _live_rows(spark, lake, cfg).select(SHARD_COL, *cfg.primary_key, LSN_COL).persist()
        try:
            quality = quality_checks(spark, lake, cfg, live, t.wm, per_shard, lake_counts, audit_run, now)
        finally:
            live.unpersist()
    samples = _samples(cfg, streak_df) if streak_df is not None and flagged is not None and persistent else {}
    rows = _result_rows(t, audit_run, now, per_shard, lake_counts, persistent, repaired, samples, clock.elapsed())
    meta_append(spark, lake, "audit_results", rows)
    failed_quality = [q for q in quality if not q["success"]]
    verdict = "fail" if (persistent and not repaired) or failed_quality else "ok"
    msg = _message(lake, cfg, mode, verdict, repaired, rows, failed_quality, quarantined, unflushed)
    if pending:
        msg += (
            f"\n  repair of {pending} persistent key(s) awaits approval: more than approvals.repair_above_keys "
            f"({limit}); approve it in this cdc_audit__{cfg.name} run (Browse > Required Actions)"
        )
    logger.info("%s", msg)
    return AuditResult(
        verdict=verdict,
        message=msg,
        mode=mode,
        shards=per_shard,
        persistent=persistent,
        repaired=repaired,
        repair_pending=pending,
        quality=quality,
        quarantine_reasons=quarantined,
        seconds=clock.elapsed(),
        timings=clock.rounded(),
    )


def _compare_with_source(
    spark: SparkSession, lake: LakeSettings, t: _Table, mode: str, lake_counts: dict[str, int], clock: PhaseClock
) -> tuple[dict[str, ShardStats], DataFrame | None, list[Row], dict[str, int], set[str]]:
    """Both sides hashed and compared, the keys in flight taken out; the source snapshots are
    released however this ends (an open one holds back vacuum on the source). Also the shards
    whose slot peek could not wait for the WAL flush (`SlotPeek.flushed`)."""
    # One snapshot per source database, taken before the keys in flight are computed: every
    # change the snapshot sees but the lake does not is then in the landing or still in the slot.
    snapshots = export_snapshots(t.endpoints)
    pool = None
    try:
        pool, pending_sums = _start_source_sums(t, mode, snapshots)
        lake_h = t.hashes
        lake_sums, lake_counts = _lake_side(t, lake_h, mode, lake_counts, clock)
        with clock.phase("source_sums_wait"):
            per_shard, mismatches = _compare_shards(spark, t, lake_h, mode, lake_sums, pending_sums, snapshots)
        with clock.phase("in_flight_and_compare"):
            inflight, unflushed = _in_flight(spark, lake, t)
            flagged, counts = _flag_in_flight(mismatches, inflight, t.key)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        release_snapshots(snapshots)
    return per_shard, flagged, counts, lake_counts, unflushed


# --- describe both sides --------------------------------------------------------------------------------


def _live_rows(spark: SparkSession, lake: LakeSettings, cfg: TableConfig) -> DataFrame:
    """The current table's live rows (soft deletes filtered out), read lazily."""
    from pyspark.sql import functions as F

    lake_df = spark.table(lake.qualified(cfg.current_table))
    if cfg.deletes == "soft":
        lake_df = lake_df.filter(~F.col(cfg.soft_delete_columns.flag))
    return lake_df


def _describe(spark: SparkSession, lake: LakeSettings, cfg: TableConfig) -> _Table:
    cur = lake.qualified(cfg.current_table)
    if not table_exists(spark, cur):
        raise AuditFailed(f"{cfg.name}: {cur} does not exist; bootstrap it first")
    wm = read_watermark(spark, cur) or Watermark.from_dict({"shards": {}})
    lake_cols = source_columns_of(spark, cur, cfg)
    types = dict(lake_cols)
    key_cols = [(k, types[k]) for k in cfg.primary_key]
    lake_df = _live_rows(spark, lake, cfg)
    shards = [_describe_shard(cfg, g, schema, shard, lake_cols) for g, schema, shard in cfg.shards()]
    # One lake hash for every shard: over the columns all shards have. While a schema change is
    # rolling out shard by shard, the new column is compared once every shard has it.
    cols = [c for c in lake_cols if all(c in s.columns for s in shards)]
    return _Table(cfg, wm, lake_cols, key_cols, lake_df, shards, cols)


def _describe_shard(cfg: TableConfig, g, schema: str, shard: str, lake_cols: list[tuple[str, str]]) -> _Shard:
    """A column dropped under keep_null is NULL in the lake: it is left out of both hashes."""
    import psycopg2

    ep = SourceEndpoint.from_uri(source_uri(g.conn_id), g.database)
    conn = psycopg2.connect(ep.dsn())
    try:
        with conn.cursor() as cu:
            info = describe_table(cu, schema, cfg.source.table)
            if info is not None:
                # The planner's row estimate picks the mode in auto.
                cu.execute(
                    "SELECT reltuples FROM pg_class WHERE oid = %s::regclass",
                    (pg_qualified(schema, cfg.source.table),),
                )
                row = cu.fetchone()
                assert row is not None  # describe_table found the relation
                estimate = float(row[0])
    finally:
        conn.close()
    if info is None:
        raise AuditFailed(f"{cfg.name}: source table {schema}.{cfg.source.table} is missing on {ep.label}")
    columns = [(c, t) for c, t in lake_cols if c in info.column_names]
    return _Shard(schema, shard, g.endpoint_id, ep, columns, {c.name: c.pg_type for c in info.columns}, estimate)


def _count_lake(t: _Table) -> dict[str, int]:
    """Rows per configured shard, observed while a no-op write fills the cache: one Spark job
    (a groupBy().count().collect() takes two), and the cache is then ready for what follows."""
    from pyspark.sql import functions as F

    shards = [s.shard for s in t.shards]
    got = observed_counts(t.hashes, *[F.count_if(F.col(SHARD_COL) == sh).alias(f"n{i}") for i, sh in enumerate(shards)])
    return {sh: as_count(got[f"n{i}"]) for i, sh in enumerate(shards)}


def _choose_mode(t: _Table, mode: str) -> tuple[str, dict[str, int]]:
    """Resolves auto by the table's size; returns the mode and the lake's counts if it took them."""
    if mode != "auto":
        return mode, {}
    estimates = [s.estimate for s in t.shards]
    lake_counts = _count_lake(t) if min(estimates) < 0 else {}  # never analyzed: count the lake
    total = sum(lake_counts.values()) if lake_counts else sum(estimates)
    return ("checksum" if total >= t.cfg.audit.checksum_min_rows else "full"), lake_counts


def _start_source_sums(
    t: _Table, mode: str, snapshots: Snapshots
) -> tuple[ThreadPoolExecutor, dict[str, Future[dict[int, tuple[int, str]]]]]:
    """In checksum mode, PostgreSQL computes each shard's bucket sums while Spark hashes the lake."""
    pool = ThreadPoolExecutor(max_workers=max(1, t.cfg.bootstrap.max_connections_per_host))
    if mode != "checksum":
        return pool, {}
    args = (t.key_cols, t.cols, t.cfg.audit.buckets)
    return pool, {
        s.shard: pool.submit(source_bucket_sums, t.cfg, s.schema, s.ep, *args, s.pg_types, snapshots[s.endpoint_id][1])
        for s in t.shards
    }


def _lake_hashes(t: _Table) -> DataFrame:
    """(shard, key, LSN, row hash, bucket), persisted (memory, spilling to disk): the counts or
    bucket sums, the comparison and the quality checks each used to scan the table again (3 to 4
    reads of every data file per audit); now the first of them reads it and the rest read this.
    The cost is a hash and a key per live row held until the audit ends."""
    from pyspark import StorageLevel

    return t.lake_df.select(
        SHARD_COL,
        *[c for c, _ in t.key_cols],
        LSN_COL,
        spark_row_hash(t.cols).alias("_h"),
        spark_bucket(t.key_cols, t.cfg.audit.buckets).alias("_b"),
    ).persist(StorageLevel.MEMORY_AND_DISK)


def _lake_side(
    t: _Table, lake_h: DataFrame, mode: str, lake_counts: dict[str, int], clock: PhaseClock
) -> tuple[dict[str, dict[int, tuple[int, str]]], dict[str, int]]:
    """The lake's bucket sums (checksum mode) and its rows per shard, counted once."""
    from pyspark.sql import functions as F

    if mode == "checksum":
        sums: dict[str, dict[int, tuple[int, str]]] = {}
        with clock.phase("lake_bucket_sums"):
            agg = lake_h.groupBy(SHARD_COL, "_b").agg(
                F.count(F.lit(1)).alias("n"), F.sum(spark_hash_num(F.col("_h"))).alias("s")
            )
            for r in agg.collect():
                sums.setdefault(r[SHARD_COL], {})[r["_b"]] = (r["n"], str(r["s"]))
        return sums, {shard: sum(n for n, _ in b.values()) for shard, b in sums.items()}
    if not lake_counts:
        with clock.phase("lake_count"):
            lake_counts = _count_lake(t)
    return {}, lake_counts


# --- compare ----------------------------------------------------------------------------------------------


def _compare_shards(
    spark: SparkSession,
    t: _Table,
    lake_h: DataFrame,
    mode: str,
    lake_sums: dict[str, dict[int, tuple[int, str]]],
    pending_sums: dict[str, Future[dict[int, tuple[int, str]]]],
    snapshots: Snapshots,
) -> tuple[dict[str, ShardStats], list[DataFrame]]:
    """Per shard: its stats, and (lazily) its mismatched keys as (shard, key..., kind)."""
    from pyspark.sql import functions as F

    per_shard: dict[str, ShardStats] = {}
    mismatches = []
    for s in t.shards:
        lh = lake_h.filter(F.col(SHARD_COL) == s.shard)
        snap = snapshots[s.endpoint_id][1]
        m: DataFrame | None
        if mode == "full":
            per_shard[s.shard], m = _compare_full(spark, t, s, lh, snap)
        else:
            src_sums = pending_sums[s.shard].result()
            per_shard[s.shard], m = _compare_buckets(spark, t, s, lh, src_sums, lake_sums.get(s.shard, {}), snap)
        if m is not None:
            mismatches.append(m)
    return per_shard, mismatches


def _compare_full(spark: SparkSession, t: _Table, s: _Shard, lh: DataFrame, snap: str) -> tuple[ShardStats, DataFrame]:
    st: ShardStats = {"mode": "full", "buckets_compared": 0, "buckets_differing": 0, "source_rows": None}
    src = source_hashes(
        spark,
        t.cfg,
        s.shard,
        s.schema,
        s.ep,
        t.key_cols,
        t.cols,
        t.cfg.audit.buckets,
        pg_types=s.pg_types,
        snapshot=snap,
    )
    return st, compare(src.drop("_b"), lh.drop("_b", LSN_COL), t.key)


def _compare_buckets(
    spark: SparkSession,
    t: _Table,
    s: _Shard,
    lh: DataFrame,
    src_sums: dict[int, tuple[int, str]],
    lake_sums: dict[int, tuple[int, str]],
    snap: str,
) -> tuple[ShardStats, DataFrame | None]:
    """Keys are read only for the buckets whose count or hash sum differ; when half of them or
    more do, a filter on the bucket saves nothing and the whole shard is read."""
    from pyspark.sql import functions as F

    buckets = t.cfg.audit.buckets
    differing = sorted(b for b in set(src_sums) | set(lake_sums) if src_sums.get(b) != lake_sums.get(b))
    st: ShardStats = {
        "mode": "checksum",
        "buckets_compared": buckets,
        "buckets_differing": len(differing),
        "source_rows": sum(n for n, _ in src_sums.values()),
    }
    if not differing:
        return st, None
    only = differing if len(differing) < buckets // 2 else None
    src = source_hashes(spark, t.cfg, s.shard, s.schema, s.ep, t.key_cols, t.cols, buckets, only, s.pg_types, snap)
    lsub = lh.filter(F.col("_b").isin(differing)) if only else lh
    return st, compare(src.drop("_b"), lsub.drop("_b", LSN_COL), t.key)


def _in_flight(spark: SparkSession, lake: LakeSettings, t: _Table) -> tuple[list[DataFrame], set[str]]:
    """Changes the slot has not delivered yet and pending landing events: (shard, key..., _all);
    and the shards whose peek went on before the WAL flush reached the snapshot.

    The slot first, the landing after: a capture that runs meanwhile (captures do not share the
    table's writer pool) moves changes from the slot to a new landing run, which the listing
    after the peek then sees. The other order missed them and called them mismatches (the
    scheduler e2e test, once its tasks ran on Spark Connect fast enough to overlap a capture)."""
    # inflight_from_slot is looked up here at call time: tests replace it on this module.
    peeks = {
        endpoint_id: inflight_from_slot(spark, t.cfg, endpoint_id, ep, shards, t.key_cols)
        for endpoint_id, (ep, shards) in t.endpoints.items()
    }
    frames = [p.keys for p in peeks.values()] + [inflight_from_landing(spark, lake, t.cfg, t.wm, t.key_cols)]
    unflushed = {shard for e, p in peeks.items() if not p.flushed for shard in t.endpoints[e][1].values()}
    return [f for f in frames if f is not None], unflushed


def _union(frames: list[DataFrame]) -> DataFrame:
    return reduce(lambda a, b: a.unionByName(b), frames)


def _flag_in_flight(
    mismatches: list[DataFrame], inflight: list[DataFrame], key: list[str]
) -> tuple[DataFrame | None, list[Row]]:
    """The mismatches with `_if` (in flight) set, persisted, and their counts per shard, kind, _if.

    A truncate in flight (`_all`) covers every key of its shard."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    if not mismatches:
        return None, []
    diff = _union(mismatches).persist(StorageLevel.MEMORY_AND_DISK)
    if inflight:
        infl = _union(inflight)
        whole = [r[0] for r in infl.filter("_all").select(SHARD_COL).distinct().collect()]
        keys_if = infl.filter(~F.col("_all")).select(*key).distinct()
        flagged = diff.join(keys_if.withColumn("_if", F.lit(True)), key, "left").withColumn(
            "_if", F.coalesce(F.col("_if"), F.col(SHARD_COL).isin(whole) if whole else F.lit(False))
        )
    else:
        flagged = diff.withColumn("_if", F.lit(False))
    flagged = flagged.persist(StorageLevel.MEMORY_AND_DISK)
    counts = flagged.groupBy(SHARD_COL, "kind", "_if").count().collect()
    diff.unpersist()
    if not counts:
        # No mismatch at all (the common case): the streak bookkeeping then has nothing to
        # checkpoint, write or count, only the old streaks to resolve.
        flagged.unpersist()
        return None, []
    return flagged, counts


def _tally(per_shard: dict[str, ShardStats], counts: list[Row]) -> None:
    for r in counts:
        st = per_shard[r[SHARD_COL]]
        name: Literal["in_flight", "missing", "extra", "different"] = "in_flight" if r["_if"] else r["kind"]
        st[name] = st.get(name, 0) + r["count"]


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


# --- streaks across audits ----------------------------------------------------------------------------


def _track(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    flagged: DataFrame | None,
    now: datetime,
    audit_run: str,
    unflushed: set[str],
) -> tuple[dict[str, int], DataFrame | None]:
    """Update the mismatch streaks; returns shards -> keys at or over the limit, and those keys.

    A retry of the same audit run (the Airflow task's retry) does not extend a streak: only
    distinct audits count as consecutive. On a shard in `unflushed` a key needs two sightings
    whatever the limit: its change may have been committed but not yet readable from the slot
    (inflight._wait_for_wal_flush)."""
    from pyspark.sql import functions as F

    table = lake.qualified(lake.meta_table("audit_mismatches"))
    prev = spark.table(table).filter((F.col("table_name") == cfg.name) & ~F.col("resolved"))
    # Materialized now: evaluated lazily after the rewrite below it would count itself twice.
    merged = None
    if flagged is not None:
        merged = local_checkpoint(_extend_streaks(cfg, flagged, prev, now, audit_run))
    # Replace this table's streaks with the new set (keys absent now are resolved and dropped).
    spark.sql(f"DELETE FROM {table} WHERE table_name = '{cfg.name}'")
    if merged is None:
        return {}, None
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
    limit, at_least_two = cfg.audit.consecutive_mismatches, max(cfg.audit.consecutive_mismatches, 2)
    needed = F.when(F.col("shard").isin(*sorted(unflushed)), at_least_two).otherwise(limit) if unflushed else limit
    over = merged.filter(F.col("times_seen") >= needed)
    counts = {r["shard"]: r["count"] for r in over.groupBy("shard").count().collect()}
    return counts, over.withColumnRenamed("shard", SHARD_COL)


def _extend_streaks(cfg: TableConfig, flagged: DataFrame, prev: DataFrame, now: datetime, audit_run: str) -> DataFrame:
    """This audit's mismatches (not in flight), each with its streak so far plus this sighting."""
    from pyspark.sql import functions as F

    kj = F.to_json(F.struct(*[F.col(k) for k in cfg.primary_key]))
    cur = flagged.filter(~F.col("_if")).select(
        F.lit(cfg.name).alias("table_name"),
        F.col(SHARD_COL).alias("shard"),
        kj.alias("key_json"),
        "kind",
        *[F.col(k) for k in cfg.primary_key],
    )
    p = prev.select("shard", "key_json", "kind", "first_seen", "times_seen", "last_audit_run")
    again = F.coalesce(F.col("last_audit_run") == F.lit(audit_run), F.lit(False))
    return cur.join(p, ["shard", "key_json", "kind"], "left").select(
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


# --- report -------------------------------------------------------------------------------------------------


def _samples(cfg: TableConfig, streak_df: DataFrame) -> dict[str, list[dict[str, Any]]]:
    samples: dict[str, list[dict[str, Any]]] = {}
    for r in streak_df.limit(cfg.audit.sample_keys * 4).collect():
        samples.setdefault(r[SHARD_COL], []).append({"kind": r["kind"], **{k: r[k] for k in cfg.primary_key}})
    return samples


def _result_rows(
    t: _Table,
    audit_run: str,
    now: datetime,
    per_shard: dict[str, ShardStats],
    lake_counts: dict[str, int],
    persistent: dict[str, int],
    repaired: int,
    samples: dict[str, list[dict[str, Any]]],
    seconds: float,
) -> list[ShardAudit]:
    """One cdc_meta.audit_results row per shard."""
    cfg = t.cfg
    rows = []
    for shard, st in per_shard.items():
        p = persistent.get(shard, 0)
        pending = any(st.get(k) for k in ("missing", "extra", "different"))
        rows.append(
            ShardAudit(
                table_name=cfg.name,
                audit_run=audit_run,
                shard=shard,
                mode=st["mode"],
                source_rows=st.get("source_rows"),
                lake_rows=lake_counts.get(shard, 0),
                missing=st.get("missing", 0),
                extra=st.get("extra", 0),
                different=st.get("different", 0),
                in_flight=st.get("in_flight", 0),
                persistent=p,
                buckets_compared=st["buckets_compared"],
                buckets_differing=st["buckets_differing"],
                sample_keys=json.dumps(samples.get(shard, [])[: cfg.audit.sample_keys], default=str),
                watermark_lsn=t.wm.shard_lsns().get(shard),
                repaired=repaired if p else 0,
                verdict="fail" if p else ("mismatch_pending" if pending else "ok"),
                seconds=seconds,
                audited_at=now,
            )
        )
    return rows


def _message(
    lake: LakeSettings,
    cfg: TableConfig,
    mode: str,
    verdict: str,
    repaired: int,
    rows: list[ShardAudit],
    failed_quality: list[QualityCheck],
    quarantined: dict[str, int],
    unflushed: set[str],
) -> str:
    lines = []
    for r in rows:
        lines.append(
            f"  {r.shard}: source {r.source_rows if r.source_rows is not None else '-'} lake "
            f"{r.lake_rows} missing {r.missing} extra {r.extra} different {r.different} "
            f"in flight {r.in_flight} persistent {r.persistent} -> {r.verdict}"
            + (f" sample {r.sample_keys}" if r.persistent else "")
        )
    for q in failed_quality:
        lines.append(f"  quality: {q['expectation']} failed (observed {q['observed']})")
    for reason, n in quarantined.items():
        lines.append(f"  {n} mismatched key(s) have events in {lake.meta_table('quarantine')}: {reason}")
    if unflushed:
        lines.append(
            f"  the source's WAL flush did not reach the audit's snapshot in time on {sorted(unflushed)}: "
            "their mismatches count as persistent only when the next audit sees them again"
        )
    return (
        f"audit {cfg.name} ({mode}): {'FAIL' if verdict == 'fail' else 'ok'}"
        + (f", repaired {repaired} key(s) — the next audit confirms" if repaired else "")
        + "\n"
        + "\n".join(lines)
    )
