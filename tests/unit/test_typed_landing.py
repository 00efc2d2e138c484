"""Typed landing (format 2, issue #56): values typed once where they enter, the same values and the
same reasons as the text path (format 1) gave, bit for bit, edge values included."""

from __future__ import annotations

import json
import math
import re
import struct
from decimal import Decimal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cdc_lakehouse.columns import LSN_COL, OP_COL, SHARD_COL, UNAVAILABLE_COL
from cdc_lakehouse.ingest.landed import read_landed
from cdc_lakehouse.ingest.validate import BKEY, RAW, REASONS, typed_events
from cdc_lakehouse.landing.format import landing_arrow_schema
from cdc_lakehouse.landing.reader import Plan
from cdc_lakehouse.landing.values import typed_column
from cdc_lakehouse.landing.writer import ImageColumns, TableWriter
from cdc_lakehouse.source.pgoutput import parse_pg_array
from cdc_lakehouse.watermark import Watermark

from tests.conftest import make_config

# What fits and what does not, per lake type, as PostgreSQL prints values (lake.casts' own table,
# tests/unit/test_events.py::test_cast_text_guards, with arrays as array literals).
FITS = [
    ("bigint", "-42", -42, ["1.5", "abc", "99999999999999999999", " 1", "+1"]),
    ("int", "7", 7, ["2147483648", "7.0"]),
    ("boolean", "t", True, ["yes", "1"]),
    ("decimal(10,2)", "12.50", Decimal("12.50"), ["1.239", "123456789.1", "NaN", "Infinity"]),
    # "1" and 30 zeros: pyarrow 21's cast alone wraps it into another number (landing.values).
    ("decimal(38,18)", "1.500000000000000000000", Decimal("1.5"), ["1." + "1" * 19, "1" * 21, "1" + "0" * 30]),
    ("date", "2026-11-22", None, ["2026-11-22 BC", "infinity", "22/11/2026", "2026-02-30"]),
    ("timestamp", "2026-11-22 10:00:00.5+02", None, ["infinity", "0001-01-01 00:00:00+00 BC", "yesterday"]),
    ("array<string>", '{a,NULL,"b \\"q\\"","c,d"}', ["a", None, 'b "q"', "c,d"], ["{{1}}", "[1:2]={1,2}"]),
    ("array<int>", "{1,2,NULL}", [1, 2, None], ["{1,x}", "{{1,2},{3,4}}"]),
    ("binary", "\\x4869", b"Hi", ["4869", "\\xZZ"]),
]


@pytest.mark.parametrize(("lake_type", "good", "value", "bad"), FITS)
def test_a_value_that_does_not_fit_is_kept_as_text_never_coerced(lake_type, good, value, bad):
    arr, misfits = typed_column([good, None, *bad], lake_type)
    assert len(arr) == len(bad) + 2
    if value is not None:
        assert arr[0].as_py() == value
    assert arr[1].as_py() is None and 1 not in misfits  # NULL is a value, not a misfit
    assert misfits == {i + 2: b for i, b in enumerate(bad)}
    assert all(arr[i + 2].as_py() is None for i in range(len(bad)))


# The test table: every lake type, with the edge values of each.
COLUMNS = (
    ("id", "bigint"),
    ("i", "int"),
    ("f", "float"),
    ("d", "double"),
    ("n", "decimal(38,10)"),
    ("n2", "decimal(10,2)"),
    ("b", "boolean"),
    ("t", "string"),
    ("j", "string"),
    ("dt", "date"),
    ("ts", "timestamp"),
    ("tsn", "timestamp_ntz"),
    ("by", "binary"),
    ("arr_t", "array<string>"),
    ("arr_i", "array<int>"),
    ("arr_d", "array<double>"),
)
NAMES = [n for n, _ in COLUMNS]
N38 = "9999999999999999999999999999.9999999999"


def row(**values):
    return [values.get(n) for n in NAMES]


