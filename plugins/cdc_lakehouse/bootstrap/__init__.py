"""Bootstrap: a consistent snapshot of every shard into the lake, handed to the change stream.

Runs on the Spark driver (source reads through JDBC on the executors, under exported snapshots).

  run       bootstrap of one table: snapshots, changelog rows, current table, watermark
  snapshot  the handoff: slots, exported snapshots, ctid ranges, text reads, typed rows
"""
