"""The chunked bootstrap's watermark messages in the WAL: how the bootstrap writes them and the
prefix by which the capture recognizes them.

Around each chunk it reads, the bootstrap (bootstrap.chunks) writes a low and a high marker as
transactional logical messages; the capture (capture.stream) records the messages with
MARKER_PREFIX in its run's manifest, so the order of chunks and stream is visible in the landing.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TypedDict

from cdc_lakehouse.source.pgoutput import lsn_to_int

# The prefix of the logical messages; the capture records the messages with this prefix.
MARKER_PREFIX = "cdc_lakehouse"

log = logging.getLogger(__name__)


class ChunkMark(TypedDict, total=False):
    """A marker's body (JSON): which chunk of which run it brackets. The capture keeps it in its
    manifest's `bootstrap_markers`, with the marker's position."""

    table: str  # the table's config name
    shard: str
    chunk: int  # from 1
    run_id: str  # a snapshot's chunked bootstrap names its run so (bootstrap.chunked)
    run: str  # a one-column backfill so (bootstrap.column)
    columns: list[str]  # a one-column backfill's columns
    mark: str  # low | high


def emit_marker(cur, payload: ChunkMark) -> int:
    """A transactional logical message (its own transaction, autocommit); returns its LSN."""
    cur.execute(
        "SELECT pg_logical_emit_message(true, %s, %s)::text",
        (MARKER_PREFIX, json.dumps(payload, separators=(",", ":"), sort_keys=True)),
    )
    return lsn_to_int(cur.fetchone()[0])


class CommitsNotVisible(RuntimeError):
    """Transactions that may have committed below a low marker stayed invisible too long."""


# Every transaction with an xid holds an ExclusiveLock on it until it has ended, and it ends
# (becomes visible to new snapshots) before it releases that lock: PostgreSQL's CommitTransaction
# writes the commit record (and waits for the WAL flush and any synchronous standby), then
# leaves the proc array, then releases its locks (src/backend/access/transam/xact.c). A
# transaction that is idle in its block is running no COMMIT, so its commit record comes later.
# The state of another role's session reads NULL without pg_read_all_stats: then it is waited for.
# A prepared transaction's lock has no pid: its database comes from pg_prepared_xacts, and it is
# waited for (its COMMIT PREPARED may be the commit below the marker).
_COMMITTING_SQL = """
SELECT l.transactionid::text, l.pid, coalesce(a.state, CASE WHEN l.pid IS NULL THEN 'prepared' END)
FROM pg_locks l
LEFT JOIN pg_stat_activity a ON a.pid = l.pid
LEFT JOIN pg_prepared_xacts p ON l.pid IS NULL AND p.transaction = l.transactionid
WHERE l.locktype = 'transactionid' AND l.mode = 'ExclusiveLock' AND l.granted
  AND l.pid IS DISTINCT FROM pg_backend_pid()
  AND CASE WHEN l.pid IS NULL THEN p.database IS NOT DISTINCT FROM current_database()
           ELSE a.datname IS NULL OR a.datname = current_database() END
  AND a.state IS DISTINCT FROM 'idle' AND a.state IS DISTINCT FROM 'idle in transaction'
  AND a.state IS DISTINCT FROM 'idle in transaction (aborted)'
"""

# After this long the wait is logged as a warning, naming what it waits for.
_WARN_AFTER_S = 10.0

_STILL_RUNNING_SQL = """
SELECT l.transactionid::text FROM pg_locks l
WHERE l.locktype = 'transactionid' AND l.mode = 'ExclusiveLock' AND l.granted
  AND l.transactionid::text = ANY(%s)
"""


def wait_until_visible(cur, what: str, timeout: float) -> float:
    """Wait, after a low marker L was written, until every transaction that may have committed
    below L is visible to the next snapshot; returns the seconds waited.

    A commit's record enters the WAL before the transaction becomes visible (the flush, and a
    synchronous standby, are waited for in between). A chunk read right after L could miss such
    a transaction although its commit lies below L, and its change, applied at its own position
    below L, would then lose to the chunk's older value (issue #51). Every transaction of this
    database that is running a statement when L is written is waited for: one whose commit is
    below L is among them. `what` names the table and chunk in messages."""
    cur.execute(_COMMITTING_SQL)
    waiting = {xid: (pid, state) for xid, pid, state in cur.fetchall()}
    if not waiting:
        return 0.0
    log.debug("%s: waits for transaction(s) %s to end before reading (their commit may be below the low marker)",
              what, sorted(waiting))  # fmt: skip
    started, pause, warned = time.monotonic(), 0.005, False
    while True:
        time.sleep(pause)
        pause = min(pause * 2, 0.25)
        cur.execute(_STILL_RUNNING_SQL, (list(waiting),))
        running = {r[0] for r in cur.fetchall()}
        waiting = {x: v for x, v in waiting.items() if x in running}
        waited = time.monotonic() - started
        if not waiting:
            return waited
        held = ", ".join(f"xid {x} (pid {p}, state {s or 'not visible to this user'})" for x, (p, s) in waiting.items())
        if waited > _WARN_AFTER_S and not warned:
            warned = True
            log.warning("%s: waiting %.0fs (at most %.0fs) for %s to end before reading", what, waited, timeout, held)
        if waited > timeout:
            raise CommitsNotVisible(
                f"{what}: after {waited:.0f}s, transaction(s) still running that may have committed below the chunk's "
                f"low marker: {held}. Reading now could miss their changes. Let them finish (a commit waiting "
                "for a synchronous standby waits for that standby; a prepared transaction for COMMIT/ROLLBACK "
                "PREPARED), or end them with pg_terminate_backend, then rerun: the run resumes after its last "
                "recorded chunk. Grant pg_read_all_stats to the bootstrap's user so sessions idle in a "
                "transaction are told apart and not waited for; bootstrap.commit_wait_seconds sets this limit"
            )
