"""Replication slots (one per endpoint: create, inspect, advance, check usable) and heartbeats, the
writes that prove a quiet source is alive and give every capture a commit to stop at."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from typing_extensions import TypedDict  # pydantic validates typing.TypedDict from Python 3.12 only

from cdc_lakehouse.identifiers import pg_qualified
from cdc_lakehouse.source.catalog import EndpointTables
from cdc_lakehouse.source.errors import SlotConflictError, SlotLostError

HEARTBEAT_TABLE = "_cdc_heartbeat"


def slot_name(endpoint_id: str) -> str:
    name = re.sub(r"[^a-z0-9_]", "_", f"cdc_lakehouse_{endpoint_id}".lower())
    return name[:63]


def ensure_heartbeat_tables(conn, schemas: list[str]) -> None:
    with conn.cursor() as cur:
        for s in schemas:
            cur.execute(
                f"CREATE TABLE IF NOT EXISTS {pg_qualified(s, HEARTBEAT_TABLE)} ("
                " id smallint PRIMARY KEY DEFAULT 1 CHECK (id = 1),"
                " beat_at timestamptz NOT NULL,"
                " run_id text NOT NULL)"
            )


def write_heartbeat(conn, schemas: list[str], run_id: str) -> int:
    """One transaction touching every shard; returns its 32-bit xid (what pgoutput reports)."""
    with conn.cursor() as cur:
        for s in schemas:
            cur.execute(
                f"INSERT INTO {pg_qualified(s, HEARTBEAT_TABLE)} AS h (id, beat_at, run_id) VALUES (1, now(), %s) "
                "ON CONFLICT (id) DO UPDATE SET beat_at = excluded.beat_at, run_id = excluded.run_id",
                (run_id,),
            )
        cur.execute("SELECT txid_current() & 4294967295")
        xid = int(cur.fetchone()[0])
    conn.commit()
    return xid


# --- slots -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlotState:
    name: str
    exists: bool
    confirmed_flush: int | None = None
    restart_lsn: int | None = None
    wal_status: str | None = None
    active_pid: int | None = None
    current_lsn: int | None = None
    # PostgreSQL 17+: a failover slot (a standby with sync_replication_slots keeps a copy), and why
    # the server invalidated it (wal_removed, rows_removed, wal_level_insufficient, idle_timeout).
    failover: bool | None = None
    invalidation_reason: str | None = None

    @property
    def lost(self) -> bool:
        """The server invalidated it: the WAL it needed is gone (before 17 only wal_status 'lost'
        says so; 18's idle timeout shows the same way)."""
        return self.exists and (self.wal_status == "lost" or self.invalidation_reason is not None)

    @property
    def retained_bytes(self) -> int | None:
        if self.restart_lsn is None or self.current_lsn is None:
            return None
        return self.current_lsn - self.restart_lsn

    @property
    def lag_bytes(self) -> int | None:
        if self.confirmed_flush is None or self.current_lsn is None:
            return None
        return self.current_lsn - self.confirmed_flush

    def to_json(self) -> SlotReport:
        return SlotReport(
            slot=self.name,
            confirmed_flush_lsn=self.confirmed_flush,
            restart_lsn=self.restart_lsn,
            wal_status=self.wal_status,
            retained_wal_bytes=self.retained_bytes,
            lag_bytes=self.lag_bytes,
            failover=self.failover,
            invalidation_reason=self.invalidation_reason,
        )


class SlotReport(TypedDict, total=False):
    """A slot's state as a capture run's manifest keeps it (`slot_before`, `slot_after`): what the
    alerts (wal_retained) and the capture metrics read."""

    slot: str
    confirmed_flush_lsn: int | None
    restart_lsn: int | None
    wal_status: str | None
    retained_wal_bytes: int | None
    lag_bytes: int | None
    failover: bool | None
    invalidation_reason: str | None


# The server version from which slots can be failover slots and say why they were invalidated.
FAILOVER_SLOTS_FROM = 170000


def slot_state(conn, name: str) -> SlotState:
    since_17 = "failover, invalidation_reason" if conn.server_version >= FAILOVER_SLOTS_FROM else "NULL, NULL"
    with conn.cursor() as cur:
        cur.execute(
            f"""
            SELECT (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint, (restart_lsn - '0/0'::pg_lsn)::bigint,
                   wal_status, active_pid, (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint,
                   database, current_database(), {since_17}
            FROM pg_replication_slots WHERE slot_name = %s
            """,
            (name,),
        )
        row = cur.fetchone()
        if row is None:
            cur.execute("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint")
            return SlotState(name, False, current_lsn=cur.fetchone()[0])
    conn.commit()
    if row[5] != row[6]:
        # Slot names are per cluster, slots per database: two endpoints (connections) with the
        # same id on one cluster would otherwise read each other's slot.
        raise SlotConflictError(
            f"replication slot {name} belongs to database {row[5]}, not {row[6]}: two endpoints on one PostgreSQL "
            "cluster have the same id. Give one of them its own Airflow connection id (the slot is named after it), "
            f"or drop the stale slot in {row[5]}: SELECT pg_drop_replication_slot('{name}')"
        )
    return SlotState(name, True, row[0], row[1], row[2], row[3], row[4], failover=row[7], invalidation_reason=row[8])


def wal_insert_position(conn: Any) -> int:
    """The source's WAL insert position. Taken after a read ended, it is above the commit record
    of every transaction the read saw (a commit is written to the WAL before it becomes visible)."""
    with conn.cursor() as cur:
        cur.execute("SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint")
        (lsn,) = cur.fetchall()[0]
    return int(lsn)


def recovery_fix(ep: EndpointTables) -> str:
    """The one action that brings an endpoint back after its slot was lost (#52)."""
    return (
        f"the changes in between are gone from the WAL: re-bootstrap every table on this endpoint ({sorted(ep.tables)}), "
        f"its shards there only: trigger cdc_recover__{ep.endpoint_id}, which also replaces the lost slot (or, table by "
        f'table, cdc_bootstrap__<table> with {{"endpoint": "{ep.endpoint_id}"}})'
    )


def lost_because(state: SlotState) -> str:
    why = _INVALIDATED_BY.get(state.invalidation_reason or "wal_removed", state.invalidation_reason)
    return f"{why}; invalidation_reason={state.invalidation_reason}, wal_status={state.wal_status}"


def check_slot_usable(state: SlotState, ep: EndpointTables, *, captured_before: bool) -> None:
    if not state.exists and captured_before:
        raise SlotLostError(
            f"replication slot {state.name} on {ep.conn_id} (endpoint {ep.endpoint_id}) was dropped after earlier "
            f"captures; {recovery_fix(ep)}"
        )
    if state.lost or (state.exists and state.restart_lsn is None):
        raise SlotLostError(
            f"replication slot {state.name} on {ep.conn_id} (endpoint {ep.endpoint_id}) was invalidated "
            f"({lost_because(state)}); {recovery_fix(ep)}"
        )


# Why PostgreSQL invalidated a slot (pg_replication_slots.invalidation_reason, 17+; before 17 only
# WAL removal shows, as wal_status 'lost'), and the setting behind it.
_INVALIDATED_BY = {
    "wal_removed": "WAL removed: the slot fell more than max_slot_wal_keep_size behind",
    "idle_timeout": "inactive longer than idle_replication_slot_timeout",
    "rows_removed": "catalog rows it needed were removed (on a standby: hot_standby_feedback off?)",
    "wal_level_insufficient": "wal_level was lowered below logical",
}


def create_slot(conn, name: str) -> int:
    """The endpoint's slot; on PostgreSQL 17+ a failover slot, which a standby running with
    sync_replication_slots keeps in step, so a promoted standby has it (#52)."""
    # pg_create_logical_replication_slot(name, plugin, temporary, twophase, failover): 17+.
    failover = ", false, false, true" if conn.server_version >= FAILOVER_SLOTS_FROM else ""
    with conn.cursor() as cur:
        cur.execute(
            f"SELECT (lsn - '0/0'::pg_lsn)::bigint FROM pg_create_logical_replication_slot(%s, 'pgoutput'{failover})",
            (name,),
        )
        lsn = cur.fetchone()[0]
    conn.commit()
    return lsn


def ensure_capture_slot(conn, name: str, before_new_slot: Callable[[], None]) -> SlotState | None:
    """The endpoint's capture slot, created when missing and replaced (dropped and created again)
    when the server invalidated it; returns the lost slot's state when it replaced one.

    The position a lost slot held is gone from the WAL anyway, and every table's ingest stops at
    the gap until its shards are re-bootstrapped past the new slot's start (landing.reader). A
    usable slot is never touched. One process at a time per slot (a session advisory lock): two
    bootstraps of one endpoint never replace the slot the other just made. `before_new_slot`
    runs before a slot is made, under the lock (the capture's attempt records, which could
    otherwise explain the new slot's start as an old attempt's keepalive, capture.positions)."""
    key = f"cdc_lakehouse slot {name}"
    with conn.cursor() as cur:
        cur.execute("SELECT pg_advisory_lock(hashtext(%s))", (key,))
    try:
        state = slot_state(conn, name)
        if state.exists and not state.lost:
            return None
        before_new_slot()
        if state.lost:
            with conn.cursor() as cur:
                cur.execute("SELECT pg_drop_replication_slot(%s)", (name,))
            conn.commit()
        create_slot(conn, name)
        return state if state.lost else None
    finally:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_advisory_unlock(hashtext(%s))", (key,))
        conn.commit()


def advance_slot(conn, name: str, lsn: int) -> int:
    """Confirm up to lsn (no-op when the slot is already there)."""
    from cdc_lakehouse.source.pgoutput import lsn_to_str

    with conn.cursor() as cur:
        cur.execute(
            "SELECT (end_lsn - '0/0'::pg_lsn)::bigint FROM pg_replication_slot_advance(%s, %s::pg_lsn)",
            (name, lsn_to_str(lsn)),
        )
        out = cur.fetchone()[0]
    conn.commit()
    return out
