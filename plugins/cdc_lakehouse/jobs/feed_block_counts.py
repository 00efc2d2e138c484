"""The example feed consumer's job (spark_jobs/feed_block_counts.py): blocks per space and creation
day, kept incrementally from the block table's feed (feed.consumer.block_counts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cdc_lakehouse.jobs.feed import FeedConsumerParams
from cdc_lakehouse.jobs.params import flag
from cdc_lakehouse.jobs.runner import StageResult, load_tables, run_per_table

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from cdc_lakehouse.config import TableConfig
    from cdc_lakehouse.settings import LakeSettings


@dataclass(frozen=True, kw_only=True)
class BlockCountsParams(FeedConsumerParams):
    """A consumer's parameters with the example's names as defaults: by hand, --tables is enough."""

    description = "Feed consumer: blocks per space and day (docs/change-feed.md)"

    consumer: str = flag("block_counts", help="the consumer's name: its offsets and holds carry it")
    output: str = flag("feed.block_counts", help="namespace.table of its Iceberg output")


def main(p: BlockCountsParams) -> int:
    def fn(spark: SparkSession, lake: LakeSettings, cfg: TableConfig, file: str | None) -> StageResult:
        from cdc_lakehouse.feed.consumer import block_counts

        return block_counts(
            spark,
            lake,
            cfg,
            consumer=p.consumer,
            output=p.output,
            upto=p.upto,
            mode=p.mode,
            max_lag_hours=p.max_lag_hours,
        )

    return run_per_table("feed", p.app_name, lambda: load_tables(p.config_dir, p.tables), fn)
