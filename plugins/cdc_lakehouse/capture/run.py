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
import select
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from cdc_lakehouse.capture.positions import ATTEMPTS_DIR, attempt_path, confirm, start_position
from cdc_lakehouse.landing.format import manifest_path, run_dir
from cdc_lakehouse.landing.reader import list_manifests
from cdc_lakehouse.landing.writer import TableWriter
from cdc_lakehouse.runtime.failpoints import crash_point
from cdc_lakehouse.source.catalog import (
    EndpointTables,
    column_type_cache,
)
from cdc_lakehouse.source.catalog import (
    lake_type as source_lake_type,
)
from cdc_lakehouse.source.catalog import (
    schema_json as source_schema_json,
)
from cdc_lakehouse.source.errors import PreflightError, SourceError
from cdc_lakehouse.source.pgoutput import (
    UNCHANGED,
    Begin,
    Change,
    Commit,
    Relation,
    Truncate,
    TypeMsg,
    decode,
    parse_pg_array,
    pg_time,
)
from cdc_lakehouse.source.publication import (
    PUBLICATION,
    check_publication,
    preflight,
    published_tables,
)
from cdc_lakehouse.source.publication import (
    source_identity as source_source_identity,
)
from cdc_lakehouse.source.session import SESSION_OPTIONS
from cdc_lakehouse.source.slots import (
    HEARTBEAT_TABLE,
    check_slot_usable,
    create_slot,
    ensure_heartbeat_tables,
    slot_state,
    write_heartbeat,
)
from cdc_lakehouse.source.slots import (
    slot_name as source_slot_name,
)

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


class _Rel:
    """A relation as the slot describes it, with what the event builder needs precomputed."""

    __slots__ = ("rel", "key", "names", "key_idx", "array_idx", "schema_json", "columns", "heartbeat")

    def __init__(self, rel: Relation, type_lookup):
        self.rel = rel
        self.key = f"{rel.schema}.{rel.name}"
        self.names = rel.names
        self.heartbeat = rel.name == HEARTBEAT_TABLE
        self.columns: list[dict[str, Any]] = []
        self.array_idx: set[int] = set()
        for i, c in enumerate(rel.columns):
            fmt, typtype, base = type_lookup(c.type_oid, c.typmod)
            lt = source_lake_type(base, "b") if typtype == "d" else source_lake_type(fmt, typtype)
            if lt and lt.startswith("array<"):
                self.array_idx.add(i)
            self.columns.append({"name": c.name, "type": fmt, "lake_type": lt, "key": c.is_key})
        self.key_idx = [i for i, c in enumerate(rel.columns) if c.is_key]
        self.schema_json = source_schema_json(self.columns)


def _row(rel: _Rel, values: list) -> tuple[list, list | None]:
    """Values -> (after as (name, text) pairs, unavailable column names or None)."""
    names = rel.names
    if not rel.array_idx and UNCHANGED not in values:
        return list(zip(names, values)), None
    out, unavailable = [], []
    for i, v in enumerate(values):
        if v is UNCHANGED:
            unavailable.append(names[i])
            continue
        if i in rel.array_idx and v is not None:
            import json

            try:
                text = json.dumps(parse_pg_array(v), separators=(",", ":"))
            except ValueError as exc:
                # Keep the raw text; the ingest quarantines it with this reason.
                text = "\x00unparseable-array:" + str(exc) + ":" + v
            out.append((names[i], text))
            continue
        out.append((names[i], v))
    return out, (unavailable or None)


def _key_pairs(rel: _Rel, values: list, only_key: bool) -> list:
    if only_key:
        return [(rel.names[i], values[i]) for i in rel.key_idx]
    return [(n, v) for n, v in zip(rel.names, values) if v is not UNCHANGED]


