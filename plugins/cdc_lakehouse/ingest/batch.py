"""The batch as one Spark plan (issue #16): the landing files are read once, and validation, casts,
deduplication, key-change splitting, the TOAST fill and the choice of the latest event per key
are one DataFrame plan, checkpointed once. The quarantine, the changelog append and the MERGE
read that result; the counters the phases need are observed in one pass over the checkpointed
rows (a narrow job over kept blocks).

Rows of the result, told apart by flags:
    LIVE      a valid row change not yet in the table (one row per half of a key change)
    DUP       a repeated delivery of the event before it (same shard, commit LSN, seq)
    LATEST    the key's latest event: what the MERGE applies
    malformed rows (REASONS not empty) and truncates (op 't') are not LIVE

Every per-key step is a window over (LIVE, shard, key) in (commit LSN, seq) order, so the plan
shuffles the batch once. What one pass cannot decide (an unchanged TOAST value that must come
from the old key of a key change, or a column of an unexpected type) is counted here and left to
the multi-pass fill in ingest.toast.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, Self

from cdc_lakehouse.columns import COMMIT_TS_COL, LSN_COL, OP_COL, SEQ_COL, SHARD_COL, UNAVAILABLE_COL
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.ingest.landed import Landed
from cdc_lakehouse.ingest.reduce import APPLIED, EVENT_ROW, split_pk_changes
from cdc_lakehouse.ingest.toast import NO_TABLE, UNAV_LEFT
from cdc_lakehouse.ingest.validate import BKEY, PKCHANGE, REASONS, typed_events
from cdc_lakehouse.runtime.phases import Observed, ObservedValue, as_count, as_time, checkpoint_counted
from cdc_lakehouse.watermark import Watermark, shard_lsn_map

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

LIVE = "_live"
DUP = "_dup"
LATEST = "_latest"
_GEN = "_gen"
# Lake types PostgreSQL never TOASTs (fixed width): the one-pass fill skips them.
_FIXED = ("bigint", "int", "smallint", "tinyint", "boolean", "float", "double", "date", "timestamp", "timestamp_ntz")


@dataclass(frozen=True)
class ReducedTotals:
    """The batch's latest event per key, counted: what the MERGE gets. Observed by the fused plan
    (_out_counters), or by ingest.ingest_table.reduced_totals for a batch it could not reduce."""

    reduced: int = 0  # keys, each with its latest event
    upserts: int = 0  # of which not a delete
    needs_base: int = 0  # upserts with unchanged TOAST columns the batch could not fill
    needs_base_no_table: int = 0  # of those, after a delete or key change of the key in the batch
    filled: int = 0  # upserts that arrived with unchanged TOAST columns
    min_ts: datetime | None = None  # commit time of the oldest and the newest of them
    max_ts: datetime | None = None

    @classmethod
    def observed(cls, values: Observed) -> Self:
        """From observed metrics, named as the fields (a sum over no rows comes back NULL: 0)."""
        counts = {f.name: as_count(values.get(f.name)) for f in fields(cls) if f.type == "int"}
        return cls(**counts, min_ts=as_time(values.get("min_ts")), max_ts=as_time(values.get("max_ts")))


@dataclass(frozen=True)
class BatchCounts(ReducedTotals):
    """The fused plan's counters, observed while it is materialized (_in_counters over the typed
    events, _out_counters over the flagged rows); the ReducedTotals fields are its latest events'."""

    n: int = 0  # events of the table in the batch's files
    applied: int = 0  # of which the table already has (below its watermark)
    bad: int = 0  # pending and malformed: to quarantine
    valid: int = 0  # pending valid row changes (truncates apart)
    pk_changes: int = 0  # of which updates that change the key
    truncates: int = 0  # pending valid truncates
    duplicates: int = 0  # repeated deliveries (same shard, commit LSN, seq)
    pk_unresolved: int = 0  # key changes whose new key lacks a TOAST value (the multi-pass fill)
    truncated: list[str] = field(default_factory=list)  # shards truncated in the batch
    unavailable: list[str] = field(default_factory=list)  # unchanged TOAST columns in the batch
    # shard -> {"ts": micros, "lsn"} of its newest source commit in the batch (lake.freshness)
    shard_commits: dict[str, dict[str, int]] = field(default_factory=dict)

    @classmethod
    def observed(cls, values: Observed) -> Self:
        """From the fused plan's observed metrics: the counts, and the JSON texts it aggregates
        (the shards' newest commits, the truncated shards, the unchanged TOAST columns)."""
        unknown = values.keys() - {f.name for f in fields(cls)}
        if unknown:  # a counter no field holds: a misnamed alias would otherwise read as 0
            raise ValueError(f"observed metrics without a BatchCounts field: {sorted(unknown)}")
        commits = _json(values.get("shard_commits")) or {}
        return replace(
            super().observed(values),  # the counts and the commit times
            truncated=sorted(_json(values.get("truncated")) or []),
            unavailable=sorted(_json(values.get("unavailable")) or []),
            shard_commits={shard: commit for shard, commit in commits.items() if commit},
        )


