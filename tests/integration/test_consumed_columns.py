"""Consumed columns on a real PostgreSQL 15: the publication's column list carries only the columns
the table configs consume (plus the replica identity), so the others never enter the WAL stream
the slot decodes; an existing list that lacks a consumed column is refused with the fix."""

from __future__ import annotations

import psycopg2
import pytest
from cdc_lakehouse.config import ConsumedColumns
from cdc_lakehouse.source.catalog import EndpointTables
from cdc_lakehouse.source.pgoutput import Change, Relation, decode
from cdc_lakehouse.source.publication import PUBLICATION, check_publication, column_list_for
from cdc_lakehouse.source.slots import ensure_heartbeat_tables

from tests.conftest import make_config


@pytest.fixture
def db(pg, unique):
    name = f"cc_{unique}"
    pg.ensure_database(name)
    conn = psycopg2.connect(pg.dsn(name))
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("CREATE SCHEMA s1")
        cur.execute("CREATE TABLE s1.t (id bigint PRIMARY KEY, title text, k int, blob bytea)")
    ensure_heartbeat_tables(conn, ["s1"])
    yield conn
    conn.close()
    for (slot,) in pg.execute(f"SELECT slot_name FROM pg_replication_slots WHERE database = '{name}'"):
        pg.execute(f"SELECT pg_drop_replication_slot('{slot}')")
    pg.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _attnames(conn) -> dict[str, list[str]]:
    with conn.cursor() as cur:
        cur.execute("SELECT tablename, attnames FROM pg_publication_tables WHERE pubname = %s", (PUBLICATION,))
        return {t: list(a) for t, a in cur.fetchall()}


def test_the_column_list_keeps_unconsumed_columns_out_of_the_wal_stream(db):
    cfg = make_config("cc", ["s1"], table="t", columns={"exclude": ["k", "blob"]})
    cols = column_list_for([cfg], ["id", "title", "k", "blob"], ["id"], "d")
    assert cols == ["id", "title"]
    ep = EndpointTables("cc_ep", "cc_conn", {"t": (["s1"], ["id"])})
    assert check_publication(db, ep, column_lists={("s1", "t"): cols}) == []
    names = _attnames(db)
    assert names["t"] == ["id", "title"] and len(names["_cdc_heartbeat"]) > 1  # the heartbeats: whole
    assert check_publication(db, ep, column_lists={("s1", "t"): cols}) == []  # accepted as it stands

    with db.cursor() as cur:
        cur.execute("SELECT pg_create_logical_replication_slot('cc_slot', 'pgoutput')")
        # The test cluster runs with synchronous_commit off: the SQL decoding functions read only
        # flushed WAL, so these commits must wait for their flush.
        cur.execute("SET synchronous_commit = on")
        cur.execute("INSERT INTO s1.t VALUES (1, 'a', 7, 'xyz'), (2, 'b', 8, 'uvw')")
        cur.execute("UPDATE s1.t SET k = 9, title = 'c' WHERE id = 2")
        cur.execute(
            "SELECT data FROM pg_logical_slot_get_binary_changes('cc_slot', NULL, NULL, "
            "'proto_version', '1', 'publication_names', %s)",
            (PUBLICATION,),
        )
        msgs = [decode(bytes(r[0])) for r in cur.fetchall()]
    rels = [m for m in msgs if isinstance(m, Relation) and m.name == "t"]
    assert rels, msgs
    rel = rels[0]
    assert rel.names == ["id", "title"]  # k and blob are not in the stream at all
    changes = [m for m in msgs if isinstance(m, Change)]
    assert [c.kind for c in changes] == ["I", "I", "U"] and all(len(c.new) == 2 for c in changes)


def test_a_column_list_without_a_consumed_column_is_refused_with_the_fix(db):
    ep = EndpointTables("cc_ep", "cc_conn", {"t": (["s1"], ["id"])})
    assert check_publication(db, ep, column_lists={("s1", "t"): ["id", "title"]}) == []
    problems = check_publication(db, ep, column_lists={("s1", "t"): ["id", "title", "k"]})
    assert len(problems) == 1
    assert "has a column list (id, title) on s1.t" in problems[0] and "ADD TABLE" in problems[0], problems
    # A config that consumes everything: the list itself is the problem (changes to k would be lost).
    assert "column list" in check_publication(db, ep)[0]


