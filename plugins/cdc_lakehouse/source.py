"""The source side: what a PostgreSQL host must provide, and the objects we keep there.

Each endpoint (one database on one host) gets one publication and one logical replication
slot covering every configured table in every shard schema, plus a small heartbeat table
per shard. Preflight checks name the host, the table and the fix.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .identifiers import pg_ident, pg_qualified

PUBLICATION = "cdc_lakehouse"
HEARTBEAT_TABLE = "_cdc_heartbeat"
# Text output the capture, the bootstrap and the audit parse: fixed here, never left to the role's
# or the server's defaults. client_encoding matters for the SQL sessions; pgoutput sends text in
# the database encoding, which preflight requires to be UTF8.
SESSION_OPTIONS = (
    "-c DateStyle=ISO -c TimeZone=UTC -c IntervalStyle=iso_8601 -c extra_float_digits=3 "
    "-c bytea_output=hex -c client_encoding=UTF8"
)


class SourceError(RuntimeError):
    """A problem with the source that a person has to fix; the message says what to do."""


class PreflightError(SourceError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("source preflight failed:\n  - " + "\n  - ".join(problems))


class SlotConflictError(SourceError):
    pass


class SlotLostError(SourceError):
    pass


def slot_name(endpoint_id: str) -> str:
    name = re.sub(r"[^a-z0-9_]", "_", f"cdc_lakehouse_{endpoint_id}".lower())
    return name[:63]


# --- types ---------------------------------------------------------------------------------

_SCALARS = {
    "bigint": "bigint",
    "integer": "int",
    "smallint": "int",
    "boolean": "boolean",
    "text": "string",
    "character varying": "string",
    "character": "string",
    "name": "string",
    "citext": "string",
    "uuid": "string",
    "json": "string",
    "jsonb": "string",
    "xml": "string",
    "inet": "string",
    "cidr": "string",
    "macaddr": "string",
    "interval": "string",
    "time without time zone": "string",
    "time with time zone": "string",
    "money": "string",
    "real": "float",
    "double precision": "double",
    "date": "date",
    "bytea": "binary",
    "timestamp with time zone": "timestamp",
    "timestamp without time zone": "timestamp_ntz",
}
_NUMERIC = re.compile(r"^numeric(?:\((\d+)(?:,(\d+))?\))?$")
_TS = re.compile(r"^(timestamp|time)\(\d\) (with|without) time zone$")
DEFAULT_NUMERIC = "decimal(38,18)"


def lake_type(pg_type: str, typtype: str = "b") -> str | None:
    """PostgreSQL format_type() -> Spark/Iceberg type, None when unsupported.

    Enums become strings. Unconstrained numeric becomes decimal(38,18) (Spark's own
    default); values that do not fit are quarantined, and column_types can override.
    """
    if typtype == "e":
        return "string"
    t = pg_type.strip()
    if t.endswith("[]"):
        elem = lake_type(t[:-2])
        return None if elem is None or elem == "binary" else f"array<{elem}>"
    m = _TS.match(t)
    if m:
        t = f"{m.group(1)} {m.group(2)} time zone"
    base = re.sub(r"\(\d+\)$", "", t) if not t.startswith("numeric") else t
    if base in _SCALARS:
        return _SCALARS[base]
    m = _NUMERIC.match(t)
    if m:
        if m.group(1) is None:
            return DEFAULT_NUMERIC
        p, s = int(m.group(1)), int(m.group(2) or 0)
        return f"decimal({p},{s})" if p <= 38 and 0 <= s <= p else None
    return None


def is_bpchar(pg_type: str) -> bool:
    """character(n): stored and sent padded with spaces, but ::text strips the padding."""
    return pg_type == "character" or pg_type.startswith("character(")


def text_select(name: str, pg_type: str, lake_type: str) -> str:
    """One column as the text the change stream carries for it, for every reader of the source
    (bootstrap, repair, tests): one row, one value, whichever path it came by.

    Arrays travel as JSON arrays of the elements' text (the capture turns pgoutput's array text
    into the same shape): not to_json's typed rendering, which embeds json values, prints numbers
    in forms the lake's parser reads differently and timestamps in another format. character(n)
    keeps its padding, as its output function prints it (a ::text cast would strip it)."""
    q = pg_ident(name)
    if lake_type.startswith("array<"):
        if cast_differs(pg_type.removesuffix("[]")):
            return f"to_json({q})::text"
        return f"to_json({q}::text[])::text"
    return pg_text(q, pg_type)


def cast_differs(pg_type: str) -> bool:
    """Types whose ::text cast is not their output function: character(n) strips its padding,
    inet and cidr always print the netmask."""
    return is_bpchar(pg_type) or pg_type in ("inet", "cidr")


def pg_text(expr: str, pg_type: str) -> str:
    """A scalar's text exactly as its output function (and so the change stream) prints it."""
    if cast_differs(pg_type):
        return f"CASE WHEN {expr} IS NULL THEN NULL ELSE format('%s', {expr}) END"
    return f"{expr}::text"


