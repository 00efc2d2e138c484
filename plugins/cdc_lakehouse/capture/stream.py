"""The streaming half of a capture run: the slot's messages up to the run's bound -> staged landing
files, then files, manifest and slot position, in the order that makes a crash at any point safe
(see cdc_lakehouse.capture.capture_run)."""

from __future__ import annotations

import json
import logging
import select
import struct
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from cdc_lakehouse.capture.events import Rel, old_values, row_values, schema_diff
from cdc_lakehouse.capture.positions import ATTEMPTS_DIR, confirm
from cdc_lakehouse.capture.streamed import (
    STREAM_ABORT,
    STREAM_COMMIT,
    STREAM_START,
    STREAM_STOP,
    StreamedTransactions,
    StreamStats,
    parse_abort,
    parse_commit,
)
from cdc_lakehouse.landing.format import (
    FORMAT_VERSION,
    DdlChange,
    Heartbeat,
    KeepaliveAdvance,
    Manifest,
    ManifestTable,
    SchemaChange,
    Streamed,
    manifest_path,
    run_dir,
)
from cdc_lakehouse.landing.writer import TableWriter
from cdc_lakehouse.runtime.failpoints import crash_point
from cdc_lakehouse.source.catalog import EndpointTables
from cdc_lakehouse.source.ddl import DDL_PREFIX, ddl_diff, logged_ddl
from cdc_lakehouse.source.errors import SourceError
from cdc_lakehouse.source.markers import MARKER_PREFIX
from cdc_lakehouse.source.pgoutput import Begin, Change, Commit, Relation, Truncate, decode, pg_time
from cdc_lakehouse.source.publication import PUBLICATION
from cdc_lakehouse.source.publication import source_identity as source_source_identity
from cdc_lakehouse.source.session import SESSION_OPTIONS
from cdc_lakehouse.source.slots import HEARTBEAT_TABLE, SlotState
from cdc_lakehouse.watermark import ServerIdentity

log = logging.getLogger(__name__)
PG_EPOCH_US = 946_684_800_000_000  # 2000-01-01 in Unix microseconds


@dataclass(frozen=True)
class CaptureLimits:
    max_events: int = 2_000_000
    max_bytes: int = 2 * 1024**3
    idle_timeout_s: float = 300.0  # silence after which the capture asks the server whether it is still decoding
    max_wait_s: float = 6 * 3600.0  # waiting longer than this for the run's bound stops the run
    batch_rows: int = 20_000
    batch_bytes: int = 64 * 1024**2  # buffered event bytes per table before a row group is written
    file_rows: int = 2_000_000
    # The server's memory for decoding a transaction before it streams it to the capture
    # (logical_decoding_work_mem of the slot's walsender, in kB); None: the server's setting.
    decoding_work_mem_kb: int | None = None
    # False: the server sends a large transaction only after its commit, spilled to its own disk
    # meanwhile (what protocol 1 did; kept for the benchmark's and the tests' comparison).
    streaming: bool = True


@dataclass(frozen=True)
class RunStart:
    """What the run settled before streaming: the slot as it stood, the bound (the heartbeat's
    xid) and what the manifest needs to prove coverage."""

    slot: str
    state: SlotState
    hb_xid: int
    type_lookup: Callable
    known_schemas: dict[str, list]
    start_lsn: int | None
    keepalive_advance: KeepaliveAdvance | None
    published_at_start: Any
    published: Callable[[], Any]  # the publication's tables now (read again at the end of the run)


