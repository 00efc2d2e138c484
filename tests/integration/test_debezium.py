"""A Debezium-fed table end to end: S3-sink objects (JSON with schemas, Avro) -> bootstrap from the
connector's snapshot events -> ingest into real Spark + Iceberg, equal to the expected table after
every batch: TOAST placeholders, deletes with tombstones, a truncate, a new column, partitions that
land out of order, a straddling file, heartbeats, and reruns that converge."""

from __future__ import annotations

from datetime import UTC, date, datetime
from decimal import Decimal

from cdc_lakehouse.ingest.run import ingest_table
from cdc_lakehouse.lake.watermark import read_watermark
from cdc_lakehouse.landing.debezium import bootstrap_debezium
from pyspark.sql import functions as F

from tests.conftest import make_config
from tests.fixtures.debezium import (
    PLACEHOLDER,
    TOMBSTONE,
    change,
    json_line,
    object_path,
    write_avro,
    write_heartbeat,
)

TOPIC = "dbz.s1.orders"
NAMES = ["id", "note", "price", "amount", "created", "updated_at", "day", "active", "ratio", "tags", "data"]


def base(i: int, **changes) -> dict:
    row = {
        "id": i,
        "note": f"note {i}",
        "price": Decimal(f"{i}.25"),
        "amount": Decimal("1.5") * i,
        "created": datetime(2024, 1, i, 10, 0, 0, 500000),  # noqa: DTZ001 (timestamp without time zone)
        "updated_at": datetime(2024, 1, i, 12, 0, 0, 250, tzinfo=UTC),
        "day": date(2024, 1, i),
        "active": i % 2 == 0,
        "ratio": i / 4,
        "tags": [f"t{i}", None],
        "data": bytes([i, 255]),
    }
    return {**row, **changes}


def ev(op, lsn, last_commit, before=None, after=None, snapshot="false"):
    return change(
        op, schema="s1", table="orders", lsn=lsn, last_commit=last_commit, txid=lsn // 100,
        ts_ms=1_700_000_000_000 + lsn, before=before, after=after, snapshot=snapshot,
    )  # fmt: skip


def key_only(i: int) -> dict:
    return {**dict.fromkeys(NAMES), "id": i}