@dataclass(frozen=True)
class SourceColumn:
    name: str
    pg_type: str
    lake_type: str | None
    nullable: bool
    is_key: bool

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.pg_type, "lake_type": self.lake_type, "key": self.is_key}


@dataclass
class SourceTable:
    schema: str
    name: str
    columns: list[SourceColumn]
    primary_key: list[str]
    replica_identity: str  # d n f i
    identity_columns: list[str] = field(default_factory=list)
    partitioned: bool = False

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]


def describe_table(cur, schema: str, table: str) -> SourceTable | None:
    cur.execute(
        """
        SELECT c.oid, c.relreplident, c.relkind = 'p' FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')
        """,
        (schema, table),
    )
    row = cur.fetchone()
    if row is None:
        return None
    oid, ident, partitioned = row
    cur.execute(
        """
        SELECT a.attname, format_type(a.atttypid, a.atttypmod), t.typtype,
               coalesce(format_type(t.typbasetype, t.typtypmod), ''), NOT a.attnotnull
        FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
        WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
        ORDER BY a.attnum
        """,
        (oid,),
    )
    cols_raw = cur.fetchall()
    cur.execute(
        """
        SELECT i.indisprimary, i.indisreplident, array_agg(a.attname ORDER BY k.ord)
        FROM pg_index i
        CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
        JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
        WHERE i.indrelid = %s AND (i.indisprimary OR i.indisreplident)
        GROUP BY i.indexrelid, i.indisprimary, i.indisreplident
        """,
        (oid,),
    )
    pk: list[str] = []
    ident_cols: list[str] = []
    for is_pk, is_ident, cols in cur.fetchall():
        if is_pk:
            pk = list(cols)
        if is_ident:
            ident_cols = list(cols)
    if ident == "d":
        ident_cols = pk
    columns = []
    for name, fmt, typtype, base_fmt, nullable in cols_raw:
        lt = lake_type(base_fmt, "b") if typtype == "d" else lake_type(fmt, typtype)
        columns.append(SourceColumn(name, fmt, lt, nullable, name in ident_cols))
    if ident == "f":
        ident_cols = [c.name for c in columns]
    return SourceTable(schema, table, columns, pk, ident, ident_cols, partitioned)


# --- preflight -------------------------------------------------------------------------------


@dataclass
class EndpointTables:
    """What one endpoint must replicate: source table -> (shard schemas, primary key)."""

    endpoint_id: str
    conn_id: str
    tables: dict[str, tuple[list[str], list[str]]]  # table -> (schemas, primary key)

    @property
    def schemas(self) -> list[str]:
        out: list[str] = []
        for schemas, _ in self.tables.values():
            for s in schemas:
                if s not in out:
                    out.append(s)
        return out

    def qualified_tables(self) -> list[tuple[str, str]]:
        return [(s, t) for t, (schemas, _) in self.tables.items() for s in schemas]


