"""Landing events -> typed events: what is taken from which image, and why an event is quarantined."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest
from cdc_lakehouse.columns import LSN_COL, OP_COL, SHARD_COL, UNAVAILABLE_COL
from cdc_lakehouse.ingest.validate import BKEY, RAW, REASONS, typed_events
from cdc_lakehouse.lake.casts import cast_text
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual

from tests.conftest import make_config

COLS = [("id", "bigint"), ("title", "string"), ("n", "decimal(10,2)")]
SHARDS = {("ep", "s1"): "s1", ("ep2", "s1"): "db2.s1"}


def typed(landing_events, *overrides, cols=COLS):
    cfg = make_config("va", ["s1"])
    df = typed_events(landing_events(*overrides), cfg, cols, SHARDS)
    return df.orderBy("_seq_raw")


def test_values_come_from_the_after_image_for_upserts_and_the_before_image_for_deletes(spark, landing_events):
    out = typed(
        landing_events,
        {"op": "r", "after": {"id": "1", "title": "snap", "n": "2.50"}, "source": {"seq": 1}},
        {"op": "c", "after": {"id": "2", "title": "", "n": "-0.5"}, "source": {"seq": 2}},
        {"op": "d", "before": {"id": "3", "title": "gone"}, "after": {"id": "99"}, "source": {"seq": 3}},
        {"op": "u", "after": {"id": "4"}, "source": {"seq": 4, "endpoint": "ep2"}},  # columns it lacks: NULL
    )
    assertDataFrameEqual(
        out.select(SHARD_COL, "id", "title", "n", OP_COL, LSN_COL, REASONS),
        spark.createDataFrame(
            [
                ("s1", 1, "snap", Decimal("2.50"), "c", 100, []),  # snapshot reads are creates
                ("s1", 2, "", Decimal("-0.50"), "c", 100, []),
                ("s1", 3, "gone", None, "d", 100, []),
                ("db2.s1", 4, None, None, "u", 100, []),
            ],
            f"{SHARD_COL} string, id bigint, title string, n decimal(10,2), {OP_COL} string, "
            f"{LSN_COL} bigint, {REASONS} array<string>",
        ),
    )


def test_good_events_carry_no_raw_payload_and_bad_ones_their_whole_event(spark, landing_events):
    out = typed(
        landing_events,
        {"source": {"seq": 1}},
        {"after": {"id": "2", "title": "x", "n": "NaN"}, "source": {"seq": 2}},
    ).collect()
    assert out[0][REASONS] == []
    assert out[0][RAW] is None
    assert out[1][REASONS] == ["column n: value 'NaN' does not fit decimal(10,2)"]
    raw = json.loads(out[1][RAW])
    assert raw["op"] == "u"
    assert raw["after"] == {"id": "2", "title": "x", "n": "NaN"}
    assert raw["source"]["seq"] == 2


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ({"op": None}, "unknown op 'null'"),
        ({"op": "U"}, "unknown op 'U'"),
        ({"source": {"commit_lsn": None}}, "missing source position (commit_lsn/seq)"),
        ({"source": {"seq": None}}, "missing source position (commit_lsn/seq)"),
        ({"op": "c", "after": None}, "missing after image"),
        ({"op": "d", "before": None}, "missing before image"),
        ({"op": "d", "before": {"title": "no key"}}, "missing key column id"),
        ({"before": {"id": "x1"}, "after": {"id": "1"}}, "before image key column id does not fit bigint"),
        ({"after": {"id": "99999999999999999999"}}, "column id: value '99999999999999999999' does not fit bigint"),
    ],
)
def test_quarantine_reason(landing_events, override, reason):
    (row,) = typed(landing_events, override).collect()
    assert reason in row[REASONS]


def test_long_bad_values_are_cut_in_the_reason(landing_events):
    (row,) = typed(landing_events, {"after": {"id": "1", "n": "9" * 200}}).collect()
    assert row[REASONS] == [f"column n: value '{'9' * 80}' does not fit decimal(10,2)"]


def test_string_columns_never_quarantine(landing_events):
    (row,) = typed(landing_events, {"after": {"id": "1", "title": "\x00 anything \u2603"}}).collect()
    assert row[REASONS] == []
    assert row["title"] == "\x00 anything \u2603"


def test_unavailable_columns_are_listed_and_empty_lists_are_null(landing_events):
    rows = typed(
        landing_events,
        {"unavailable": ["title"], "after": {"id": "1", "n": "1.00"}, "source": {"seq": 1}},
        {"unavailable": [], "source": {"seq": 2}},
    ).collect()
    assert [r[UNAVAILABLE_COL] for r in rows] == [["title"], None]
    assert rows[0]["title"] is None and rows[0][REASONS] == []


def test_before_image_key_is_typed_for_key_changes_only(landing_events):
    rows = typed(
        landing_events,
        {"before": {"id": "5"}, "after": {"id": "6", "title": "t", "n": "1.00"}, "source": {"seq": 1}},
        {"op": "d", "before": {"id": "7"}, "after": None, "source": {"seq": 2}},
    ).collect()
    assert [r[BKEY + "id"] for r in rows] == [5, None]


@pytest.mark.parametrize(
    ("lake_type", "good", "bad"),
    [
        (
            "decimal(10,2)",
            [("1.2300", Decimal("1.23")), ("-0.5", Decimal("-0.50")), ("12345678", Decimal("12345678"))],
            [".5", "1e3", " 1", "1.239"],
        ),
        ("decimal(5,0)", [("12345", Decimal("12345")), ("7.000", Decimal("7"))], ["123456", "7.5"]),
        ("double", [("1e5", 1e5), ("-2.5", -2.5), ("-Infinity", float("-inf"))], ["abc", "1,5", ""]),
        ("boolean", [("true", True), ("f", False)], ["T", "0", ""]),
        ("smallint", [("-32768", -32768)], ["32768", "+1"]),
        ("int", [("-7", -7)], [" 7", "7 "]),
    ],
)
def test_cast_text_more_guards(spark, lake_type, good, bad):
    df = spark.createDataFrame([(t,) for t, _ in good] + [(b,) for b in bad], "raw string")
    got = [r["v"] for r in df.select(cast_text(F.col("raw"), lake_type).alias("v")).collect()]
    assert got[: len(good)] == [v for _, v in good]
    assert got[len(good) :] == [None] * len(bad)


def test_cast_text_nan_double_is_kept(spark):
    df = spark.createDataFrame([("NaN",)], "raw string")
    (row,) = df.select(F.isnan(cast_text(F.col("raw"), "double")).alias("nan")).collect()
    assert row["nan"] is True


def test_cast_text_rejects_an_unknown_lake_type():
    with pytest.raises(ValueError, match="no cast for lake type 'interval'"):
        cast_text(F.col("raw"), "interval")