@dataclass
class FusedBatch:
    rows: DataFrame  # materialized: every pending event of the batch, flagged (see the module doc)
    counts: BatchCounts
    filled_columns: list[str]  # the columns the one-pass fill looked at

    def malformed(self) -> DataFrame:
        from pyspark.sql import functions as F

        return self.rows.filter((F.size(REASONS) > 0) & ~F.col(APPLIED))

    def events(self) -> DataFrame:
        """Valid row changes, each once, TOAST-filled: what the changelog appends."""
        from pyspark.sql import functions as F

        return self.rows.filter(F.col(LIVE) & ~F.col(DUP))

    def truncates(self) -> DataFrame:
        from pyspark.sql import functions as F

        return self.rows.filter((F.size(REASONS) == 0) & (F.col(OP_COL) == "t") & ~F.col(DUP) & ~F.col(APPLIED))

    def latest(self) -> DataFrame:
        from pyspark.sql import functions as F

        return self.rows.filter(F.col(LATEST))

    def needs_multipass_fill(self) -> bool:
        """A key change whose new key lacks a TOAST value (it comes from the old key), or an
        unavailable column the one pass did not look at."""
        names = set(self.counts.unavailable)
        return bool(self.counts.pk_unresolved) or not names <= set(self.filled_columns)


# A batch of at most this many landed rows is computed in one task: its per-key windows then need
# no shuffle, and its checkpoint is one Spark job instead of two (adaptive execution runs a
# shuffle's map stage as a job of its own). A small table's batch is tens of rows: 20 of them
# spent 7.0-7.2 s in this phase against 8.6-8.7 s with the shuffle (bench/tables_bench.py
# --tables 20 --job-log; docs/benchmarks-history.md, #56). One task types, splits and windows
# about 40,000 events a second (the 2M bench's 200,000 took 2.2-2.6 s on two), so at this size
# it stays under a second.
SINGLE_TASK_ROWS = 20_000