class Stream:
    """One run's walk over the slot: each message updates this state; run() ends at the bound or a cap."""

    def __init__(
        self,
        ep: EndpointTables,
        dsn: str,
        store,
        run_id: str,
        start: RunStart,
        limits: CaptureLimits,
        *,
        host_label: str = "",
        database: str = "",
    ):
        self.ep, self.dsn, self.store, self.run_id, self.start, self.limits = ep, dsn, store, run_id, start, limits
        self.started = datetime.now(UTC)
        self.staging = store.staging_dir()
        self.consts = {
            "connector": "postgresql",
            "endpoint": ep.endpoint_id,
            "host": host_label,
            "db": database,
            "ts_ms": int(self.started.timestamp() * 1000),
            "run_id": run_id,
        }
        self.writers: dict[str, TableWriter] = {}
        # Directory names under staging are table names (identifiers): ".streams" is none of them.
        self.streamed = StreamedTransactions(self.staging / ".streams")
        self.rels: dict[int, Rel] = {}
        self.schemas_seen: dict[str, list] = {}
        self.schema_changes: list[SchemaChange] = []
        self.heartbeats: dict[str, Heartbeat] = {}
        self.markers: list[dict[str, Any]] = []  # the chunked bootstrap's watermarks, in WAL order (their JSON)
        self.ddl: list[DdlChange] = []  # the captured tables' DDL (source.ddl), in WAL order
        self.events = self.nbytes = self.txs = 0
        self.capped = self.done = False
        self.last_commit: Commit | None = None
        # The open transaction: its BEGIN, commit time, event sequence and heartbeat rows.
        self.tx: Begin | None = None
        self.tx_commit_us = 0
        self.seq = 0
        self.tx_heartbeat_schemas: list[str] = []
        # Keepalive tracking: the server's last reported position and when anything last moved.
        self.server_pos = 0
        self.last_activity = self.waiting_since = 0.0

    def run(self) -> Manifest:
        """Stream up to the bound, then publish; returns the manifest. Staged files never outlive a failure."""
        import psycopg2
        from psycopg2.extras import LogicalReplicationConnection

        options = SESSION_OPTIONS
        if self.limits.decoding_work_mem_kb:
            options += f" -c logical_decoding_work_mem={int(self.limits.decoding_work_mem_kb)}kB"
        repl = psycopg2.connect(
            self.dsn,
            connection_factory=LogicalReplicationConnection,
            options=options,
            application_name="cdc_lakehouse capture stream",
        )
        cur = repl.cursor()
        try:
            identity = source_source_identity(cur)
            cur.start_replication(
                slot_name=self.start.slot,
                decode=False,
                status_interval=10,
                # messages: the chunked bootstrap's low/high watermarks (pg_logical_emit_message).
                # Protocol 2 with streaming: a transaction larger than the server's decoding memory
                # arrives in blocks before its commit (capture.streamed), instead of after a silence
                # as long as its decoding while the server spills it to its own disk.
                options={
                    "proto_version": "2",
                    "streaming": "on" if self.limits.streaming else "off",
                    "publication_names": PUBLICATION,
                    "messages": "true",
                },
            )
            self.last_activity = self.waiting_since = time.monotonic()
            self.server_pos = getattr(cur, "wal_end", 0)
            while not self.done:
                msg = cur.read_message()
                if msg is None:
                    self._keepalive(cur)
                else:
                    self._handle(msg)
            return self._finish(cur, identity)
        except BaseException:
            self.streamed.close()
            self.store.discard(self.staging)
            raise
        finally:
            try:
                repl.close()
            except Exception:  # noqa: BLE001
                pass

    # --- while streaming ---------------------------------------------------------------------

    def _keepalive(self, cur) -> None:
        """No message. Keepalives are answered inside psycopg2; one whose position moved means the
        server is still reading WAL (a large transaction of other tables), not stuck."""
        pos = getattr(cur, "wal_end", 0)
        if pos != self.server_pos:
            self.server_pos, self.last_activity = pos, time.monotonic()
        elif time.monotonic() - self.last_activity > self.limits.idle_timeout_s:
            waited = time.monotonic() - self.waiting_since
            _check_still_decoding(self.ep, self.dsn, self.start.slot, self.start.hb_xid, self.limits, waited)
            self.last_activity = time.monotonic()
        select.select([cur], [], [], 1.0)

    def _handle(self, msg) -> None:
        self.last_activity = time.monotonic()
        payload = msg.payload
        self.nbytes += len(payload)
        tag = payload[:1]
        if self.streamed.in_block and tag != STREAM_STOP:
            self.streamed.add(payload, msg.data_start)
        elif tag == STREAM_START:
            self.streamed.start(payload)
        elif tag == STREAM_STOP:
            self.streamed.stop()
        elif tag == STREAM_COMMIT:
            self._on_stream_commit(payload)
        elif tag == STREAM_ABORT:
            self.streamed.abort(parse_abort(payload))
        else:
            self._dispatch(payload, msg.data_start)

    def _on_stream_commit(self, payload: bytes) -> None:
        """A streamed transaction committed: its spool, in order, through the same path as a
        transaction that arrived whole, between a Begin and a Commit made from the Stream Commit."""
        m = parse_commit(payload)
        self._on_begin(Begin(m.commit_lsn, m.commit_ts, m.xid))
        for data_start, body in self.streamed.replay(m):
            self._dispatch(body, data_start)
        self._on_commit(Commit(m.commit_lsn, m.end_lsn, m.commit_ts))

    def _on_begin(self, m: Begin) -> None:
        self.tx, self.seq, self.tx_heartbeat_schemas = m, 0, []
        self.tx_commit_us = m.commit_ts + PG_EPOCH_US

    def _dispatch(self, payload: bytes, data_start: int) -> None:
        if payload[:1] == b"M":  # a logical message: decode() knows none
            self._on_message(payload)
            return
        m = decode(payload)
        if isinstance(m, Change):
            self._on_change(m, data_start, len(payload))
        elif isinstance(m, Begin):
            self._on_begin(m)
        elif isinstance(m, Commit):
            self._on_commit(m)
        elif isinstance(m, Relation):
            self._on_relation(m, data_start)
        elif isinstance(m, Truncate):
            self._on_truncate(m, data_start)
        # Type messages and those decode() does not know carry nothing the landing needs.

    def _on_change(self, m: Change, data_start: int, size: int) -> None:
        r = self.rels[m.relid]
        if r.heartbeat:
            self.tx_heartbeat_schemas.append(r.rel.schema)
            return
        # pgoutput sends the new row with an insert or update, the old key or row with a delete.
        before = after = unavailable = None
        if m.kind != "D":
            assert m.new is not None
            after, missing = row_values(m.new)
            if missing:
                unavailable = [r.names[i] for i in missing]
        if m.old is not None:
            before = old_values(r, m.old, m.old_is_key)
        op = "c" if m.kind == "I" else "u" if m.kind == "U" else "d"
        self._add(r, op, before, after, unavailable, data_start, size)

    def _on_message(self, payload: bytes) -> None:
        """Record the bootstrap's watermark messages and the DDL trigger's (source.ddl) with the
        commit LSN of their transaction."""
        lsn, prefix, content = parse_logical_message(payload)
        if prefix == DDL_PREFIX:
            self._on_ddl(lsn, content)
            return
        if prefix != MARKER_PREFIX:
            return
        try:
            body = json.loads(content)
        except ValueError:
            body = None
        if not isinstance(body, dict):  # not JSON, or JSON but no object: kept as it came
            body = {"raw": content.decode("utf-8", "replace")}
        self.markers.append({"lsn": lsn, "commit_lsn": self.tx.final_lsn if self.tx else None, **body})

    def _on_ddl(self, lsn: int, content: bytes) -> None:
        """A DDL of a captured table, as the columns it renamed, added, dropped, retyped or gave
        another default; in the manifest's `ddl`, in WAL order, once the trigger's log confirms it
        (_verified_ddl). A message that is not the trigger's shape is logged and left out: the
        change is then inferred from relation messages, as without the trigger."""
        try:
            body = json.loads(content)
            key = str(body["table"])
            diff = ddl_diff(body.get("before") or {}, body.get("after") or {})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning(
                "capture %s: DDL message at %s ignored (not the trigger's shape: %s)", self.ep.endpoint_id, lsn, exc
            )
            return
        schema, _, table = key.rpartition(".")
        if schema not in self.ep.tables.get(table, ([], []))[0]:
            return
        at_commit = self.tx.final_lsn if self.tx else None
        self.ddl.append(DdlChange(table=key, lsn=lsn, at_commit_lsn=at_commit, tag=body.get("tag"), **diff))
        # The table's schema as this run tracks it follows the rename at once: a shard that writes
        # nothing after it still lists the new names in the manifest.
        cols = self.schemas_seen.get(key) or self.start.known_schemas.get(key)
        if cols and diff["renamed"]:
            names = dict(diff["renamed"])
            self.schemas_seen[key] = [{**c, "name": names.get(c["name"], c["name"])} for c in cols]
        log.warning("capture %s: DDL on %s: %s", self.ep.endpoint_id, key, {k: v for k, v in diff.items() if v})

    def _verified_ddl(self) -> list[DdlChange]:
        """The run's DDL messages that the trigger logged itself; any role may emit a message with
        the prefix, and a forged rename must not rename a lake column."""
        if not self.ddl:
            return []
        import psycopg2

        conn = psycopg2.connect(self.dsn, application_name="cdc_lakehouse capture")
        try:
            logged = logged_ddl(conn, [d.lsn for d in self.ddl])
        finally:
            conn.close()
        forged = [d.to_dict() for d in self.ddl if d.lsn not in logged]
        if forged:
            log.warning(
                "capture %s: DDL messages not written by the trigger, left out: %s", self.ep.endpoint_id, forged
            )
        return [d for d in self.ddl if d.lsn in logged]

    def _on_truncate(self, m: Truncate, data_start: int) -> None:
        for relid in m.relids:
            r = self.rels.get(relid)
            if r is None or r.heartbeat:
                continue
            self._add(r, "t", None, None, None, data_start, 0)

    def _add(self, r: Rel, op: str, before, after, unavailable, data_start: int, size: int) -> None:
        self.seq += 1
        name = r.rel.name
        w = self.writers.get(name) or self._writer_for(name)
        tx = self.tx
        assert tx is not None  # changes arrive between a transaction's BEGIN and COMMIT
        w.add(
            op,
            before,
            after,
            unavailable,
            r.rel.schema,
            r.image,
            tx.final_lsn,
            data_start,
            tx.xid,
            self.seq,
            self.tx_commit_us,
            size,
        )
        self.events += 1

    def _writer_for(self, table: str) -> TableWriter:
        d = self.staging / table
        d.mkdir()
        lim = self.limits
        self.writers[table] = TableWriter(d, self.consts, lim.batch_rows, lim.file_rows, lim.batch_bytes, table)
        return self.writers[table]

    def _on_commit(self, m: Commit) -> None:
        self.txs += 1
        self.last_commit = m
        tx = self.tx
        assert tx is not None  # a COMMIT ends the transaction a BEGIN started
        for s in self.tx_heartbeat_schemas:
            self.heartbeats[s] = Heartbeat(
                commit_lsn=m.commit_lsn, end_lsn=m.end_lsn, commit_ts=pg_time(m.commit_ts).isoformat(), xid=tx.xid
            )
        if tx.xid == self.start.hb_xid:
            self.done = True  # the run's bound: everything committed before it is in
        elif self.events >= self.limits.max_events or self.nbytes >= self.limits.max_bytes:
            # Checked at COMMIT only: a transaction is never split across runs.
            self.capped = self.done = True
        self.tx = None

    def _on_relation(self, m: Relation, data_start: int = 0) -> None:
        r = Rel(m, self.start.type_lookup, self.ep.column_types.get(m.name))
        self.rels[m.oid] = r
        if r.heartbeat:
            return
        prev = self.schemas_seen.get(r.key) or self.start.known_schemas.get(r.key)
        at = {
            "table": r.key,
            "at_commit_lsn": self.tx.final_lsn if self.tx else None,
            "at_lsn": data_start or None,  # where in its transaction (a DDL there may precede it)
            "columns": [c["name"] for c in r.columns],
        }
        if prev is None:
            # No earlier schema to diff with: the ingest compares these columns with
            # the shard's known ones (columns added since its bootstrap need values).
            self.schema_changes.append(SchemaChange(**at, first_seen=True, added=[], dropped=[], retyped=[]))
        else:
            diff = schema_diff(prev, r.columns)
            if diff:
                self.schema_changes.append(SchemaChange(**at, **diff))
                log.warning("capture %s: schema change on %s: %s", self.ep.endpoint_id, r.key, diff)
        self.schemas_seen[r.key] = r.columns

    # --- at the bound ------------------------------------------------------------------------

    def _finish(self, cur, identity: ServerIdentity) -> Manifest:
        """Files first, durably; then the manifest; then the slot. Confirming earlier would lose the
        run's events to a crash; the failpoints let the crash tests stop between the steps."""
        self.ddl = self._verified_ddl()
        self.streamed.close()
        tables = self._publish_files()
        crash_point("after_files")
        manifest = self._manifest(tables, identity)
        self.store.write_json(manifest_path(self.ep.endpoint_id, self.run_id), manifest.to_dict())
        crash_point("after_manifest")
        assert self.last_commit is not None  # the run ends at a COMMIT (its bound)
        confirm(self.dsn, self.start.slot, self.last_commit.end_lsn, cur)
        attempts = f"{self.ep.endpoint_id}/{ATTEMPTS_DIR}"
        for name in self.store.list_names(attempts):  # resolved by this manifest
            self.store.delete(f"{attempts}/{name}")
        return manifest

    def _publish_files(self) -> list[ManifestTable]:
        tables = []
        for name, w in sorted(self.writers.items()):
            files = w.close()
            rel = run_dir(self.ep.endpoint_id, name, self.run_id)
            self.store.publish_dir(self.staging / name, rel)
            tables.append(
                ManifestTable(
                    table=name,
                    dir=rel,
                    files=files,
                    events=w.rows,
                    min_commit_lsn=w.min_commit_lsn,
                    max_commit_lsn=w.max_commit_lsn,
                    shards=sorted(w.shards),
                )
            )
        self.store.discard(self.staging)
        return tables

    def _manifest(self, tables: list[ManifestTable], identity: ServerIdentity) -> Manifest:
        last, start = self.last_commit, self.start
        assert last is not None
        # What the run covered: a table's changes are in this run only if it was published for the
        # whole run. The ingest checks its shards against this before moving their watermark.
        published_end = start.published()
        # Parts a run without them leaves out of its file (unset fields are not written).
        optional: dict[str, Any] = {}
        if start.keepalive_advance:
            optional["keepalive_advance"] = start.keepalive_advance
        if self.markers:
            optional["bootstrap_markers"] = self.markers
        if self.ddl:
            optional["ddl"] = self.ddl
        if self.streamed.stats != StreamStats():
            optional["streamed"] = Streamed(**asdict(self.streamed.stats))
        return Manifest(
            format=FORMAT_VERSION,
            run_id=self.run_id,
            endpoint=self.ep.endpoint_id,
            conn_id=self.ep.conn_id,
            slot=start.slot,
            publication=PUBLICATION,
            started_at=self.started.isoformat(),
            finished_at=datetime.now(UTC).isoformat(),
            start_lsn=start.start_lsn,
            end_lsn=last.end_lsn,
            last_commit_lsn=last.commit_lsn,
            last_commit_ts=pg_time(last.commit_ts).isoformat(),
            capped=self.capped,
            heartbeat_xid=start.hb_xid,
            events=self.events,
            bytes=self.nbytes,
            transactions=self.txs,
            tables=tables,
            heartbeats=self.heartbeats,
            schemas={**start.known_schemas, **self.schemas_seen},
            schema_changes=self.schema_changes,
            slot_before=start.state.to_json(),
            source_identity=identity,
            published=published_end,
            published_at_start=start.published_at_start,
            **optional,
        )


