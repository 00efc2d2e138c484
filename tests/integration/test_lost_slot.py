"""A capture slot the server invalidated (#52): the WAL it needed is gone, here because the slot
fell more than max_slot_wal_keep_size behind. The capture stops at once naming the endpoint and
the one action that brings it back (cdc_recover__<endpoint>: the bootstrap of that endpoint's
shards of every table on it, which replaces the slot); each table's ingest stops at the gap until
its own shards are re-bootstrapped, and the lake then equals the source.

Its own server (the session's PostgreSQL version): the tiny max_slot_wal_keep_size would
invalidate the other tests' slots."""

from __future__ import annotations

import pytest
from cdc_lakehouse.audit.audit_table import audit_table
from cdc_lakehouse.capture.positions import attempt_path
from cdc_lakehouse.jobs.bootstrap import BootstrapParams, bootstrap_scope
from cdc_lakehouse.source.errors import SlotLostError
from cdc_lakehouse.source.slots import slot_name

from devstack.localstack import LocalPostgres, free_port
from tests.helpers import assert_lake_equals_source
from tests.integration.conftest import Source


@pytest.fixture
def short_wal_server(tmp_root):
    """A server that keeps at most 2 MB of WAL behind a slot."""
    server = LocalPostgres(tmp_root / "pg_short_wal", free_port(), fast=True)
    server.start()
    for setting in ("max_slot_wal_keep_size = '2MB'", "max_wal_size = '32MB'", "min_wal_size = '32MB'"):
        server.execute(f"ALTER SYSTEM SET {setting}")
    server.execute("SELECT pg_reload_conf()")
    yield server
    server.destroy()


def _lose_the_slot(s: Source, slot: str) -> None:
    """Changes the capture never reads (a workload step among them), then WAL enough to pass
    max_slot_wal_keep_size, with checkpoints that remove it."""
    s.wl.step(200, pk_changes=2)
    s.execute("CREATE TABLE public.filler (id bigint PRIMARY KEY, v text)")
    for _ in range(6):
        s.execute(
            "INSERT INTO public.filler SELECT g, repeat('x', 500) FROM generate_series(1, 20000) g "
            "ON CONFLICT (id) DO UPDATE SET v = excluded.v || 'y'",
            "SELECT pg_switch_wal()",
            "CHECKPOINT",
        )
    assert s.pg.execute(f"SELECT wal_status FROM pg_replication_slots WHERE slot_name = '{slot}'") == [("lost",)]


def test_a_lost_slot_stops_the_capture_and_one_recovery_brings_its_endpoint_back(
    short_wal_server, spark, lake, unique, monkeypatch
):
    srv = short_wal_server
    monkeypatch.setenv("AIRFLOW_CONN_CDC_TEST_SOURCE", srv.uri())
    s = Source(srv, spark, lake, unique, blocks=300)
    s.capture()
    for cfg in (s.block, s.perm):
        s.bootstrap(cfg)
    s.wl.step(200, pk_changes=2)
    last = s.capture().manifest
    for cfg in (s.block, s.perm):
        assert s.ingest(cfg, last.run_id).metrics.status == "ok"
    slot = slot_name(s.endpoint)
    # A capture that died while streaming leaves its attempt record (capture.positions), which
    # explains a slot moved past the last manifest by that attempt's keepalives. The new slot's
    # start must not pass for one.
    s.store.write_json(
        attempt_path(s.endpoint, "20260101T030000Z"),
        {"run_id": "20260101T030000Z", "from_lsn": last.end_lsn, "started_at": "2026-01-01T03:00:00+00:00"},
    )

    _lose_the_slot(s, slot)
    with pytest.raises(SlotLostError) as lost:
        s.capture()
    assert f"endpoint {s.endpoint}" in str(lost.value) and f"cdc_recover__{s.endpoint}" in str(lost.value), lost.value

    # What cdc_recover__<endpoint> runs, one table after another: here the first table only, so
    # the second shows what an ingest does before its shards are back.
    recover = BootstrapParams(tables=(s.block.name, s.perm.name), endpoints=(s.endpoint,))
    scope = bootstrap_scope(s.block, recover)
    s.bootstrap(s.block, shards=scope.shards, snapshot_only=scope.snapshot_only)
    [(status,)] = srv.execute(f"SELECT wal_status FROM pg_replication_slots WHERE slot_name = '{slot}'")
    assert status in ("reserved", "extended"), status  # a new slot in the lost one's place
    s.wl.step(200, pk_changes=2)
    run = s.capture().manifest.run_id
    assert s.ingest(s.block, run).metrics.status == "ok"
    with pytest.raises(Exception, match=f"landing gap.*cdc_recover__{s.endpoint}") as gap:
        s.ingest(s.perm, run)
    print(gap.value)

    # A table whose bootstraps are chunked recovers in the snapshot mode: a chunked run keeps the
    # shards' positions (before the gap) and only upserts (rows deleted in the gap would stay).
    s.perm = s.perm.model_copy(update={"bootstrap": s.perm.bootstrap.model_copy(update={"mode": "chunked"})})
    scope = bootstrap_scope(s.perm, recover)
    s.bootstrap(s.perm, shards=scope.shards, snapshot_only=scope.snapshot_only)
    s.wl.step(200, pk_changes=2)
    run = s.capture().manifest.run_id
    for cfg in (s.block, s.perm):
        r = s.ingest(cfg, run)
        assert r.metrics.status == "ok" and r.metrics.events_read > 0, r.metrics
        assert_lake_equals_source(spark, lake, cfg, s.dsn)
        assert audit_table(spark, lake, cfg, audit_run=f"recovered_{cfg.name}").verdict == "ok"
