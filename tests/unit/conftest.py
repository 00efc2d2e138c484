"""Unit-test fixtures: the session's one SparkSession, without PostgreSQL.

The root `spark` fixture builds its lake's JDBC catalog in a throwaway PostgreSQL. Unit tests
need none of that: this `spark` makes the same SparkSession (same factory, same settings) with
a Hadoop (filesystem) Iceberg catalog, `unit_lake`, in a temp dir, on the session's one Spark
Connect server (tests/conftest.py `spark_server`).
"""

from __future__ import annotations

import pytest

UNIT_CATALOG = "unit_lake"


@pytest.fixture(scope="session")
def unit_lake(tmp_root):
    from cdc_lakehouse.settings import LakeSettings

    return LakeSettings(
        catalog_type="hadoop",
        catalog_name=UNIT_CATALOG,
        warehouse=f"file://{tmp_root / 'unit-warehouse'}",
        landing_uri=f"file://{tmp_root / 'unit-landing'}",
    )


@pytest.fixture(scope="session")
def spark(unit_lake, spark_server):
    from tests.helpers import suite_spark_session

    session = suite_spark_session(unit_lake, spark_server.url)
    yield session
    session.stop()


# A landing event (Debezium envelope, values as PostgreSQL text): tests build tiny frames from
# this base row plus per-row overrides (`source` overrides merge into the base's source).
BASE_EVENT = {
    "op": "u",
    "before": None,
    "after": {"id": "1", "title": "a", "n": "1.00"},
    "unavailable": None,
    "source": {
        "connector": "postgresql",
        "endpoint": "ep",
        "host": "h",
        "db": "d",
        "schema": "s1",
        "table": "block",
        "commit_lsn": 100,
        "lsn": 90,
        "xid": 5,
        "seq": 1,
        "commit_ts": None,
    },
    "table_schema": "[]",
    "ts_ms": 0,
    "run_id": "r1",
}


@pytest.fixture
def landing_events(spark):
    """landing_events(*overrides) -> a DataFrame in the landing schema, one row per override."""
    from cdc_lakehouse.landing.format import landing_spark_schema

    def make(*overrides):
        rows = []
        for o in overrides:
            row = {**BASE_EVENT, **o}
            row["source"] = {**BASE_EVENT["source"], **o.get("source", {})}
            rows.append(row)
        return spark.createDataFrame(rows, landing_spark_schema())

    return make
