"""source.catalog: what a source table is, read from PostgreSQL's catalog (Airflow worker and
Spark driver): PostgreSQL types -> lake types, describe_table (columns, key, replica identity),
every column as the text the change stream carries (text_select, text_select_list), and the
preflight checks of a configured primary key.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, TypedDict

from cdc_lakehouse.identifiers import pg_ident, pg_qualified

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


def text_select_list(columns: list[tuple[str, str]], pg_types: dict[str, str] | None = None) -> str:
    """Every column as text (text_select), each under its own name: the select list of a source
    query whose rows go through the ingest's casts, so a snapshot and the change stream share them.

    columns: (name, lake type); pg_types: name -> PostgreSQL format_type (for arrays, character(n),
    inet and cidr, whose text differs from a plain cast)."""
    pg_types = pg_types or {}
    return ", ".join(f"{text_select(n, pg_types.get(n, ''), t)} AS {pg_ident(n)}" for n, t in columns)


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
    # table -> column -> the lake type its config reads it as (column_types): the capture lands the
    # column's values typed that way (capture.events.landing_type)
    column_types: dict[str, dict[str, str]] = field(default_factory=dict)

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


class SchemaColumn(TypedDict):
    """One column of a relation as the capture records it (and a Debezium record's schema gives it):
    a landed event's `table_schema` and a manifest's `schemas` list them, as JSON (schema_json)."""

    name: str
    type: str  # the source's type, as format_type() shows it
    lake_type: str | None  # the lake type it maps to; None when there is none (column_types decides)
    key: bool  # in the replica identity


def schema_json(columns: list[SchemaColumn]) -> str:
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
