"""One bounded capture run: committed transactions from an endpoint's slot -> landing files.

The run's bound is a heartbeat transaction it writes at its start, touching every shard:
every transaction that committed before the heartbeat is delivered by the slot before the
heartbeat's COMMIT, so reading up to that COMMIT captures exactly "what was committed when
the run started", and on quiet shards the heartbeat still moves the slot and measures
freshness. A cap on events or bytes can end a run earlier, always at a transaction
boundary (a transaction is never split across runs).

Order of effects, which is what makes a crash at any point safe:
  1. finish a previous run whose manifest exists but whose slot confirmation did not happen
  2. stream and write the events to a staging area, then publish them durably
  3. write the manifest (the run now exists for the ingest)
  4. confirm the slot up to the run's last COMMIT
A crash before 3 leaves unlisted files (ignored) and re-delivers everything next run; a
crash between 3 and 4 re-confirms at the next run's step 1 (or a retry of this run_id).

Every table in the publication is landed, whether or not a currently valid config asks for it:
the slot is shared by all tables of the endpoint, so an event dropped here (a config broken for
an hour, a shard taken out and put back) would be gone for good once the slot moves on. The
manifest lists what was published and the server's identity, so the ingest can prove that a run
covered its shards before it advances their watermark.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from cdc_lakehouse.capture.positions import attempt_path, confirm, start_position
from cdc_lakehouse.capture.stream import CaptureLimits, RunStart, Stream
from cdc_lakehouse.landing.format import Manifest, manifest_path, parse_manifest
from cdc_lakehouse.landing.reader import list_manifests
from cdc_lakehouse.source.catalog import EndpointTables, column_type_cache
from cdc_lakehouse.source.ddl import capture_ddl
from cdc_lakehouse.source.errors import PreflightError, SourceError
from cdc_lakehouse.source.publication import (
    check_publication,
    consumed_column_lists,
    identity_mismatch,
    preflight,
    published_tables,
    server_identity,
)
from cdc_lakehouse.source.session import SESSION_OPTIONS
from cdc_lakehouse.source.slots import (
    FAILOVER_SLOTS_FROM,
    SlotState,
    check_slot_usable,
    create_slot,
    ensure_heartbeat_tables,
    slot_state,
    write_heartbeat,
)
from cdc_lakehouse.source.slots import slot_name as source_slot_name

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaptureResult:
    """What a capture run did: its manifest (with the slot's state after the run, `slot_after`),
    and whether the run existed already (a retry: only its slot position was confirmed)."""

    manifest: Manifest
    reused: bool = False

    def xcom(self) -> dict[str, Any]:
        """What the capture task returns (its XCom): the run's figures; `reused` is null for a new run."""
        m = self.manifest
        return {
            "run_id": m.run_id,
            "events": m.events,
            "transactions": m.transactions,
            "bytes": m.bytes,
            "capped": m.capped,
            "start_lsn": m.start_lsn,
            "end_lsn": m.end_lsn,
            "reused": True if self.reused else None,
        }


def capture_run(
    ep: EndpointTables,
    dsn: str,
    store,
    run_id: str,
    *,
    host_label: str = "",
    database: str = "",
    limits: CaptureLimits = CaptureLimits(),
    table_configs: list[Any] | None = None,
) -> CaptureResult:
    """Capture one run for an endpoint; returns its manifest (also when the run already existed).
    table_configs: the valid TableConfigs reading the endpoint; a table they all read as a subset of
    its columns (`columns:`) enters the publication with that column list (source.publication)."""
    import psycopg2

    slot = source_slot_name(ep.endpoint_id)
    store.verify()  # before the slot is touched: an unwritable landing zone must cost nothing
    existing = _existing_run(ep, dsn, store, run_id, slot)
    if existing is not None:
        return existing
    conn = psycopg2.connect(dsn, options=SESSION_OPTIONS, application_name="cdc_lakehouse capture")
    try:
        _check_source(conn, ep, table_configs)
        previous = list_manifests(store, ep.endpoint_id)
        state = _ready_slot(conn, dsn, ep, slot, previous)
        start = _start(conn, store, ep, run_id, slot, previous, state)
        manifest = Stream(ep, dsn, store, run_id, start, limits, host_label=host_label, database=database).run()
        _report(conn, ep, run_id, slot, manifest)
        return CaptureResult(manifest)
    finally:
        conn.close()


def _existing_run(ep: EndpointTables, dsn: str, store, run_id: str, slot: str) -> CaptureResult | None:
    """A retry of a run whose manifest exists only makes sure its position is confirmed (step 4)."""
    mpath = manifest_path(ep.endpoint_id, run_id)
    if not store.exists(mpath):
        return None
    manifest = parse_manifest(store.read_json(mpath))
    confirm(dsn, slot, manifest.end_lsn, None)
    log.info("capture %s: run %s already captured; slot confirmed at %s", ep.endpoint_id, run_id, manifest.end_lsn)
    return CaptureResult(manifest, reused=True)


def _check_source(conn, ep: EndpointTables, table_configs: list[Any] | None = None) -> None:
    """Preflight, heartbeat tables and publication membership: nothing is read before they hold."""
    problems = preflight(conn, ep)
    conn.commit()
    if problems:
        raise PreflightError(problems)
    ensure_heartbeat_tables(conn, ep.schemas)
    conn.commit()
    capture_ddl(conn, ep)
    # Column lists keep unconsumed columns out of the WAL stream the slot decodes. They exist from
    # PostgreSQL 15 on; before that none are passed: the whole row is published and the ingest keeps
    # only the consumed columns. A list is set when a table enters the publication; an existing
    # one is checked to carry every consumed column (source.publication.check_publication).
    lists = consumed_column_lists(conn, ep, table_configs) if table_configs else None
    problems = check_publication(conn, ep, column_lists=lists)
    conn.commit()
    if problems:
        raise PreflightError(problems)


def _ready_slot(conn, dsn: str, ep: EndpointTables, slot: str, previous: list[Manifest]) -> SlotState:
    """The endpoint's slot, usable, free and confirmed up to the last manifest (step 1)."""
    state = slot_state(conn, slot)
    check_slot_usable(state, ep, captured_before=bool(previous))
    if not state.exists:
        create_slot(conn, slot)
        state = slot_state(conn, slot)
    if state.failover is False and conn.server_version >= FAILOVER_SLOTS_FROM:
        # Made before this release or before an upgrade to 17: a standby keeps no copy of it.
        log.warning(
            "capture %s: slot %s is not a failover slot, so a promoted standby will not have it; to change "
            "that: ALTER_REPLICATION_SLOT %s (FAILOVER true) on a replication connection to %s",
            ep.endpoint_id,
            slot,
            slot,
            ep.conn_id,
        )
    if state.active_pid:
        raise SourceError(
            f"replication slot {slot} on {ep.conn_id} is in use by process {state.active_pid}: another "
            "capture of this endpoint is running (captures of one endpoint share the pool "
            f"cdc_capture__{ep.endpoint_id}; check for a run outside Airflow)"
        )
    if previous and previous[-1].end_lsn > (state.confirmed_flush or 0):
        # Step 1: a run that wrote its manifest but died before confirming. Only on the server
        # that run read (or a promoted standby whose history holds it): on any other the position
        # is foreign, and confirming it would skip that server's changes up to it (#52).
        why = identity_mismatch(previous[-1].source_identity, server_identity(dsn), previous[-1].end_lsn)
        if why is None:
            confirm(dsn, slot, previous[-1].end_lsn, None)
            state = slot_state(conn, slot)
        else:
            log.warning(
                "capture %s: the last run %s was read on another server (%s); slot %s is not confirmed to its end, "
                "and this run starts where the slot stands (the ingest decides whether its positions compare)",
                ep.endpoint_id,
                previous[-1].run_id,
                why,
                slot,
            )
    return state


def _start(
    conn, store, ep: EndpointTables, run_id: str, slot: str, previous: list[Manifest], state: SlotState
) -> RunStart:
    """Record the attempt, then write the heartbeat that bounds the run.

    The attempt file comes first: it is what lets a later run explain a slot moved by this
    attempt's keepalive feedback (capture.positions.start_position)."""
    start_lsn, advanced = start_position(store, ep.endpoint_id, previous, state)
    store.write_json(
        attempt_path(ep.endpoint_id, run_id),
        {"run_id": run_id, "from_lsn": state.confirmed_flush, "started_at": datetime.now(UTC).isoformat()},
    )
    published_start = published_tables(conn)
    # Looked up in this module's globals at call time: tests replace it with a bound that never arrives.
    hb_xid = write_heartbeat(conn, ep.schemas, run_id)
    return RunStart(
        slot=slot,
        state=state,
        hb_xid=hb_xid,
        type_lookup=column_type_cache(conn),
        known_schemas=previous[-1].schemas if previous else {},
        start_lsn=start_lsn,
        keepalive_advance=advanced,
        published_at_start=published_start,
        published=lambda: published_tables(conn),
    )


def _report(conn, ep: EndpointTables, run_id: str, slot: str, manifest: Manifest) -> None:
    after = slot_state(conn, slot)
    manifest.slot_after = after.to_json()
    log.info(
        "capture %s run %s: %d events in %d transactions, %d bytes decoded, slot %s retains %s WAL bytes, lag %s bytes%s",
        ep.endpoint_id,
        run_id,
        manifest.events,
        manifest.transactions,
        manifest.bytes,
        slot,
        after.retained_bytes,
        after.lag_bytes,
        " (capped: more remains)" if manifest.capped else "",
    )
