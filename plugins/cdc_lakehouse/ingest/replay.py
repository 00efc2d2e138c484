"""Quarantine replay: re-validate a table's quarantined events after a fix (a widened column, a
config change) and apply those that now pass through the ingest's own merge path.

    read        the table's quarantined events that carry their landing payload (held-back TOAST
                rows carry only key and position: they are left as they are)
    revalidate  the payloads through the ingest's fused plan (validate, dedupe, key-change split,
                TOAST fill within the replayed events, latest per key), against today's lake types
    decide      per event: still failing (keeps it, with today's reason); valid but not safely
                applicable (a truncate, or an unchanged TOAST value the replay cannot source);
                superseded (the changelog holds a newer change of the key that reached the table,
                or a truncate or re-bootstrap of its shard after it: applying it would resurrect
                or overwrite); or to apply
    merge       the ingest's LSN-guarded MERGE (lake.merge.run_merge): a row of the table that
                is newer than the replayed event is never touched
    resolve     applied and superseded events leave the quarantine; failing ones get their reason

Idempotent: the merge changes only rows older than the replayed event, so a replay killed after
the merge and run again merges nothing and then resolves the same events (none applied twice,
none lost).

Positions. The replay's commit carries no `cdc.watermark`: the watermark (read from the newest
ancestor that has one) stays where the ingest left it, never moves back. It carries
`cdc.writer: replay` (lake.writers): the change feed, serving exports and derived trees diff
snapshots across it (lake.ranges), as across a backfill. Replayed events are not appended to the changelog: their LSNs lie below
the changelog's watermark, a range every reader of `lake.changelog.changes_between` has already
consumed, and an append there would change what an already-read range contains.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from cdc_lakehouse.columns import LSN_COL, OP_COL, SEQ_COL, SHARD_COL
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.ingest.batch import LIVE, FusedBatch, fused_batch
from cdc_lakehouse.ingest.ingest_table import current_columns, needs_base, start_position, table_positions
from cdc_lakehouse.ingest.toast import UNAV_LEFT
from cdc_lakehouse.ingest.validate import REASONS
from cdc_lakehouse.lake.commits import (
    ConcurrentWriterError,
    fenced_commit,
    with_commit_retries,
)
from cdc_lakehouse.lake.merge import lsn_newer, run_merge
from cdc_lakehouse.lake.tables import source_columns_of
from cdc_lakehouse.lake.writers import REPLAY
from cdc_lakehouse.landing.format import landing_spark_schema
from cdc_lakehouse.runtime.failpoints import crash_point
from cdc_lakehouse.runtime.phases import local_checkpoint
from cdc_lakehouse.settings import LakeSettings
from cdc_lakehouse.watermark import Watermark

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)

# The fields of a landing event that a quarantined event's `raw` keeps (ingest.validate.typed_events).
RAW_FIELDS = ("op", "before", "after", "unavailable", "source", "run_id")
DONE, FAIL = "done", "fail"
_SEQ = "_seq_raw"  # the event's seq in its transaction, as the quarantine stores it


@dataclass
class ReplayResult:
    """What one replay did, in events (quarantine rows), except `rows_changed` (table rows)."""

    table_name: str
    replay_run: str
    examined: int  # quarantined events with a payload
    resolved: int  # removed from the quarantine: applied, or superseded by a newer change
    rows_changed: int  # table rows the MERGE inserted, updated or deleted
    still_quarantined: int  # examined events kept (still failing, or not safely applicable)
    held_untouched: int  # held-back TOAST rows (no payload): never replayed

    def to_dict(self) -> dict[str, Any]:
        """The CLI's output and the job's result line (jobs.runner.StageResult)."""
        return asdict(self)


@dataclass
class Decision:
    """The decide phase's output: the latest event per key to MERGE, and each event's outcome."""

    apply: DataFrame  # current_columns(...) rows for run_merge
    outcomes: DataFrame  # (_cdc_shard, commit_lsn, seq, action DONE|FAIL, reason)
    rows_changed: int  # how many apply rows the LSN guard lets through


def replay_quarantine(spark: SparkSession, lake: LakeSettings, cfg: TableConfig, *, replay_run: str) -> ReplayResult:
    """The replay's phases, in order: read, revalidate, decide, merge, resolve."""
    cur = lake.qualified(cfg.current_table)
    wm = start_position(spark, cfg, cur)
    lake_cols = source_columns_of(spark, cur, cfg)
    q, held = read_quarantined(spark, lake, cfg)
    examined = q.count()
    result = ReplayResult(cfg.name, replay_run, examined, 0, 0, examined, held)
    if not examined:
        return result
    fb = revalidate(q, cfg, lake_cols)
    d = decide(spark, lake, cfg, fb, lake_cols)
    if d.rows_changed:
        merge_replayed(spark, cfg, cur, wm, lake_cols, d.apply, replay_run)
    crash_point("replay_after_merge")
    result.rows_changed = d.rows_changed
    result.resolved = resolve_quarantine(spark, lake, cfg, d.outcomes, replay_run)
    result.still_quarantined = examined - result.resolved
    log.info("quarantine replay %s: %s", cfg.name, result.to_dict())
    return result


