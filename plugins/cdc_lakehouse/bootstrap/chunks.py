"""The source side of a chunked bootstrap (bootstrap.chunked): keyset-paginated chunk queries,
the low/high watermark messages written into the WAL around each read, and the row estimate.

Every statement runs in autocommit mode, so each is its own short transaction: the low marker,
the chunk's COPY and the high marker. Between chunks the connection is idle and holds neither a
snapshot nor an xmin, so vacuum is never held back longer than one chunk's read.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from cdc_lakehouse.bootstrap.typed_select import TypedSelect, typed_select
from cdc_lakehouse.identifiers import pg_ident, pg_qualified
from cdc_lakehouse.source.catalog import text_select, text_select_list
from cdc_lakehouse.source.markers import ChunkMark, emit_marker, wait_until_visible

if TYPE_CHECKING:
    import pyarrow as pa

APPLICATION_NAME = "cdc_lakehouse bootstrap chunk"


class NoUsableKey(RuntimeError):
    """The table has no primary key or unique index that keyset pagination could walk."""


@dataclass(frozen=True)
class ChunkQuery:
    """How one shard's table is read in key order."""

    qualified: str
    select_list: str
    key: tuple[str, ...]
    limit: int
    key_select: str = ""  # the key columns as text, as select_list prints them

    def sql(self, after: list[str] | None, upto: list[str] | None = None) -> tuple[str, tuple[str, ...]]:
        """COPY (CSV) of the next chunk (select, below)."""
        inner, params = self.select(after, upto)
        return f"COPY ({inner}) TO STDOUT WITH (FORMAT csv)", params

    def select(self, after: list[str] | None, upto: list[str] | None = None) -> tuple[str, tuple[str, ...]]:
        """The next chunk: the first `limit` rows whose full key is above `after` and at
        most `upto` (the shard's last key when it started: rows inserted later come through the
        stream, so the last chunk does not chase a growing table). The row comparison
        (k1, k2) > (%s, %s) walks the key's index; the text values come back as unknown-typed
        literals, which PostgreSQL casts to each key column's type."""
        bounds = [(op, b) for op, b in ((">", after), ("<=", upto)) if b is not None]
        # With parameters the statement goes through mogrify: a % in the select list
        # (format('%s', ...)) or in a quoted name must not be taken for a placeholder.
        esc = (lambda x: x.replace("%", "%%")) if bounds else (lambda x: x)
        keys = esc(", ".join(pg_ident(k) for k in self.key))
        conds: list[str] = []
        params: tuple[str, ...] = ()
        for op, bound in bounds:
            if len(bound) != len(self.key):
                raise ValueError(f"key {bound} does not match the key columns {list(self.key)}")
            conds.append(f"({keys}) {op} ({', '.join(['%s'] * len(self.key))})")
            params += tuple(bound)
        where = f" WHERE {' AND '.join(conds)}" if conds else ""
        inner = (
            f"SELECT {esc(self.select_list)} FROM {esc(self.qualified)}{where} ORDER BY {keys} LIMIT {int(self.limit)}"
        )
        return inner, params

    def last_key_sql(self) -> str:
        """The shard's highest key, printed as the chunk rows print it."""
        desc = ", ".join(f"{pg_ident(k)} DESC" for k in self.key)
        return f"SELECT {self.key_select} FROM {self.qualified} ORDER BY {desc} LIMIT 1"


def chunk_query(
    schema: str,
    table: str,
    columns: list[tuple[str, str]],
    pg_types: dict[str, str],
    key: list[str],
    limit: int,
) -> ChunkQuery:
    names = {n for n, _ in columns}
    missing = [k for k in key if k not in names]
    if missing:
        raise ValueError(f"{schema}.{table}: key column(s) {missing} are not among the columns read")
    types = dict(columns)
    return ChunkQuery(
        pg_qualified(schema, table),
        text_select_list(columns, pg_types),
        tuple(key),
        limit,
        text_select_list([(k, types[k]) for k in key], pg_types),
    )


# The key columns' text, after the typed columns of a typed chunk: where the next chunk starts, as
# the source prints it (the progress rows keep it so).
KEY_TEXT_PREFIX = "_cdc_key_text_"


def typed(q: ChunkQuery, columns: list[tuple[str, str]], pg_types: dict[str, str]) -> tuple[ChunkQuery, TypedSelect]:
    """A chunk query (chunk_query) with the typed select list (bootstrap.typed_select) and each key
    column's text last."""
    select = typed_select(columns, pg_types)
    types = dict(columns)
    key_text = ", ".join(
        f"{text_select(k, pg_types.get(k, ''), types[k])} AS {pg_ident(KEY_TEXT_PREFIX + k)}" for k in q.key
    )
    return replace(q, select_list=f"{select.select_list()}, {key_text}"), select


@dataclass
class ChunkRead:
    """One chunk as read: its rows (text columns), the markers around it and its last key."""

    shard: str
    no: int
    low: int
    high: int
    rows: pa.Table
    last_key: list[str] | None
    xact_seconds: float  # how long the read's transaction was open
    read_seconds: float  # markers and read together
    visible_wait_seconds: float = 0.0  # waited after L for commits below it (wait_until_visible)
    meta: dict[str, Any] = field(default_factory=dict)


def last_key(conn, q: ChunkQuery) -> list[str] | None:
    """The shard's highest key now (autocommit: a transaction of its own)."""
    with conn.cursor() as cur:
        cur.execute(q.last_key_sql())
        row = cur.fetchone()
    return None if row is None else list(row)


