"""Transactions the server streams before they commit (pgoutput protocol 2, `streaming on`).

When a transaction's changes outgrow the server's logical_decoding_work_mem, the walsender sends
them in blocks (Stream Start ... Stream Stop) as they are decoded, interleaved with other
transactions, and ends the transaction later with a Stream Commit or a Stream Abort. Without
streaming the server spills such a transaction to its own disk (pg_replslot) and sends nothing
until the commit has been decoded: minutes of silence for a transaction of several GB.

Here each streamed transaction is spooled to a file of its own, raw, as it arrives; nothing of it
reaches the landing's table writers before its commit. At the Stream Commit the spool is read back
in order and handed to the ordinary path as if the transaction had arrived whole (the caller
replays it between a Begin and a Commit built from the Stream Commit), so a streamed transaction
lands exactly as an unstreamed one would. A Stream Abort of the transaction deletes its spool; one
of a subtransaction (ROLLBACK TO SAVEPOINT) leaves that subtransaction's changes out of the replay.
Memory stays flat: one message at a time in, one at a time out.

What is still open when the run ends (streamed, not committed before the run's bound) is dropped
with the staging: the slot is confirmed only up to the bound, so the server streams the
transaction again, from its first change, to the next run.

Message layout (https://www.postgresql.org/docs/current/protocol-logicalrep-message-formats.html):
inside a stream block every message carries the (sub)transaction's xid as an Int32 right after
its type byte; Stream Start is xid Int32 + first-segment Int8; Stream Commit is xid Int32, flags
Int8, commit LSN, end LSN and commit time Int64; Stream Abort is xid Int32, subxid Int32 (protocol
4 adds the abort's LSN and time, which this protocol version does not send).
"""

from __future__ import annotations

import logging
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)

STREAM_START, STREAM_STOP, STREAM_COMMIT, STREAM_ABORT = b"S", b"E", b"c", b"A"
# The messages a stream block carries, each with its xid after the type byte: insert, update,
# delete, truncate, relation, type and logical message. Origin ('O') carries none; it says where
# a replicated transaction came from and the landing does not use it.
_WITH_XID = frozenset(b"IUDTRYM")
_XID = struct.Struct(">I")
_START = struct.Struct(">IB")
_COMMIT = struct.Struct(">IBqqq")  # xid, flags, commit_lsn, end_lsn, commit_ts
_ABORT = struct.Struct(">II")  # xid, subxid
_RECORD = struct.Struct(">QII")  # data_start, subxid, payload length


@dataclass(frozen=True)
class StreamCommit:
    xid: int
    commit_lsn: int
    end_lsn: int
    commit_ts: int  # microseconds since 2000-01-01 UTC


@dataclass(frozen=True)
class StreamAbort:
    xid: int
    subxid: int  # == xid: the whole transaction


@dataclass
class _Spool:
    path: Path
    out: BinaryIO
    messages: int = 0
    bytes: int = 0
    aborted: set[int] = field(default_factory=set)  # subtransactions rolled back


@dataclass
class StreamStats:
    """What the run saw of streamed transactions (the manifest's `streamed`)."""

    committed: int = 0
    aborted: int = 0
    subtransactions_aborted: int = 0
    spooled_bytes: int = 0
    open_at_end: int = 0


def parse_commit(payload: bytes) -> StreamCommit:
    xid, _flags, commit_lsn, end_lsn, commit_ts = _COMMIT.unpack_from(payload, 1)
    return StreamCommit(xid, commit_lsn, end_lsn, commit_ts)


def parse_abort(payload: bytes) -> StreamAbort:
    return StreamAbort(*_ABORT.unpack_from(payload, 1))


class StreamedTransactions:
    """The open streamed transactions of one capture run, each spooled under `directory`."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.spools: dict[int, _Spool] = {}
        self.current: int | None = None  # the transaction of the open stream block
        self.stats = StreamStats()

    @property
    def in_block(self) -> bool:
        return self.current is not None

    def start(self, payload: bytes) -> None:
        xid, first = _START.unpack_from(payload, 1)
        if self.current is not None:
            raise ValueError(f"pgoutput: Stream Start of {xid} inside the open block of {self.current}")
        spool = self.spools.get(xid)
        if first and spool is not None:
            # The server starts the transaction over: what was spooled is sent again.
            self._drop(xid)
            spool = None
        if spool is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self.directory / f"{xid}.spool"
            self.spools[xid] = _Spool(path, path.open("wb"))
        self.current = xid

    def add(self, payload: bytes, data_start: int) -> None:
        """One message of the open block: kept with its subtransaction, its xid taken out."""
        if self.current is None:
            raise ValueError("pgoutput: a streamed message outside a stream block")
        if payload[0] not in _WITH_XID:
            return
        (subxid,) = _XID.unpack_from(payload, 1)
        body = bytes(payload[:1]) + bytes(payload[5:])
        spool = self.spools[self.current]
        spool.out.write(_RECORD.pack(data_start, subxid, len(body)))
        spool.out.write(body)
        spool.messages += 1
        spool.bytes += len(body)
        self.stats.spooled_bytes += len(body)

    def stop(self) -> None:
        self.current = None

    def abort(self, m: StreamAbort) -> None:
        spool = self.spools.get(m.xid)
        if spool is None:
            return  # nothing of it was streamed to this run
        if m.subxid == m.xid:
            self._drop(m.xid)
            self.stats.aborted += 1
        else:
            spool.aborted.add(m.subxid)
            self.stats.subtransactions_aborted += 1

    def replay(self, m: StreamCommit) -> Iterator[tuple[int, bytes]]:
        """The committed transaction's messages in the order they came, as (data_start, message
        without its xid); those of aborted subtransactions left out. The spool is gone after."""
        spool = self.spools.get(m.xid)
        if spool is None:
            return
        spool.out.close()
        try:
            with spool.path.open("rb") as f:
                while header := f.read(_RECORD.size):
                    data_start, subxid, n = _RECORD.unpack(header)
                    body = f.read(n)
                    if len(body) != n:
                        raise ValueError(f"streamed transaction {m.xid}: its spool {spool.path} ends early")
                    if subxid not in spool.aborted:
                        yield data_start, body
        finally:
            self._drop(m.xid)
        self.stats.committed += 1

    def close(self) -> None:
        """At the run's end: transactions still open are streamed again to the next run."""
        self.stats.open_at_end = len(self.spools)
        if self.spools:
            log.info("capture: %d streamed transactions still open at the run's bound", len(self.spools))
        for xid in list(self.spools):
            self._drop(xid)
        shutil.rmtree(self.directory, ignore_errors=True)

    def _drop(self, xid: int) -> None:
        spool = self.spools.pop(xid)
        spool.out.close()
        spool.path.unlink(missing_ok=True)