# (op, before, after, unavailable): images as pgoutput's text, in the relation's order.
EVENTS = [
    (
        "c",
        None,
        row(
            id="1",
            i="-2147483648",
            f="NaN",
            d="-0",
            n=N38,
            n2="-12.50",
            b="t",
            t="héllo ✓ 𝄞 'q' \"dq\" \\ back",
            j='{"a": [1, 2.5e10], "é": null}',
            dt="0001-01-01",
            ts="2026-11-22 10:00:00.5+00",
            tsn="2026-11-22 10:00:00.123456",
            by="\\x00ff",
            arr_t='{a,NULL,"b \\"q\\"","c,d","NULL"}',
            arr_i="{1,2,NULL}",
            arr_d="{NaN,-Infinity,4.9e-324}",
        ),
        None,
    ),
    (
        "u",
        None,
        row(
            id="1",
            i="2147483647",
            f="-Infinity",
            d="4.9e-324",
            n="-" + N38,
            n2="0.01",
            b="f",
            t="",
            dt="9999-12-31",
            ts="1970-01-01 00:00:00+00",
            tsn="0001-01-01 00:00:00",
        ),
        None,
    ),
    ("u", None, row(id="2", d="Infinity", n="NaN", ts="infinity", dt="2026-01-01 BC", arr_i="{{1,2},{3,4}}"), None),
    ("u", None, row(id="3", by="zz", n2="1.239", f="3.4028235e+38", d="1.7976931348623157e+308"), None),
    ("d", row(id="4"), None, None),
    ("u", row(id="5"), row(id="6", i="1"), ["t"]),
    ("c", None, row(id="7"), None),
]


def text_row(values):
    """An image as format 1 held it: a map of text, arrays as JSON of their elements' text (what
    the capture wrote before format 2), absent entries for key-only images' other columns."""
    if values is None:
        return None
    out = []
    for (name, lake_type), v in zip(COLUMNS, values, strict=True):
        text = v
        if lake_type.startswith("array<") and v is not None:
            try:
                text = json.dumps(parse_pg_array(v), separators=(",", ":"))
            except ValueError as exc:
                text = "\x00unparseable-array:" + str(exc) + ":" + v
        out.append((name, text))
    return out


def write_both(tmp_path):
    """The events as a format-1 file and as a format-2 file (TableWriter, what the capture runs)."""
    consts = {"connector": "postgresql", "endpoint": "ep", "host": "h", "db": "d", "ts_ms": 0, "run_id": "r1"}
    image = ImageColumns(COLUMNS, json.dumps([{"name": n, "lake_type": t} for n, t in COLUMNS]))
    typed_dir = tmp_path / "typed"
    typed_dir.mkdir()
    w = TableWriter(typed_dir, consts, table="block")
    for seq, (op, before, after, unav) in enumerate(EVENTS, 1):
        w.add(op, before, after, unav, "s1", image, 100, 90 + seq, 5, seq, 0)
    typed_files = w.close()
    assert w.misfits == 6
    text = {
        "op": [e[0] for e in EVENTS],
        "before": [text_row(e[1]) for e in EVENTS],
        "after": [text_row(e[2]) for e in EVENTS],
        "unavailable": [e[3] for e in EVENTS],
        "source": [
            dict(
                connector="postgresql",
                endpoint="ep",
                host="h",
                db="d",
                schema="s1",
                table="block",
                commit_lsn=100,
                lsn=90 + seq,
                xid=5,
                seq=seq,
                commit_ts=0,
            )
            for seq in range(1, len(EVENTS) + 1)
        ],
        "table_schema": [image.schema_json] * len(EVENTS),
        "ts_ms": [0] * len(EVENTS),
        "run_id": ["r1"] * len(EVENTS),
    }
    text_file = tmp_path / "text.parquet"
    pq.write_table(pa.Table.from_pydict(text, schema=landing_arrow_schema()), text_file)
    typed_uri = f"file://{typed_dir / typed_files[0].name}"
    return f"file://{text_file}", typed_uri, list(typed_files[0].columns or [])


def text_reason(reason: str) -> str:
    """Format 1's reason for an array that did not parse showed the old capture's marker, not
    the array's text; format 2's shows the text."""
    marker = re.match(r"(column \w+: value ')\x00unparseable-array:[^:]*:(.*)", reason)
    return marker.group(1) + marker.group(2) if marker else reason


