"""Debezium S3-sink files -> landing events: the pure conversion, the offsets, the config."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, date, datetime
from decimal import Decimal

import pytest
from cdc_lakehouse.config import parse_table_config
from cdc_lakehouse.landing.debezium.connect_types import DebeziumFormatError, table_columns, to_text
from cdc_lakehouse.landing.debezium.plan import (
    advance,
    after_applied,
    frontiers,
    pending_files,
    take_below,
    within_budget,
)
from cdc_lakehouse.landing.debezium.records import SinkFile, cut_point, file_events, file_stats, shape_of
from cdc_lakehouse.watermark import Watermark

from tests.fixtures.debezium import (
    PLACEHOLDER,
    TOMBSTONE,
    change,
    envelope_schema,
    json_line,
    object_path,
    write_avro,
)

TOPIC = "dbz.s1.orders"


def cfg(**landing):
    data = {
        "name": "orders",
        "source": {"table": "orders", "shards": [{"conn_id": "app_db", "schemas": ["s1"]}]},
        "primary_key": ["id"],
        "landing": {"kind": "debezium_s3", "uri": "file:///tmp/x", "topic_prefix": "dbz", **landing},
    }
    c, errors = parse_table_config(data, "orders.yaml")
    assert not errors, errors
    return c


ROW = {
    "id": 7,
    "note": "héllo",
    "price": Decimal("-12.50"),
    "amount": Decimal("3.1400"),
    "created": datetime(2024, 2, 29, 23, 59, 58, 120000),  # noqa: DTZ001
    "updated_at": datetime(2024, 3, 1, 1, 2, 3, 456789, tzinfo=UTC),
    "day": date(1999, 12, 31),
    "active": True,
    "ratio": 0.25,
    "tags": ["a", None, 'q"uote'],
    "data": b"\x00\xffA",
}
TEXT = {
    "id": "7",
    "note": "héllo",
    "price": "-12.50",
    "amount": "3.1400",
    "created": "2024-02-29 23:59:58.12",
    "updated_at": "2024-03-01 01:02:03.456789+00",
    "day": "1999-12-31",
    "active": "t",
    "ratio": "0.25",
    "tags": '["a",null,"q\\"uote"]',
    "data": "\\x00ff41",
}


def ev(op="c", lsn=2000, last_commit=1900, before=None, after=None, **kw):
    return change(
        op, schema="s1", table="orders", lsn=lsn, last_commit=last_commit, txid=55, ts_ms=1_700_000_000_123,
        before=before, after=after, **kw,
    )  # fmt: skip


def rows_of(lines: list[str], start=0, skip_below=0, fmt="json", data=None):
    sf = SinkFile(f"file:///x/{TOPIC}+0+{start:010d}.{fmt}", TOPIC, 0, start, skip_below)
    payload = data if data is not None else "".join(line + "\n" for line in lines).encode()
    return list(file_events(shape_of(cfg(format=fmt)), sf, payload)), file_stats(shape_of(cfg(format=fmt)), sf, payload)


def test_values_come_out_as_postgresql_text():
    rows, stats = rows_of([json_line(ev(after=ROW))])
    (op, before, after, unavailable, source, table_schema, ts_ms, run_id) = rows[0]
    assert (op, before, unavailable) == ("c", None, None)
    assert after == TEXT
    assert source[:6] == ("postgresql", "app_db", "dbz", "app", "s1", "orders")
    assert source[6:10] == (1900, 2000, 55, 2000)  # commit = sequence[0], seq = event LSN
    assert source[10] == datetime(2023, 11, 14, 22, 13, 20, 123000, tzinfo=UTC)
    assert ts_ms == 1_700_000_000_130 and run_id == f"{TOPIC}+0+0000000000.json"
    types = {c["name"]: (c["type"], c["lake_type"], c["key"]) for c in json.loads(table_schema)}
    assert types["id"] == ("integer", "int", True)
    assert types["price"] == ("numeric(10,2)", "decimal(10,2)", False)
    assert types["amount"][1] == "decimal(38,18)"
    assert types["created"][1] == "timestamp_ntz" and types["updated_at"][1] == "timestamp"
    assert types["tags"][1] == "array<string>" and types["data"][1] == "binary"
    assert stats["records"] == 1 and stats["last"] == [1900, "2023-11-14T22:13:20.123000+00:00"]


def test_avro_gives_the_same_events_as_json(tmp_path):
    path = write_avro(tmp_path, TOPIC, 0, 0, [ev(after=ROW)])
    rows, stats = rows_of([], fmt="avro", data=path.read_bytes())
    json_rows, _ = rows_of([json_line(ev(after=ROW))])
    assert rows[0][:5] == json_rows[0][:5]
    assert json.loads(rows[0][5]) == json.loads(json_rows[0][5])
    assert stats["records"] == 1


def test_placeholder_tombstone_snapshot_truncate_and_offsets():
    upd = ev("u", lsn=2100, last_commit=2050, after={**ROW, "note": PLACEHOLDER, "data": PLACEHOLDER})
    snap = ev("r", lsn=1500, last_commit=None, after=ROW, snapshot="last")
    dele = ev("d", lsn=2200, last_commit=2150, before={**{k: None for k in ROW}, "id": 7})
    trunc = ev("t", lsn=2300, last_commit=2250)
    lines = [json_line(snap), json_line(upd), json_line(dele), json_line(TOMBSTONE), json_line(trunc)]
    rows, stats = rows_of(lines, start=40)
    assert [r[0] for r in rows] == ["r", "u", "d", "t"]
    assert rows[0][4][6:10] == (1499, 1500, 55, 40 * 1024 + 1)  # snapshot rows sort just before their LSN
    assert rows[1][3] == ["note", "data"] and "note" not in rows[1][2] and rows[1][2]["price"] == "-12.50"
    assert rows[2][1]["id"] == "7" and rows[2][2] is None
    assert rows[3][1] is None and rows[3][2] is None and rows[3][4][6] == 2250
    assert stats["records"] == 5 and stats["last"][0] == 2250  # the tombstone takes an offset too
    later, _ = rows_of(lines, start=40, skip_below=42)  # a straddling file: offsets 40, 41 are applied
    assert [r[0] for r in later] == ["d", "t"]


def test_unsupported_type_and_lossy_decimals_name_table_field_and_fix():
    schema = envelope_schema("s1", "orders")
    value = next(f for f in schema["fields"] if f["field"] == "after")
    dur = {"type": "int64", "optional": True, "name": "io.debezium.time.MicroDuration", "field": "wait"}
    with pytest.raises(DebeziumFormatError, match=r"orders: column 'wait'.*MicroDuration.*Fix"):
        table_columns({**value, "fields": [*value["fields"], dur]}, ["id"], "orders")
    dbl = {
        "type": "double",
        "optional": True,
        "field": "total",
        "parameters": {"__debezium.source.column.type": "NUMERIC"},
    }
    with pytest.raises(DebeziumFormatError, match=r"'total'.*decimal.handling.mode=precise"):
        table_columns({**value, "fields": [dbl]}, ["id"], "orders")
    _c, errors = parse_table_config(
        {
            "name": "orders",
            "source": {"table": "orders", "shards": [{"conn_id": "app_db", "schemas": ["s1"]}]},
            "primary_key": ["id"],
            "landing": {
                "kind": "debezium_s3",
                "uri": "file:///x",
                "topic_prefix": "dbz",
                "decimal_handling_mode": "double",
            },
        },
        "orders.yaml",
    )
    text = " ".join(f"{e.field} {e.message} {e.fix}" for e in errors)
    assert "decimal_handling_mode 'double'" in text and "decimal.handling.mode=precise" in text


def test_a_record_without_schemas_is_refused():
    line = json.dumps({"before": None, "after": {"id": 1}, "op": "c"})
    sf = SinkFile(f"file:///x/{TOPIC}+0+0000000000.json", TOPIC, 0, 0)
    stats = file_stats(shape_of(cfg()), sf, (line + "\n").encode())
    assert "orders: file:///x/" in stats["error"] and "schemas.enable=true" in stats["error"]
    with pytest.raises(DebeziumFormatError, match="schemas.enable=true"):
        list(file_events(shape_of(cfg()), sf, (line + "\n").encode()))


@pytest.mark.parametrize(
    ("col", "value", "text"),
    [
        ({"type": "float"}, 1.100000023841858, "1.1"),
        ({"type": "double"}, 100.0, "100"),
        ({"type": "double"}, float("nan"), "NaN"),
        ({"type": "int16"}, -3, "-3"),
        ({"type": "boolean"}, False, "f"),
        ({"type": "int64", "name": "io.debezium.time.NanoTimestamp"}, 1_000_000_001_500, "1970-01-01 00:16:40.000001"),
        ({"type": "int64", "name": "io.debezium.time.MicroTime"}, 3_723_000_500, "01:02:03.0005"),
        ({"type": "string", "name": "io.debezium.time.ZonedTime"}, "10:15:30Z", "10:15:30+00"),
        ({"type": "int64", "name": "io.debezium.time.Timestamp"}, 86_400_000, "1970-01-02 00:00:00"),
    ],
)
def test_scalar_texts(col, value, text):
    assert to_text(col, value) == text


class ListingFS:
    """A directory listing (pending_files only lists names)."""

    def __init__(self, names):
        self.names = names

    def list_names(self, uri):
        return sorted(self.names.get(uri, []))


def test_pending_files_skip_what_the_offsets_cover():
    base = "file:///l/topics"
    names = [object_path(__import__("pathlib").Path("/"), TOPIC, 0, s, "json").name for s in (0, 3, 5)]
    fs = ListingFS({f"{base}/{TOPIC}": ["partition=0"], f"{base}/{TOPIC}/partition=0": [*names, "junk.tmp"]})
    got = pending_files(fs, base, TOPIC, {"0": 4}, False)
    # 0..2 is below offset 4; the file at 3 straddles it (read from 4 on); 5 is new.
    assert [(f.start, f.skip_below) for f in got] == [(3, 4), (5, 5)]
    assert [f.start for f in pending_files(fs, base, TOPIC, {}, False)] == [0, 3, 5]


def stat(name, events, lo=None, hi=None, records=None, ts="2024-01-01T00:00:00+00:00", heartbeat=None):
    last = [hi, ts] if events else None
    return {"name": name, "records": records or events, "events": events, "lo": lo, "hi": hi, "last": last,
            "late": 0, "top": None, "fresh": False, "again": 0, "heartbeat": heartbeat, "error": None}  # fmt: skip


def plan_of(c, wm, files, stats, limit=1000):
    """The driver's plan without Spark (no file crosses a frontier here, so none is read again)."""
    chosen = within_budget(files, stats, limit)
    taken, fronts = take_below(None, shape_of(c), chosen, stats, frontiers(c, wm, files, chosen, stats))
    return taken, fronts, advance(c, wm, taken, fronts)