def schema_diff(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> dict[str, list] | None:
    before = {c["name"]: c["type"] for c in old}
    after = {c["name"]: c["type"] for c in new}
    added = [n for n in after if n not in before]
    dropped = [n for n in before if n not in after]
    retyped = [{"column": n, "from": before[n], "to": after[n]} for n in after if n in before and before[n] != after[n]]
    if added or dropped or retyped:
        return {"added": added, "dropped": dropped, "retyped": retyped}
    return None


def capture_run(
    ep: EndpointTables,
    dsn: str,
    store,
    run_id: str,
    *,
    host_label: str = "",
    database: str = "",
    limits: CaptureLimits = CaptureLimits(),
) -> dict[str, Any]:
    """Capture one run for an endpoint; returns its manifest (also when the run already existed)."""
    import psycopg2

    slot = source_slot_name(ep.endpoint_id)
    mpath = manifest_path(ep.endpoint_id, run_id)
    store.verify()  # before the slot is touched: an unwritable landing zone must cost nothing
    if store.exists(mpath):
        manifest = store.read_json(mpath)
        confirm(dsn, slot, manifest["end_lsn"], None)
        log.info(
            "capture %s: run %s already captured; slot confirmed at %s", ep.endpoint_id, run_id, manifest["end_lsn"]
        )
        return {**manifest, "reused": True}

    conn = psycopg2.connect(dsn, options=SESSION_OPTIONS, application_name="cdc_lakehouse capture")
    try:
        problems = preflight(conn, ep)
        conn.commit()
        if problems:
            raise PreflightError(problems)
        ensure_heartbeat_tables(conn, ep.schemas)
        conn.commit()
        problems = check_publication(conn, ep)
        conn.commit()
        if problems:
            raise PreflightError(problems)
        previous = list_manifests(store, ep.endpoint_id)
        state = slot_state(conn, slot)
        check_slot_usable(state, ep, captured_before=bool(previous))
        if not state.exists:
            create_slot(conn, slot)
            state = slot_state(conn, slot)
        if state.active_pid:
            raise SourceError(
                f"replication slot {slot} on {ep.conn_id} is in use by process {state.active_pid}: another "
                "capture of this endpoint is running (captures of one endpoint share the pool "
                f"cdc_capture__{ep.endpoint_id}; check for a run outside Airflow)"
            )
        if previous and previous[-1]["end_lsn"] > (state.confirmed_flush or 0):
            # Step 1: a run that wrote its manifest but died before confirming.
            confirm(dsn, slot, previous[-1]["end_lsn"], None)
            state = slot_state(conn, slot)
        known_schemas = previous[-1].get("schemas", {}) if previous else {}
        start_lsn, advanced = start_position(store, ep.endpoint_id, previous, state)
        store.write_json(
            attempt_path(ep.endpoint_id, run_id),
            {"run_id": run_id, "from_lsn": state.confirmed_flush, "started_at": datetime.now(UTC).isoformat()},
        )
        published_start = published_tables(conn)
        hb_xid = write_heartbeat(conn, ep.schemas, run_id)
        type_lookup = column_type_cache(conn)
        coverage = {
            "published_at_start": published_start,
            "start_lsn": start_lsn,
            "keepalive_advance": advanced,
            "published": lambda: published_tables(conn),
        }
        manifest = _stream(
            ep,
            dsn,
            store,
            run_id,
            slot,
            state,
            hb_xid,
            type_lookup,
            known_schemas,
            host_label,
            database,
            limits,
            coverage,
        )
        after = slot_state(conn, slot)
        manifest["slot_after"] = after.to_json()
        log.info(
            "capture %s run %s: %d events in %d transactions, %d bytes decoded, slot %s retains %s WAL bytes, lag %s bytes%s",
            ep.endpoint_id,
            run_id,
            manifest["events"],
            manifest["transactions"],
            manifest["bytes"],
            slot,
            after.retained_bytes,
            after.lag_bytes,
            " (capped: more remains)" if manifest["capped"] else "",
        )
        return manifest
    finally:
        conn.close()


def _stream(
    ep,
    dsn,
    store,
    run_id,
    slot,
    state,
    hb_xid,
    type_lookup,
    known_schemas,
    host_label,
    database,
    limits: CaptureLimits,
    coverage: dict[str, Any],
) -> dict[str, Any]:
    import psycopg2
    from psycopg2.extras import LogicalReplicationConnection

    started = datetime.now(UTC)
    ts_ms = int(started.timestamp() * 1000)
    staging = store.staging_dir()
    writers: dict[str, TableWriter] = {}
    consts = {
        "connector": "postgresql",
        "endpoint": ep.endpoint_id,
        "host": host_label,
        "db": database,
        "ts_ms": ts_ms,
        "run_id": run_id,
    }
    rels: dict[int, _Rel] = {}
    schemas_seen: dict[str, list] = {}
    schema_changes: list[dict[str, Any]] = []
    heartbeats: dict[str, dict[str, Any]] = {}
    events = nbytes = txs = 0
    capped = False
    last_commit: Commit | None = None
    tx: Begin | None = None
    tx_commit_us = 0
    seq = 0
    tx_heartbeat_schemas: list[str] = []

    def writer_for(table: str) -> TableWriter:
        d = staging / table
        d.mkdir()
        writers[table] = TableWriter(d, consts, limits.batch_rows, limits.file_rows, limits.batch_bytes)
        return writers[table]

    repl = psycopg2.connect(
        dsn,
        connection_factory=LogicalReplicationConnection,
        options=SESSION_OPTIONS,
        application_name="cdc_lakehouse capture stream",
    )
    cur = repl.cursor()
    try:
        identity = source_source_identity(cur)
        cur.start_replication(
            slot_name=slot,
            decode=False,
            status_interval=10,
            options={"proto_version": "1", "publication_names": PUBLICATION},
        )
        last_activity = waiting_since = time.monotonic()
        server_pos = getattr(cur, "wal_end", 0)
        done = False
        while not done:
            msg = cur.read_message()
            if msg is None:
                # Keepalives are answered inside psycopg2; one whose position moved means the
                # server is still reading WAL (a large transaction of other tables), not stuck.
                pos = getattr(cur, "wal_end", 0)
                if pos != server_pos:
                    server_pos, last_activity = pos, time.monotonic()
                elif time.monotonic() - last_activity > limits.idle_timeout_s:
                    _check_still_decoding(ep, dsn, slot, hb_xid, limits, time.monotonic() - waiting_since)
                    last_activity = time.monotonic()
                select.select([cur], [], [], 1.0)
                continue
            last_activity = time.monotonic()
            payload = msg.payload
            nbytes += len(payload)
            m = decode(payload)
            if isinstance(m, Change):
                r = rels[m.relid]
                if r.heartbeat:
                    tx_heartbeat_schemas.append(r.rel.schema)
                    continue
                seq += 1
                if m.kind == "I":
                    op, before = "c", None
                    after, unavailable = _row(r, m.new)
                elif m.kind == "U":
                    op = "u"
                    before = _key_pairs(r, m.old, m.old_is_key) if m.old is not None else None
                    after, unavailable = _row(r, m.new)
                else:
                    op, after, unavailable = "d", None, None
                    before = _key_pairs(r, m.old, m.old_is_key)
                w = writers.get(r.rel.name) or writer_for(r.rel.name)
                w.add(
                    op,
                    before,
                    after,
                    unavailable,
                    r.rel.schema,
                    r.rel.name,
                    tx.final_lsn,
                    msg.data_start,
                    tx.xid,
                    seq,
                    tx_commit_us,
                    r.schema_json,
                    len(payload),
                )
                events += 1
            elif isinstance(m, Begin):
                tx, seq, tx_heartbeat_schemas = m, 0, []
                tx_commit_us = m.commit_ts + PG_EPOCH_US
            elif isinstance(m, Commit):
                txs += 1
                last_commit = m
                for s in tx_heartbeat_schemas:
                    heartbeats[s] = {
                        "commit_lsn": m.commit_lsn,
                        "end_lsn": m.end_lsn,
                        "commit_ts": pg_time(m.commit_ts).isoformat(),
                        "xid": tx.xid,
                    }
                if tx.xid == hb_xid:
                    done = True  # the run's bound: everything committed before it is in
                elif events >= limits.max_events or nbytes >= limits.max_bytes:
                    capped = done = True
                tx = None
            elif isinstance(m, Relation):
                r = _Rel(m, type_lookup)
                rels[m.oid] = r
                if not r.heartbeat:
                    prev = schemas_seen.get(r.key) or known_schemas.get(r.key)
                    at = {
                        "table": r.key,
                        "at_commit_lsn": tx.final_lsn if tx else None,
                        "columns": [c["name"] for c in r.columns],
                    }
                    if prev is None:
                        # No earlier schema to diff with: the ingest compares these columns with
                        # the shard's known ones (columns added since its bootstrap need values).
                        schema_changes.append({**at, "first_seen": True, "added": [], "dropped": [], "retyped": []})
                    else:
                        diff = schema_diff(prev, r.columns)
                        if diff:
                            schema_changes.append({**at, **diff})
                            log.warning("capture %s: schema change on %s: %s", ep.endpoint_id, r.key, diff)
                    schemas_seen[r.key] = r.columns
            elif isinstance(m, Truncate):
                for relid in m.relids:
                    r = rels.get(relid)
                    if r is None or r.heartbeat:
                        continue
                    seq += 1
                    w = writers.get(r.rel.name) or writer_for(r.rel.name)
                    w.add(
                        "t",
                        None,
                        None,
                        None,
                        r.rel.schema,
                        r.rel.name,
                        tx.final_lsn,
                        msg.data_start,
                        tx.xid,
                        seq,
                        tx_commit_us,
                        r.schema_json,
                    )
                    events += 1
            elif isinstance(m, TypeMsg) or m is None:
                pass

        # Files first, durably; then the manifest; then the slot.
        tables = []
        for name, w in sorted(writers.items()):
            files = w.close()
            rel = run_dir(ep.endpoint_id, name, run_id)
            store.publish_dir(staging / name, rel)
            tables.append(
                {
                    "table": name,
                    "dir": rel,
                    "files": files,
                    "events": w.rows,
                    "min_commit_lsn": w.min_commit_lsn,
                    "max_commit_lsn": w.max_commit_lsn,
                    "shards": sorted(w.shards),
                }
            )
        store.discard(staging)
        crash_point("after_files")
        assert last_commit is not None
        # What the run covered: a table's changes are in this run only if it was published for the
        # whole run. The ingest checks its shards against this before moving their watermark.
        published_end = coverage["published"]()
        manifest = {
            "format": 1,
            "run_id": run_id,
            "endpoint": ep.endpoint_id,
            "conn_id": ep.conn_id,
            "slot": slot,
            "publication": PUBLICATION,
            "started_at": started.isoformat(),
            "finished_at": datetime.now(UTC).isoformat(),
            "start_lsn": coverage["start_lsn"],
            "end_lsn": last_commit.end_lsn,
            "last_commit_lsn": last_commit.commit_lsn,
            "last_commit_ts": pg_time(last_commit.commit_ts).isoformat(),
            "capped": capped,
            "heartbeat_xid": hb_xid,
            "events": events,
            "bytes": nbytes,
            "transactions": txs,
            "tables": tables,
            "heartbeats": heartbeats,
            "schemas": {**known_schemas, **schemas_seen},
            "schema_changes": schema_changes,
            "slot_before": state.to_json(),
            "source_identity": identity,
            "published": published_end,
            "published_at_start": coverage["published_at_start"],
        }
        if coverage["keepalive_advance"]:
            manifest["keepalive_advance"] = coverage["keepalive_advance"]
        store.write_json(manifest_path(ep.endpoint_id, run_id), manifest)
        crash_point("after_manifest")
        confirm(dsn, slot, last_commit.end_lsn, cur)
        for name in store.list_names(f"{ep.endpoint_id}/{ATTEMPTS_DIR}"):  # resolved by this manifest
            store.delete(f"{ep.endpoint_id}/{ATTEMPTS_DIR}/{name}")
        cur = None
        return manifest
    except BaseException:
        store.discard(staging)
        raise
    finally:
        try:
            repl.close()
        except Exception:  # noqa: BLE001
            pass


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