def preflight(conn, ep: EndpointTables, *, need_replication: bool = True) -> list[str]:
    """Problems that stop capture on this endpoint, each with its fix. Empty when fine."""
    problems: list[str] = []
    where = f"source {ep.conn_id!r} (endpoint {ep.endpoint_id})"
    with conn.cursor() as cur:
        cur.execute("SHOW wal_level")
        level = cur.fetchone()[0]
        if level != "logical":
            problems.append(
                f"{where}: wal_level is {level!r}; set wal_level = logical in postgresql.conf and restart "
                "the server (Amazon RDS/Aurora: rds.logical_replication = 1 in the parameter group)"
            )
        cur.execute("SELECT pg_encoding_to_char(encoding), datname FROM pg_database WHERE datname = current_database()")
        encoding, dbname = cur.fetchone()
        if encoding != "UTF8":
            problems.append(
                f"{where}: database {dbname!r} uses encoding {encoding}; logical replication sends text in the "
                "database encoding and the capture reads UTF-8, so values could be misread or fail. Fix: replicate "
                "from a UTF8 database (CREATE DATABASE ... ENCODING 'UTF8' and migrate the data into it)"
            )
        cur.execute("SELECT rolsuper, rolreplication, current_user FROM pg_roles WHERE rolname = current_user")
        is_super, can_repl, user = cur.fetchone()
        if need_replication and not (is_super or can_repl):
            problems.append(
                f"{where}: role {user!r} lacks the REPLICATION attribute needed for a replication slot; "
                f"run ALTER ROLE {pg_ident(user)} REPLICATION (RDS: GRANT rds_replication TO {pg_ident(user)})"
            )
        for table, (schemas, key) in ep.tables.items():
            for schema in schemas:
                fq = f"{schema}.{table}"
                info = describe_table(cur, schema, table)
                if info is None:
                    problems.append(
                        f"{where}: table {fq} does not exist; create it or remove shard {schema!r} from the config"
                    )
                    continue
                if info.partitioned:
                    problems.append(
                        f"{where}: table {fq} is partitioned; its changes are published under the leaf partitions' "
                        "names, and TRUNCATE, ATTACH and DETACH of a partition produce no change events through the "
                        "root, so rows would vanish or appear unseen. Fix: configure each leaf partition as its own "
                        "table (source.table), or replicate a non-partitioned table"
                    )
                    continue
                if info.replica_identity == "n" or (info.replica_identity == "d" and not info.primary_key):
                    problems.append(
                        f"{where}: table {fq} has no primary key and no replica identity, so updates and "
                        f"deletes cannot be identified; add a primary key or run ALTER TABLE {pg_qualified(schema, table)} "
                        "REPLICA IDENTITY FULL"
                    )
                elif info.replica_identity != "f" and not set(key) <= set(info.identity_columns):
                    problems.append(
                        f"{where}: table {fq}: configured primary_key {key} is not covered by the source's replica "
                        f"identity {info.identity_columns}; set primary_key to the source key or use REPLICA IDENTITY FULL"
                    )
                missing = [k for k in key if k not in info.column_names]
                if missing:
                    problems.append(f"{where}: table {fq}: primary_key column(s) {missing} do not exist")
                bad = [f"{c.name} ({c.pg_type})" for c in info.columns if c.lake_type is None]
                if bad:
                    problems.append(
                        f"{where}: table {fq}: unsupported column type(s) {', '.join(bad)}; "
                        "set column_types in the table config to read them as a supported type (e.g. string)"
                    )
                cur.execute("SELECT has_table_privilege(%s, 'SELECT')", (pg_qualified(schema, table),))
                if not cur.fetchone()[0]:
                    problems.append(
                        f"{where}: role {user!r} cannot SELECT {fq}; GRANT SELECT ON {pg_qualified(schema, table)} TO {pg_ident(user)}"
                    )
    return problems