# --- read, revalidate -----------------------------------------------------------------------------


def read_quarantined(spark: SparkSession, lake: LakeSettings, cfg: TableConfig) -> tuple[DataFrame, int]:
    """The table's quarantined events with a landing payload (materialized: the resolve phase
    changes the table they were read from), and how many held-back rows without one there are."""
    from pyspark.sql import functions as F

    qt = lake.qualified(lake.meta_table("quarantine"))
    spark.sql(f"REFRESH TABLE {qt}")
    mine = spark.table(qt).filter(F.col("table_name") == cfg.name)
    held = mine.filter(F.col("landing_file").isNull()).count()
    return local_checkpoint(mine.filter(F.col("landing_file").isNotNull())), held


def revalidate(q: DataFrame, cfg: TableConfig, lake_cols: list[tuple[str, str]]) -> FusedBatch:
    """The quarantined payloads as landing rows, through the ingest's fused plan with no floor
    (every quarantined event lies below the watermark that the ingest moved past it)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StructType

    schema = StructType([f for f in landing_spark_schema().fields if f.name in RAW_FIELDS])
    events = q.select(F.from_json("raw", schema).alias("e")).select("e.*")
    return fused_batch(events, cfg, lake_cols, None)  # no floor: every quarantined event is pending


# --- decide ---------------------------------------------------------------------------------------


def decide(
    spark: SparkSession, lake: LakeSettings, cfg: TableConfig, fb: FusedBatch, lake_cols: list[tuple[str, str]]
) -> Decision:
    """Per event what happens to it (see the module doc), and the rows the MERGE applies."""
    from pyspark.sql import functions as F

    key = [SHARD_COL, *cfg.primary_key]
    ev = [SHARD_COL, LSN_COL, _SEQ]
    held_keys = toast_held_keys(fb, key)
    live = fb.rows.filter(F.col(LIVE)).join(held_keys.withColumn("_held", F.lit(True)), key, "left")
    tgt = table_positions(cfg, spark.table(lake.qualified(cfg.current_table)))
    latest = fb.latest().join(held_keys, key, "left_anti")
    latest = latest.join(superseded_keys(spark, lake, cfg, latest, tgt, key), key, "left_anti")
    apply = local_checkpoint(latest.select(*current_columns(lake_cols), UNAV_LEFT))
    # What the MERGE will change: an insert of an absent key, or any event newer than the row.
    changes = apply.join(tgt, key, "left").filter(
        (F.col("_t_lsn").isNull() & (F.col(OP_COL) != "d"))
        | lsn_newer(F.col(LSN_COL), F.col(SEQ_COL), F.col("_t_lsn"), F.col("_t_seq"))
    )
    toast_reason = F.concat(
        F.lit("valid after the fix, but unchanged TOAST column(s) of this key ("),
        F.array_join(F.coalesce(UNAV_LEFT, F.array()), ", "),
        F.lit(") have no value the replay can trust (it never takes them from the table); "),
        F.lit(f"the audit's repair (cdc_audit__{cfg.name}, repair: true) re-reads the key from the source"),
    )
    trunc_reason = (
        "valid after the fix, but a truncate is not replayed (it would remove the shard's newer rows); "
        f"re-bootstrap the shard (cdc_bootstrap__{cfg.name} with conf shards), then clear this event"
    )
    outcomes = (
        live.select(*ev, F.when(F.col("_held"), toast_reason).alias("_r"))
        .unionByName(fb.truncates().select(*ev, F.lit(trunc_reason).alias("_r")))
        .unionByName(fb.malformed().select(*ev, F.array_join(REASONS, "; ").alias("_r")))
        .groupBy(*ev)
        .agg(F.max("_r").alias("reason"))  # a key change is two rows: held if either half is
        .select(
            F.col(SHARD_COL),
            F.col(LSN_COL).alias("commit_lsn"),
            F.col(_SEQ).alias("seq"),
            F.when(F.col("reason").isNull(), F.lit(DONE)).otherwise(F.lit(FAIL)).alias("action"),
            "reason",
        )
    )
    return Decision(apply, local_checkpoint(outcomes), changes.count())


def toast_held_keys(fb: FusedBatch, key: list[str]) -> DataFrame:
    """Keys whose latest replayed upsert still lacks an unchanged TOAST value after the fill within
    the replayed events. The table's value is not used: other changes of the key may be missing
    from it (held back, or still in quarantine), so it may not be the value the event left alone.
    Both keys of a key change touching such a key are held, so no half of it is applied alone."""
    from pyspark.sql import functions as F

    needy = fb.latest().filter(needs_base()).select(*key).distinct()
    ev = [SHARD_COL, LSN_COL, _SEQ]
    live = fb.rows.filter(F.col(LIVE))
    touched = live.join(needy, key, "inner").select(*ev).distinct()
    return live.join(touched, ev, "inner").select(*key).union(needy).distinct()


def superseded_keys(
    spark: SparkSession, lake: LakeSettings, cfg: TableConfig, latest: DataFrame, tgt: DataFrame, key: list[str]
) -> DataFrame:
    """Keys whose replayed event a later change makes obsolete: a truncate or bootstrap (snapshot
    rows, seq < 0) of its shard after it, or a newer changelog row of the key that reached the
    table (the row is at least as new, or the row is gone and that change was a delete). The LSN
    guard alone cannot see these when the row is gone (a hard delete, a truncate, a shard
    re-bootstrapped without the key) or kept with its older position (a soft truncate). A newer
    change that was held back (in the changelog, not in the table) does not count: the replayed
    event, a full row, then moves the key to a state it really had."""
    from pyspark.sql import functions as F

    cl = spark.table(lake.qualified(cfg.changelog_table))
    mine = latest.select(*key, F.col(LSN_COL).alias("_r_lsn"), F.col(SEQ_COL).alias("_r_seq"))
    shards = [r[0] for r in mine.select(SHARD_COL).distinct().collect()]
    cl = cl.filter(F.col(SHARD_COL).isin(shards))
    later = lsn_newer(F.col(LSN_COL), F.col(SEQ_COL), F.col("_r_lsn"), F.col("_r_seq"))
    t_row = F.col("_t_lsn").isNotNull()
    reached = (t_row & ~lsn_newer(F.col(LSN_COL), F.col(SEQ_COL), F.col("_t_lsn"), F.col("_t_seq"))) | (
        ~t_row & (F.col(OP_COL) == "d")
    )
    by_key = (
        cl.select(*key, OP_COL, LSN_COL, SEQ_COL)
        .join(F.broadcast(mine), key, "inner")
        .filter(later)
        .join(tgt, key, "left")
        .filter(reached)
    )
    resets = (
        cl.filter((F.col(OP_COL) == "t") | (F.col(SEQ_COL) < 0))
        .groupBy(SHARD_COL)
        .agg(F.max(F.struct(LSN_COL, SEQ_COL)).alias("_m"))
        .select(SHARD_COL, F.col(f"_m.{LSN_COL}").alias(LSN_COL), F.col(f"_m.{SEQ_COL}").alias(SEQ_COL))
    )
    by_shard = mine.join(F.broadcast(resets), SHARD_COL, "inner").filter(later)
    return by_key.select(*key).union(by_shard.select(*key)).distinct()


# --- merge, resolve -------------------------------------------------------------------------------


def merge_replayed(
    spark: SparkSession,
    cfg: TableConfig,
    cur: str,
    wm: Watermark,
    lake_cols: list[tuple[str, str]],
    apply: DataFrame,
    replay_run: str,
) -> None:
    """The ingest's LSN-guarded MERGE of the replayed rows, fenced on the watermark the replay read
    (lake.commits.fenced_commit: checked when the commit is published, not only before the write;
    #51): an ingest that committed meanwhile may have deleted a key this replay would re-insert.
    The commit carries no cdc.watermark (see the module doc, positions): the fence's position is
    the one it leaves in place."""
    view = f"cdc_replay_{cfg.name}"
    apply.createOrReplaceTempView(view)
    cols = current_columns(lake_cols)
    props = {"cdc.replay-run": replay_run, **REPLAY.props()}

    def moved(now: Watermark | None) -> ConcurrentWriterError:
        return ConcurrentWriterError(
            f"{cfg.name}: quarantine replay: {cur} was committed by another writer since the replay started "
            f"(watermark {wm.to_json()} -> {now.to_json() if now is not None else {}}); nothing was applied. "
            "Run the replay again (it re-reads the table), outside the table's ingest runs"
        )

    write = lambda target: run_merge(spark, cfg, target, view, cols, props)  # noqa: E731
    fenced_commit(spark, cur, wm, wm, write, what=f"{cfg.name} quarantine replay merge", conflict=moved)


def resolve_quarantine(
    spark: SparkSession, lake: LakeSettings, cfg: TableConfig, outcomes: DataFrame, replay_run: str
) -> int:
    """Applied and superseded events leave the quarantine; failing ones take today's reason.
    Returns how many rows were removed. Held-back rows (no landing file) are never matched."""
    from pyspark.sql import functions as F

    qt = lake.qualified(lake.meta_table("quarantine"))
    view = f"cdc_replay_outcomes_{cfg.name}"
    outcomes.createOrReplaceTempView(view)
    name = cfg.name  # validated by the config (check_lake_ident): safe as a literal
    before = spark.table(qt).filter(F.col("table_name") == name).count()
    with_commit_retries(
        lambda: spark.sql(
            f"MERGE INTO {qt} t USING {view} s ON t.table_name = '{name}' AND t.landing_file IS NOT NULL "
            "AND t.shard = s._cdc_shard AND t.commit_lsn <=> s.commit_lsn AND t.seq <=> s.seq "
            f"WHEN MATCHED AND s.action = '{DONE}' THEN DELETE "
            f"WHEN MATCHED AND s.action = '{FAIL}' AND t.reason <> s.reason THEN UPDATE SET t.reason = s.reason"
        ),
        what=f"{cfg.name} quarantine replay resolve ({replay_run})",
    )
    spark.sql(f"REFRESH TABLE {qt}")
    return before - spark.table(qt).filter(F.col("table_name") == name).count()
