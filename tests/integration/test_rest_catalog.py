"""The lake on a real Iceberg REST catalog: Apache Iceberg's own REST server (devstack.localstack.
LocalRestCatalog, 1.11.0 from Maven), its tables kept in PostgreSQL, Spark (Iceberg 1.12.0),
pyiceberg, DuckDB and Trino (476, from Maven) its clients, each authenticated with OAuth2 client
credentials.

One table's whole life on it: capture, bootstrap, ingests, the reads of three other engines, the
audit, maintenance (the latest-per-key table included) and a feed consumer; and the same source
table into a format-v3 table, whose deletion vectors DuckDB applies and Trino 476 cannot read.
Every table the project creates is the server's: listed by its REST API, not by our own code.
"""

from __future__ import annotations

import importlib
import json
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from cdc_lakehouse.audit.audit_table import audit_table
from cdc_lakehouse.feed.models import FEED_OP_COL, OP_DELETE
from cdc_lakehouse.feed.offsets import commit_meta_offset, meta_offset
from cdc_lakehouse.feed.read import read_changes
from cdc_lakehouse.lake.meta import ensure_meta_tables
from cdc_lakehouse.maintenance.maintain_table import maintain_table
from cdc_lakehouse.runtime.session import attach_lake
from trino import exceptions as trino_errors

from tests.conftest import make_config
from tests.helpers import assert_lake_equals_source
from tests.integration.conftest import REST_CLIENT_ID, REST_CLIENT_SECRET, Source


def rest_tables(url: str, namespace: str) -> set[str]:
    """The tables the server lists in `namespace` (its own API: GET /v1/namespaces/{ns}/tables)."""
    with urllib.request.urlopen(f"{url}/v1/namespaces/{namespace}/tables", timeout=10) as r:  # noqa: S310 - loopback
        return {i["name"] for i in json.load(r)["identifiers"]}


def duckdb_on(rest_url: str):
    """DuckDB with its Iceberg extension (from PyPI, loaded from the package's file: no download),
    the REST catalog attached as `rest` through its own OAuth2 client-credentials exchange."""
    import duckdb

    con = duckdb.connect()
    for name in ("avro", "httpfs", "iceberg"):
        pkg = Path(importlib.import_module(f"duckdb_extension_{name}").__file__).parent
        con.load_extension(str(pkg / "extensions" / f"v{duckdb.__version__}" / f"{name}.duckdb_extension"))
    con.sql(
        f"CREATE SECRET rest_oauth (TYPE iceberg, CLIENT_ID '{REST_CLIENT_ID}', CLIENT_SECRET '{REST_CLIENT_SECRET}', "
        f"OAUTH2_SERVER_URI '{rest_url}/v1/oauth/tokens')"
    )
    con.sql(f"ATTACH '' AS rest (TYPE iceberg, ENDPOINT '{rest_url}', SECRET rest_oauth)")
    return con


ROW_COLS = ["_cdc_shard", "id", "version", "space_id"]


def spark_rows(spark, lake, table: str) -> Counter:
    return Counter(tuple(r) for r in spark.table(lake.qualified(table)).select(*ROW_COLS).collect())


def assert_same_rows(duck, spark, lake, table: str) -> None:
    ns, name = table.split(".")
    got = Counter(duck.sql(f'SELECT {", ".join(ROW_COLS)} FROM rest."{ns}"."{name}"').fetchall())
    want = spark_rows(spark, lake, table)
    assert got == want and got, (table, got.total(), want.total())


def assert_trino_reads(trino, spark, lake, table: str) -> None:
    """Trino reads `table` through its own REST client and sees the rows Spark sees."""
    ns, name = table.split(".")
    got = Counter(trino.query(f'SELECT {", ".join(ROW_COLS)} FROM rest."{ns}"."{name}"'))
    want = spark_rows(spark, lake, table)
    assert got == want and got, ("trino", table, got.total(), want.total())


def feed_step(s: Source, state: dict, consumer: str) -> str:
    """One run of a mirror consumer: apply the feed's range to `state`, commit the offset; returns the mode."""
    since, _ = meta_offset(s.spark, s.lake, consumer, s.block.current_table)
    batch = read_changes(s.spark, s.lake, s.block, consumer, since)
    if batch.range.replaces_state:
        state.clear()
    for r in batch.rows.select(FEED_OP_COL, "_cdc_shard", "id", "version").collect():
        key = (r["_cdc_shard"], r["id"])
        if r[FEED_OP_COL] == OP_DELETE:
            state.pop(key, None)
        else:
            state[key] = r["version"]
    if batch.range.mode != "noop":
        commit_meta_offset(s.spark, s.lake, batch.range.offset, since)
    return batch.range.mode


