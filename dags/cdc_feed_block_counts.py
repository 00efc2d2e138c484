"""Airflow DAG of an example change-feed consumer: blocks per space and creation day, kept incrementally from the
block table's feed (logic in cdc_lakehouse.feed.consumer; contract in docs/change-feed.md)."""

from cdc_lakehouse.orchestration.dag_parts import feed_consumer_dag

dag = feed_consumer_dag(
    table="block",
    consumer="block_counts",
    job="feed_block_counts",
    output="feed.block_counts",
    about="Blocks per `space_id` and day of `created_at` (UTC), in `lake.feed.block_counts`.",
)
