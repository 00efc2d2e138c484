"""Pure logic of the chunked bootstrap: keyset chunk statements, watermark messages as pgoutput
sends them, progress bookkeeping and the config fields."""

from __future__ import annotations

import struct

import pyarrow as pa
import pytest
from cdc_lakehouse.bootstrap.chunks import ChunkRead, chunk_query
from cdc_lakehouse.bootstrap.progress import ShardProgress
from cdc_lakehouse.capture.stream import parse_logical_message
from cdc_lakehouse.source.markers import MARKER_PREFIX

from tests.conftest import make_config


def _q(key=("tenant", "n"), limit=7, types=None):
    cols = [("tenant", "string"), ("n", "int"), ("body", "string")]
    return chunk_query("s0", "doc", cols, types or {}, list(key), limit)


def test_first_chunk_has_no_predicate_and_orders_by_the_full_key():
    sql, params = _q().sql(None)
    assert params == ()
    assert 'FROM "s0"."doc" ORDER BY "tenant", "n" LIMIT 7' in sql
    assert sql.startswith("COPY (SELECT ") and sql.endswith(") TO STDOUT WITH (FORMAT csv)")
    assert "WHERE" not in sql


def test_next_chunk_compares_the_whole_key_as_a_row():
    sql, params = _q().sql(["a b", "3"])
    assert 'WHERE ("tenant", "n") > (%s, %s) ORDER BY "tenant", "n" LIMIT 7' in sql
    assert params == ("a b", "3")


def test_chunks_stop_at_the_shards_last_key_when_it_started():
    q = _q()
    sql, params = q.sql(None, ["z", "9"])
    assert 'WHERE ("tenant", "n") <= (%s, %s) ORDER BY' in sql and params == ("z", "9")
    sql, params = q.sql(["a", "1"], ["z", "9"])
    assert '("tenant", "n") > (%s, %s) AND ("tenant", "n") <= (%s, %s)' in sql
    assert params == ("a", "1", "z", "9")
    assert q.last_key_sql() == (
        'SELECT "tenant"::text AS "tenant", "n"::text AS "n" FROM "s0"."doc" ORDER BY "tenant" DESC, "n" DESC LIMIT 1'
    )


def test_percent_signs_are_escaped_only_when_parameters_follow():
    # character(n) columns are printed with format('%s', ...): not a placeholder.
    q = _q(types={"body": "character(4)"})
    first, _ = q.sql(None)
    later, _ = q.sql(["x", "1"])
    assert "format('%s'" in first
    assert "format('%%s'" in later and later.count("%s") == 2 + later.count("%%s")


def test_resume_key_must_match_the_key_columns():
    with pytest.raises(ValueError, match="does not match the key columns"):
        _q().sql(["only-one"])


def test_key_columns_must_be_read():
    with pytest.raises(ValueError, match=r"key column\(s\) \['missing'\]"):
        chunk_query("s0", "doc", [("n", "int")], {}, ["missing"], 10)


def test_logical_message_as_pgoutput_sends_it():
    content = b'{"chunk":3,"mark":"low"}'
    buf = b"M" + bytes([1]) + struct.pack(">Q", 0x1_0000_00A0) + MARKER_PREFIX.encode() + b"\0"
    buf += struct.pack(">I", len(content)) + content + b"trailing"
    assert parse_logical_message(buf) == (0x1_0000_00A0, MARKER_PREFIX, content)


def _chunk(no, rows, last):
    return ChunkRead("s0", no, 10 * no, 10 * no + 5, pa.table({"id": [str(i) for i in range(rows)]}), last, 0.01, 0.1)


def test_progress_ends_at_the_first_short_chunk():
    st = ShardProgress("t", "s0", "r1")
    st.advance(_chunk(0, 5, ["4"]), 5)
    assert (st.chunk, st.last_key, st.rows_total, st.done) == (0, ["4"], 5, False)
    st.advance(_chunk(1, 0, None), 5)
    assert (st.chunk, st.last_key, st.rows_total, st.done, st.chunks_done) == (1, ["4"], 5, True, 2)


def test_config_mode_defaults_to_auto_and_rejects_unknown_modes():
    cfg = make_config("cfg_chunk", ["s0"])
    assert cfg.bootstrap.mode == "auto" and cfg.bootstrap.chunk_rows == 50_000
    from cdc_lakehouse.config import parse_table_config

    _, errors = parse_table_config(
        {
            "name": "x",
            "source": {"table": "t", "shards": [{"conn_id": "c", "schemas": ["s"]}]},
            "primary_key": ["id"],
            "bootstrap": {"mode": "online"},
        },
        "x.yaml",
    )
    assert errors and errors[0].field == "bootstrap.mode"


def test_a_rounds_key_range_is_literals_only_and_bounds_what_it_can():
    """The MERGE's target-side range (lake.merge.within_keys): values travel as hex or integers,
    whatever they hold; a key column of a type without an exact literal is left unbounded."""
    from cdc_lakehouse.lake.merge import KeyRange, merge_sql, range_kind, within_keys

    evil = "x') OR true OR ('"
    w = within_keys(
        {
            "s1": [KeyRange("tenant", "string", "", evil), KeyRange("n", "int", -3, 7)],
            "s0": [
                KeyRange("at", "timestamp", -1, 5),
                KeyRange("d", "date", 0, 1),
                KeyRange("m", "decimal(5,2)", "-1.50", "2.00"),
            ],
        }
    )
    assert w is not None and evil not in w and f"BETWEEN CAST(X'' AS STRING) AND CAST(X'{evil.encode().hex()}'" in w
    assert w.index("X'7330'") < w.index("X'7331'"), "shards in a stable order"
    assert "t.`n` BETWEEN CAST(-3 AS int) AND CAST(7 AS int)" in w
    assert "timestamp_micros(-1) AND timestamp_micros(5)" in w and "date_from_unix_date(0)" in w
    assert f"CAST(CAST(X'{b'-1.50'.hex()}' AS STRING) AS decimal(5,2))" in w
    assert within_keys({}) is None
    assert [range_kind(t) for t in ("double", "binary", "timestamp_ntz", "boolean")] == [None] * 4
    cfg = make_config("cfg_within", ["s0"], primary_key=["tenant", "n"])
    sql = merge_sql(cfg, "lake.db.t", "v", ["tenant", "n"], [], w)
    assert f"ON t.`_cdc_shard` = s.`_cdc_shard` AND t.`tenant` = s.`tenant` AND t.`n` = s.`n` AND ({w}) WHEN" in sql
    assert "AND (" not in merge_sql(cfg, "lake.db.t", "v", ["tenant", "n"], []).split("WHEN")[0]
    with pytest.raises(ValueError, match="truncated"):
        merge_sql(cfg, "lake.db.t", "v", ["tenant", "n"], ["s0"], w)
