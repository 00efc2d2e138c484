"""Publication column lists wired into the capture, on a real PostgreSQL 15: a table whose configs
consume a subset of its columns enters the publication with that list (plus its key), so the
captured events carry no unconsumed column; tables read whole, or read by no config, stay whole."""

from __future__ import annotations

import psycopg2
import pytest
from cdc_lakehouse.capture.capture_run import CaptureResult, capture_run
from cdc_lakehouse.landing.stores import LocalLanding
from cdc_lakehouse.source.catalog import EndpointTables
from cdc_lakehouse.source.publication import consumed_column_lists

from tests.conftest import make_config
from tests.helpers import landed_rows
from tests.integration.test_consumed_columns import _attnames


@pytest.fixture
def db(pg, unique):
    name = f"pc_{unique}"
    pg.ensure_database(name)
    conn = psycopg2.connect(pg.dsn(name))
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("CREATE SCHEMA s1")
        cur.execute("CREATE TABLE s1.t (id bigint PRIMARY KEY, title text, k int, secret text)")
        cur.execute("CREATE TABLE s1.u (id bigint PRIMARY KEY, a text, b text)")
        cur.execute("CREATE TABLE s1.v (id bigint PRIMARY KEY, c text)")
    yield pg.dsn(name), conn
    conn.close()
    for (slot,) in pg.execute(f"SELECT slot_name FROM pg_replication_slots WHERE database = '{name}'"):
        pg.execute(f"SELECT pg_drop_replication_slot('{slot}')")
    pg.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _landed(store, run: CaptureResult, table: str) -> list[dict]:
    rows: list[dict] = []
    for entry in run.manifest.tables:
        if entry.table == table:
            for f in entry.files:
                rows += landed_rows(store.root / entry.dir / f.name)
    return rows


def test_capture_publishes_consumed_columns_only(db, tmp_path):
    dsn, conn = db
    # t: two configs read it, each a subset: the list is their union plus the key. u: one config
    # reads it whole. v: no config reads it (it still lands, whole).
    t_narrow = make_config("pc_t1", ["s1"], table="t", columns={"exclude": ["k", "secret"]})
    t_other = make_config("pc_t2", ["s1"], table="t", columns={"include": ["id", "k"]})
    u_whole = make_config("pc_u", ["s1"], table="u")
    cfgs = [t_narrow, t_other, u_whole]
    ep = EndpointTables(
        t_narrow.source.shards[0].endpoint_id, "cdc_test_source", {t: (["s1"], ["id"]) for t in ("t", "u", "v")}
    )
    assert consumed_column_lists(conn, ep, cfgs) == {("s1", "t"): ["id", "title", "k"]}
    store = LocalLanding(f"file://{tmp_path}/landing")
    capture_run(ep, dsn, store, "r1", table_configs=cfgs)
    names = _attnames(conn)
    assert names["t"] == ["id", "title", "k"]
    assert names["u"] == ["id", "a", "b"] and names["v"] == ["id", "c"]

    with conn.cursor() as cur:
        cur.execute("INSERT INTO s1.t VALUES (1, 'a', 7, 'pw1'), (2, 'b', 8, 'pw2')")
        cur.execute("UPDATE s1.t SET secret = 'pw3', title = 'c' WHERE id = 2")
        cur.execute("DELETE FROM s1.t WHERE id = 1")
        cur.execute("INSERT INTO s1.v VALUES (1, 'x')")
    m = capture_run(ep, dsn, store, "r2", table_configs=cfgs)  # the existing list is accepted as is
    events = _landed(store, m, "t")
    assert [e["op"] for e in events] == ["c", "c", "u", "d"]
    for e in events:
        for image in (e["before"], e["after"]):
            assert image is None or {k for k, _ in image} <= {"id", "title", "k"}, e
    assert dict(events[2]["after"]) == {"id": "2", "title": "c", "k": "8"}
    assert "pw" not in repr(events)  # the unconsumed column never left the server
    assert [dict(e["after"]) for e in _landed(store, m, "v")] == [{"id": "1", "c": "x"}]
    assert _attnames(conn)["t"] == ["id", "title", "k"]