def test_a_consuming_table_runs_through_unconsumed_changes_and_stops_on_a_consumed_drop(source, spark, lake):
    """A real ingest: a column the table excludes is added, retyped and dropped at the source while
    the table keeps running with its own columns; dropping a consumed column stops it, naming it."""
    from cdc_lakehouse.ingest.errors import SchemaChangeError

    s = source
    cfg = s.block.model_copy(update={"columns": ConsumedColumns(exclude=["tracking"])})
    s.capture()
    s.bootstrap(cfg)
    cur = lake.qualified(cfg.current_table)
    before = spark.table(cur).columns
    steps = [
        "ALTER TABLE {s}.block ADD COLUMN tracking int",
        "ALTER TABLE {s}.block ALTER COLUMN tracking TYPE text",
        "ALTER TABLE {s}.block DROP COLUMN tracking",
    ]
    for i, ddl in enumerate(steps):
        for schema in s.schemas:
            s.execute(ddl.format(s=schema))
            s.execute(
                f"UPDATE {schema}.block SET version = version + 1 WHERE id IN (SELECT id FROM {schema}.block LIMIT 5)"
            )
        r = s.ingest(cfg, s.capture().manifest.run_id, run=f"cc{i}")
        assert r.metrics.status == "ok" and r.metrics.updates == 10 and r.metrics.quarantined == 0, (ddl, r)
        spark.sql(f"REFRESH TABLE {cur}")
        assert spark.table(cur).columns == before  # the lake table holds only its columns
    # The updates arrived: the lake's versions equal the source's for the consumed columns.
    src = dict(s.pg.execute("SELECT id, version FROM s0.block ORDER BY id LIMIT 5", dbname=s.db))
    lake_v = {r["id"]: r["version"] for r in spark.table(cur).filter(f"id IN ({','.join(map(str, src))})").collect()}
    assert lake_v == src

    s.execute(
        "ALTER TABLE s0.block DROP COLUMN content", "UPDATE s0.block SET version = version + 1 WHERE id < 1000000010"
    )
    with pytest.raises(SchemaChangeError, match="'content' was dropped"):
        s.ingest(cfg, s.capture().manifest.run_id, run="cc_stop")


def test_an_include_list_bootstraps_and_ingests_only_its_columns(source, spark, lake):
    """`columns.include`: the bootstrap reads only the listed columns, and updates (some leaving the
    unconsumed, TOASTed `content` unchanged) reach the lake through them."""
    s = source
    all_cols = [
        r[0]
        for r in s.pg.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = 's0' AND table_name = 'block' "
            "ORDER BY ordinal_position",
            dbname=s.db,
        )
    ]
    keep = [c for c in all_cols if c != "content"]
    cfg = s.block.model_copy(update={"columns": ConsumedColumns(include=keep)})
    s.capture()
    s.bootstrap(cfg)
    cur = lake.qualified(cfg.current_table)
    assert "content" not in spark.table(cur).columns and set(keep) <= set(spark.table(cur).columns)
    for schema in s.schemas:
        s.execute(
            f"UPDATE {schema}.block SET version = version + 1 WHERE id IN (SELECT id FROM {schema}.block LIMIT 5)"
        )
    r = s.ingest(cfg, s.capture().manifest.run_id, run="inc")
    assert r.metrics.status == "ok" and r.metrics.updates == 10 and r.metrics.quarantined == 0, r
    src = dict(s.pg.execute("SELECT id, version FROM s0.block ORDER BY id LIMIT 5", dbname=s.db))
    spark.sql(f"REFRESH TABLE {cur}")
    lake_v = {r["id"]: r["version"] for r in spark.table(cur).filter(f"id IN ({','.join(map(str, src))})").collect()}
    assert lake_v == src
