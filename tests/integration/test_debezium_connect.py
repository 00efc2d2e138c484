"""Real Debezium: its PostgreSQL connector (3.6.1.Final) in a Kafka Connect worker, writing to a
Kafka broker (4.3.0), both from Maven (devstack.localstack.LocalKafkaConnect), captures the same
two-shard source as our own capture. The records go to the lake as Confluent's S3 sink would
write them (`sink_drain`: one object per topic partition and offset range, the JsonConverter's
values with schemas, tombstones written as `null`), since that sink is not on Maven Central.

Through the connector's snapshot and rounds of workload (updates that leave TOASTed content
unchanged, inserts, deletes, primary-key changes, among them key changes of TOASTed rows), the Debezium-fed table equals the source after
every round and equals, row for row, the table our own capture builds from the same source.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from cdc_lakehouse.bootstrap.debezium import bootstrap_debezium

from tests.conftest import make_config
from tests.fixtures.debezium import object_path
from tests.helpers import assert_lake_equals_source
from tests.integration.conftest import DBZ_PASSWORD_MARKER, Source

pytestmark = pytest.mark.slow

PREFIX = "dbz"


class SinkDrain:
    """What Confluent's S3 sink (JsonFormat, DefaultPartitioner, behavior.on.null.values=write)
    would have written since the last drain: per topic partition of the connector's topics, one
    object of the records' values in offset order, named by its first offset."""

    def __init__(self, bootstrap: str, root: Path):
        from confluent_kafka import Consumer

        self.root = root
        self.next: dict[tuple[str, int], int] = {}
        self.records: dict[str, list[dict | None]] = {}
        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "s3-sink", "enable.auto.commit": False})

    def topics(self) -> list[str]:
        names = self.consumer.list_topics(timeout=10).topics
        return sorted(t for t in names if t.startswith(f"{PREFIX}.") or t == f"__debezium-heartbeat.{PREFIX}")

    def drain(self) -> int:
        from confluent_kafka import TopicPartition

        written = 0
        for topic in self.topics():
            for p in self.consumer.list_topics(topic, timeout=10).topics[topic].partitions:
                start = self.next.get((topic, p), 0)
                _, high = self.consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
                if high <= start:
                    continue
                self.consumer.assign([TopicPartition(topic, p, start)])
                values: list[bytes | None] = []
                while len(values) < high - start:
                    for m in self.consumer.consume(high - start - len(values), timeout=10):
                        assert m.error() is None, m.error()
                        values.append(m.value())
                path = object_path(self.root, topic, p, start, "json")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("".join(f"{v.decode() if v is not None else 'null'}\n" for v in values))
                self.records.setdefault(topic, []).extend(json.loads(v) if v else None for v in values)
                self.next[(topic, p)] = high
                written += len(values)
        return written

    def wait_for(self, topic: str, key: int, version: int, timeout: float = 120) -> None:
        """Drain until `topic` holds the change that set row `key` to `version`: every earlier
        change of that table's shard is then in the sink (one partition, in WAL order)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            self.drain()
            for r in self.records.get(topic, []):
                after = (r or {}).get("payload", {}).get("after") or {}
                if after.get("id") == key and after.get("version") == version:
                    return
            time.sleep(0.5)
        raise AssertionError(f"Debezium did not deliver {topic} id={key} version={version} in {timeout}s")

    def close(self) -> None:
        self.consumer.close()


def mark(s: Source) -> dict[str, tuple[int, int]]:
    """One last change per shard, whose arrival in Kafka means the shard's earlier ones are there."""
    out = {}
    for schema in s.schemas:
        rows = s.pg.execute(
            f"UPDATE {schema}.block SET version = version + 1 WHERE id = (SELECT min(id) FROM {schema}.block) "
            "RETURNING id, version",
            dbname=s.db,
        )
        out[f"{PREFIX}.{schema}.block"] = rows[0]
    return out


def connector_config(s: Source, slot: str) -> dict[str, str]:
    return {
        "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "database.hostname": "127.0.0.1",
        "database.port": str(s.pg.port),
        "database.user": "postgres",
        "database.password": "${env:CDC_DBZ_PG_PASSWORD}",  # the worker's environment (Kafka's EnvVarConfigProvider)
        "database.dbname": s.db,
        "topic.prefix": PREFIX,
        "plugin.name": "pgoutput",
        "slot.name": slot,
        "publication.name": f"{slot}_pub",
        "publication.autocreate.mode": "filtered",
        "table.include.list": ",".join(f"{schema}.block" for schema in s.schemas),
        "snapshot.mode": "initial",
        "heartbeat.interval.ms": "500",
    }


