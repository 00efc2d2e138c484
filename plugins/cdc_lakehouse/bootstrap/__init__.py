"""Bootstrap: a consistent snapshot of every shard into the lake, handed to the change stream.

Runs on the Spark driver (source reads on the executors, under exported snapshots, in the lake's
types: Spark's JDBC reader by default, or binary COPY into Arrow with `bootstrap.reader: copy`).

  bootstrap_table  bootstrap of one table: snapshots, changelog rows, current table, watermark
  snapshot   the handoff: slots, exported snapshots, ctid ranges, the typed reads
  typed_select  the select list in lake types, with PostgreSQL's "does not fit" check
  copy_read  the binary COPY -> Arrow reader (ADBC, mapInArrow on the executors)
  chunked    the online chunked mode (bootstrap.mode: chunked): DBLog-style chunks, resumable
  chunks     its source side: keyset chunk queries between low/high WAL watermark messages
  progress   its progress rows in cdc_meta.bootstrap_progress
  column     a one-column backfill, chunked the same way
  debezium   a Debezium-fed table's bootstrap: its lake tables, at the start of the connector's topics
"""
