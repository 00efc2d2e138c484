"""The change feed from Spark: the net changes of a table since a consumer's offset, one row
per lake key, bounded by a complete snapshot (see feed.plan and docs/change-feed.md).

Each row: `_feed_op` (upsert | delete), the lake key (`_cdc_shard` + primary key), and the
table's columns at the range's snapshot (NULL for a delete). With `with_before=True` a struct
`_feed_before` holds the key's live row at the offset's snapshot (NULL when it had none): a
consumer keeping aggregates subtracts it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.feed.models import (
    BEFORE_COL,
    FEED_OP_COL,
    OP_DELETE,
    OP_UPSERT,
    FeedOffset,
    FeedRange,
    check_consumer_name,
)
from cdc_lakehouse.feed.plan import plan_range
from cdc_lakehouse.lake import ranges
from cdc_lakehouse.lake.ranges import KeyRange, table_snapshots
from cdc_lakehouse.settings import LakeSettings

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession


@dataclass
class FeedBatch:
    """One read: the range it covers (commit `range.offset` with the output) and its rows."""

    range: FeedRange
    rows: DataFrame


def plan(
    spark: SparkSession, lake: LakeSettings, cfg: TableConfig, consumer: str, since: FeedOffset | None, upto=None
) -> FeedRange:
    check_consumer_name(consumer)
    table = lake.qualified(cfg.current_table)
    snaps, current = table_snapshots(spark, table)
    return plan_range(cfg.current_table, consumer, snaps, current, since, upto)


def read_changes(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    consumer: str,
    since: FeedOffset | None,
    *,
    upto: int | None = None,
    with_before: bool = False,
) -> FeedBatch:
    """The net changes after `since` (None: a first read, every live row) up to the newest
    complete snapshot, or up to snapshot `upto` (an asset event's)."""
    if since is not None and (since.table != cfg.current_table or since.consumer != consumer):
        raise ValueError(f"offset {since} is not consumer {consumer}'s offset of {cfg.current_table}")
    rng = plan(spark, lake, cfg, consumer, since, upto)
    key = cfg.lake_key
    at_hi = live_rows(spark, lake, cfg, rng.snapshot_id)
    if rng.mode == "full":
        rest = [c for c in at_hi.columns if c not in key]
        rows = at_hi.select(F_lit_op(OP_UPSERT), *key, *rest)
        return FeedBatch(rng, rows.withColumn(BEFORE_COL, _null_struct(at_hi)) if with_before else rows)
    if rng.mode == "noop":
        return FeedBatch(rng, net_rows(at_hi.select(*key).limit(0), at_hi, at_hi, key, with_before))
    assert since is not None, "without an offset the range is full"
    at_lo = live_rows(spark, lake, cfg, since.snapshot_id)
    keys = ranges.changed_keys(spark, lake, cfg, _key_range(rng), at_lo, at_hi)
    if keys.found_by != rng.mode:  # a truncate or re-bootstrap marker: vanished keys are in no changelog row
        rng = replace(rng, mode="diff", reason=keys.reason)
    return FeedBatch(rng, net_rows(keys.keys, at_lo, at_hi, key, with_before))


def _key_range(rng: FeedRange) -> KeyRange:
    assert rng.since is not None and rng.mode != "noop", "a changelog or diff range"
    return KeyRange(rng.since.snapshot_id, rng.snapshot_id, rng.mode, rng.reason, rng.lo_watermark, rng.watermark)


def F_lit_op(op: str) -> Column:  # noqa: N802 - reads as the literal it builds
    from pyspark.sql import functions as F

    return F.lit(op).alias(FEED_OP_COL)


def live_rows(spark: SparkSession, lake: LakeSettings, cfg: TableConfig, snapshot_id: int) -> DataFrame:
    """The table's rows at a snapshot, soft-deleted rows left out (to a consumer they are deletes)."""
    return ranges.live_rows(spark, lake.qualified(cfg.current_table), cfg, snapshot_id)


def _null_struct(df: DataFrame) -> Column:
    from pyspark.sql import functions as F

    return F.lit(None).cast(df.select(F.struct(*df.columns).alias("s")).schema["s"].dataType)


def net_rows(keys: DataFrame, at_lo: DataFrame, at_hi: DataFrame, key: list[str], with_before: bool) -> DataFrame:
    """One row per changed key: its row at the head (upsert) or nothing there (delete)."""
    from pyspark.sql import functions as F

    now = at_hi.withColumn("_feed_present", F.lit(True))
    out = keys.join(now, key, "left")
    op = F.when(F.col("_feed_present"), F.lit(OP_UPSERT)).otherwise(F.lit(OP_DELETE)).alias(FEED_OP_COL)
    rest = [c for c in at_hi.columns if c not in key]
    cols = [op, *[F.col(c) for c in key], *[F.col(c) for c in rest]]
    if with_before:
        before = at_lo.select(*[F.col(c).alias(f"_b_{c}") for c in key], F.struct(*at_lo.columns).alias(BEFORE_COL))
        out = out.join(before, [out[c] == before[f"_b_{c}"] for c in key], "left")
        cols.append(F.col(BEFORE_COL))
    return out.select(*cols)