def test_debezium_connector_output_builds_the_lake_our_capture_builds(
    pg, source_uri, spark, lake, kafka_connect, tmp_root, unique
):
    s = Source(pg, spark, lake, unique, schemas=("s0", "s1"), blocks=300)
    root = tmp_root / f"dbz_sink_{unique}"
    shards = {"conn_id": "cdc_test_source", "database": s.db, "schemas": s.schemas}
    dbz = make_config(
        f"dbz_{unique}",
        [],
        source={"table": "block", "shards": [shards]},
        landing={"kind": "debezium_s3", "uri": f"file://{root}", "topic_prefix": PREFIX},
    )
    sink = SinkDrain(kafka_connect.bootstrap, root)
    name = f"dbz_{unique}"
    try:
        s.capture()
        s.bootstrap(s.block)
        kafka_connect.add_connector(name, connector_config(s, f"dbz_{unique}"))
        for topic, (key, version) in mark(s).items():
            sink.wait_for(topic, key, version)
        bootstrap_debezium(spark, lake, dbz)

        for rnd in range(2):
            s.wl.step(200, pk_changes=2)
            s.execute("DELETE FROM s1.block WHERE id IN (SELECT id FROM s1.block ORDER BY id LIMIT 3)")
            # A key change that leaves the TOASTed content alone, on every shard: Debezium writes a
            # delete and a create whose content is a placeholder (landing.debezium.plan.paired_key_changes).
            for schema in s.schemas:
                s.execute(
                    f"UPDATE {schema}.block SET id = id + 50000000 WHERE id = (SELECT max(id) FROM {schema}.block "
                    "WHERE length(content) > 2000 AND id % 100000000 < 50000000)"
                )
            for topic, (key, version) in mark(s).items():
                sink.wait_for(topic, key, version)
            r = s.ingest(dbz, None, run=f"dbz-{rnd}")
            assert r.metrics.status == "ok" and r.metrics.events_read > 0, r
            ours = s.ingest(s.block, s.capture().manifest.run_id, run=f"ours-{rnd}")
            assert ours.metrics.status == "ok", ours

            rows = assert_lake_equals_source(spark, lake, dbz, s.dsn)
            assert assert_lake_equals_source(spark, lake, s.block, s.dsn) == rows > 0
            cols = [
                c.name
                for c in spark.table(lake.qualified(s.block.current_table)).schema
                if not c.name.startswith("_cdc_")
            ]
            mine = spark.table(lake.qualified(s.block.current_table)).select("_cdc_shard", *cols)
            theirs = spark.table(lake.qualified(dbz.current_table)).select("_cdc_shard", *cols)
            assert mine.exceptAll(theirs).count() == 0 and theirs.exceptAll(mine).count() == 0

        changes = [r["payload"] for rs in sink.records.values() for r in rs if r and "op" in r.get("payload", {})]
        placeholders = sum(json.dumps(p).count("__debezium_unavailable_value") for p in changes)
        moved = [p for p in changes if p["op"] == "c" and "__debezium_unavailable_value" in json.dumps(p["after"])]
        assert placeholders > 0 and len(moved) >= 4, (placeholders, len(moved))
        ops = {
            t: sorted({(r or {}).get("payload", {}).get("op") for r in rs} - {None}) for t, rs in sink.records.items()
        }
        print(f"debezium records per topic: { {t: len(rs) for t, rs in sink.records.items()} }, ops {ops}, "
              f"{placeholders} unavailable-value placeholders, {rows} rows in both lakes")  # fmt: skip
        state = kafka_connect.connector_state(name)
        assert state["connector"]["state"] == "RUNNING", state
        # The password reached the connector from the worker's environment only.
        for f in kafka_connect.workdir.glob("*"):
            if f.is_file():
                assert DBZ_PASSWORD_MARKER not in f.read_text(errors="replace"), f
    finally:
        sink.close()
        try:
            kafka_connect.delete_connector(name)
        finally:
            s.close()