def write(root, partition, start, lines):
    """One sink object of raw lines (events with the schema block they were sent with)."""
    path = object_path(root, TOPIC, partition, start, "json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))


def lake_rows(spark, lake, cfg) -> dict[int, dict]:
    df = spark.table(lake.qualified(cfg.current_table))
    cols = [c for c in [*NAMES, "extra"] if c in df.columns]
    sel = [F.unix_micros(c).alias(c) if c == "updated_at" else F.col(c) for c in cols]
    out = {}
    for r in df.select(*sel).collect():
        d = r.asDict()
        d["data"] = bytes(d["data"]) if d["data"] is not None else None
        out[d["id"]] = d
    return out


def expected(rows: dict[int, dict]) -> dict[int, dict]:
    out = {}
    for i, r in rows.items():
        d = {**r, "updated_at": int((r["updated_at"] - datetime(1970, 1, 1, tzinfo=UTC)).total_seconds() * 1e6)}
        out[i] = d
    return out


def assert_table(spark, lake, cfg, rows: dict[int, dict], extra: dict[int, int | None] | None = None):
    got = lake_rows(spark, lake, cfg)
    want = expected(rows)
    if extra is not None:
        want = {i: {**r, "extra": extra.get(i)} for i, r in want.items()}
    assert sorted(got) == sorted(want)
    for i in want:
        assert got[i] == want[i], (i, got[i], want[i])


def test_json_sink_full_ingest_with_toast_deletes_truncate_schema_change_and_reruns(spark, lake, tmp_root, unique):
    root = tmp_root / f"sink_{unique}"
    cfg = make_config(
        f"dbz_{unique}", ["s1"], table="orders",
        landing={"kind": "debezium_s3", "uri": f"file://{root}", "topic_prefix": "dbz", "partitions": 2},
    )  # fmt: skip
    big = "x" * 6000
    # Snapshot at LSN 1000 (rows 1..4, split over the two partitions by key), then transaction A
    # (last commit 1000) touching both partitions.
    write(root, 0, 0, [json_line(ev("r", 1000, None, after=base(2), snapshot="true")),
                       json_line(ev("r", 1000, None, after=base(4), snapshot="last")),
                       json_line(ev("u", 1101, 1000, after=base(2, price=Decimal("99.99"))))])  # fmt: skip
    write(root, 1, 0, [json_line(ev("r", 1000, None, after=base(1), snapshot="true")),
                       json_line(ev("r", 1000, None, after=base(3), snapshot="true")),
                       json_line(ev("c", 1100, 1000, after=base(5, note=big)))])  # fmt: skip
    bootstrap_debezium(spark, lake, cfg)
    rows = {i: base(i) for i in (1, 3, 4)} | {2: base(2, price=Decimal("99.99")), 5: base(5, note=big)}
    ingest_table(spark, lake, cfg, upto_run=None, ingest_run="r1")
    assert_table(spark, lake, cfg, rows)
    wm = read_watermark(spark, lake.qualified(cfg.current_table))
    assert wm["debezium"]["offsets"][TOPIC] == {"0": 3, "1": 3}
    assert wm["shards"]["s1"]["lsn"] == 1000

    # Partition 0 moves on (a delete with its tombstone, then an update that brings a new column);
    # partition 1's older transaction B has not landed yet.
    write(root, 0, 3, [json_line(ev("d", 1400, 1350, before=key_only(4))), json_line(TOMBSTONE),
                       json_line(ev("u", 1500, 1450, after={**base(2, price=Decimal("99.99")), "extra": 7}), extra=True)])  # fmt: skip
    ingest_table(spark, lake, cfg, upto_run=None, ingest_run="r2")
    del rows[4]
    assert_table(spark, lake, cfg, rows, extra={2: 7})
    assert read_watermark(spark, lake.qualified(cfg.current_table))["shards"]["s1"]["lsn"] == 1000  # p1 is behind

    # Transaction B lands late in partition 1: an update whose TOASTed note did not change.
    write(root, 1, 3, [json_line(ev("u", 1300, 1200, after=base(5, note=PLACEHOLDER, price=Decimal("55.55"))))])
    ingest_table(spark, lake, cfg, upto_run=None, ingest_run="r3")
    rows[5] = base(5, note=big, price=Decimal("55.55"))
    assert_table(spark, lake, cfg, rows, extra={2: 7})
    assert read_watermark(spark, lake.qualified(cfg.current_table))["shards"]["s1"]["lsn"] == 1200

    # A truncate, then new rows in both partitions.
    write(root, 0, 6, [json_line(ev("t", 1600, 1550)),
                       json_line(ev("c", 1700, 1650, after={**base(8), "extra": 8}), extra=True)])  # fmt: skip
    write(root, 1, 4, [json_line(ev("c", 1701, 1650, after={**base(9), "extra": 9}), extra=True)])
    ingest_table(spark, lake, cfg, upto_run=None, ingest_run="r4")
    rows = {8: base(8), 9: base(9)}
    assert_table(spark, lake, cfg, rows, extra={8: 8, 9: 9})

    # The sink rewrote partition 0 from offset 7 (already applied): only offset 8 on is new.
    # Offset 7 here differs from what was applied there, so reading it would show in the table.
    write(root, 0, 7, [json_line(ev("c", 1702, 1650, after={**base(11), "extra": 11}), extra=True),
                       json_line(ev("c", 1800, 1750, after={**base(10), "extra": 10}), extra=True)])  # fmt: skip
    write_heartbeat(root, 0, 0, [1_900_000_000_000, 1_900_000_060_000])
    ingest_table(spark, lake, cfg, upto_run=None, ingest_run="r5")
    rows[10] = base(10)
    assert_table(spark, lake, cfg, rows, extra={8: 8, 9: 9, 10: 10})
    wm = read_watermark(spark, lake.qualified(cfg.current_table))
    assert wm["debezium"]["offsets"][TOPIC] == {"0": 9, "1": 5}
    assert wm["shards"]["s1"]["ts"] == "2030-03-17T17:47:40+00:00"  # the newest heartbeat

    # Reruns with nothing new converge: same table, same watermark.
    ingest_table(spark, lake, cfg, upto_run=None, ingest_run="r6")
    assert_table(spark, lake, cfg, rows, extra={8: 8, 9: 9, 10: 10})
    assert read_watermark(spark, lake.qualified(cfg.current_table)) == wm
    cl = spark.table(lake.qualified(cfg.changelog_table))
    assert cl.filter(F.col("id") == 11).count() == 0


def test_avro_sink_bootstrap_toast_and_delete(spark, lake, tmp_root, unique):
    root = tmp_root / f"sink_{unique}"
    cfg = make_config(
        f"dbz_avro_{unique}", ["s1"], table="orders",
        landing={"kind": "debezium_s3", "uri": f"file://{root}", "topic_prefix": "dbz", "format": "avro"},
    )  # fmt: skip
    big = "y" * 7000
    write_avro(root, TOPIC, 0, 0, [ev("r", 500, None, after=base(1), snapshot="true"),
                                   ev("r", 500, None, after=base(2), snapshot="last"),
                                   ev("c", 600, 500, after=base(3, note=big))])  # fmt: skip
    bootstrap_debezium(spark, lake, cfg)
    ingest_table(spark, lake, cfg, upto_run=None, ingest_run="a1")
    assert_table(spark, lake, cfg, {1: base(1), 2: base(2), 3: base(3, note=big)})
    write_avro(root, TOPIC, 0, 3, [ev("u", 700, 650, after=base(3, note=PLACEHOLDER, ratio=9.5)),
                                   ev("d", 800, 750, before=key_only(1))])  # fmt: skip
    ingest_table(spark, lake, cfg, upto_run=None, ingest_run="a2")
    want = {2: base(2), 3: base(3, note=big, ratio=9.5)}
    assert_table(spark, lake, cfg, want)
    ingest_table(spark, lake, cfg, upto_run=None, ingest_run="a3")
    assert_table(spark, lake, cfg, want)
    wm = read_watermark(spark, lake.qualified(cfg.current_table))
    assert wm["debezium"]["offsets"][TOPIC] == {"0": 5} and wm["shards"]["s1"]["lsn"] == 750


def write_gz(root, partition, start, lines):
    """A sink object written with s3.compression.type=gzip."""
    import gzip

    path = object_path(root, TOPIC, partition, start, "json.gz")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress("".join(line + "\n" for line in lines).encode()))


