"""Quarantine: malformed events, and rows held back because their unchanged TOAST value has
no trustworthy source. Kept in cdc_meta.quarantine so nothing is lost or silently NULLed."""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING

from cdc_lakehouse.columns import LSN_COL, OP_COL, RUN_COL, SEQ_COL, SHARD_COL, UNAVAILABLE_COL
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.ingest.toast import NO_TABLE, UNAV_LEFT
from cdc_lakehouse.ingest.validate import FILE, RAW, REASONS
from cdc_lakehouse.lake.batches import CLOCK_SKEW_MS
from cdc_lakehouse.lake.commits import sql_with_commit_properties, with_commit_retries
from cdc_lakehouse.lake.merge import lsn_newer
from cdc_lakehouse.lake.snapshots import current_ancestors, files_matching
from cdc_lakehouse.lake.tables import sql_string
from cdc_lakehouse.runtime.phases import local_checkpoint
from cdc_lakehouse.settings import LakeSettings

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from cdc_lakehouse.ingest.batch import ReducedTotals

log = logging.getLogger(__name__)

# The commit of one write_quarantine call carries its own id: what it added is read from there.
QUARANTINE_WRITE_PROP = "cdc.quarantine-write"


def write_quarantine(spark: SparkSession, lake: LakeSettings, cfg: TableConfig, bad: DataFrame, ingest_run: str) -> int:
    """Idempotent: an event quarantined by an earlier attempt of the same data is not added twice."""
    from pyspark.sql import functions as F

    rows = bad.select(
        F.lit(cfg.name).alias("table_name"),
        F.col(SHARD_COL).alias("shard"),
        F.array_join(REASONS, "; ").alias("reason"),
        F.col(RAW).alias("raw"),
        F.col(LSN_COL).alias("commit_lsn"),
        F.col("_seq_raw").alias("seq"),
        F.col(RUN_COL).alias("landing_run"),
        F.col(FILE).alias("landing_file"),
        F.lit(ingest_run).alias("ingest_run"),
        F.current_timestamp().alias("quarantined_at"),
    ).dropDuplicates(["commit_lsn", "seq", "landing_file", "reason"])
    # Materialized: a row-level MERGE whose source still reads a lake table (held rows come from
    # a join with the current table) fails in Spark 4.1's planner ("No plan for TableReference").
    rows = local_checkpoint(rows)
    if rows.isEmpty():
        return 0
    view = f"cdc_quarantine_{cfg.name}_{uuid.uuid4().hex[:8]}"
    rows.createOrReplaceTempView(view)
    q = lake.qualified(lake.meta_table("quarantine"))
    tag, since_ms = uuid.uuid4().hex, int(time.time() * 1000) - CLOCK_SKEW_MS
    # Two runs of one batch (a second deployment, a manual run) quarantine the same events, maybe
    # at the same moment. An insert-only MERGE is planned as an anti-join and a plain append, which
    # Iceberg never validates: both appended every event (#51). The MATCHED clause that never fires
    # makes it a row-level MERGE, which Iceberg commits only if no file that may hold this table's
    # rows (the literal table_name: the scan's filter, so its partition) was added since its scan;
    # the loser is retried and then finds the events there.
    sql = (
        f"MERGE INTO {q} t USING {view} s ON t.table_name = {sql_string(cfg.name)} AND t.commit_lsn <=> s.commit_lsn "
        "AND t.seq <=> s.seq AND t.landing_file <=> s.landing_file AND t.reason = s.reason WHEN MATCHED AND t.reason IS NULL THEN DELETE WHEN NOT MATCHED THEN INSERT *"
    )
    try:
        with_commit_retries(
            lambda: sql_with_commit_properties(spark, sql, {QUARANTINE_WRITE_PROP: tag}), what=f"{cfg.name} quarantine"
        )
    finally:
        spark.catalog.dropTempView(view)
    # What this call added (another run may have added the rest): its own commits' counts (more
    # than one if a commit whose outcome was unknown had landed before its retry), net of the rows
    # a copy-on-write rewrite of files holding events already there wrote again.
    added = 0
    for snap in current_ancestors(spark, q):
        if int(snap.timestamp_ms) < since_ms:
            break
        if snap.summary.get(QUARANTINE_WRITE_PROP) == tag:
            added += int(snap.summary.get("added-records", "0")) - int(snap.summary.get("deleted-records", "0"))
    return added


