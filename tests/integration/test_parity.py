"""One row, one value, whichever path it came by, and an audit that agrees (issue 22).

Edge values of every supported type go through the snapshot (bootstrap) and through the stream
(capture + ingest). Then: the lake equals the source exactly; PostgreSQL's and Spark's canonical
text of every value are equal, column by column; the audit (full and checksum) finds nothing.
Values the lake cannot hold are quarantined at ingest, and the audit still ends with a verdict.
"""

from __future__ import annotations

import psycopg2
import pytest
from cdc_lakehouse.audit.audit_table import audit_table
from cdc_lakehouse.audit.hashing import pg_canonical, spark_canonical
from cdc_lakehouse.bootstrap.bootstrap_table import bootstrap_table
from cdc_lakehouse.capture.capture_run import capture_run
from cdc_lakehouse.identifiers import pg_qualified
from cdc_lakehouse.ingest.ingest_table import ingest_table
from cdc_lakehouse.lake.tables import source_columns_of
from cdc_lakehouse.landing.stores import LocalLanding
from cdc_lakehouse.source.catalog import EndpointTables, describe_table
from cdc_lakehouse.source.session import SESSION_OPTIONS
from pyspark.sql import functions as F

from tests.conftest import make_config
from tests.helpers import assert_lake_equals_source, source_df

# column -> (type, edge values as SQL literals). Row i takes value i % len(values) of each column.
COLUMNS: dict[str, tuple[str, list[str]]] = {
    "i2": ("smallint", ["0", "-32768", "32767", "NULL"]),
    "i4": ("integer", ["0", "-2147483648", "2147483647"]),
    "i8": ("bigint", ["0", "-9223372036854775808", "9223372036854775807"]),
    "b": ("boolean", ["true", "false", "NULL"]),
    "f4": (
        "real",
        [
            "0",
            "'-0'",
            "0.1",
            "3.4028235e38",
            "1e-45",
            "'NaN'",
            "'Infinity'",
            "'-Infinity'",
            "1.17549435e-38",
            "16777217",
            "NULL",
        ],
    ),
    "f8": (
        "double precision",
        [
            "0",
            "'-0'",
            "0.1",
            "1e300",
            "1.7976931348623157e308",
            "5e-324",
            "'NaN'",
            "'Infinity'",
            "'-Infinity'",
            "1/3.0",
            "123456789012345678",
            "1e-7",
            "100",
            "125000000000000.125",
            "'NaN'::float8 * 0 - 'Infinity'::float8 + 'Infinity'",
        ],
    ),
    "n": (
        "numeric",
        [
            "0",
            "0.000000000000000001",
            "-0.5",
            "12345678901234567890.123456789012345678",
            "-99999999999999999999.999999999999999999",
            "100",
            "1.10",
            "0.000000000000000000",
            "NULL",
        ],
    ),
    "n12": ("numeric(12,2)", ["0", "-0.01", "9999999999.99", "1.5"]),
    "n38": ("numeric(38,10)", ["1234567890123456789012345678.0123456789", "-0.0000000001", "0"]),
    "t": ("text", ["''", "' '", "'a''b'", "E'tab\\tnl\\n'", "E'back\\\\slash'", "'日本語'", "'🙂 x'", "'NULL'"]),
    "vc": ("varchar(10)", ["'abc'", "''"]),
    "ch": ("char(5)", ["'ab'", "''", "'abcde'", "' a'", "NULL"]),
    "u": ("uuid", ["'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'"]),
    "j": ("json", ["'{ \"a\" : 1 }'", "'[]'", "'null'"]),
    "jb": ("jsonb", ['\'{"b": 1, "a": [1, 2.50]}\'', "'\"s\"'", "'{}'"]),
    "ip": ("inet", ["'192.168.0.1/24'", "'::1'"]),
    "iv": ("interval", ["'1 day 02:03:04.5'", "'-1 mon'", "'0'"]),
    "tm": ("time", ["'00:00'", "'23:59:59.999999'", "'24:00'"]),
    "tz": ("timetz", ["'12:00+05:30'"]),
    "d": ("date", ["'1970-01-01'", "'0001-01-01'", "'9999-12-31'", "'2000-02-29'"]),
    "ts": (
        "timestamp",
        [
            "'1970-01-01 00:00:00'",
            "'0001-01-01 00:00:00'",
            "'9999-12-31 23:59:59.999999'",
            "'2000-01-01 00:00:00.000001'",
        ],
    ),
    "tstz": (
        "timestamptz",
        [
            "'1970-01-01 00:00:00+00'",
            "'2024-06-01 12:00:00+05:30'",
            "'9999-12-31 23:59:59.999999+00'",
            "'1969-12-31 23:59:59.999999+00'",
        ],
    ),
    "by": ("bytea", ["'\\x00ff'", "'\\x'", "'\\x5c'"]),
    "e": ("mood", ["'happy'", "'sad'"]),
    "a_i": ("int[]", ["'{}'", "'{NULL}'", "'{1,NULL,3}'", "'{-2147483648}'", "NULL"]),
    "a_t": ("text[]", ["ARRAY['a,b', 'c\"d', '', E'x\\\\y']", "'{NULL,\"NULL\"}'", "'{}'"]),
    "a_n": ("numeric[]", ["'{1.50,2,NULL}'", "'{0.000000000000000001}'", "'{}'"]),
    "a_ts": ("timestamptz[]", ['\'{"2024-01-01 00:00:00+00","1970-01-01 00:00:00.000001+00",NULL}\'']),
    "a_jb": ("jsonb[]", ["ARRAY['{\"a\": 1}'::jsonb, '[1, 2]', NULL]", "'{}'"]),
    "a_ch": ("char(3)[]", ['\'{"a","ab ",NULL}\'']),
    "a_f8": ("float8[]", ["'{0.1,NaN,-0,1e300,Infinity,5e-324}'"]),
    "a_b": ("bool[]", ["'{t,f,NULL}'"]),
    "a_d": ("date[]", ["'{1970-01-01,9999-12-31}'"]),
}
ROWS = max(len(v) for _, v in COLUMNS.values())


