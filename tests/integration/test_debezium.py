"""A Debezium-fed table end to end: S3-sink objects (JSON with schemas, Avro) -> bootstrap from the
connector's snapshot events -> ingest into real Spark + Iceberg, equal to the expected table after
every batch: TOAST placeholders, deletes with tombstones, a truncate, a new column, partitions that
land out of order, a straddling file, heartbeats, and reruns that converge."""

from __future__ import annotations

from datetime import UTC, date, datetime
from decimal import Decimal

from cdc_lakehouse.bootstrap.debezium import bootstrap_debezium
from cdc_lakehouse.feed.models import BEFORE_COL, FEED_OP_COL, OP_UPSERT
from cdc_lakehouse.feed.offsets import commit_meta_offset, meta_offset
from cdc_lakehouse.feed.read import read_changes
from cdc_lakehouse.ingest.ingest_table import ingest_table
from cdc_lakehouse.lake.snapshots import read_watermark
from cdc_lakehouse.watermark import Watermark
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
    assert wm.debezium["offsets"][TOPIC] == {"0": 3, "1": 3}
    assert wm.shards["s1"].lsn == 1001  # strictly above transaction A's position (1000)

    # Partition 0 moves on (a delete with its tombstone, then an update that brings a new column);
    # partition 1's older transaction B has not landed yet: partition 0's changes wait for it.
    write(root, 0, 3, [json_line(ev("d", 1400, 1350, before=key_only(4))), json_line(TOMBSTONE),
                       json_line(ev("u", 1500, 1450, after={**base(2, price=Decimal("99.99")), "extra": 7}), extra=True)])  # fmt: skip
    ingest_table(spark, lake, cfg, upto_run=None, ingest_run="r2")
    assert_table(spark, lake, cfg, rows)
    wm = read_watermark(spark, lake.qualified(cfg.current_table))
    assert wm.shards["s1"].lsn == 1001 and wm.debezium["offsets"][TOPIC] == {"0": 3, "1": 3}
    assert wm.debezium["frontier"]["s1"] == {"partition": f"{TOPIC} partition 1", "held": 2}

    # Transaction B lands late in partition 1: an update whose TOASTed note did not change. It
    # applies; partition 0's changes still wait (partition 1 may yet deliver up to 1350).
    write(root, 1, 3, [json_line(ev("u", 1300, 1200, after=base(5, note=PLACEHOLDER, price=Decimal("55.55"))))])
    ingest_table(spark, lake, cfg, upto_run=None, ingest_run="r3")
    rows[5] = base(5, note=big, price=Decimal("55.55"))
    assert_table(spark, lake, cfg, rows)
    assert read_watermark(spark, lake.qualified(cfg.current_table)).shards["s1"].lsn == 1201

    # A truncate, then new rows in both partitions: everything applies.
    write(root, 0, 6, [json_line(ev("t", 1600, 1550)),
                       json_line(ev("c", 1700, 1650, after={**base(8), "extra": 8}), extra=True)])  # fmt: skip
    write(root, 1, 4, [json_line(ev("c", 1701, 1650, after={**base(9), "extra": 9}), extra=True)])
    ingest_table(spark, lake, cfg, upto_run=None, ingest_run="r4")
    rows = {8: base(8), 9: base(9)}
    assert_table(spark, lake, cfg, rows, extra={8: 8, 9: 9})
    assert read_watermark(spark, lake.qualified(cfg.current_table)).shards["s1"].lsn == 1651

    # The sink rewrote partition 0 from offset 7 (already applied): only offset 8 on is new.
    # Offset 7 here differs from what was applied there, so reading it would show in the table.
    write(root, 0, 7, [json_line(ev("c", 1702, 1650, after={**base(11), "extra": 11}), extra=True),
                       json_line(ev("c", 1800, 1750, after={**base(10), "extra": 10}), extra=True)])  # fmt: skip
    write(root, 1, 5, [json_line(ev("c", 1801, 1750, after={**base(12), "extra": 12}), extra=True)])
    write_heartbeat(root, 0, 0, [1_900_000_000_000, 1_900_000_060_000])
    ingest_table(spark, lake, cfg, upto_run=None, ingest_run="r5")
    rows |= {10: base(10), 12: base(12)}
    assert_table(spark, lake, cfg, rows, extra={8: 8, 9: 9, 10: 10, 12: 12})
    wm = read_watermark(spark, lake.qualified(cfg.current_table))
    assert wm.debezium["offsets"][TOPIC] == {"0": 9, "1": 6}
    assert wm.shards["s1"].ts == "2030-03-17T17:47:40+00:00"  # the newest heartbeat: nothing waits

    # Reruns with nothing new converge: same table, same watermark.
    ingest_table(spark, lake, cfg, upto_run=None, ingest_run="r6")
    assert_table(spark, lake, cfg, rows, extra={8: 8, 9: 9, 10: 10, 12: 12})
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
    assert wm.debezium["offsets"][TOPIC] == {"0": 5} and wm.shards["s1"].lsn == 751

    # UPDATE orders SET id = 9 WHERE id = 3 leaving the TOASTed note alone: Debezium writes a
    # delete of 3 and a create of 9 at one WAL position, the create's note a placeholder. The
    # row moves with its note (paired back into one key change), not dropped as unfillable.
    write_avro(root, TOPIC, 0, 5, [ev("d", 900, 850, before=key_only(3)),
                                   ev("c", 900, 850, after=base(3, id=9, note=PLACEHOLDER))])  # fmt: skip
    ingest_table(spark, lake, cfg, upto_run=None, ingest_run="a4")
    assert_table(spark, lake, cfg, {2: base(2), 9: base(3, id=9, note=big)})


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
    # Run 1 takes the snapshot's files of both partitions (the lowest position, 999, together),
    # though partition 0's alone fills the budget: the frontier then moves to 1000.
    ingest_table(spark, lake, cfg, upto_run=None, ingest_run="g1")
    assert_table(spark, lake, cfg, {1: base(1), 2: base(2), 4: base(4)})
    wm = read_watermark(spark, lake.qualified(cfg.current_table))
    assert wm.debezium["offsets"][TOPIC] == {"0": 2, "1": 1} and wm.shards["s1"].lsn == 1000
    # Then lowest positions first until nothing more can apply.
    runs = 1
    while True:
        runs += 1
        ingest_table(spark, lake, cfg, upto_run=None, ingest_run=f"g{runs}")
        new = read_watermark(spark, lake.qualified(cfg.current_table))
        if new == wm:
            break
        wm = new
    assert runs == 4  # g2: p0@2 + p1@1 (1000), g3: p0@3 (1200) + p1@2 (1250, held), g4: nothing moves
    # Partition 1's update at 1250 waits: partition 0 delivered nothing past 1200.
    want = {1: base(1), 2: base(2, price=Decimal("7.77")), 5: base(5, note=big)}
    assert_table(spark, lake, cfg, want)
    assert wm.debezium["offsets"][TOPIC] == {"0": 5, "1": 2} and wm.shards["s1"].lsn == 1201
    assert wm.debezium["frontier"]["s1"] == {"partition": f"{TOPIC} partition 0", "held": 1}
    # A transaction over both partitions moves both past it: everything applies (in two runs of
    # two events: g5 the held 1250, g6 the transaction at 1300, both halves together).
    write_gz(root, 0, 5, [json_line(ev("u", 1310, 1300, after=base(2, price=Decimal("8.88"))))])
    write_gz(root, 1, 3, [json_line(ev("u", 1311, 1300, after=base(1, ratio=0.5)))])
    ingest_table(spark, lake, cfg, upto_run=None, ingest_run="g5")
    assert read_watermark(spark, lake.qualified(cfg.current_table)).shards["s1"].lsn == 1300
    ingest_table(spark, lake, cfg, upto_run=None, ingest_run="g6")
    want = {1: base(1, ratio=0.5), 2: base(2, price=Decimal("8.88")), 5: base(5, note=big, ratio=8.5)}
    assert_table(spark, lake, cfg, want)
    wm = read_watermark(spark, lake.qualified(cfg.current_table))
    assert wm.shards["s1"].lsn == 1301 and wm.debezium["frontier"]["s1"]["held"] == 0