def test_the_watermark_sits_above_every_applied_event_and_waits_for_every_partition():
    c = cfg(partitions=2)
    wm = Watermark.from_dict({"v": 1, "shards": {"s1": {"lsn": 0, "endpoint": "app_db"}}, "runs": {}})
    snap0, tx0 = SinkFile(f"{TOPIC}+0+0.json", TOPIC, 0, 0), SinkFile(f"{TOPIC}+0+2.json", TOPIC, 0, 2)
    stats = {snap0.name: stat(snap0.name, 2, 999, 999), tx0.name: stat(tx0.name, 1, 1000, 1000)}
    # Partition 1 never delivered: it may still hold any transaction, so nothing moves or applies.
    taken, fronts, first = plan_of(c, wm, [snap0, tx0], stats)
    assert taken == [] and first.shards["s1"].lsn == 0
    assert first.debezium["frontier"]["s1"] == {"partition": f"{TOPIC} partition 1 (never delivered)", "held": 3}
    # Partition 1 delivers its snapshot row: the frontier is one above its last position (999 is
    # the commit before the next transaction: that one's position is higher), so partition 0's
    # transaction at 1000 waits, the snapshot rows below it apply.
    snap1 = SinkFile(f"{TOPIC}+1+0.json", TOPIC, 1, 0)
    hb = SinkFile("h", "__debezium-heartbeat.dbz", 0, 0, heartbeat=True)
    stats |= {snap1.name: stat(snap1.name, 1, 999, 999), "h": stat("h", 0, records=1, heartbeat=1_904_153_600_000)}
    taken, fronts, second = plan_of(c, first, [snap0, tx0, snap1, hb], stats)
    assert sorted(t.file.name for t in taken if not t.file.heartbeat) == [snap0.name, snap1.name]
    assert second.shards["s1"].lsn == 1000
    assert second.debezium["offsets"][TOPIC] == {"0": 2, "1": 1}
    assert second.debezium["frontier"]["s1"] == {"partition": f"{TOPIC} partition 1", "held": 1}
    assert second.shards["s1"].ts == "2024-01-01T00:00:00+00:00"  # not the heartbeat's: an event waits
    # Partition 1 moves past it: the held transaction applies, the watermark is one above it, and
    # with nothing waiting the heartbeat makes the shard fresh.
    tx1 = SinkFile(f"{TOPIC}+1+1.json", TOPIC, 1, 1)
    stats[tx1.name] = stat(tx1.name, 1, 1200, 1200)
    tx0_again = SinkFile(tx0.uri, TOPIC, 0, 2, skip_below=2)
    taken, fronts, third = plan_of(c, second, [tx0_again, tx1, hb], stats)
    assert third.shards["s1"].lsn == 1001  # partition 0 is now the one behind (its last is 1000)
    assert [t.file.name for t in taken if t.events] == [tx0.name]
    assert third.debezium["frontier"]["s1"] == {"partition": f"{TOPIC} partition 0", "held": 1}
    one_partition = cfg()
    _taken, _fronts, alone = plan_of(one_partition, wm, [snap0, tx0, hb], stats)
    assert alone.shards["s1"].lsn == 1001 and alone.debezium["frontier"]["s1"]["held"] == 0
    assert alone.shards["s1"].ts == "2030-05-04T19:33:20+00:00"  # nothing waits: the heartbeat counts