def insert_rows(cur, first_id: int, shift: int = 0) -> None:
    names = ", ".join(COLUMNS)
    for i in range(ROWS):
        vals = ", ".join(v[(i + shift) % len(v)] for _, v in COLUMNS.values())
        cur.execute(f"INSERT INTO public.edge (id, {names}) VALUES ({first_id + i}, {vals})")
    cur.execute(f"INSERT INTO public.edge (id) VALUES ({first_id + ROWS})")  # every column NULL


@pytest.fixture
def edge_db(pg, source_uri, unique):
    db = f"par_{unique}"
    pg.execute(f"CREATE DATABASE {db}")
    conn = psycopg2.connect(pg.dsn(db))
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("CREATE TYPE mood AS ENUM ('happy', 'sad')")
        cols = ", ".join(f"{c} {t}" for c, (t, _) in COLUMNS.items())
        cur.execute(f"CREATE TABLE public.edge (id bigint PRIMARY KEY, {cols})")
    yield db, conn
    conn.close()
    for (slot,) in pg.execute(f"SELECT slot_name FROM pg_replication_slots WHERE database = '{db}'"):
        pg.execute(f"SELECT pg_drop_replication_slot('{slot}')")
    pg.execute(f"DROP DATABASE {db} WITH (FORCE)")


def column_diffs(spark, lake, cfg, dsn) -> list[str]:
    """Lake values that differ from the source's (read as the lake should hold them), per column."""
    cols = source_columns_of(spark, lake.qualified(cfg.current_table), cfg)
    expected = source_df(spark, cfg, dsn, cols).select(*[F.col(c).alias(f"s_{c}") for c, _ in cols])
    actual = spark.table(lake.qualified(cfg.current_table)).select(*[F.col(c).alias(f"l_{c}") for c, _ in cols])
    j = expected.join(actual, F.col("s_id") == F.col("l_id"), "full_outer")
    out = []
    for c, _ in cols:
        bad = (
            j.filter(~F.col(f"s_{c}").eqNullSafe(F.col(f"l_{c}"))).select("s_id", f"s_{c}", f"l_{c}").limit(3).collect()
        )
        out += [f"{c}: id {r[0]} source {r[1]!r} lake {r[2]!r}" for r in bad]
    return out