def fused_batch(
    raw: Landed | DataFrame,
    cfg: TableConfig,
    lake_cols: list[tuple[str, str]],
    watermark: Watermark | None,
    landed_rows: int | None = None,
) -> FusedBatch:
    """Landing rows (ingest.landed, or format-1 rows) -> the batch's flagged events, materialized
    once, with its counters. Events below the watermark are already applied (none without one).
    landed_rows: the rows in the batch's files, where the manifests say (SINGLE_TASK_ROWS)."""
    from pyspark.sql import functions as F

    typed = typed_events(raw, cfg, lake_cols, cfg.shard_map()).filter(F.col(SHARD_COL).isNotNull())
    if landed_rows is not None and landed_rows <= SINGLE_TASK_ROWS:
        typed = typed.coalesce(1)
    # Events the table already has (replays, reruns) are flagged APPLIED and pass by validation,
    # so an old malformed event is not quarantined twice; they are kept only to be counted.
    floor = shard_lsn_map(watermark)
    typed = typed.withColumn(APPLIED, F.col(LSN_COL) < F.coalesce(floor[F.col(SHARD_COL)], F.lit(0)))
    live = ~F.col(APPLIED) & (F.size(REASONS) == 0) & (F.col(OP_COL) != "t")
    events = split_pk_changes(typed, cfg, live=live).withColumn(LIVE, live)
    names = [c for c, t in lake_cols if c not in cfg.primary_key and t.replace(" ", "") not in _FIXED]
    # Computed once into a checkpoint, counted by the job that fills it (runtime.phases.
    # checkpoint_counted). Spark Connect delivers no observed metrics to a checkpoint's command:
    # observing the plan itself meant persisting it, a no-op write, then the checkpoint (11 s
    # against 7 s for an eager checkpoint and a count, for the bench's 200k events at 2M rows); a
    # lazy checkpoint and the count are one job (issue #56).
    rows, seen = checkpoint_counted(_per_key(events, cfg, names), *_in_counters(cfg), *_out_counters())
    # An input with no partitions never runs the observed node: its metrics are then empty (the
    # fields' defaults).
    return FusedBatch(rows, BatchCounts.observed(seen), names)


def _per_key(events: DataFrame, cfg: TableConfig, names: list[str]) -> DataFrame:
    """DUP, the one-pass TOAST fill (UNAV_LEFT, NO_TABLE) and LATEST, all windows over the key."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    part = [LIVE, SHARD_COL, *cfg.primary_key]
    w = Window.partitionBy(*part).orderBy(LSN_COL, SEQ_COL)
    before = w.rowsBetween(Window.unboundedPreceding, -1)
    same_as_prev = (F.lag(LSN_COL).over(w) == F.col(LSN_COL)) & (F.lag(SEQ_COL).over(w) == F.col(SEQ_COL))
    first = F.col(LIVE) & ~F.col(DUP)
    df = events.withColumn(DUP, F.coalesce(same_as_prev, F.lit(False)))
    # A value never crosses a delete of its key: events after the key's n-th delete in the batch
    # look back only within generation n (see ingest.toast._generations).
    df = df.withColumn(
        _GEN, F.coalesce(F.sum((first & (F.col(OP_COL) == "d")).cast("int")).over(before), F.lit(0))
    ).withColumn(LATEST, F.col(LIVE) & F.lead(LSN_COL).over(w).isNull())
    gen = Window.partitionBy(*part, _GEN).orderBy(LSN_COL, SEQ_COL)
    work = F.coalesce(F.col(UNAVAILABLE_COL), F.array().cast("array<string>"))
    prevs: dict[str, Column] = {}
    for c in names:
        # The key's latest earlier event (in its generation) that carried the value.
        src = F.when(first & (F.col(OP_COL) != "d") & ~F.array_contains(work, c), F.struct(F.col(c).alias("v")))
        prevs[f"_prev_{c}"] = F.last(src, ignorenulls=True).over(gen.rowsBetween(Window.unboundedPreceding, -1))
    no_table = (F.col(_GEN) > 0) | F.max(F.col(PKCHANGE).cast("int")).over(
        gen.rowsBetween(Window.unboundedPreceding, 0)
    ).cast("boolean")
    df = df.withColumns({**prevs, NO_TABLE: no_table})
    # Then, per column, take the value where it was missing; the columns still missing are
    # UNAV_LEFT. (Built from the _prev_ columns, not by nesting: a chain of when(.., left) per
    # column would double the expression with every column.)
    takes = {
        c: F.col(LIVE) & F.array_contains(work, c) & ~F.col(PKCHANGE) & F.col(f"_prev_{c}").isNotNull() for c in names
    }
    taken = F.array(*[F.when(t, F.lit(c)) for c, t in takes.items()]) if names else F.array().cast("array<string>")
    cols = {c: F.when(t, F.col(f"_prev_{c}")["v"]).otherwise(F.col(c)) for c, t in takes.items()}
    return df.withColumns({**cols, UNAV_LEFT: F.array_except(work, taken)}).drop(_GEN, *prevs)


def _in_counters(cfg: TableConfig) -> list[Column]:
    """Per typed event (EVENT_ROW), the applied ones included; named as BatchCounts' fields."""
    from pyspark.sql import functions as F

    event = F.col(EVENT_ROW)
    pend = event & ~F.col(APPLIED)
    ok = pend & (F.size(REASONS) == 0)
    pk_change = F.lit(False)
    for k in cfg.primary_key:
        pk_change = pk_change | (F.col(BKEY + k).isNotNull() & ~F.col(BKEY + k).eqNullSafe(F.col(k)))
    return [
        F.sum(event.cast("int")).alias("n"),
        F.sum((event & F.col(APPLIED)).cast("int")).alias("applied"),
        F.sum((pend & (F.size(REASONS) > 0)).cast("int")).alias("bad"),
        F.sum((ok & (F.col(OP_COL) != "t")).cast("int")).alias("valid"),
        F.sum((ok & (F.col(OP_COL) == "u") & pk_change).cast("int")).alias("pk_changes"),
        F.sum((ok & (F.col(OP_COL) == "t")).cast("int")).alias("truncates"),
        # Arrays come back from the JVM as opaque objects: JSON text instead.
        F.to_json(F.collect_set(F.when(ok & (F.col(OP_COL) == "t"), F.col(SHARD_COL)))).alias("truncated"),
        F.to_json(F.array_distinct(F.flatten(F.collect_set(F.when(ok, F.col(UNAVAILABLE_COL)))))).alias("unavailable"),
        # Per shard, the newest source commit seen (lake.freshness records it): one aggregate per
        # configured shard, so the freshness table costs no pass over the landing files.
        F.to_json(
            F.struct(
                *[
                    F.max(
                        F.when(
                            F.col(SHARD_COL) == shard,
                            F.struct(F.unix_micros(COMMIT_TS_COL).alias("ts"), F.col(LSN_COL).alias("lsn")),
                        )
                    ).alias(shard)
                    for _, _, shard in cfg.shards()
                ]
            )
        ).alias("shard_commits"),
    ]