def test_capture_to_feed_on_an_iceberg_rest_catalog(pg, source_uri, spark, lake_rest, rest_catalog, trino, unique):
    attach_lake(spark, lake_rest)
    ensure_meta_tables(spark, lake_rest)
    s = Source(pg, spark, lake_rest, unique, schemas=("s0", "s1"), blocks=400)
    mirror: dict = {}
    # The same source table into a format-v3 table: its deletes are deletion vectors (Puffin).
    shards = {"conn_id": "cdc_test_source", "database": s.db, "schemas": s.schemas}
    v3 = make_config(f"b3_{unique}", [], source={"table": "block", "shards": [shards]}, lake={"format_version": 3})
    try:
        s.capture()
        s.bootstrap(s.block)
        s.bootstrap(v3)
        assert feed_step(s, mirror, "rest_mirror") == "full"
        s.change_and_ingest(rounds=2)
        assert_lake_equals_source(spark, lake_rest, s.block, s.dsn)
        assert s.ingest(v3, f"20260101T{s.runs:02d}0000Z").metrics.status == "ok"
        assert_lake_equals_source(spark, lake_rest, v3, s.dsn)

        # The server holds the tables (and the meta tables), as its own API lists them.
        ns, current = s.block.current_table.split(".")
        assert {current, s.block.changelog_table.split(".")[1]} <= rest_tables(rest_catalog.url, ns)
        assert "ingest_runs" in rest_tables(rest_catalog.url, lake_rest.meta_namespace)

        # pyiceberg reads the same table through the same catalog and credentials.
        from pyiceberg.catalog import load_catalog

        catalog = load_catalog(lake_rest.catalog_name, **lake_rest.pyiceberg_properties())
        py_rows = catalog.load_table(s.block.current_table).scan().to_arrow().num_rows
        assert py_rows == spark.table(lake_rest.qualified(s.block.current_table)).count() > 0

        # DuckDB reads the current table (merge-on-read: its position deletes applied) and the
        # changelog through the same catalog, and sees what Spark sees.
        deletes = spark.table(f"{lake_rest.qualified(s.block.current_table)}.delete_files").count()
        assert deletes > 0, "the ingests left no position deletes to read"
        duck = duckdb_on(rest_catalog.url)
        for table in (s.block.current_table, s.block.changelog_table):
            assert_same_rows(duck, spark, lake_rest, table)
            assert_trino_reads(trino, spark, lake_rest, table)

        result = audit_table(spark, lake_rest, s.block, audit_run="rest-audit")
        assert result.verdict == "ok", result
        maint = maintain_table(spark, lake_rest, s.block, run_id="rest-maint")
        assert maint.latest_rows == py_rows, maint
        assert_lake_equals_source(spark, lake_rest, s.block, s.dsn)
        assert_same_rows(duck, spark, lake_rest, s.block.latest_view)  # the latest-per-key table
        assert_trino_reads(trino, spark, lake_rest, s.block.latest_view)

        # Format v3: DuckDB applies the deletion vectors; Trino 476 cannot read them (README).
        formats = spark.table(f"{lake_rest.qualified(v3.current_table)}.delete_files").select("file_format").collect()
        assert formats and {r[0] for r in formats} == {"PUFFIN"}, formats
        assert_same_rows(duck, spark, lake_rest, v3.current_table)
        with pytest.raises(trino_errors.TrinoExternalError, match="PUFFIN"):
            assert_trino_reads(trino, spark, lake_rest, v3.current_table)

        # The feed's incremental range brings the consumer to the lake's live rows.
        assert feed_step(s, mirror, "rest_mirror") in ("changelog", "diff")
        live = spark.table(lake_rest.qualified(s.block.current_table)).select("_cdc_shard", "id", "version")
        assert mirror == {(r["_cdc_shard"], r["id"]): r["version"] for r in live.collect()}

        # The OAuth2 client secret is not in the REST server's log.
        assert REST_CLIENT_SECRET not in rest_catalog.log.read_text(errors="replace")
        for f in [trino.log, *trino.workdir.joinpath("etc").rglob("*.properties")]:
            assert REST_CLIENT_SECRET not in f.read_text(errors="replace"), f
        assert REST_CLIENT_SECRET not in repr(lake_rest)
    finally:
        s.close()


def test_the_lake_as_the_iceberg_providers_connection(rest_catalog, lake_rest, monkeypatch):
    """#53: the lake's connection in the Iceberg provider's form (conn type `iceberg`: the catalog
    URI as host, OAuth2 client id and secret as login and password, pyiceberg properties in extra)
    gives the same lake settings as the generic form the other tests use, so Spark and pyiceberg
    see the same catalog; and the provider's own IcebergHook reaches the same server with it."""
    from airflow.models.connection import Connection
    from airflow.providers.apache.iceberg.hooks.iceberg import IcebergHook
    from cdc_lakehouse.feed.arrow import load_catalog_for
    from cdc_lakehouse.settings import LakeSettings

    extra = {
        "warehouse": rest_catalog.warehouse,
        "rest.auth.type": "oauth2",
        "oauth2-server-uri": f"{rest_catalog.url}/v1/oauth/tokens",
        "catalog_name": lake_rest.catalog_name,
        "landing_uri": lake_rest.landing_uri,
    }
    conn = Connection(
        conn_id="cdc_lake_iceberg",
        conn_type="iceberg",
        host=rest_catalog.url + "/",
        login=REST_CLIENT_ID,
        password=REST_CLIENT_SECRET,
        extra=json.dumps(extra),
    )
    settings = LakeSettings.from_airflow_connection(conn)
    assert settings == lake_rest
    assert REST_CLIENT_SECRET not in json.dumps(settings.public_env())

    monkeypatch.setenv("AIRFLOW_CONN_CDC_LAKE_ICEBERG", conn.as_json())
    hook = IcebergHook("cdc_lake_iceberg")
    ok, message = hook.test_connection()
    assert ok, message
    ours = load_catalog_for(settings)
    ours.create_namespace_if_not_exists("iceberg_conn_probe")
    assert "iceberg_conn_probe" in hook.list_namespaces()
    assert {".".join(n) for n in ours.list_namespaces()} == set(hook.list_namespaces())

    with pytest.raises(ValueError, match=r"catalog type 'sql' is not supported.*generic form with catalog_type: jdbc"):
        LakeSettings.from_airflow_connection(
            Connection(conn_id="x", conn_type="iceberg", extra=json.dumps({**extra, "type": "sql"}))
        )