def canonical_diffs(spark, lake, cfg, dsn) -> list[str]:
    """(id, column) pairs whose canonical text differs between PostgreSQL and the lake."""
    cols = [(c, t) for c, t in source_columns_of(spark, lake.qualified(cfg.current_table), cfg) if c != "id"]
    with psycopg2.connect(dsn, options=SESSION_OPTIONS) as conn, conn.cursor() as cur:
        info = describe_table(cur, "public", "edge")
        pg_types = {c.name: c.pg_type for c in info.columns}
        sel = ", ".join(pg_canonical(c, t, pg_types[c]) for c, t in cols)
        cur.execute(f"SELECT id, {sel} FROM {pg_qualified('public', 'edge')}")
        source = {r[0]: r[1:] for r in cur.fetchall()}
    rows = (
        spark.table(lake.qualified(cfg.current_table))
        .select("id", *[spark_canonical(F.col(c), t).alias(c) for c, t in cols])
        .collect()
    )
    lake_rows = {r["id"]: tuple(r[1:]) for r in rows}
    assert set(source) == set(lake_rows)
    return [
        f"id {i} {c} ({t}): postgres {s!r} spark {k!r}"
        for i in sorted(source)
        for (c, t), s, k in zip(cols, source[i], lake_rows[i])
        if s != k
    ]


def test_every_type_same_value_through_snapshot_and_stream_and_the_audit_agrees(pg, spark, lake, edge_db):
    db, conn = edge_db
    dsn = pg.dsn(db)
    cfg = make_config(
        f"edge_{db[4:]}",
        [],
        source={"table": "edge", "shards": [{"conn_id": "cdc_test_source", "database": db, "schemas": ["public"]}]},
        ingest={"error_budget": {"max_fraction": 1.0, "max_quarantined": 1000}},
    )
    endpoint = cfg.source.shards[0].endpoint_id
    ep = EndpointTables(endpoint, "cdc_test_source", {"edge": (["public"], ["id"])})
    store = LocalLanding(lake.landing_uri)
    with conn.cursor() as cur:
        insert_rows(cur, 1)  # through the snapshot
    capture_run(ep, dsn, store, "20260101T000000Z")
    bootstrap_table(spark, lake, cfg, run_id="edge", all_endpoint_tables={endpoint: ep.tables})
    with conn.cursor() as cur:
        insert_rows(cur, 1001)  # through the stream, the same values
        insert_rows(cur, 2001, shift=1)
        cur.execute("UPDATE public.edge SET f8 = 'NaN', a_f8 = '{-0}', ch = 'z' WHERE id = 2")
    m = capture_run(ep, dsn, store, "20260101T010000Z")
    r = ingest_table(spark, lake, cfg, upto_run=m.manifest.run_id, ingest_run="edge1")
    assert r.metrics.quarantined == 0, r
    assert column_diffs(spark, lake, cfg, dsn) == []
    assert_lake_equals_source(spark, lake, cfg, dsn)
    assert canonical_diffs(spark, lake, cfg, dsn) == []
    for mode in ("full", "checksum"):
        a = audit_table(spark, lake, cfg, audit_run=f"edge-{mode}", mode=mode)
        assert a.verdict == "ok", a

    # Values the lake cannot hold: quarantined at ingest; the audit still ends with a verdict.
    with conn.cursor() as cur:
        cur.execute(
            "INSERT INTO public.edge (id, n, ts, d) VALUES (9001, 'NaN', 'infinity', '-infinity'), "
            "(9002, 1e30, '2000-01-01', '2000-01-01')"
        )
    m = capture_run(ep, dsn, store, "20260101T020000Z")
    r = ingest_table(spark, lake, cfg, upto_run=m.manifest.run_id, ingest_run="edge2")
    assert r.metrics.quarantined == 2, r
    a = audit_table(spark, lake, cfg, audit_run="edge-unholdable", mode="full")
    assert sum(st.get("missing", 0) for st in a.shards.values()) == 2, a
    assert sum(a.quarantine_reasons.values()) == 2 and all("does not fit" in r for r in a.quarantine_reasons), a