PUBLISH_ACTIONS = ("insert", "update", "delete", "truncate")


def check_publication(conn, ep: EndpointTables, *, fix: bool = True) -> list[str]:
    """Create the publication or add missing tables when we may; otherwise report the fix.

    Membership is not enough: a publication that does not publish deletes or truncates, or that
    filters rows or columns of one of our tables, silently drops changes, so those are problems."""
    wanted = ep.qualified_tables() + [(s, HEARTBEAT_TABLE) for s in ep.schemas]
    problems: list[str] = []
    with conn.cursor() as cur:
        cur.execute(
            "SELECT pubowner::regrole::text, puballtables, pubinsert, pubupdate, pubdelete, pubtruncate "
            "FROM pg_publication WHERE pubname = %s",
            (PUBLICATION,),
        )
        row = cur.fetchone()
        if row is None:
            if not fix:
                return [f"publication {PUBLICATION} does not exist on endpoint {ep.endpoint_id}"]
            tables = ", ".join(pg_qualified(s, t) for s, t in wanted)
            try:
                cur.execute(f"CREATE PUBLICATION {pg_ident(PUBLICATION)} FOR TABLE {tables}")
            except Exception as exc:  # noqa: BLE001 - reported with the fix
                conn.rollback()
                return [
                    f"endpoint {ep.endpoint_id} ({ep.conn_id}): cannot create publication {PUBLICATION}: "
                    f"{str(exc).strip()}; a superuser or the database owner must run: "
                    f"CREATE PUBLICATION {PUBLICATION} FOR TABLE {tables}"
                ]
            return []
        problems += _publish_actions(conn, cur, ep, dict(zip(PUBLISH_ACTIONS, row[2:6])), fix)
        problems += _publication_filters(cur, ep, wanted)
        cur.execute("SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s", (PUBLICATION,))
        present = set(cur.fetchall())
        for s, t in wanted:
            if (s, t) in present:
                continue
            stmt = f"ALTER PUBLICATION {pg_ident(PUBLICATION)} ADD TABLE {pg_qualified(s, t)}"
            if fix:
                try:
                    cur.execute(stmt)
                    continue
                except Exception as exc:  # noqa: BLE001
                    conn.rollback()
                    problems.append(
                        f"endpoint {ep.endpoint_id} ({ep.conn_id}): publication {PUBLICATION} is missing "
                        f"{s}.{t} and it cannot be added ({str(exc).strip()}); its owner must run: {stmt}"
                    )
                    continue
            problems.append(f"endpoint {ep.endpoint_id}: publication {PUBLICATION} is missing {s}.{t}; run: {stmt}")
    return problems


def _publish_actions(conn, cur, ep: EndpointTables, actions: dict[str, bool], fix: bool) -> list[str]:
    missing = [a for a, on in actions.items() if not on]
    if not missing:
        return []
    stmt = f"ALTER PUBLICATION {pg_ident(PUBLICATION)} SET (publish = '{', '.join(PUBLISH_ACTIONS)}')"
    if fix:
        try:
            cur.execute(stmt)
            return []
        except Exception:  # noqa: BLE001 - reported with the fix below
            conn.rollback()
    return [
        f"endpoint {ep.endpoint_id} ({ep.conn_id}): publication {PUBLICATION} does not publish "
        f"{', '.join(missing)}, so those changes would never reach the lake; its owner must run: {stmt}"
    ]


