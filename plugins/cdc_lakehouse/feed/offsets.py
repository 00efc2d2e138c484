"""Committed feed offsets, per consumer and per table, stored in the lake.

Exactly once (output is an Iceberg table): the offsets ride in the `cdc.feed.offsets` snapshot
property of the very commit that writes the output, as the ingest's watermark does. A run that
dies before that commit leaves neither output nor offset (the next run reads the same range
again); one that dies after it leaves both (the next run starts after it). The commit is fenced
on the offsets the run started from when it is published (lake.commits.fenced_commit), so a
zombie or a second run of the consumer cannot apply a range twice.

At least once (any other output): the offset is appended to `cdc_meta.feed_offsets` after the
output was written. A crash in between makes the next run deliver the same range again, so such
a sink must be idempotent (an upsert by key, or a replace of the range's partitions).

Either way, once the offset is committed the consumer holds its snapshot of each table it read
(lake.holds, tag `cdc_consumer_feed_<consumer>`) for `max_lag_hours`, so maintenance keeps it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from cdc_lakehouse.feed.models import FeedError, FeedOffset, OffsetConflictError, check_consumer_name
from cdc_lakehouse.lake.commits import fenced_commit, with_commit_retries
from cdc_lakehouse.lake.holds import DEFAULT_MAX_LAG_HOURS, hold
from cdc_lakehouse.lake.snapshots import current_ancestors
from cdc_lakehouse.lake.tables import create_table_sql, ensure_namespace
from cdc_lakehouse.runtime.failpoints import crash_point
from cdc_lakehouse.settings import LakeSettings

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

OFFSETS_PROP = "cdc.feed.offsets"
META_NAME = "feed_offsets"
META_COLUMNS = [
    ("consumer", "string"),
    ("table_name", "string"),
    ("snapshot_id", "bigint"),
    ("watermark", "string"),  # shard -> exclusive LSN, JSON
    ("seq", "bigint"),  # 1, 2, ... per consumer and table: the newest row wins, clocks never decide
    ("committed_at", "timestamp"),
]

# --- exactly once: in the output's own commit -------------------------------------------------------


def offsets_property(consumer: str, offsets: list[FeedOffset]) -> dict[str, str]:
    """The snapshot property to commit with the output: {consumer, tables: {table: offset}}."""
    tables = {o.table: {"snapshot_id": o.snapshot_id, "watermark": o.watermark} for o in offsets}
    if any(o.consumer != consumer for o in offsets):
        raise ValueError(f"offsets of another consumer given to {consumer}")
    return {OFFSETS_PROP: json.dumps({"consumer": consumer, "tables": tables}, separators=(",", ":"), sort_keys=True)}


def output_offsets(spark: SparkSession, output_table: str, consumer: str) -> dict[str, FeedOffset]:
    """The offsets committed with the output table's newest snapshot that carries them (later
    compactions or expiry carry none); {} when the table or its offsets do not exist yet."""
    check_consumer_name(consumer)
    if not spark.catalog.tableExists(output_table):
        return {}
    spark.sql(f"REFRESH TABLE {output_table}")
    return offsets_in(current_ancestors(spark, output_table), output_table, consumer)


def offsets_in(snapshots: Iterable[Any], output_table: str, consumer: str) -> dict[str, FeedOffset]:
    """The consumer's offsets as of the first snapshot of a chain (newest first) of the output."""
    for snap in snapshots:
        raw = snap.summary.get(OFFSETS_PROP)
        if raw is None:
            continue
        data = json.loads(raw)
        if data.get("consumer") != consumer:
            raise FeedError(
                f"{output_table}: its offsets belong to consumer {data.get('consumer')!r}, not {consumer!r}; "
                "give each consumer its own output table"
            )
        return {
            t: FeedOffset(consumer=consumer, table=t, snapshot_id=o["snapshot_id"], watermark=o["watermark"])
            for t, o in data["tables"].items()
        }
    return {}


