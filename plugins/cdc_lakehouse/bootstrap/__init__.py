"""Bootstrap: a consistent snapshot of every shard into the lake, handed to the change stream.

Runs on the Spark driver (source reads on the executors, under exported snapshots: Spark's JDBC
reader by default, or COPY into Arrow with `bootstrap.reader: copy`).

  run        bootstrap of one table: snapshots, changelog rows, current table, watermark
  snapshot   the handoff: slots, exported snapshots, ctid ranges, text reads, typed rows
  copy_read  the COPY -> Arrow reader (mapInArrow on the executors)
  chunked    the online chunked mode (bootstrap.mode: chunked): DBLog-style chunks, resumable
  chunks     its source side: keyset chunk queries between low/high WAL watermark messages
  progress   its progress rows in cdc_meta.bootstrap_progress
"""
