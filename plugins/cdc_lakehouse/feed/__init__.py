"""The change feed: what a table gained since a consumer last looked, exactly once.

  models    FeedOffset, FeedRange, SnapshotInfo and the feed's errors (typed, pure Python)
  plan      which range a read covers and how it is computed (changelog, snapshot diff, full)
  read      the net changes as a Spark DataFrame (one row per lake key: upsert or delete)
  arrow     the same from pyiceberg as a pyarrow Table, for small consumers without Spark
  offsets   committed offsets: in the consumer's Iceberg output commit, or in cdc_meta.feed_offsets
  consumer  the demo consumer: blocks per space and day, kept incrementally through the feed

The contract (ordering, net changes across key changes, truncates and re-bootstraps) is in
docs/change-feed.md. Nothing here imports Spark or pyiceberg at module level: DAG files reach it.
"""
