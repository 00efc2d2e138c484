"""Canonical text of lake values (the audit's row hashes and buckets).

The audit hashes each row in PostgreSQL and in Spark; both must print every value the same
way. Spark's side is checked on edge values here; PostgreSQL's side (no server in unit tests)
only as the SQL text it renders.
"""

from __future__ import annotations

import hashlib
import struct
from datetime import UTC, date, datetime
from decimal import Decimal

import pytest
from cdc_lakehouse.audit.hashing import (
    NULL,
    SEP,
    pg_bucket,
    pg_canonical,
    pg_row_hash,
    spark_bucket,
    spark_canonical,
    spark_hash_num,
    spark_row_hash,
)
from cdc_lakehouse.identifiers import IdentifierError
from pyspark.sql import functions as F


def double_bits(x: float) -> str:
    return str(struct.unpack(">q", struct.pack(">d", x))[0])


def float_bits(x: float) -> str:
    return str(struct.unpack(">i", struct.pack(">f", x))[0])


CASES = [
    # (lake type, value, canonical text)
    ("string", None, "\\N"),
    ("string", "", ""),
    ("string", "\\N", "\\N"),  # the text \N itself prints like NULL: both engines agree on that
    ("string", '{"a": [1, 2.50]}', '{"a": [1, 2.50]}'),  # json/jsonb: the source's text, untouched
    ("bigint", -42, "-42"),
    ("int", None, "\\N"),
    ("boolean", True, "true"),
    ("decimal(10,2)", Decimal("1.50"), "1.5"),
    ("decimal(10,2)", Decimal("2.00"), "2"),
    ("decimal(10,2)", Decimal("100.00"), "100"),
    ("decimal(10,2)", Decimal("-0.00"), "0"),
    ("decimal(10,2)", Decimal("-0.10"), "-0.1"),
    ("decimal(10,2)", Decimal("12345678.90"), "12345678.9"),  # no grouping commas
    ("decimal(10,0)", Decimal("1000"), "1000"),
    ("decimal(38,18)", Decimal("0.000000000000000001"), "0.000000000000000001"),  # not 1E-18
    ("decimal(38,18)", Decimal("12345678901234567890.123456789012345678"), "12345678901234567890.123456789012345678"),
    ("double", 1.0, double_bits(1.0)),
    ("double", 0.0, "0"),
    ("double", -0.0, double_bits(-0.0)),  # negative zero is not zero: its bits differ
    ("double", float("nan"), "NaN"),
    ("double", float("-inf"), double_bits(float("-inf"))),
    ("double", None, "\\N"),
    ("float", 1.5, float_bits(1.5)),
    ("float", -0.0, float_bits(-0.0)),
    ("date", date(1970, 1, 2), "1"),
    ("date", date(1969, 12, 31), "-1"),
    ("date", date(2026, 11, 22), str((date(2026, 11, 22) - date(1970, 1, 1)).days)),
    ("timestamp", datetime(1970, 1, 1, 0, 0, 0, 1, tzinfo=UTC), "1"),
    ("timestamp", datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=UTC), "-1"),
    ("timestamp_ntz", datetime(1970, 1, 1, 0, 0, 1), "1000000"),  # wall clock read as UTC
    ("binary", b"Hi", "4869"),
    ("binary", b"", ""),
    ("binary", b"\xab\xcd", "abcd"),  # lower-case hex, like encode(x, 'hex')
    ("array<string>", ["a", None, ""], "[a,\\N,]"),
    ("array<string>", [], "[]"),
    ("array<string>", None, "\\N"),
    ("array<decimal(10,2)>", [Decimal("1.50"), None, Decimal("-0.00")], "[1.5,\\N,0]"),
    ("array<bigint>", [3, -1], "[3,-1]"),
]


@pytest.mark.parametrize(("lake_type", "value", "text"), CASES, ids=[f"{c[0]}:{c[1]!r}" for c in CASES])
def test_spark_canonical_text(spark, lake_type, value, text):
    df = spark.createDataFrame([(value,)], f"v {lake_type}")
    assert df.select(spark_canonical(F.col("v"), lake_type).alias("c")).first()["c"] == text