def _out_counters() -> list[Column]:
    """Over the flagged rows: duplicates, and the reduced batch's totals (ReducedTotals); named as
    BatchCounts' fields."""
    from pyspark.sql import functions as F

    latest, upsert = F.col(LATEST), F.col(OP_COL) != "d"
    needs_base = latest & upsert & (F.size(UNAV_LEFT) > 0)
    return [
        F.sum((F.col(LIVE) & F.col(DUP)).cast("int")).alias("duplicates"),
        F.sum(latest.cast("int")).alias("reduced"),
        F.sum((latest & upsert).cast("int")).alias("upserts"),
        F.sum(needs_base.cast("int")).alias("needs_base"),
        F.sum((needs_base & F.col(NO_TABLE)).cast("int")).alias("needs_base_no_table"),
        F.sum((latest & upsert & (F.size(F.coalesce(UNAVAILABLE_COL, F.array())) > 0)).cast("int")).alias("filled"),
        F.sum((F.col(LIVE) & F.col(PKCHANGE) & (F.size(UNAV_LEFT) > 0)).cast("int")).alias("pk_unresolved"),
        F.unix_micros(F.min(F.when(latest, F.col(COMMIT_TS_COL)))).alias("min_ts"),
        F.unix_micros(F.max(F.when(latest, F.col(COMMIT_TS_COL)))).alias("max_ts"),
    ]


def _json(value: ObservedValue) -> Any:
    """An observed JSON text, decoded (None: no text)."""
    return json.loads(value) if isinstance(value, str) and value else None
