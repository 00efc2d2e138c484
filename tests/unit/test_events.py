"""Event logic as pure DataFrame functions on tiny DataFrames (base row + overrides)."""

from __future__ import annotations

from datetime import date, datetime
from decimal import Decimal

import pytest
from cdc_lakehouse.columns import LSN_COL, OP_COL, SEQ_COL, SHARD_COL
from cdc_lakehouse.ingest.reduce import latest_per_key, split_pk_changes
from cdc_lakehouse.ingest.validate import REASONS, typed_events
from cdc_lakehouse.lake.casts import cast_text
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual

from tests.conftest import make_config
from tests.unit.conftest import BASE_EVENT


@pytest.mark.parametrize(
    ("lake_type", "good", "value", "bad"),
    [
        ("bigint", "-42", -42, ["1.5", "abc", "99999999999999999999"]),
        ("int", "7", 7, ["2147483648", "7.0"]),
        ("boolean", "t", True, ["yes", "1"]),
        ("decimal(10,2)", "12.50", Decimal("12.50"), ["1.239", "123456789.1", "NaN"]),
        ("decimal(38,18)", "1.500000000000000000000", Decimal("1.5"), ["1." + "1" * 19]),
        ("date", "2026-11-22", date(2026, 11, 22), ["2026-11-22 BC", "infinity", "22/11/2026"]),
        (
            "timestamp",
            "2026-11-22 10:00:00.5+02",
            datetime(2026, 11, 22, 8, 0, 0, 500000),
            ["infinity", "0001-01-01 00:00:00+00 BC", "yesterday"],
        ),
        ("array<string>", '["a",null]', ["a", None], ["\x00unparseable-array:x:{{1}}"]),
        ("array<int>", '["1","2"]', [1, 2], ['["1","x"]']),
        ("binary", "\\x4869", b"Hi", ["4869", "\\xZZ"]),
    ],
)
def test_cast_text_guards(spark, lake_type, good, value, bad):
    df = spark.createDataFrame([(good,)] + [(b,) for b in bad], "raw string")
    out = df.select(cast_text(F.col("raw"), lake_type).alias("v")).collect()
    got = out[0]["v"]
    if isinstance(got, bytearray):
        got = bytes(got)
    assert got == value
    assert [r["v"] for r in out[1:]] == [None] * len(bad), "a value that does not fit must not be coerced"


# The shared base landing event, with a commit time.
BASE = {**BASE_EVENT, "source": {**BASE_EVENT["source"], "commit_ts": datetime(2026, 1, 1)}}


def events(spark, *overrides):
    from cdc_lakehouse.landing.format import landing_spark_schema

    rows = []
    for o in overrides:
        row = {**BASE, **o}
        row["source"] = {**BASE["source"], **o.get("source", {})}
        rows.append(row)
    return spark.createDataFrame(rows, landing_spark_schema())


COLS = [("id", "bigint"), ("title", "string"), ("n", "decimal(10,2)")]


def test_typed_events_quarantine_reasons(spark):
    cfg = make_config("ev", ["s1"])
    df = events(
        spark,
        {},
        {"op": "x"},
        {"after": {"title": "no key"}},
        {"after": {"id": "abc", "title": "b", "n": "1.00"}},
        {"after": {"id": "2", "title": "c", "n": "1.234"}},
        {"op": "d", "after": None, "before": None},
        {"source": {"schema": "not_configured"}},
    )
    out = typed_events(df, cfg, COLS, {("ep", "s1"): "s1"}).orderBy(F.monotonically_increasing_id()).collect()
    reasons = [r[REASONS] for r in out]
    assert reasons[0] == []
    assert "unknown op 'x'" in reasons[1]
    assert "missing key column id" in reasons[2]
    assert any("column id: value 'abc' does not fit bigint" == r for r in reasons[3])
    assert any("column n: value '1.234' does not fit decimal(10,2)" == r for r in reasons[4])
    assert "missing before image" in reasons[5]
    assert out[6][SHARD_COL] is None  # outside the table's shards: filtered by the caller


def test_latest_per_key_orders_by_commit_lsn_then_seq(spark):
    df = spark.createDataFrame(
        [("s1", 1, "old", 100, 4), ("s1", 1, "new", 100, 6), ("s1", 1, "older", 90, 8), ("s2", 1, "other", 50, 2)],
        f"{SHARD_COL} string, id bigint, title string, {LSN_COL} bigint, {SEQ_COL} bigint",
    )
    assertDataFrameEqual(
        latest_per_key(df, [SHARD_COL, "id"]),
        spark.createDataFrame([("s1", 1, "new", 100, 6), ("s2", 1, "other", 50, 2)], df.schema),
    )


def test_primary_key_change_becomes_delete_then_upsert(spark):
    cfg = make_config("ev", ["s1"])
    df = events(
        spark, {"before": {"id": "1"}, "after": {"id": "9", "title": "moved", "n": "1.00"}, "source": {"seq": 3}}
    )
    typed = typed_events(df, cfg, COLS, {("ep", "s1"): "s1"})
    out = split_pk_changes(typed.drop(REASONS, "_raw"), cfg).select("id", OP_COL, SEQ_COL, "title")
    assertDataFrameEqual(
        out,
        spark.createDataFrame(
            [(1, "d", 6, None), (9, "u", 7, "moved")], "id bigint, _cdc_op string, _cdc_seq bigint, title string"
        ),
    )
