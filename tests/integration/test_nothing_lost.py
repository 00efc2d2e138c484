"""Paths where a change could vanish or a value go wrong, each driven against real PostgreSQL,
Spark and Iceberg (issue 22). Every test here failed on the code before its fix."""

from __future__ import annotations

import psycopg2
import pytest
from cdc_lakehouse import source as src
from cdc_lakehouse.bootstrap import bootstrap_table
from cdc_lakehouse.capture import capture_run
from cdc_lakehouse.ingest import CoverageError, SourceIdentityChanged
from cdc_lakehouse.lake import read_watermark
from cdc_lakehouse.landing import LocalLanding
from pyspark.sql import functions as F

from tests.conftest import make_config
from tests.helpers import _update_manifest, assert_lake_equals_source
from tests.integration.conftest import Source

BIG = "(SELECT string_agg(md5(g::text || '{tag}'), '') FROM generate_series(1, 80) g)"  # 2.5 kB, out of line


def capture_with(s: Source, tables: dict) -> dict:
    """A capture driven by other configs than the fixture's (one broken, one shard removed, ...)."""
    s.runs += 1
    ep = src.EndpointTables(s.endpoint, "cdc_test_source", tables)
    return capture_run(ep, s.dsn, s.store, f"20260101T{s.runs:02d}0000Z")


def shard_of(s: Source, schema: str) -> str:
    return next(n for _, sch, n in s.block.shards() if sch == schema)


def test_changes_of_a_table_whose_config_is_broken_still_land(source, spark, lake):
    """While permission's YAML is invalid, captures run for block only: permission's changes must
    land anyway (the slot is shared), and reach the lake once the config is back."""
    s = source
    s.capture()
    s.bootstrap(s.block)
    s.bootstrap(s.perm)
    s.wl.step(400)
    s.execute("UPDATE s1.permission SET role = 'editor' WHERE block_id IN "
              "(SELECT block_id FROM s1.permission LIMIT 20)")
    m = capture_with(s, {"block": (s.schemas, ["id"])})
    assert "permission" in {t["table"] for t in m["tables"]}
    s.wl.step(200)
    m = s.capture()
    for cfg in (s.block, s.perm):
        assert s.ingest(cfg, m["run_id"])["status"] == "ok"
        assert_lake_equals_source(spark, lake, cfg, s.dsn)


def test_a_run_that_did_not_cover_a_shard_never_moves_its_position(source, spark, lake):
    """A shard taken out of the config (and so out of the publication) for a while, then put back:
    its changes in between were never read. The ingest must stop, not report ok."""
    s = source
    s.capture()
    s.bootstrap(s.block)
    s.execute("ALTER PUBLICATION cdc_lakehouse DROP TABLE s1.block",
              f"UPDATE s1.block SET version = version + 7 WHERE id = {s.wl.first_id['s1']}",
              f"UPDATE s0.block SET version = version + 7 WHERE id = {s.wl.first_id['s0']}")
    m = capture_with(s, {"block": (["s0"], ["id"]), "permission": (s.schemas, ["block_id", "user_id"])})
    assert "s1.block" not in m["published"]
    cur = lake.qualified(s.block.current_table)
    wm = read_watermark(spark, cur)
    with pytest.raises(CoverageError) as exc:
        s.ingest(s.block, m["run_id"])
    msg = str(exc.value)
    assert shard_of(s, "s1") in msg and "s1.block" in msg and f"cdc_bootstrap__{s.block.name}" in msg
    assert read_watermark(spark, cur) == wm
    # The fix the message names: re-bootstrap the shard (which puts it back in the publication).
    s.bootstrap(s.block, shards=[shard_of(s, "s1")])
    s.wl.step(200)
    m = s.capture()
    s.ingest(s.block, m["run_id"])
    assert_lake_equals_source(spark, lake, s.block, s.dsn)


def test_positions_never_compare_across_servers_or_endpoints(source, source_uri, spark, lake, monkeypatch):
    s = source
    s.capture()
    s.bootstrap(s.block)
    wm = read_watermark(spark, lake.qualified(s.block.current_table))
    ident = wm["shards"][shard_of(s, "s0")]["source"]
    assert ident["database"] == s.db and ident["system_identifier"] and ident["timeline"] >= 1
    # A failover to a server on another timeline, behind the same connection and slot name.
    s.wl.step(100)
    m = s.capture()
    _update_manifest(lake, s.endpoint, m["run_id"],
                     lambda mf: mf["source_identity"].update(timeline=mf["source_identity"]["timeline"] + 1))
    with pytest.raises(SourceIdentityChanged) as exc:
        s.ingest(s.block, m["run_id"])
    assert "timeline" in str(exc.value) and "re-bootstrap" in str(exc.value)
    _update_manifest(lake, s.endpoint, m["run_id"],
                     lambda mf: mf["source_identity"].update(timeline=mf["source_identity"]["timeline"] - 1))
    s.ingest(s.block, m["run_id"])
    # The shards are now read through another connection (another host name, a proxy): another
    # endpoint with its own slot, whose positions say nothing about the old slot's.
    monkeypatch.setenv("AIRFLOW_CONN_CDC_TEST_ALIAS", source_uri)
    group = {"conn_id": "cdc_test_alias", "database": s.db, "schemas": s.schemas}
    moved = make_config(s.block.name, [], source={"table": "block", "shards": [group]})
    ep = src.EndpointTables(moved.source.shards[0].endpoint_id, "cdc_test_alias", s.tables())
    capture_run(ep, s.dsn, s.store, "20260101T500000Z")
    s.wl.step(100)
    m = capture_run(ep, s.dsn, s.store, "20260101T510000Z")
    with pytest.raises(SourceIdentityChanged) as exc:
        s.ingest(moved, m["run_id"])
    assert "endpoint" in str(exc.value) and "re-bootstrap" in str(exc.value)
    bootstrap_table(spark, lake, moved, run_id="moved", all_endpoint_tables={ep.endpoint_id: s.tables()})
    s.wl.step(100)
    m = capture_run(ep, s.dsn, s.store, "20260101T520000Z")
    s.ingest(moved, m["run_id"])
    assert_lake_equals_source(spark, lake, moved, s.dsn)