def test_spark_row_hash_is_md5_of_the_canonical_texts_joined_by_unit_separator(spark):
    cols = [("id", "bigint"), ("title", "string"), ("n", "decimal(10,2)"), ("at", "date")]
    df = spark.createDataFrame(
        [(1, None, Decimal("1.50"), date(1970, 1, 11)), (1, "", Decimal("1.50"), date(1970, 1, 11))],
        "id bigint, title string, n decimal(10,2), at date",
    )
    got = [r["h"] for r in df.select(spark_row_hash(cols).alias("h")).collect()]
    assert got == [
        hashlib.md5(SEP.join(["1", NULL, "1.5", "10"]).encode()).hexdigest(),
        hashlib.md5(SEP.join(["1", "", "1.5", "10"]).encode()).hexdigest(),
    ]
    assert got[0] != got[1], "NULL and the empty string must hash differently"


def test_spark_bucket_and_hash_num_follow_the_md5_prefix(spark):
    df = spark.createDataFrame([(k,) for k in range(-3, 20)], "id bigint")
    rows = df.select(
        "id",
        spark_bucket([("id", "bigint")], 7).alias("b"),
        spark_hash_num(F.md5(F.col("id").cast("string"))).alias("h"),
    ).collect()
    for r in rows:
        digest = hashlib.md5(str(r["id"]).encode()).hexdigest()
        assert r["b"] == int(digest[:7], 16) % 7
        assert int(r["h"]) == int(digest[:15], 16)


# --- PostgreSQL's side, as SQL text --------------------------------------------------------------


def test_pg_null_marker_and_separator_match_spark():
    # E'\\N' in PostgreSQL is the two characters backslash, N: Spark's NULL marker.
    assert NULL == "\\" + "N"
    assert pg_canonical("title", "string", "text") == "coalesce(\"title\"::text, E'\\\\N')"
    assert SEP == chr(31)
    assert pg_row_hash([("a", "bigint"), ("b", "string")]).startswith("md5(concat_ws(chr(31), ")


@pytest.mark.parametrize(
    ("lake_type", "pg_type", "fragment"),
    [
        ("decimal(10,2)", "numeric(10,2)", 'trim_scale("c"::numeric)::text'),
        ("double", "double precision", 'float8send("c"::float8)'),
        ("double", "double precision", "'NaN'"),
        ("float", "real", 'float4send("c"::float4)'),
        ("date", "date", "(\"c\" - date '1970-01-01')::text"),
        ("timestamp", "timestamp with time zone", '(extract(epoch from "c") * 1000000)::bigint::text'),
        ("timestamp_ntz", "timestamp without time zone", '(extract(epoch from "c") * 1000000)::bigint::text'),
        ("binary", "bytea", "encode(\"c\", 'hex')"),
        ("string", "character(3)", "format('%s', \"c\")"),  # bpchar keeps its padding
        ("array<string>", "text[]", 'unnest("c") WITH ORDINALITY AS u(e, o)'),
    ],
)
def test_pg_canonical_renders_the_matching_expression(lake_type, pg_type, fragment):
    sql = pg_canonical("c", lake_type, pg_type)
    assert sql.startswith("coalesce(")
    assert sql.endswith(", E'\\\\N')")
    assert fragment in sql


def test_pg_array_elements_use_the_element_canonical_form_in_order():
    sql = pg_canonical("c", "array<decimal(10,2)>", "numeric(10,2)[]")
    assert "trim_scale(u.e::numeric)::text" in sql
    assert "string_agg(coalesce(trim_scale(u.e::numeric)::text, E'\\\\N'), ',' ORDER BY u.o)" in sql
    assert "'[' ||" in sql and "|| ']'" in sql


def test_pg_side_quotes_identifiers_and_refuses_bad_ones():
    assert '"select"' in pg_canonical("select", "string")
    assert '"id"' in pg_bucket([("id", "bigint")], 16)
    assert pg_bucket([("id", "bigint")], 16).endswith("% 16)")
    with pytest.raises(IdentifierError):
        pg_canonical('x"; drop table t; --', "string")