def _publication_filters(cur, ep: EndpointTables, wanted: list[tuple[str, str]]) -> list[str]:
    """Row filters and column lists (PostgreSQL 15+) on our tables: refused, never fixed silently
    (someone chose them), with the statements that remove them."""
    cur.execute("SELECT current_setting('server_version_num')::int")
    if cur.fetchone()[0] < 150000:
        return []
    cur.execute(
        """
        SELECT n.nspname, c.relname, pg_get_expr(pr.prqual, pr.prrelid), pr.prattrs IS NOT NULL
        FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid
        JOIN pg_class c ON c.oid = pr.prrelid JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE p.pubname = %s AND (pr.prqual IS NOT NULL OR pr.prattrs IS NOT NULL)
        """,
        (PUBLICATION,),
    )
    want = set(wanted)
    problems = []
    for schema, table, rowfilter, collist in cur.fetchall():
        if (schema, table) not in want:
            continue
        what = f"a row filter (WHERE {rowfilter})" if rowfilter else "a column list"
        if rowfilter and collist:
            what = f"a row filter (WHERE {rowfilter}) and a column list"
        q = pg_qualified(schema, table)
        problems.append(
            f"endpoint {ep.endpoint_id} ({ep.conn_id}): publication {PUBLICATION} has {what} on {schema}.{table}, so "
            f"changes outside it would never reach the lake; publish the whole table: ALTER PUBLICATION "
            f"{pg_ident(PUBLICATION)} DROP TABLE {q}; ALTER PUBLICATION {pg_ident(PUBLICATION)} ADD TABLE {q}"
        )
    return problems


def published_tables(conn) -> list[str]:
    """'schema.table' of every table the publication sends (partition roots when via root)."""
    with conn.cursor() as cur:
        cur.execute(
            "SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = %s ORDER BY 1",
            (PUBLICATION,),
        )
        out = [r[0] for r in cur.fetchall()]
    conn.commit()
    return out


def source_identity(repl_cursor) -> dict[str, Any]:
    """Which server's LSNs these are, from IDENTIFY_SYSTEM on a replication connection.

    Positions compare only within one identity. A shard moved to another cluster or database, or
    a failover to a server on another timeline, yields a different identity; comparing its LSNs
    with the old ones would drop or re-apply changes, so the ingest refuses and asks for a
    re-bootstrap of the shard."""
    repl_cursor.execute("IDENTIFY_SYSTEM")
    system_id, timeline, _pos, database = repl_cursor.fetchone()
    return {"system_identifier": str(system_id), "timeline": int(timeline), "database": database}


def identity_mismatch(recorded: dict[str, Any] | None, seen: dict[str, Any] | None) -> str | None:
    """Why two identities differ, or None when they may be compared (or one is unknown)."""
    if not recorded or not seen:
        return None
    diffs = [
        f"{k} {recorded.get(k)} -> {seen.get(k)}"
        for k in ("system_identifier", "database", "timeline")
        if recorded.get(k) != seen.get(k)
    ]
    return ", ".join(diffs) or None


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

    def to_json(self) -> dict[str, Any]:
        return {
            "slot": self.name,
            "confirmed_flush_lsn": self.confirmed_flush,
            "restart_lsn": self.restart_lsn,
            "wal_status": self.wal_status,
            "retained_wal_bytes": self.retained_bytes,
            "lag_bytes": self.lag_bytes,
        }


