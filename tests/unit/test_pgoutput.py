"""pgoutput decoding on hand-built messages (the protocol's byte layout), and type mapping."""

from __future__ import annotations

import struct

import pytest
from cdc_lakehouse.source.catalog import lake_type
from cdc_lakehouse.source.pgoutput import (
    UNCHANGED,
    Begin,
    Change,
    Commit,
    Relation,
    Truncate,
    decode,
    lsn_to_int,
    lsn_to_str,
    parse_pg_array,
)


def tup(*vals) -> bytes:
    out = struct.pack(">h", len(vals))
    for v in vals:
        if v is None:
            out += b"n"
        elif v is UNCHANGED:
            out += b"u"
        else:
            b = v.encode()
            out += b"t" + struct.pack(">i", len(b)) + b
    return out


def test_begin_commit():
    b = decode(b"B" + struct.pack(">qqI", 0x16B3748, 12345, 42))
    assert b == Begin(0x16B3748, 12345, 42)
    c = decode(b"C" + struct.pack(">bqqq", 0, 100, 148, 999))
    assert c == Commit(100, 148, 999)


def test_relation():
    body = struct.pack(">I", 16384) + b"shard_01\x00block\x00" + b"d" + struct.pack(">h", 2)
    body += b"\x01id\x00" + struct.pack(">Ii", 20, -1) + b"\x00title\x00" + struct.pack(">Ii", 25, -1)
    r = decode(b"R" + body)
    assert isinstance(r, Relation)
    assert (r.schema, r.name, r.replica_identity) == ("shard_01", "block", "d")
    assert [(c.name, c.type_oid, c.is_key) for c in r.columns] == [("id", 20, True), ("title", 25, False)]


def test_insert_update_delete():
    ins = decode(b"I" + struct.pack(">I", 7) + b"N" + tup("1", None, "x"))
    assert ins == Change("I", 7, None, False, ["1", None, "x"])
    upd = decode(b"U" + struct.pack(">I", 7) + b"K" + tup("1", None, None) + b"N" + tup("2", "a", UNCHANGED))
    assert upd.old == ["1", None, None] and upd.old_is_key
    assert upd.new == ["2", "a", UNCHANGED]
    plain = decode(b"U" + struct.pack(">I", 7) + b"N" + tup("1", "b", "c"))
    assert plain.old is None
    dele = decode(b"D" + struct.pack(">I", 7) + b"O" + tup("1", "b", "c"))
    assert dele.kind == "D" and not dele.old_is_key and dele.new is None


def test_truncate_and_unicode():
    t = decode(b"T" + struct.pack(">ib", 2, 1) + struct.pack(">II", 5, 6))
    assert t == Truncate([5, 6], True, False)
    ins = decode(b"I" + struct.pack(">I", 1) + b"N" + tup("naïve ✓"))
    assert ins.new == ["naïve ✓"]


def test_unknown_message_is_an_error():
    with pytest.raises(ValueError):
        decode(b"Z")


def test_lsn_text_roundtrip():
    assert lsn_to_int("16/B374D848") == (0x16 << 32) | 0xB374D848
    assert lsn_to_str(lsn_to_int("0/1A2B")) == "0/1A2B"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{}", []),
        ("{a,b}", ["a", "b"]),
        ('{"b c",NULL,"NULL",""}', ["b c", None, "NULL", ""]),
        ('{"quo\\"te","back\\\\slash",x}', ['quo"te', "back\\slash", "x"]),
        ("{1,2,3}", ["1", "2", "3"]),
    ],
)
def test_parse_pg_array(text, expected):
    assert parse_pg_array(text) == expected


@pytest.mark.parametrize("text", ["{{1,2},{3,4}}", "[1:2]={1,2}", "{a,b"])
def test_parse_pg_array_rejects_what_it_cannot_represent(text):
    with pytest.raises(ValueError):
        parse_pg_array(text)


@pytest.mark.parametrize(
    ("pg", "lake"),
    [
        ("bigint", "bigint"),
        ("integer", "int"),
        ("smallint", "int"),
        ("text", "string"),
        ("character varying(20)", "string"),
        ("boolean", "boolean"),
        ("numeric(12,4)", "decimal(12,4)"),
        ("numeric", "decimal(38,18)"),
        ("numeric(50,2)", None),
        ("timestamp with time zone", "timestamp"),
        ("timestamp(3) with time zone", "timestamp"),
        ("timestamp without time zone", "timestamp_ntz"),
        ("date", "date"),
        ("jsonb", "string"),
        ("uuid", "string"),
        ("text[]", "array<string>"),
        ("integer[]", "array<int>"),
        ("bytea", "binary"),
        ("point", None),
        ("tsvector", None),
    ],
)
def test_lake_types(pg, lake):
    assert lake_type(pg) == lake


def test_enum_is_a_string():
    assert lake_type("mood", "e") == "string"