def commit_with_offsets(
    spark: SparkSession,
    output_table: str,
    consumer: str,
    expected: dict[str, FeedOffset],
    new: list[FeedOffset],
    write: Callable[[str, dict[str, str]], None],
    *,
    max_lag_hours: int = DEFAULT_MAX_LAG_HOURS,
) -> bool:
    """Run `write(target, props)`, which must make exactly one Iceberg commit to `target` carrying
    `props` (DataFrameWriterV2 on `target` with `.option("snapshot-property.<k>", v)`, or
    lake.commits.sql_with_commit_properties for SQL on it). `target` is a branch of the output
    (lake.commits.fenced_commit): the commit is published only while the committed offsets are
    still `expected`, checked when it is published, so a second run of the consumer that
    committed in between (a zombie, a second deployment) makes this one raise OffsetConflictError
    with nothing of it visible. Returns False when this very commit (the same range from the same
    offsets) had already landed: an earlier attempt whose outcome was unknown, or another run.
    Once the offsets are published, holds their snapshots (hold_offsets)."""
    props = offsets_property(consumer, new)
    want = {**expected, **{o.table: o for o in new}}

    def conflict(now: dict[str, FeedOffset]) -> OffsetConflictError:
        return OffsetConflictError(
            f"consumer {consumer}: {output_table} was committed by another run since this one read its "
            f"offsets ({_brief(expected)} -> {_brief(now)}); nothing of this run was published. Check for a "
            "second deployment or a run that outlived its task, then rerun"
        )

    def _write(target: str) -> None:
        crash_point("feed_before_output_commit")
        write(target, props)

    done = fenced_commit(
        spark,
        output_table,
        expected,
        want,
        _write,
        what=f"feed {consumer} -> {output_table}",
        position=lambda snapshots: offsets_in(snapshots, output_table, consumer),
        conflict=conflict,
    )
    if done:
        crash_point("feed_after_output_commit")
    # After the publish, never before: a run fenced out must not move the winner's hold. The
    # tables read live in the output's catalog: the feed reads one lake.
    hold_offsets(spark, output_table.split(".", 1)[0], consumer, new, max_lag_hours)
    return done


def hold_offsets(
    spark: SparkSession, catalog: str, consumer: str, offsets, max_lag_hours: int = DEFAULT_MAX_LAG_HOURS
) -> None:
    """Hold each offset's snapshot of its table (lake.holds) for `max_lag_hours`. After every
    offset commit, and on a run with nothing new (a noop), so that a consumer which keeps up
    keeps its hold while the table is quiet. A crash before it leaves the previous, older hold."""
    for o in offsets:
        hold(spark, f"{catalog}.{o.table}", "feed", consumer, o.snapshot_id, max_lag_hours)


def _brief(offsets: dict[str, FeedOffset]) -> str:
    return json.dumps({t: o.snapshot_id for t, o in sorted(offsets.items())})


# --- at least once: cdc_meta.feed_offsets ------------------------------------------------------------


def ensure_offsets_table(spark: SparkSession, lake: LakeSettings) -> str:
    ensure_namespace(spark, lake, lake.meta_namespace)
    table = lake.qualified(lake.meta_table(META_NAME))
    props = {"format-version": "2", "commit.retry.num-retries": "20"}
    spark.sql(create_table_sql(table, META_COLUMNS, "", props))
    return table


def meta_offset(spark: SparkSession, lake: LakeSettings, consumer: str, table: str) -> tuple[FeedOffset | None, int]:
    """(the consumer's committed offset of `table`, its seq); (None, 0) before its first commit."""
    from pyspark.sql import functions as F

    check_consumer_name(consumer)
    t = ensure_offsets_table(spark, lake)
    spark.sql(f"REFRESH TABLE {t}")
    rows = spark.table(t).filter((F.col("consumer") == consumer) & (F.col("table_name") == table))
    top = rows.orderBy(F.col("seq").desc()).limit(1).collect()
    if not top:
        return None, 0
    r = top[0]
    offset = FeedOffset(
        consumer=consumer, table=table, snapshot_id=r["snapshot_id"], watermark=json.loads(r["watermark"])
    )
    return offset, int(r["seq"])


def commit_meta_offset(
    spark: SparkSession,
    lake: LakeSettings,
    offset: FeedOffset,
    expected: FeedOffset | None,
    *,
    max_lag_hours: int = DEFAULT_MAX_LAG_HOURS,
) -> None:
    """Record `offset` after the output was written (at least once), then hold its snapshot
    (hold_offsets). Fenced on `expected`: a second run of the consumer that committed in between
    makes this one fail loudly."""
    from datetime import UTC, datetime

    def attempt() -> None:
        now, seq = meta_offset(spark, lake, offset.consumer, offset.table)
        if now == offset:
            return
        if now != expected:
            raise OffsetConflictError(
                f"consumer {offset.consumer}: its offset of {offset.table} moved since this run read it "
                f"({expected and expected.snapshot_id} -> {now and now.snapshot_id}); the output of this run "
                "is already written (at-least-once sink): rerun, and the range is delivered again"
            )
        row = (offset.consumer, offset.table, offset.snapshot_id, json.dumps(offset.watermark, sort_keys=True))
        schema = ", ".join(f"{c} {t}" for c, t in META_COLUMNS)
        df = spark.createDataFrame([(*row, seq + 1, datetime.now(UTC).replace(tzinfo=None))], schema)
        df.writeTo(lake.qualified(lake.meta_table(META_NAME))).append()

    with_commit_retries(attempt, what=f"feed offset {offset.consumer}/{offset.table}")
    hold_offsets(spark, lake.catalog_name, offset.consumer, [offset], max_lag_hours)