def test_a_gzip_backlog_is_applied_in_bounded_batches(spark, lake, tmp_root, unique):
    root = tmp_root / f"sink_{unique}"
    cfg = make_config(
        f"dbz_gz_{unique}", ["s1"], table="orders",
        landing={"kind": "debezium_s3", "uri": f"file://{root}", "topic_prefix": "dbz", "partitions": 2},
        ingest={"max_events_per_run": 2},
    )  # fmt: skip
    big = "z" * 6000
    write_gz(root, 0, 0, [json_line(ev("r", 1000, None, after=base(2), snapshot="true")),
                          json_line(ev("r", 1000, None, after=base(4), snapshot="last"))])  # fmt: skip
    write_gz(root, 1, 0, [json_line(ev("r", 1000, None, after=base(1), snapshot="true"))])
    bootstrap_debezium(spark, lake, cfg)
    # A backlog of three files per partition (the snapshot's and two of changes).
    write_gz(root, 0, 2, [json_line(ev("u", 1101, 1000, after=base(2, price=Decimal("7.77"))))])
    write_gz(root, 1, 1, [json_line(ev("c", 1100, 1000, after=base(5, note=big)))])
    write_gz(root, 0, 3, [json_line(ev("d", 1201, 1200, before=key_only(4))), json_line(TOMBSTONE)])
    write_gz(root, 1, 2, [json_line(ev("u", 1300, 1250, after=base(5, note=PLACEHOLDER, ratio=8.5)))])
    # Run 1 takes partition 0's first file (2 events: the budget); partition 1 is not seen yet, so
    # the shard's LSN must not move.
    ingest_table(spark, lake, cfg, upto_run=None, ingest_run="g1")
    assert_table(spark, lake, cfg, {2: base(2), 4: base(4)})
    wm = read_watermark(spark, lake.qualified(cfg.current_table))
    assert wm["debezium"]["offsets"][TOPIC] == {"0": 2} and wm["shards"]["s1"]["lsn"] == 0
    # Then one file of each partition per run (round-robin) until nothing is left.
    runs = 1
    while True:
        runs += 1
        ingest_table(spark, lake, cfg, upto_run=None, ingest_run=f"g{runs}")
        new = read_watermark(spark, lake.qualified(cfg.current_table))
        if new == wm:
            break
        wm = new
    assert runs == 5  # g2: p0@2 + p1@0, g3: p0@3 + p1@1, g4: p1@2, g5: nothing left
    want = {1: base(1), 2: base(2, price=Decimal("7.77")), 5: base(5, note=big, ratio=8.5)}
    assert_table(spark, lake, cfg, want)
    assert wm["debezium"]["offsets"][TOPIC] == {"0": 5, "1": 3} and wm["shards"]["s1"]["lsn"] == 1200
