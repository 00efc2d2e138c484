"""The capture writes landing Parquet with an Arrow schema; the ingest reads it with a Spark
schema. The two are declared separately and must agree field for field."""

from __future__ import annotations

from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.parquet as pq
from cdc_lakehouse.landing.format import LANDING_FIELDS, SOURCE_FIELDS, landing_arrow_schema, landing_spark_schema
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql.types import TimestampType


def test_field_names_and_order_agree_with_the_documented_lists():
    arrow, spark_schema = landing_arrow_schema(), landing_spark_schema()
    assert arrow.names == LANDING_FIELDS
    assert spark_schema.fieldNames() == LANDING_FIELDS
    assert [f.name for f in arrow.field("source").type] == SOURCE_FIELDS
    assert spark_schema["source"].dataType.fieldNames() == SOURCE_FIELDS


def test_arrow_schema_converts_to_the_spark_schema_exactly():
    # Types, nested types and nullability (everything nullable on both sides).
    assert from_arrow_schema(landing_arrow_schema()) == landing_spark_schema()


def test_commit_ts_is_an_instant_on_both_sides():
    ts = landing_arrow_schema().field("source").type.field("commit_ts").type
    assert ts.unit == "us"
    assert ts.tz == "UTC"
    assert isinstance(landing_spark_schema()["source"].dataType["commit_ts"].dataType, TimestampType)


def test_a_file_written_with_the_arrow_schema_reads_back_with_the_spark_schema(spark, tmp_path):
    commit_ts = datetime(2026, 11, 22, 8, 0, 0, 500000, tzinfo=UTC)
    source = {
        "connector": "postgresql",
        "endpoint": "ep",
        "host": "h",
        "db": "d",
        "schema": "s1",
        "table": "block",
        "commit_lsn": 2**40,
        "lsn": 2**40 - 8,
        "xid": 7,
        "seq": 3,
        "commit_ts": commit_ts,
    }
    rows = {
        "op": ["u", "d"],
        "before": [None, [("id", "2"), ("title", None)]],
        "after": [[("id", "1"), ("title", "")], None],
        "unavailable": [["body"], []],
        "source": [source, {**source, "seq": 4}],
        "table_schema": ['[{"name": "id"}]', "[]"],
        "ts_ms": [1, 2],
        "run_id": ["r1", "r1"],
    }
    path = tmp_path / "part-00000.parquet"
    pq.write_table(pa.Table.from_pydict(rows, schema=landing_arrow_schema()), path)

    got = spark.read.schema(landing_spark_schema()).parquet(f"file://{path}").orderBy("source.seq").collect()
    assert [r["op"] for r in got] == ["u", "d"]
    assert got[0]["after"] == {"id": "1", "title": ""}
    assert got[0]["before"] is None
    assert got[1]["before"] == {"id": "2", "title": None}
    assert [r["unavailable"] for r in got] == [["body"], []]
    assert got[0]["source"]["commit_lsn"] == 2**40
    assert got[0]["source"]["endpoint"] == "ep"
    assert got[0]["table_schema"] == '[{"name": "id"}]'
    # The instant survives: Spark shows it in the session time zone (UTC).
    ts = spark.read.parquet(f"file://{path}").selectExpr("unix_micros(source.commit_ts) AS us").first()["us"]
    assert ts == int(commit_ts.timestamp()) * 1_000_000 + 500000
