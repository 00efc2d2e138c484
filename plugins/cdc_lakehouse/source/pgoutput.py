"""Decoder for PostgreSQL's built-in `pgoutput` logical replication protocol (version 1).

Pure functions over bytes; no database access. Values stay in PostgreSQL's text output
format (the walsender runs with DateStyle=ISO, TimeZone=UTC): Spark casts them to the lake
types in bulk, which is far cheaper than converting each value in Python.

Message layout: https://www.postgresql.org/docs/15/protocol-logicalrep-message-formats.html
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from struct import Struct

PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
_I16 = Struct(">h")
_I32 = Struct(">i")
_U32 = Struct(">I")
_I64 = Struct(">q")
_BEGIN = Struct(">qqI")  # final_lsn, commit_ts, xid
_COMMIT = Struct(">bqqq")  # flags, commit_lsn, end_lsn, commit_ts
_COLUMN_TAIL = Struct(">Ii")  # type oid, typmod


class Unchanged:
    """pgoutput's 'u': an unchanged TOASTed value the server did not send. Never NULL."""

    _inst: Unchanged | None = None

    def __new__(cls) -> Unchanged:
        if cls._inst is None:
            cls._inst = super().__new__(cls)
        return cls._inst

    def __repr__(self) -> str:
        return "UNCHANGED_TOAST"


UNCHANGED = Unchanged()


def lsn_to_int(lsn: str) -> int:
    hi, lo = lsn.split("/")
    return (int(hi, 16) << 32) | int(lo, 16)


