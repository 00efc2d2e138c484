"""Slot positions of a capture: where a run starts (explaining a slot moved by a failed attempt's
keepalive feedback) and confirming a run's end, which happens only after its manifest is durable."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from cdc_lakehouse.landing.format import KeepaliveAdvance
from cdc_lakehouse.source.errors import SlotLostError, SourceError
from cdc_lakehouse.source.slots import SlotState, advance_slot, slot_state

if TYPE_CHECKING:
    from cdc_lakehouse.landing.format import Manifest

log = logging.getLogger(__name__)


ATTEMPTS_DIR = "_attempts"


def attempt_path(endpoint: str, run_id: str) -> str:
    return f"{endpoint}/{ATTEMPTS_DIR}/{run_id}.json"


def forget_attempts(store, endpoint: str) -> None:
    """Drop the endpoint's attempt records: done before a new slot replaces a lost one, whose start
    no earlier attempt's keepalive explains (start_position would otherwise call the jump from
    the last manifest to the new slot no gap)."""
    for name in store.list_names(f"{endpoint}/{ATTEMPTS_DIR}"):
        store.delete(f"{endpoint}/{ATTEMPTS_DIR}/{name}")


def start_position(
    store, endpoint: str, previous: list[Manifest], state: SlotState
) -> tuple[int | None, KeepaliveAdvance | None]:
    """Where this run's changes start for the ingest's gap check, and how a skip was explained.

    psycopg2 answers the server's keepalives and, before the first data message of a session,
    reports the keepalive's position as flushed (psycopg/pqpath.c), so a run that dies before
    its first transaction can leave the slot past the last manifest. Nothing was skipped: the
    server sends every published transaction it decoded before such a keepalive. Every run
    records where it started streaming (an attempt file) before it streams; when the slot stands
    past the last manifest and failed attempts since then started exactly there, the gap is
    that keepalive's, and the run starts at the last manifest. Any other advance (someone else
    consumed or advanced the slot) stays a gap, which stops the ingest."""
    last_end = previous[-1].end_lsn if previous else None
    confirmed = state.confirmed_flush
    if last_end is None or confirmed is None or confirmed <= last_end:
        return confirmed, None
    attempts = sorted(
        (
            store.read_json(f"{endpoint}/{ATTEMPTS_DIR}/{n}")
            for n in store.list_names(f"{endpoint}/{ATTEMPTS_DIR}")
            if n.endswith(".json")
        ),
        key=lambda a: a["started_at"],
    )
    froms = [a["from_lsn"] for a in attempts]
    if froms and froms[0] == last_end and froms == sorted(froms) and froms[-1] <= confirmed:
        log.warning(
            "capture %s: slot moved from %s to %s by keepalive feedback of failed attempt(s) %s; no change was skipped",
            endpoint,
            last_end,
            confirmed,
            [a["run_id"] for a in attempts],
        )
        return last_end, KeepaliveAdvance(
            {"from": last_end, "to": confirmed, "attempts": [a["run_id"] for a in attempts]}
        )
    return confirmed, None


def confirm(dsn: str, slot: str, lsn: int, cur) -> None:
    """Move the slot's confirmed position to lsn and make sure the server took it."""
    import psycopg2

    if cur is not None:
        cur.send_feedback(write_lsn=lsn, flush_lsn=lsn, apply_lsn=lsn, force=True)
        cur.connection.close()
    conn = psycopg2.connect(dsn, application_name="cdc_lakehouse confirm")
    try:
        deadline = time.monotonic() + 30
        while True:
            st = slot_state(conn, slot)
            if not st.exists:
                raise SlotLostError(f"replication slot {slot} disappeared while confirming position {lsn}")
            if (st.confirmed_flush or 0) >= lsn:
                return
            if st.active_pid is None:
                advance_slot(conn, slot, lsn)
                return
            if time.monotonic() > deadline:
                raise SourceError(f"slot {slot} stayed active (pid {st.active_pid}); could not confirm {lsn}")
            time.sleep(0.1)
    finally:
        conn.close()