def test_toast_fill_never_looks_across_a_delete_or_key_change(source, spark, lake):
    """update 1 with large A; move 1 -> 99; move 2 (large B) -> 1; update another column of 1."""
    s = source
    s.capture()
    s.bootstrap(s.block)
    a, b = s.wl.first_id["s0"], s.wl.first_id["s0"] + 1
    s.execute(f"UPDATE s0.block SET content = {BIG.format(tag='B')} WHERE id = {b}")
    m = s.capture()
    s.ingest(s.block, m["run_id"])
    s.execute(
        f"UPDATE s0.block SET content = {BIG.format(tag='A')} WHERE id = {a}",
        f"UPDATE s0.block SET id = 990099 WHERE id = {a}",
        f"UPDATE s0.block SET id = {a} WHERE id = {b}",
        f"UPDATE s0.block SET version = version + 1 WHERE id = {a}",
    )
    m = s.capture()
    r = s.ingest(s.block, m["run_id"])
    assert r["quarantined"] == 0
    assert_lake_equals_source(spark, lake, s.block, s.dsn)
    row = spark.table(lake.qualified(s.block.current_table)).filter(
        (F.col("id") == a) & (F.col("_cdc_shard") == shard_of(s, "s0"))).first()
    assert row["content"].startswith(_md5_prefix("1B"))


def _md5_prefix(text: str) -> str:
    import hashlib

    return hashlib.md5(text.encode()).hexdigest()


def test_publication_that_drops_changes_is_fixed_or_refused(pg, unique, tmp_path):
    """A pre-existing publication without deletes/truncates is widened; row filters, column lists
    and partitioned tables are refused with the statement that fixes them."""
    name = f"pub_{unique}"
    pg.execute(f"CREATE DATABASE {name}")
    dsn = pg.dsn(name)
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    store = LocalLanding(f"file://{tmp_path}/landing")
    try:
        with conn.cursor() as cur:
            cur.execute("CREATE TABLE public.items (id bigint PRIMARY KEY, v text, w text)")
            cur.execute("INSERT INTO public.items SELECT g, 'x', 'y' FROM generate_series(1, 10) g")
            cur.execute("CREATE PUBLICATION cdc_lakehouse FOR TABLE public.items WITH (publish = 'insert, update')")
        ep = src.EndpointTables("pubep", "cdc_test_source", {"items": (["public"], ["id"])})
        capture_run(ep, dsn, store, "r1")
        with conn.cursor() as cur:
            cur.execute("DELETE FROM public.items WHERE id = 3")
            cur.execute("TRUNCATE public.items")
        m = capture_run(ep, dsn, store, "r2")
        ops = []
        for t in m["tables"]:
            import pyarrow.parquet as pq

            for f in t["files"]:
                ops += pq.read_table(store.root / t["dir"] / f["name"]).column("op").to_pylist()
        assert ops == ["d", "t"]
        with conn.cursor() as cur:
            cur.execute("ALTER PUBLICATION cdc_lakehouse SET TABLE public.items WHERE (id > 5), public._cdc_heartbeat")
        with pytest.raises(src.PreflightError) as exc:
            capture_run(ep, dsn, store, "r3")
        assert "row filter" in str(exc.value) and "DROP TABLE" in str(exc.value) and "public.items" in str(exc.value)
        with conn.cursor() as cur:
            cur.execute("ALTER PUBLICATION cdc_lakehouse SET TABLE public.items (id, v), public._cdc_heartbeat")
        with pytest.raises(src.PreflightError) as exc:
            capture_run(ep, dsn, store, "r3")
        assert "column list" in str(exc.value)
        with conn.cursor() as cur:
            cur.execute("CREATE TABLE public.events (id bigint, at date, PRIMARY KEY (id, at)) PARTITION BY RANGE (at)")
            cur.execute("CREATE TABLE public.events_2026 PARTITION OF public.events "
                        "FOR VALUES FROM ('2026-01-01') TO ('2027-01-01')")
        ep2 = src.EndpointTables("pubep", "cdc_test_source", {"events": (["public"], ["id", "at"])})
        with pytest.raises(src.PreflightError) as exc:
            capture_run(ep2, dsn, store, "r4")
        assert "partitioned" in str(exc.value) and "leaf partition" in str(exc.value)
    finally:
        conn.close()
        for (slot,) in pg.execute(f"SELECT slot_name FROM pg_replication_slots WHERE database = '{name}'"):
            pg.execute(f"SELECT pg_drop_replication_slot('{slot}')")
        pg.execute(f"DROP DATABASE {name} WITH (FORCE)")