def price_total(spark, lake, cfg, consumer: str, total: Decimal) -> Decimal:
    """One run of a feed consumer that keeps the sum of `price` from before-images: it subtracts
    a key's row at its offset and adds its row at the range's head."""
    since, _ = meta_offset(spark, lake, consumer, cfg.current_table)
    batch = read_changes(spark, lake, cfg, consumer, since, with_before=True)
    if batch.range.replaces_state:
        total = Decimal(0)
    for r in batch.rows.select(FEED_OP_COL, "price", BEFORE_COL).collect():
        if r[BEFORE_COL] is not None:
            total -= r[BEFORE_COL]["price"]
        if r[FEED_OP_COL] == OP_UPSERT:
            total += r["price"]
    if batch.range.mode != "noop":
        commit_meta_offset(spark, lake, batch.range.offset, since)
    return total


def test_a_before_image_consumer_counts_the_last_transaction_of_every_batch(spark, lake, tmp_root, unique):
    """The watermark of a Debezium batch sits above its last transaction: a change-feed consumer
    that subtracts before-images counts every transaction once, the last of each batch included,
    and a quiet table leaves nothing uncounted."""
    root = tmp_root / f"sink_{unique}"
    cfg = make_config(
        f"dbz_feed_{unique}", ["s1"], table="orders",
        landing={"kind": "debezium_s3", "uri": f"file://{root}", "topic_prefix": "dbz"},
    )  # fmt: skip
    rows = {i: base(i) for i in (1, 2, 3, 4)}
    # The snapshot, then the first transaction after it (no last commit: its own LSN).
    snap = [json_line(ev("r", 1000, None, after=rows[i], snapshot="true")) for i in rows]
    rows[2] = base(2, price=Decimal("99.99"))
    write(root, 0, 0, [*snap, json_line(ev("u", 1010, None, after=rows[2]))])
    bootstrap_debezium(spark, lake, cfg)
    consumer, total = f"price_sum_{unique}", Decimal(0)

    def step(run: str) -> None:
        nonlocal total
        ingest_table(spark, lake, cfg, upto_run=None, ingest_run=run)
        total = price_total(spark, lake, cfg, consumer, total)
        assert total == sum(r["price"] for r in rows.values()), (run, total)

    step("f1")
    # Two transactions: the last one (a new row) is what a watermark at its position would leave
    # in no range: counted never, by this consumer.
    rows[3], rows[5] = base(3, price=Decimal("50.00")), base(5)
    write(root, 0, 5, [json_line(ev("u", 1110, 1100, after=rows[3])), json_line(ev("c", 1210, 1200, after=rows[5]))])
    step("f2")
    step("f3")  # a quiet table: nothing more comes to make up for it
    write(root, 0, 7, [json_line(ev("d", 1310, 1300, before=key_only(1)))])
    del rows[1]
    step("f4")


