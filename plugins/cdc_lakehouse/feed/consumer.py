"""The demo's feed consumer: blocks per space and creation day (UTC), kept incrementally.

Each run reads the block table's net changes since its offset, with each key's row at the
offset (`_feed_before`): a key counts -1 where it was and +1 where it is now, and only the
(space, day) pairs that moved are merged. The output is an Iceberg table whose commit carries
the offset (feed.offsets, exactly once): a run killed anywhere neither skips nor repeats a
change, which a count would show at once (a repeat counts a block twice).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.feed.models import BEFORE_COL, FEED_OP_COL, OP_UPSERT, check_consumer_name
from cdc_lakehouse.feed.offsets import commit_with_offsets, hold_offsets, output_offsets
from cdc_lakehouse.feed.read import read_changes
from cdc_lakehouse.identifiers import check_lake_ident
from cdc_lakehouse.lake.batches import BatchId
from cdc_lakehouse.lake.commits import sql_with_commit_properties
from cdc_lakehouse.lake.holds import DEFAULT_MAX_LAG_HOURS
from cdc_lakehouse.lake.tables import create_table_sql, ensure_namespace
from cdc_lakehouse.runtime.phases import local_checkpoint
from cdc_lakehouse.settings import LakeSettings

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

COUNT_COLUMNS = [("space_id", "bigint"), ("day", "date"), ("blocks", "bigint")]
SPACE, CREATED = "space_id", "created_at"


@dataclass(frozen=True)
class ConsumerResult:
    """What one run of the consumer did: the range it read (feed.plan) and what it committed."""

    mode: str  # the range's: full | changelog | diff | noop
    reason: str
    snapshot_id: int  # read up to (inclusive)
    committed: bool  # False: nothing new, or another run of the same range committed it
    pairs: int  # (space, day) pairs written

    def to_dict(self) -> dict[str, Any]:
        """For the job's result line."""
        return asdict(self)


def ensure_output(spark: SparkSession, lake: LakeSettings, output: str) -> str:
    ns, name = output.split(".", 1)
    check_lake_ident(ns, "feed output namespace")
    check_lake_ident(name, "feed output table")
    ensure_namespace(spark, lake, ns)
    table = lake.qualified(output)
    spark.sql(create_table_sql(table, COUNT_COLUMNS, "", {"format-version": "2"}))
    return table


def _deltas(rows: DataFrame) -> DataFrame:
    """(space_id, day, delta): +1 where a key is now, -1 where it was; pairs that net to 0 dropped."""
    from pyspark.sql import functions as F

    now = rows.filter(F.col(FEED_OP_COL) == OP_UPSERT).select(
        F.col(SPACE).alias("space_id"), F.to_date(F.col(CREATED)).alias("day"), F.lit(1).alias("d")
    )
    was = rows.filter(F.col(BEFORE_COL).isNotNull()).select(
        F.col(f"{BEFORE_COL}.{SPACE}").alias("space_id"),
        F.to_date(F.col(f"{BEFORE_COL}.{CREATED}")).alias("day"),
        F.lit(-1).alias("d"),
    )
    summed = now.unionByName(was).groupBy("space_id", "day").agg(F.sum("d").cast("bigint").alias("delta"))
    return summed.filter(F.col("delta") != 0)


def block_counts(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    *,
    consumer: str = "block_counts",
    output: str = "feed.block_counts",
    upto: int | None = None,
    mode: str = "auto",
    max_lag_hours: int = DEFAULT_MAX_LAG_HOURS,
) -> ConsumerResult:
    """One incremental run (mode=full: a reset, every live row replaces the counts); returns what
    it did (mode, range, pairs changed)."""
    from pyspark.sql import functions as F

    check_consumer_name(consumer)
    table = ensure_output(spark, lake, output)
    committed = output_offsets(spark, table, consumer)
    since = None if mode == "full" else committed.get(cfg.current_table)
    batch = read_changes(spark, lake, cfg, consumer, since, upto=upto, with_before=True)
    rng = batch.range
    if rng.mode == "noop":
        hold_offsets(spark, lake.catalog_name, consumer, committed.values(), max_lag_hours)
        return ConsumerResult(rng.mode, rng.reason, rng.snapshot_id, committed=False, pairs=0)
    for c in (SPACE, CREATED):
        if c not in batch.rows.columns:
            raise ValueError(
                f"{cfg.current_table}: column {c!r} is missing; the block_counts consumer needs {SPACE} and "
                f"{CREATED}: point --tables at the block table"
            )
    if rng.replaces_state:
        counts = batch.rows.groupBy(F.col(SPACE).alias("space_id"), F.to_date(F.col(CREATED)).alias("day"))
        out = local_checkpoint(counts.agg(F.count(F.lit(1)).alias("blocks")))

        def write(target: str, props: dict[str, str]) -> None:
            w = out.writeTo(target)
            for k, v in props.items():
                w = w.option(f"snapshot-property.{k}", v)
            w.overwrite(F.lit(True))

        pairs = out.count()
    else:
        deltas = local_checkpoint(_deltas(batch.rows))
        pairs = deltas.count()
        write = _merge_writer(spark, consumer, deltas, pairs)
    # One output table: the offsets already make its commit exactly once; the batch id (lake.batches)
    # marks it like every other multi-table run's commits, from the range it applies.
    start = {t: o.snapshot_id for t, o in committed.items()}
    batch_id = BatchId.of(f"feed:{consumer}:{table}", start, {cfg.current_table: rng.offset.snapshot_id})
    done = commit_with_offsets(
        spark,
        table,
        consumer,
        committed,
        [rng.offset],
        lambda target, props: write(target, {**props, **batch_id.props()}),
        max_lag_hours=max_lag_hours,
    )
    return ConsumerResult(rng.mode, rng.reason, rng.snapshot_id, committed=done, pairs=pairs)


def _merge_writer(spark: SparkSession, consumer: str, deltas: DataFrame, pairs: int):
    """The commit of an incremental run: a MERGE of the deltas, or (nothing to count) an empty
    append, which still commits a snapshot, so the offset moves past ranges that change no count."""

    def write(target: str, props: dict[str, str]) -> None:
        if pairs == 0:
            w = deltas.selectExpr("space_id", "day", "delta AS blocks").writeTo(target)
            for k, v in props.items():
                w = w.option(f"snapshot-property.{k}", v)
            w.append()
            return
        view = f"feed_deltas_{consumer}"
        deltas.createOrReplaceTempView(view)
        sql_with_commit_properties(
            spark,
            f"MERGE INTO {target} t USING {view} s ON t.space_id = s.space_id AND t.day = s.day "
            "WHEN MATCHED AND t.blocks + s.delta = 0 THEN DELETE "
            "WHEN MATCHED THEN UPDATE SET t.blocks = t.blocks + s.delta "
            "WHEN NOT MATCHED THEN INSERT (space_id, day, blocks) VALUES (s.space_id, s.day, s.delta)",
            props,
        )

    return write