def bits(v):
    """Floats compared bit for bit (NaN, -0, subnormals), everything else as is."""
    if isinstance(v, float):
        return struct.pack(">d", v)
    if isinstance(v, list):
        return [bits(x) for x in v]
    if isinstance(v, bytearray):
        return bytes(v)
    return v


def test_typed_landing_gives_the_text_paths_values_and_reasons_bit_for_bit(spark, tmp_path):
    text_uri, typed_uri, columns = write_both(tmp_path)
    cfg = make_config("typed_landing", ["s1"])
    wm = Watermark()
    plans = {
        "text": Plan([], [text_uri], wm),
        "typed": Plan([], [typed_uri], wm, typed={typed_uri: columns}),
    }
    got = {}
    for fmt, plan in plans.items():
        df = typed_events(read_landed(spark, cfg, plan), cfg, list(COLUMNS), cfg.shard_map())
        got[fmt] = sorted(df.collect(), key=lambda r: r["_seq_raw"])
    keep = [SHARD_COL, *NAMES, OP_COL, LSN_COL, "_seq_raw", UNAVAILABLE_COL, BKEY + "id"]
    for t, x in zip(got["text"], got["typed"], strict=True):
        assert {k: bits(t[k]) for k in keep} == {k: bits(x[k]) for k in keep}, t["_seq_raw"]
        assert sorted(map(text_reason, t[REASONS])) == sorted(x[REASONS]), t["_seq_raw"]
        assert (t[RAW] is None) == (x[RAW] is None)
    by_seq = {r["_seq_raw"]: r for r in got["typed"]}
    assert math.isnan(by_seq[1]["f"]) and struct.pack(">d", by_seq[1]["d"]) == struct.pack(">d", -0.0)
    assert by_seq[2]["d"] == 5e-324 and by_seq[1]["n"] == Decimal(N38)
    assert by_seq[1]["arr_t"] == ["a", None, 'b "q"', "c,d", "NULL"]
    reasons = sorted(by_seq[3][REASONS])
    assert "column n: value 'NaN' does not fit decimal(38,10)" in reasons and len(reasons) == 4, reasons
    assert by_seq[3]["n"] is None and by_seq[3]["ts"] is None  # misfits are never coerced


def test_a_quarantined_typed_event_replays_with_its_original_text(spark, tmp_path):
    """The quarantine keeps a typed event's payload in format 1's shape: the text kept at capture
    for the values that did not fit, the typed values written as text the text path reads back."""
    _, typed_uri, columns = write_both(tmp_path)
    cfg = make_config("typed_replay", ["s1"])
    plan = Plan([], [typed_uri], Watermark(), typed={typed_uri: columns})
    df = typed_events(read_landed(spark, cfg, plan), cfg, list(COLUMNS), cfg.shard_map())
    bad = {r["_seq_raw"]: json.loads(r[RAW]) for r in df.filter(f"size({REASONS}) > 0").collect()}
    assert set(bad) == {3, 4}
    after = bad[3]["after"]
    assert after["n"] == "NaN" and after["ts"] == "infinity" and after["arr_i"] == "{{1,2},{3,4}}"
    assert after["d"] == "Infinity" and after["id"] == "2"
    # Replayed (ingest.replay reads the payload as format-1 rows): the same values and reasons.
    from cdc_lakehouse.ingest.replay import RAW_FIELDS
    from cdc_lakehouse.landing.format import landing_spark_schema
    from pyspark.sql import functions as F
    from pyspark.sql.types import StructType

    schema = StructType([f for f in landing_spark_schema().fields if f.name in RAW_FIELDS])
    payload = df.filter(f"size({REASONS}) > 0").select(F.from_json(RAW, schema).alias("e")).select("e.*")
    replayed = {r["_seq_raw"]: r for r in typed_events(payload, cfg, list(COLUMNS), cfg.shard_map()).collect()}
    original = {r["_seq_raw"]: r for r in df.filter(f"size({REASONS}) > 0").collect()}
    for seq, r in replayed.items():
        assert sorted(r[REASONS]) == sorted(original[seq][REASONS])
        assert {k: bits(r[k]) for k in NAMES} == {k: bits(original[seq][k]) for k in NAMES}