def test_a_partition_behind_holds_back_the_others_until_it_delivers(spark, lake, tmp_root, unique):
    """With two partitions, changes of one partition above the other's last position wait (that
    partition may still deliver an older transaction); the next run applies them once it moves
    past them; nothing is applied twice."""
    root = tmp_root / f"sink_{unique}"
    cfg = make_config(
        f"dbz_hold_{unique}", ["s1"], table="orders",
        landing={"kind": "debezium_s3", "uri": f"file://{root}", "topic_prefix": "dbz", "partitions": 2},
    )  # fmt: skip
    write(root, 0, 0, [json_line(ev("r", 1000, None, after=base(i), snapshot="true")) for i in (2, 4)])
    write(root, 1, 0, [json_line(ev("r", 1000, None, after=base(i), snapshot="true")) for i in (1, 3)])
    # Partition 0: transactions at positions 1000 and 1100; partition 1 has not delivered its
    # transaction at 1050 (between them) yet.
    write(root, 0, 2, [json_line(ev("u", 1010, 1000, after=base(2, note="a"))),
                       json_line(ev("u", 1110, 1100, after=base(4, note="b")))])  # fmt: skip
    bootstrap_debezium(spark, lake, cfg)
    cur = lake.qualified(cfg.current_table)

    def run(name: str) -> Watermark:
        m = ingest_table(spark, lake, cfg, upto_run=None, ingest_run=name)
        assert Watermark.from_json(m.metrics.watermark) == read_watermark(spark, cur)  # the run's metrics show it
        return read_watermark(spark, cur)

    wm = run("h1")
    assert_table(spark, lake, cfg, {i: base(i) for i in (1, 2, 3, 4)})  # the snapshot only
    assert wm.shards["s1"].lsn == 1000 and wm.debezium["offsets"][TOPIC] == {"0": 2, "1": 2}
    assert wm.debezium["frontier"]["s1"] == {"partition": f"{TOPIC} partition 1", "held": 2}
    write(root, 1, 2, [json_line(ev("u", 1060, 1050, after=base(3, note="c")))])
    wm = run("h2")  # partition 1 moved past 1000: the transaction at 1000 applies; 1100 still waits
    assert_table(spark, lake, cfg, {1: base(1), 2: base(2, note="a"), 3: base(3, note="c"), 4: base(4)})
    assert wm.shards["s1"].lsn == 1051 and wm.debezium["offsets"][TOPIC] == {"0": 3, "1": 3}
    assert wm.debezium["frontier"]["s1"] == {"partition": f"{TOPIC} partition 1", "held": 1}
    write(root, 1, 3, [json_line(ev("u", 1210, 1200, after=base(1, note="d")))])
    wm = run("h3")  # partition 1 past 1100: it applies; now partition 0 (last 1100) holds 1200 back
    assert_table(spark, lake, cfg, {1: base(1), 2: base(2, note="a"), 3: base(3, note="c"), 4: base(4, note="b")})
    assert wm.shards["s1"].lsn == 1101 and wm.debezium["offsets"][TOPIC] == {"0": 4, "1": 3}
    assert wm.debezium["frontier"]["s1"] == {"partition": f"{TOPIC} partition 0", "held": 1}
    assert run("h4") == wm  # a rerun applies nothing and moves nothing
    cl = spark.table(lake.qualified(cfg.changelog_table)).groupBy("id", "note").count().collect()
    assert sorted((r["id"], r["note"], r["count"]) for r in cl) == [
        (1, "note 1", 1), (2, "a", 1), (2, "note 2", 1), (3, "c", 1), (3, "note 3", 1), (4, "b", 1), (4, "note 4", 1),
    ]  # fmt: skip