def test_a_file_is_cut_at_the_frontier_and_late_events_sit_at_the_watermark():
    lines = [json_line(ev("u", lsn=1010, last_commit=1000, after=ROW)), json_line(TOMBSTONE),
             json_line(ev("u", lsn=1011, last_commit=1000, after=ROW)),
             json_line(ev("u", lsn=1210, last_commit=1200, after=ROW))]  # fmt: skip
    data = "".join(x + "\n" for x in lines).encode()
    sf = SinkFile(f"file:///x/{TOPIC}+0+0000000040.json", TOPIC, 0, 40)
    assert cut_point(shape_of(cfg()), sf, data, 1001) == {
        "name": sf.name, "at": 43, "events": 2, "last": [1000, "2023-11-14T22:13:20.123000+00:00"],
        "held": 1, "top": [1000, 1011, 1], "fresh": False,
    }  # fmt: skip
    assert [r[4][6] for r in file_events(shape_of(cfg()), replace(sf, stop_at=43), data)] == [1000, 1000]
    # The rest of a transaction whose first part an earlier batch applied (the watermark moved
    # past its position): placed at the watermark, counted as late.
    late = replace(sf, floor=1001)
    assert [r[4][6:8] for r in file_events(shape_of(cfg()), late, data)] == [(1001, 1010), (1001, 1011), (1200, 1210)]
    stats = file_stats(shape_of(cfg()), late, data)
    assert (stats["lo"], stats["hi"], stats["late"], stats["records"]) == (1001, 1200, 2, 4)