def slot_state(conn, name: str) -> SlotState:
    with conn.cursor() as cur:
        cur.execute(
            """
            SELECT (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint, (restart_lsn - '0/0'::pg_lsn)::bigint,
                   wal_status, active_pid, (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint,
                   database, current_database()
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
    return SlotState(name, True, row[0], row[1], row[2], row[3], row[4])


def check_slot_usable(state: SlotState, ep: EndpointTables, *, captured_before: bool) -> None:
    fix = (
        "the changes in between are gone from the WAL: re-bootstrap every table on this endpoint "
        f"(trigger cdc_bootstrap__<table> for {sorted(ep.tables)})"
    )
    if not state.exists and captured_before:
        raise SlotLostError(f"replication slot {state.name} on {ep.conn_id} was dropped after earlier captures; {fix}")
    if state.exists and (state.wal_status == "lost" or state.restart_lsn is None):
        raise SlotLostError(
            f"replication slot {state.name} on {ep.conn_id} was invalidated (WAL removed, "
            f"wal_status={state.wal_status}); {fix}"
        )


def create_slot(conn, name: str) -> int:
    with conn.cursor() as cur:
        cur.execute(
            "SELECT (lsn - '0/0'::pg_lsn)::bigint FROM pg_create_logical_replication_slot(%s, 'pgoutput')", (name,)
        )
        lsn = cur.fetchone()[0]
    conn.commit()
    return lsn


def advance_slot(conn, name: str, lsn: int) -> int:
    """Confirm up to lsn (no-op when the slot is already there)."""
    from .pgoutput import lsn_to_str

    with conn.cursor() as cur:
        cur.execute(
            "SELECT (end_lsn - '0/0'::pg_lsn)::bigint FROM pg_replication_slot_advance(%s, %s::pg_lsn)",
            (name, lsn_to_str(lsn)),
        )
        out = cur.fetchone()[0]
    conn.commit()
    return out


def column_type_cache(conn):
    """(type oid, typmod) -> (format_type, typtype, base format) for relation messages."""
    cache: dict[tuple[int, int], tuple[str, str, str]] = {}

    def lookup(oid: int, typmod: int) -> tuple[str, str, str]:
        key = (oid, typmod)
        if key not in cache:
            with conn.cursor() as cur:
                cur.execute(
                    "SELECT format_type(t.oid, %s), t.typtype, coalesce(format_type(t.typbasetype, t.typtypmod), '') "
                    "FROM pg_type t WHERE t.oid = %s",
                    (typmod, oid),
                )
                row = cur.fetchone()
            conn.commit()
            cache[key] = row if row else (f"oid:{oid}", "b", "")
        return cache[key]

    return lookup


def schema_json(columns: list[dict[str, Any]]) -> str:
    return json.dumps(columns, separators=(",", ":"), sort_keys=True)


def key_is_enforced(cur, schema: str, table: str, key: list[str]) -> bool:
    """True when a unique index on exactly the key columns exists and they are all NOT NULL."""
    cur.execute(
        """
        SELECT EXISTS (
          SELECT 1 FROM pg_index i
          JOIN pg_class c ON c.oid = i.indrelid JOIN pg_namespace n ON n.oid = c.relnamespace
          WHERE n.nspname = %s AND c.relname = %s AND i.indisunique AND i.indpred IS NULL
            AND (SELECT array_agg(a.attname::text ORDER BY a.attname) FROM pg_attribute a
                 WHERE a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)) = %s::text[]
        ) AND (SELECT bool_and(a.attnotnull) FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
               JOIN pg_namespace n ON n.oid = c.relnamespace
               WHERE n.nspname = %s AND c.relname = %s AND a.attname = ANY(%s::text[]))
        """,
        (schema, table, sorted(key), schema, table, list(key)),
    )
    return bool(cur.fetchone()[0])


def key_violations(cur, schema: str, table: str, key: list[str]) -> str | None:
    """Scan for NULL or duplicate keys (used only when no unique index enforces the key)."""
    cols = ", ".join(pg_ident(k) for k in key)
    nulls = " OR ".join(f"{pg_ident(k)} IS NULL" for k in key)
    cur.execute(f"SELECT 1 FROM {pg_qualified(schema, table)} WHERE {nulls} LIMIT 1")
    if cur.fetchone():
        return f"{schema}.{table}: primary_key {key} has NULL values"
    cur.execute(f"SELECT {cols} FROM {pg_qualified(schema, table)} GROUP BY {cols} HAVING count(*) > 1 LIMIT 1")
    row = cur.fetchone()
    if row:
        return f"{schema}.{table}: primary_key {key} is not unique (duplicate {dict(zip(key, row))})"
    return None