def test_changes_debezium_sends_again_are_not_applied_again(spark, lake, tmp_root, unique):
    """After an unclean Kafka Connect stop Debezium sends changes again at new offsets. Copies of
    applied updates, of a delete and of the re-insert after it change nothing: no key goes back to
    an older value or disappears for a batch, whether the copies come after the batch that applied
    them or in the same batch, and the changelog holds every change once (#51)."""
    root = tmp_root / f"sink_{unique}"
    cfg = make_config(
        f"dbz_again_{unique}", ["s1"], table="orders",
        landing={"kind": "debezium_s3", "uri": f"file://{root}", "topic_prefix": "dbz"},
        ingest={"max_events_per_run": 1},
    )  # fmt: skip
    cur = lake.qualified(cfg.current_table)
    write(root, 0, 0, [json_line(ev("r", 1000, None, after=base(i), snapshot="true")) for i in (1, 2, 3)])
    bootstrap_debezium(spark, lake, cfg)
    first = [ev("u", 1101, 1050, after=base(1, note="a")), ev("u", 1201, 1200, after=base(1, note="b")),
             ev("d", 1301, 1300, before=key_only(2)), ev("c", 1401, 1400, after=base(2, note="back"))]  # fmt: skip
    write(root, 0, 3, [json_line(first[0]), json_line(first[1]), json_line(first[2]), json_line(TOMBSTONE),
                       json_line(first[3])])  # fmt: skip
    rows = {1: base(1, note="b"), 2: base(2, note="back"), 3: base(3)}

    def drain(name: str, steady: dict[int, dict]) -> Watermark:
        """Ingest until nothing moves; after every batch the keys of `steady` hold their values."""
        wm, n = read_watermark(spark, cur), 0
        while True:
            n += 1
            ingest_table(spark, lake, cfg, upto_run=None, ingest_run=f"{name}{n}")
            got = lake_rows(spark, lake, cfg)
            for i, r in expected(steady).items():
                assert got.get(i) == r, (f"{name}{n}", i, got.get(i))
            new = read_watermark(spark, cur)
            if new == wm:
                return wm
            wm = new

    drain("a", {})
    assert_table(spark, lake, cfg, rows)
    assert read_watermark(spark, cur).debezium["applied"][TOPIC] == {"0": [1400, 1401, 1]}
    # The connector restarts from an older offset: the four changes again, then a new change, in
    # three objects the sink flushes one after another. Before #51 the copies were applied at the
    # watermark: id 1 went back to "a", then id 2 was deleted for a batch.
    write(root, 0, 8, [json_line(first[0])])
    drain("b", {1: rows[1], 2: rows[2]})
    write(root, 0, 9, [json_line(first[1]), json_line(first[2]), json_line(TOMBSTONE)])
    drain("c", {1: rows[1], 2: rows[2]})
    write(root, 0, 12, [json_line(first[3]), json_line(ev("u", 1501, 1500, after=base(3, note="c")))])
    drain("d", {1: rows[1], 2: rows[2]})
    rows[3] = base(3, note="c")
    assert_table(spark, lake, cfg, rows)
    # Changes and their copies in one batch: the copies sit in a later object at the batch's
    # lowest position, so they are taken with the changes.
    second = [ev("u", 1601, 1600, after=base(1, note="d")), ev("d", 1701, 1700, before=key_only(3))]
    write(root, 0, 14, [json_line(second[0]), json_line(second[1]), json_line(TOMBSTONE)])
    write(root, 0, 17, [json_line(second[0]), json_line(second[1]), json_line(TOMBSTONE),
                        json_line(ev("c", 1801, 1800, after=base(3, note="new")))])  # fmt: skip
    wm = drain("e", {})
    rows |= {1: base(1, note="d"), 3: base(3, note="new")}
    assert_table(spark, lake, cfg, rows)
    assert wm.debezium["offsets"][TOPIC] == {"0": 21} and wm.shards["s1"].lsn == 1801
    cl = spark.table(lake.qualified(cfg.changelog_table)).groupBy("id").count().collect()
    assert sorted((r["id"], r["count"]) for r in cl) == [(1, 4), (2, 3), (3, 4)]
