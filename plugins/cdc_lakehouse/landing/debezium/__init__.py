"""landing.debezium: Debezium's PostgreSQL connector, through Confluent's S3 sink, as a landing source
(docs/debezium.md).

The sink writes one object per topic partition and offset range:

    <uri>/<topics.dir>/<topic>/partition=<p>/<topic>+<p>+<startOffset>.<json|json.gz|avro>

with one record per Kafka record, in offset order (JsonFormat with schemas.enable=true: one
`{"schema": ..., "payload": ...}` per line; AvroFormat: an Avro container file). Table topics are
`<topic.prefix>.<schema>.<table>`, heartbeats `__debezium-heartbeat.<topic.prefix>`.

This module turns those files into exactly the landing events of our own capture
(landing.format.EVENT_SCHEMA), so validation, pre-combine, TOAST fill, MERGE and the watermark
are unchanged. The pure conversion (record -> event row) runs on the executors; the planner runs
on the driver, stages the batch's events as landing Parquet (read by the ingest like our capture's
files) and keeps, in the table's watermark under `debezium`, the next Kafka offset of every topic
partition (a rerun skips what is below it), each partition's last position and, per shard, the
partition that holds its frontier. A shard's watermark sits strictly above every event applied
and at or below every event not applied (`frontiers`), as our capture's does.

Pure Python at import time: pyspark and fastavro are imported inside the functions that need them.

The package, along the data path:
- connect_types: a column's Connect schema -> its PostgreSQL and lake types; a value -> its text;
- records: sink files -> records -> landing event rows (executors);
- plan: the driver's plan of one ingest: pending files, frontiers, staging, the next watermark.
A Debezium-fed table's bootstrap (its lake tables from the connector's snapshot events) is
bootstrap.debezium.
"""