def held_back(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    reduced: DataFrame,
    tgt: DataFrame,
    lake_cols: list[tuple[str, str]],
    totals: ReducedTotals,
) -> DataFrame | None:
    """Rows whose unchanged TOAST value has no trustworthy source, as quarantine rows (or None).

    The MERGE would take the table's value for them, which is wrong when (a) the key was deleted
    or re-created by a key change earlier in the batch and the batch could not supply the value,
    or (b) a quarantined event of the key (this batch or an earlier one) is newer than the table's
    row: the value it carried never reached the table. Held rows keep the table's older row
    (never a mix); the audit reports the key, and a fixed replay or a repair brings it back.
    Rows the table already holds at a newer position are never held: the MERGE skips them. The
    table's positions are read only when the batch has such rows."""
    from pyspark.sql import functions as F

    key = [SHARD_COL, *cfg.primary_key]
    needs_base = (F.col(OP_COL) != "d") & (F.size(UNAV_LEFT) > 0)
    filled = (F.col(OP_COL) != "d") & (F.size(F.coalesce(UNAVAILABLE_COL, F.array())) > 0)
    # A row the table already holds at a newer position is stale: the MERGE keeps the table's row,
    # so the missing value never matters (a chunked bootstrap's chunk read after a key change).
    fresh = F.col("_t_lsn").isNull() | lsn_newer(F.col(LSN_COL), F.col(SEQ_COL), F.col("_t_lsn"), F.col("_t_seq"))
    reason = F.when(
        needs_base & F.col(NO_TABLE) & fresh,
        F.concat(
            F.lit("unchanged TOAST column(s) "),
            F.array_join(F.coalesce(UNAV_LEFT, F.array()), ", "),
            F.lit(" follow a delete or key change of this key in the batch whose value the batch does not hold"),
        ),
    )
    rows = reduced.filter(needs_base & F.col(NO_TABLE)).join(tgt, key, "left") if totals.needs_base_no_table else None
    if totals.filled and has_quarantine(spark, lake, cfg):
        q = open_quarantine_keys(spark, lake, cfg, lake_cols)
        rows = reduced.filter(needs_base | filled).join(F.broadcast(q), key, "inner").join(tgt, key, "left")
        after_table = F.col("_t_lsn").isNull() | lsn_newer(
            F.col("_q_lsn"), F.col("_q_seq"), F.col("_t_lsn"), F.col("_t_seq")
        )
        depends = filled & after_table & lsn_newer(F.col(LSN_COL), F.col(SEQ_COL), F.col("_q_lsn"), F.col("_q_seq"))
        reason = reason.when(
            depends,
            F.concat(
                F.lit("unchanged TOAST column(s) depend on quarantined event at commit LSN "),
                F.col("_q_lsn").cast("string"),
                F.lit(" of this key, whose values never reached the table"),
            ),
        )
        rows = rows.unionByName(
            reduced.filter(needs_base & F.col(NO_TABLE)).join(q, key, "left_anti").join(tgt, key, "left"),
            allowMissingColumns=True,
        )
    if rows is None:
        return None
    rows = local_checkpoint(rows.withColumn(REASONS, F.array(reason)).filter(F.col(REASONS)[0].isNotNull()))
    return None if rows.isEmpty() else as_held(rows, key)


def as_held(rows: DataFrame, key: list[str]) -> DataFrame:
    """Reduced rows with REASONS -> the shape quarantine takes (the key and position as payload)."""
    from pyspark.sql import functions as F

    return (
        rows.withColumn(RAW, F.to_json(F.struct(*key, LSN_COL, SEQ_COL)))
        .withColumn("_seq_raw", F.floor(F.col(SEQ_COL) / 2).cast("bigint"))
        .withColumn(RUN_COL, F.lit(None).cast("string"))
        .withColumn(FILE, F.lit(None).cast("string"))
    )


def hold_dependents(
    spark: SparkSession, lake: LakeSettings, cfg: TableConfig, held: DataFrame | None, ingest_run: str
) -> int:
    """Write held-back rows (see held_back, as_held) to quarantine; returns how many were added."""
    if held is None:
        return 0
    n = write_quarantine(spark, lake, cfg, held, ingest_run)
    if n:
        log.warning("%s: %d event(s) held back in quarantine: unchanged TOAST value unknown", cfg.name, n)
    return n


def has_quarantine(spark: SparkSession, lake: LakeSettings, cfg: TableConfig) -> bool:
    """Any quarantined event of this table. The quarantine is partitioned by table: where the
    lake's catalog is read with pyiceberg, its manifests answer (no Spark job: one of an ingest's
    few, issue #56); a file of the table's partition may hold only resolved events' deletes, so
    the answer may be a cautious yes, never a wrong no. Otherwise Spark reads, and Iceberg prunes
    the files of other tables while planning, so the common case scans no file."""
    from pyspark.sql import functions as F

    table = lake.qualified(lake.meta_table("quarantine"))
    files = files_matching(table, "table_name", cfg.name)
    if files is not None:
        return files > 0
    return not spark.table(table).filter(F.col("table_name") == cfg.name).limit(1).isEmpty()


def open_quarantine_keys(
    spark: SparkSession, lake: LakeSettings, cfg: TableConfig, lake_cols: list[tuple[str, str]]
) -> DataFrame:
    """Per key, the newest quarantined event of this table: (shard, key..., _q_lsn, _q_seq, _q_reason)."""
    from pyspark.sql import functions as F

    from cdc_lakehouse.lake.casts import cast_text

    types = dict(lake_cols)
    q = spark.table(lake.qualified(lake.meta_table("quarantine"))).filter(F.col("table_name") == cfg.name)
    after = F.from_json(F.get_json_object("raw", "$.after"), "map<string,string>")
    before = F.from_json(F.get_json_object("raw", "$.before"), "map<string,string>")
    cols = [F.col("shard").alias(SHARD_COL)]
    for k in cfg.primary_key:
        text = F.coalesce(after[k], before[k], F.get_json_object("raw", f"$.{k}"))
        cols.append(cast_text(text, types[k]).alias(k))
    # Lake order is 2*seq (+1 for the insert half of a key change): compare in lake order.
    cols += [
        F.col("commit_lsn").alias("_q_lsn"),
        (F.col("seq") * 2 + 1).alias("_q_seq"),
        F.col("reason").alias("_q_reason"),
    ]
    keyed = q.select(*cols).filter(F.col(SHARD_COL).isNotNull() & F.col("_q_lsn").isNotNull())
    for k in cfg.primary_key:
        keyed = keyed.filter(F.col(k).isNotNull())
    key = [SHARD_COL, *cfg.primary_key]
    return (
        keyed.groupBy(*key)
        .agg(F.max(F.struct("_q_lsn", "_q_seq", "_q_reason")).alias("_q"))
        .select(
            *key,
            F.col("_q._q_lsn").alias("_q_lsn"),
            F.col("_q._q_seq").alias("_q_seq"),
            F.col("_q._q_reason").alias("_q_reason"),
        )
    )