def parse_logical_message(buf: bytes) -> tuple[int, str, bytes]:
    """pgoutput 'M' (protocol 1, no streaming): flags Int8, LSN Int64, prefix (NUL-terminated),
    content length Int32, content -> (LSN, prefix, content)."""
    (lsn,) = struct.unpack_from(">Q", buf, 2)
    end = buf.index(b"\0", 10)
    prefix = buf[10:end].decode()
    (n,) = struct.unpack_from(">I", buf, end + 1)
    return lsn, prefix, bytes(buf[end + 5 : end + 5 + n])


def _standbys_not_streaming(dsn: str) -> list[str]:
    """The slots of synchronized_standby_slots with no standby streaming from them (missing,
    inactive), as 'slot (why)'."""
    import psycopg2

    conn = psycopg2.connect(dsn, application_name="cdc_lakehouse capture check")
    try:
        with conn.cursor() as c:
            c.execute(
                "SELECT n.name, s.active FROM unnest(string_to_array(replace("
                "current_setting('synchronized_standby_slots'), ' ', ''), ',')) AS n(name) "
                "LEFT JOIN pg_replication_slots s ON s.slot_name = n.name WHERE n.name <> ''"
            )
            rows = c.fetchall()
    finally:
        conn.close()
    return [f"{name} ({'no such slot' if active is None else 'inactive'})" for name, active in rows if not active]


