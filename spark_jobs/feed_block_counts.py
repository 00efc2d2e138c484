"""spark-submit entry point of the feed_block_counts job: parameters and main in cdc_lakehouse.jobs.feed_block_counts."""

from cdc_lakehouse.jobs.registry import run_job

if __name__ == "__main__":
    raise SystemExit(run_job("feed_block_counts"))