def lsn_to_str(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def pg_time(micros: int) -> datetime:
    return PG_EPOCH + timedelta(microseconds=micros)


@dataclass(frozen=True)
class Column:
    name: str
    type_oid: int
    typmod: int
    is_key: bool


@dataclass
class Relation:
    oid: int
    schema: str
    name: str
    replica_identity: str  # d(efault) n(othing) f(ull) i(ndex)
    columns: list[Column]
    names: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.names = [c.name for c in self.columns]


@dataclass(frozen=True)
class Begin:
    final_lsn: int  # the commit record's LSN: what orders transactions
    commit_ts: int  # microseconds since 2000-01-01 UTC
    xid: int


@dataclass(frozen=True)
class Commit:
    commit_lsn: int
    end_lsn: int
    commit_ts: int


@dataclass(frozen=True)
class Change:
    kind: str  # I U D
    relid: int
    old: list | None  # key columns ('K') or the full old row ('O'); None when not sent
    old_is_key: bool
    new: list | None


@dataclass(frozen=True)
class Truncate:
    relids: list[int]
    cascade: bool
    restart_identity: bool


@dataclass(frozen=True)
class TypeMsg:
    oid: int
    schema: str
    name: str


def _cstring(buf: bytes, pos: int) -> tuple[str, int]:
    end = buf.index(0, pos)
    return buf[pos:end].decode("utf-8"), end + 1


def parse_tuple(buf: bytes, pos: int) -> tuple[list, int]:
    """TupleData -> values (str, None, UNCHANGED, or bytes for binary) and the next offset."""
    (n,) = _I16.unpack_from(buf, pos)
    pos += 2
    values: list = []
    append = values.append
    unpack = _I32.unpack_from
    for _ in range(n):
        kind = buf[pos]
        pos += 1
        if kind == 0x74:  # 't' text
            (ln,) = unpack(buf, pos)
            pos += 4
            append(buf[pos : pos + ln].decode("utf-8"))
            pos += ln
        elif kind == 0x6E:  # 'n' null
            append(None)
        elif kind == 0x75:  # 'u' unchanged toast
            append(UNCHANGED)
        elif kind == 0x62:  # 'b' binary (only when binary mode is requested; we never do)
            (ln,) = unpack(buf, pos)
            pos += 4
            append(bytes(buf[pos : pos + ln]))
            pos += ln
        else:
            raise ValueError(f"pgoutput: unknown tuple value kind {kind!r} at offset {pos - 1}")
    return values, pos


# One return per pgoutput message type, in the protocol's order.
def decode(buf: bytes):  # noqa: PLR0911
    """One pgoutput message -> Begin | Commit | Relation | Change | Truncate | TypeMsg | None."""
    tag = buf[0]
    if tag == 0x49:  # 'I' insert
        (relid,) = _U32.unpack_from(buf, 1)
        new, _ = parse_tuple(buf, 6)  # byte 5 is 'N'
        return Change("I", relid, None, False, new)
    if tag == 0x55:  # 'U' update
        (relid,) = _U32.unpack_from(buf, 1)
        pos = 5
        old = None
        old_is_key = False
        sub = buf[pos]
        if sub in (0x4B, 0x4F):  # 'K' key / 'O' old row
            old_is_key = sub == 0x4B
            old, pos = parse_tuple(buf, pos + 1)
            sub = buf[pos]
        if sub != 0x4E:
            raise ValueError(f"pgoutput: update without new tuple (got {sub!r})")
        new, _ = parse_tuple(buf, pos + 1)
        return Change("U", relid, old, old_is_key, new)
    if tag == 0x44:  # 'D' delete
        (relid,) = _U32.unpack_from(buf, 1)
        sub = buf[5]
        old, _ = parse_tuple(buf, 6)
        return Change("D", relid, old, sub == 0x4B, None)
    if tag == 0x42:  # 'B' begin
        return Begin(*_BEGIN.unpack_from(buf, 1))
    if tag == 0x43:  # 'C' commit
        _, commit_lsn, end_lsn, ts = _COMMIT.unpack_from(buf, 1)
        return Commit(commit_lsn, end_lsn, ts)
    if tag == 0x52:  # 'R' relation
        (relid,) = _U32.unpack_from(buf, 1)
        schema, pos = _cstring(buf, 5)
        name, pos = _cstring(buf, pos)
        ident = chr(buf[pos])
        (ncols,) = _I16.unpack_from(buf, pos + 1)
        pos += 3
        cols = []
        for _ in range(ncols):
            flags = buf[pos]
            cname, pos = _cstring(buf, pos + 1)
            oid, typmod = _COLUMN_TAIL.unpack_from(buf, pos)
            pos += 8
            cols.append(Column(cname, oid, typmod, bool(flags & 1)))
        return Relation(relid, schema, name, ident, cols)
    if tag == 0x54:  # 'T' truncate
        (n,) = _I32.unpack_from(buf, 1)
        opts = buf[5]
        relids = [_U32.unpack_from(buf, 6 + 4 * i)[0] for i in range(n)]
        return Truncate(relids, bool(opts & 1), bool(opts & 2))
    if tag == 0x59:  # 'Y' type
        (oid,) = _U32.unpack_from(buf, 1)
        schema, pos = _cstring(buf, 5)
        name, _ = _cstring(buf, pos)
        return TypeMsg(oid, schema, name)
    if tag in (0x4F, 0x4D):  # 'O' origin, 'M' logical message: not replicated
        return None
    raise ValueError(f"pgoutput: unknown message type {chr(tag)!r}")


# --- PostgreSQL array text format -> JSON ------------------------------------------------


def parse_pg_array(text: str) -> list | None:
    """'{a,"b c",NULL}' -> ['a', 'b c', None]; one-dimensional arrays only.

    Raises ValueError for what it cannot represent (nested arrays, bounds decoration),
    so the event is quarantined with that reason instead of being guessed at.
    """
    if text is None:
        return None
    try:
        return _parse_array(text)
    except IndexError:
        raise ValueError("unterminated array") from None


# A hand-rolled scanner of PostgreSQL's array text (quotes, escapes, NULL, nesting): one branch per
# character class reads closer to the grammar than a split into helpers.
def _parse_array(text: str) -> list:  # noqa: PLR0912
    if not text.startswith("{"):
        raise ValueError("array with explicit bounds is not supported")
    out: list = []
    i, n = 1, len(text)
    if text == "{}":
        return out
    while i < n:
        ch = text[i]
        if ch == "{":
            raise ValueError("multi-dimensional arrays are not supported")
        if ch == '"':
            i += 1
            buf = []
            while True:
                ch = text[i]
                if ch == "\\":
                    buf.append(text[i + 1])
                    i += 2
                elif ch == '"':
                    i += 1
                    break
                else:
                    buf.append(ch)
                    i += 1
            out.append("".join(buf))
        else:
            j = i
            while text[j] not in ",}":
                j += 1
            item = text[i:j].strip()
            out.append(None if item == "NULL" else item)
            i = j
        if i >= n:
            raise ValueError("unterminated array")
        if text[i] == ",":
            i += 1
        elif text[i] == "}":
            if i != n - 1:
                raise ValueError("trailing characters after array")
            return out
    raise ValueError("unterminated array")