def _check_still_decoding(
    ep: EndpointTables, dsn: str, slot: str, hb_xid: int, limits: CaptureLimits, waited: float
) -> None:
    """Silence for idle_timeout_s: go on while the slot's walsender is decoding (replaying a large
    transaction sends nothing for a long time), stop when it waits for WAL with the run's
    heartbeat still missing (that cannot recover) or when the run waited max_wait_s in all."""
    import psycopg2

    conn = psycopg2.connect(dsn, application_name="cdc_lakehouse capture check")
    try:
        with conn.cursor() as c:
            c.execute(
                "SELECT a.state, a.wait_event FROM pg_replication_slots s "
                "JOIN pg_stat_activity a ON a.pid = s.active_pid WHERE s.slot_name = %s",
                (slot,),
            )
            row = c.fetchone()
    finally:
        conn.close()
    state, wait_event = row if row else (None, None)
    where = (
        f"capture {ep.endpoint_id}: the run's heartbeat transaction (xid {hb_xid}) has not arrived after {waited:.0f}s"
    )
    if wait_event == "WaitForStandbyConfirmation":  # PostgreSQL 17+, a failover slot's walsender
        missing = _standbys_not_streaming(dsn)
        if missing:
            raise SourceError(
                f"{where}: {ep.conn_id} holds the changes back until the physical standbys named in its "
                f"synchronized_standby_slots have received them, and {', '.join(missing)} is not streaming (a "
                "standby down, or the setting copied to a promoted server that has no such standby). Fix: bring "
                f"the standby back, or remove it from synchronized_standby_slots on {ep.conn_id} (ALTER SYSTEM, "
                "then pg_reload_conf())"
            )
        # Every named standby is attached: one lags, and the wait goes on as for decoding.
    if wait_event in ("WalSenderWaitForWAL", "WalSenderMain"):  # idle: everything decoded was sent
        raise SourceError(
            f"{where} and the server has nothing left to decode; check that {HEARTBEAT_TABLE} "
            f"is in publication {PUBLICATION}"
        )
    if waited > limits.max_wait_s:
        raise SourceError(
            f"{where} (the server is still {state or 'busy'}, {wait_event or 'on CPU'}); raise "
            "the capture's max_wait_s if a transaction this large is expected"
        )
    log.info("%s; the server is still decoding (%s, %s), waiting", where, state, wait_event or "on CPU")