def test_copies_sent_again_are_left_out_and_the_rest_of_a_split_transaction_is_not():
    """Debezium sends changes again after an unclean stop, at new offsets: a change at or below the
    place of one applied before is a copy and is left out, in the same file or a later one of the
    batch, a key change's delete and create (one LSN) included; the rest of a transaction (same
    position, later LSN) is still placed at the watermark."""
    u1010, u1011, u1210 = (json_line(ev("u", lsn=n, last_commit=n // 100 * 100, after=ROW)) for n in (1010, 1011, 1210))
    delete, create = (json_line(ev(op, lsn=1110, last_commit=1100, **{k: {**ROW, "id": i}}))
                      for op, k, i in (("d", "before", 1), ("c", "after", 2)))  # fmt: skip
    # An earlier batch applied transaction 1000's first change (the watermark is past it, 1001).
    # Then: a copy of it, the rest of that transaction, a key change (a delete and a create at one
    # LSN), copies of the key change, and a new transaction.
    lines = [u1010, u1011, delete, json_line(TOMBSTONE), create, delete, json_line(TOMBSTONE), create, u1210]
    data = "".join(x + "\n" for x in lines).encode()
    sf = SinkFile(f"file:///x/{TOPIC}+0+0000000040.json", TOPIC, 0, 40, floor=1001, applied=(1000, 1010, 1))
    got = [(r[0], r[4][6], r[4][7]) for r in file_events(shape_of(cfg()), sf, data)]
    assert got == [("u", 1001, 1011), ("d", 1100, 1110), ("c", 1100, 1110), ("u", 1200, 1210)]
    stats = file_stats(shape_of(cfg()), sf, data)
    assert (stats["events"], stats["again"], stats["late"], stats["top"]) == (4, 3, 1, [1200, 1210, 1])
    # Without a known place (a watermark from before #51) nothing is left out but the copies in
    # the file: what was placed at the watermark before still is.
    unknown = [(r[0], r[4][6]) for r in file_events(shape_of(cfg()), replace(sf, applied=None), data)]
    assert unknown == [("u", 1001), ("u", 1001), ("d", 1100), ("c", 1100), ("u", 1200)]
    # A batch that applied the key change's delete only: its create is not a copy.
    rest = replace(sf, applied=(1100, 1110, 0), floor=1101)
    got = [(r[0], r[4][6]) for r in file_events(shape_of(cfg()), rest, "".join(x + "\n" for x in lines[4:]).encode())]
    assert got == [("c", 1101), ("u", 1200)]
    # Across the files of one batch: a later file's copies of an earlier file's changes.
    a, b = SinkFile(f"{TOPIC}+0+0.json", TOPIC, 0, 0), SinkFile(f"{TOPIC}+0+4.json", TOPIC, 0, 4)
    c = SinkFile(f"{TOPIC}+1+0.json", TOPIC, 1, 0, applied=(900, 901, 1))
    stats = {a.name: {"top": [1100, 1110, 1], "fresh": False}, b.name: {"top": [1200, 1210, 1], "fresh": False},
             c.name: {"top": None, "fresh": False}}  # fmt: skip
    assert [f.applied for f in after_applied([a, b, c], stats)] == [None, (1100, 1110, 1), (900, 901, 1)]
    # A new snapshot (a new slot or server: lower LSNs) starts the order again; an incremental
    # snapshot's reads do not.
    snap = [json_line(ev("r", lsn=500, last_commit=None, after=ROW, snapshot=flag)) for flag in ("true", "last")]
    incremental = json_line(ev("r", lsn=1300, last_commit=None, after=ROW, snapshot="incremental"))
    data = "".join(x + "\n" for x in [incremental, u1010, *snap, u1010, u1011]).encode()
    got = [(r[0], r[4][7]) for r in file_events(shape_of(cfg()), replace(sf, floor=0), data)]
    assert got == [("r", 1300), ("r", 500), ("r", 500), ("u", 1010), ("u", 1011)]
    stats = file_stats(shape_of(cfg()), replace(sf, floor=0), data)
    assert (stats["again"], stats["top"], stats["fresh"]) == (1, [1000, 1011, 1], True)


def test_config_needs_uri_and_prefix_and_capture_dags_skip_debezium_tables():
    from cdc_lakehouse.orchestration.dag_parts import endpoint_ids

    _c, errors = parse_table_config(
        {
            "name": "orders",
            "source": {"table": "orders", "shards": [{"conn_id": "app_db", "schemas": ["s1"]}]},
            "primary_key": ["id"],
            "landing": {"kind": "debezium_s3"},
        },
        "orders.yaml",
    )
    assert errors and "topic_prefix" in " ".join(e.message for e in errors)
    own = parse_table_config(
        {
            "name": "items",
            "source": {"table": "items", "shards": [{"conn_id": "other_db", "schemas": ["s1"]}]},
            "primary_key": ["id"],
        },
        "items.yaml",
    )[0]
    assert endpoint_ids([cfg(), own]) == ["other_db"]


def test_gzip_objects_read_like_plain_json():
    import gzip

    lines = [json_line(ev(after=ROW)), json_line(TOMBSTONE), json_line(ev("u", lsn=2100, last_commit=2050, after=ROW))]
    plain, plain_stats = rows_of(lines)
    packed, packed_stats = rows_of([], data=gzip.compress("".join(x + "\n" for x in lines).encode()))
    assert packed == plain and packed_stats["records"] == plain_stats["records"] == 3
    from cdc_lakehouse.landing.debezium.plan import FILE_RE

    assert FILE_RE.match(f"{TOPIC}+0+0000000042.json.gz")["start"] == "0000000042"


def test_a_backlog_is_taken_lowest_position_first_in_per_partition_prefixes():
    p0 = [SinkFile(f"u/{TOPIC}+0+{s}.json", TOPIC, 0, s) for s in (0, 10, 20)]
    p1 = [SinkFile(f"u/{TOPIC}+1+{s}.json", TOPIC, 1, s) for s in (0, 10)]
    hb = SinkFile("u/__debezium-heartbeat.dbz+0+0.json", "__debezium-heartbeat.dbz", 0, 0, heartbeat=True)
    files = [*p0, *p1, hb]
    lows = {p0[0].name: 100, p0[1].name: 300, p0[2].name: 500, p1[0].name: 200, p1[1].name: 400}
    stats = {f.name: {"events": 0 if f.heartbeat else 10, "lo": lows.get(f.name)} for f in files}
    got = within_budget(files, stats, 25)
    # Heartbeats always; then p0[0] (100), p1[0] (200), p0[1] (300): 30 >= 25, a prefix of each partition.
    assert [f.name for f in got] == [hb.name, p0[0].name, p1[0].name, p0[1].name]
    # One file at least, even over the budget; everything when it fits.
    assert [f.name for f in within_budget(files, stats, 1)] == [hb.name, p0[0].name]
    assert len(within_budget(files, stats, 1000)) == len(files)
    # Files at the lowest position all go together: one transaction over both partitions is never
    # taken half, which would leave the batch nothing below its frontier to apply.
    stats[p1[0].name]["lo"] = 100
    assert [f.name for f in within_budget(files, stats, 1)] == [hb.name, p0[0].name, p1[0].name]