def read_chunk(
    conn,
    q: ChunkQuery,
    columns: tuple[str, ...],
    after: list[str] | None,
    marker: ChunkMark,
    upto: list[str] | None = None,
    *,
    commit_wait: float,
) -> ChunkRead:
    """Low marker, the chunk's COPY, high marker: three transactions on an autocommit connection."""
    import pyarrow as pa
    from pyarrow import csv

    t0 = time.monotonic()
    with conn.cursor() as cur:
        low = emit_marker(cur, {**marker, "mark": "low"})
        # Rows applied at L: the read must see every commit below it (source.markers).
        waited = wait_until_visible(
            cur, f"{marker['table']} shard {marker['shard']} chunk {marker['chunk']}", commit_wait
        )
        sql, params = q.sql(after, upto)
        buf = io.BytesIO()
        t1 = time.monotonic()
        cur.copy_expert(cur.mogrify(sql, params).decode() if params else sql, buf, size=1 << 16)
        xact = time.monotonic() - t1
        high = emit_marker(cur, {**marker, "mark": "high"})
    read, parse, convert = _csv_options(columns)
    data = buf.getvalue()
    table = (
        csv.read_csv(pa.py_buffer(data), read_options=read, parse_options=parse, convert_options=convert)
        if data
        else pa.table({c: pa.array([], pa.string()) for c in columns})
    )
    last = _last_key(table, q.key)
    return ChunkRead(marker["shard"], marker["chunk"], low, high, table, last, xact, time.monotonic() - t0, waited)


def read_typed_chunk(
    conn,
    reader,
    q: ChunkQuery,
    select: TypedSelect,
    after: list[str] | None,
    marker: ChunkMark,
    upto: list[str] | None = None,
    *,
    commit_wait: float,
) -> ChunkRead:
    """read_chunk with typed values: the chunk's SELECT (its key bounds inlined by psycopg2, as
    read_chunk's COPY has them) runs on `reader`, an autocommit ADBC cursor, which reads it with
    binary COPY into Arrow (bootstrap.copy_read). The rows hold the typed columns, the misfit
    message and the key columns' text."""
    import pyarrow as pa

    from cdc_lakehouse.bootstrap.copy_read import arrow_schema, conform

    types = (*select.spark_types(numeric_as_text=True), *[(KEY_TEXT_PREFIX + k, "string") for k in q.key])
    schema = arrow_schema(tuple(types))
    t0 = time.monotonic()
    with conn.cursor() as cur:
        low = emit_marker(cur, {**marker, "mark": "low"})
        # Rows applied at L: the read must see every commit below it (source.markers).
        waited = wait_until_visible(
            cur, f"{marker['table']} shard {marker['shard']} chunk {marker['chunk']}", commit_wait
        )
        sql, params = q.select(after, upto)
        t1 = time.monotonic()
        reader.execute(cur.mogrify(sql, params).decode() if params else sql)
        batches = [conform(b, schema, marker["shard"]) for b in reader.fetch_record_batch()]
        xact = time.monotonic() - t1
        high = emit_marker(cur, {**marker, "mark": "high"})
    table = pa.Table.from_batches(batches, schema=schema)
    last = _last_key(table, [KEY_TEXT_PREFIX + k for k in q.key])
    return ChunkRead(marker["shard"], marker["chunk"], low, high, table, last, xact, time.monotonic() - t0, waited)


def _last_key(table: pa.Table, columns: Iterable[str]) -> list[str] | None:
    """The last row's key, as text: where the next chunk starts."""
    return [table.column(k)[table.num_rows - 1].as_py() for k in columns] if table.num_rows else None


# PostgreSQL's CSV is handed to pyarrow's parser in one buffer per chunk.
BUFFER_BYTES = 8 << 20


def _csv_options(columns: tuple[str, ...]):
    import pyarrow as pa
    from pyarrow import csv

    # PostgreSQL's CSV: NULL is an unquoted empty field, an empty string is quoted (""); values
    # may hold newlines inside quotes. Every column stays text: typed_rows casts it, as for JDBC.
    return (
        csv.ReadOptions(column_names=list(columns), block_size=BUFFER_BYTES + (1 << 20), use_threads=False),
        csv.ParseOptions(newlines_in_values=True),
        csv.ConvertOptions(
            column_types={c: pa.string() for c in columns},
            null_values=[""],
            strings_can_be_null=True,
            quoted_strings_can_be_null=False,
        ),
    )


def has_usable_key(cur, schema: str, table: str, key: list[str]) -> bool:
    from cdc_lakehouse.source.catalog import key_is_enforced

    return key_is_enforced(cur, schema, table, key)


def refuse_without_key(cur, cfg_name: str, schema: str, table: str, key: list[str]) -> None:
    """Keyset pagination needs a unique, NOT NULL key backed by an index: without it chunks
    could skip or repeat rows, and every chunk would sort the whole table."""
    cur.execute("SELECT to_regclass(%s) IS NOT NULL", (pg_qualified(schema, table),))
    if not cur.fetchone()[0] or has_usable_key(cur, schema, table, key):
        return  # a missing table is the preflight's to report
    raise NoUsableKey(
        f"{cfg_name}: {schema}.{table} has no primary key or unique index on {key} with NOT NULL columns, "
        "so the chunked bootstrap cannot page through it by key; add one (ALTER TABLE "
        f"{pg_qualified(schema, table)} ADD PRIMARY KEY ({', '.join(pg_ident(k) for k in key)})), set "
        "primary_key to the table's real key, or use bootstrap.mode: snapshot"
    )


def estimated_rows(cur, schema: str, table: str) -> int:
    """pg_class.reltuples: the planner's estimate (-1 before the first VACUUM/ANALYZE: then 0)."""
    cur.execute("SELECT reltuples::bigint FROM pg_class WHERE oid = %s::regclass", (pg_qualified(schema, table),))
    row = cur.fetchone()
    return max(0, int(row[0])) if row else 0
