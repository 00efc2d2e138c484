"""The typed snapshot read (issue #56) decides "fits the lake type" on the PostgreSQL side exactly
as the text casts decide it in Spark (lake.casts.cast_text), and hands over the same values.

For every type the typed select list reads natively, edge values on both sides of each bound
(NaN, +-Infinity, +-infinity, BC, five-digit years, numerics wider or finer than the lake's
decimal) go through both: PostgreSQL's `_cdc_misfit` must name exactly the values cast_text turns
into NULL, with typed_rows' message; the values that fit must bootstrap, through both readers, to
exactly what cast_text makes of their text; and a misfit stops a bootstrap with its raw text.
"""

from __future__ import annotations

import psycopg2
import pytest
from cdc_lakehouse.audit.hashing import spark_canonical
from cdc_lakehouse.bootstrap.bootstrap_table import bootstrap_table
from cdc_lakehouse.bootstrap.typed_select import MISFIT_COL, typed_select
from cdc_lakehouse.lake.casts import cast_text
from cdc_lakehouse.source.catalog import describe_table, text_select
from cdc_lakehouse.source.session import SESSION_OPTIONS
from pyspark.sql import functions as F

from tests.conftest import make_config

# column -> (PostgreSQL type, lake type (column_types when it is not the natural one), values).
CASES: dict[str, tuple[str, str, list[str]]] = {
    "n": (
        "numeric",
        "decimal(38,18)",
        [
            "0",
            "'NaN'",
            "'Infinity'",
            "'-Infinity'",
            "1e30",
            "1e20",
            "-99999999999999999999.999999999999999999",
            "0.0000000000000000001",
            "0.1000000000000000000000",
            "1.10",
            "-0.000000000000000001",
        ],
    ),
    "n12": ("numeric(12,2)", "decimal(12,2)", ["'NaN'", "9999999999.99", "-0.01", "0"]),
    "nn": ("numeric(14,4)", "decimal(10,2)", ["12345678.99", "123456789.5", "1.005", "1.0000", "-99999999.99"]),
    "n5": ("numeric(5,5)", "decimal(5,5)", ["0.12345", "-0.5", "0"]),
    "n38": ("numeric(38,10)", "decimal(38,10)", ["1234567890123456789012345678.0123456789", "'NaN'"]),
    "d": (
        "date",
        "date",
        ["'infinity'", "'-infinity'", "'0044-03-15 BC'", "'0001-01-01'", "'9999-12-31'", "'10000-01-01'"],
    ),
    "tz": (
        "timestamptz",
        "timestamp",
        [
            "'infinity'",
            "'-infinity'",
            "'0001-01-01 00:00:00+00'",
            "'0001-01-01 00:30:00+01'",
            "'9999-12-31 23:59:59.999999+00'",
            "'9999-12-31 23:30:00-01'",
            "'0044-03-15 12:00:00+00 BC'",
            "'2024-06-01 12:00:00.123456+05:30'",
        ],
    ),
    "ts": (
        "timestamp",
        "timestamp_ntz",
        [
            "'infinity'",
            "'-infinity'",
            "'0001-01-01 00:00:00'",
            "'9999-12-31 23:59:59.999999'",
            "'10000-01-01 00:00:00'",
            "'0044-03-15 12:00:00 BC'",
        ],
    ),
    "ts3": ("timestamp(3) with time zone", "timestamp", ["'2024-01-01 00:00:00.123+00'", "'infinity'"]),
    "i2": ("smallint", "int", ["-32768", "32767"]),
    "f4": ("real", "float", ["'NaN'", "'-0'", "1e-45", "'-Infinity'", "3.4028235e38"]),
    "f8": ("double precision", "double", ["'NaN'", "'-0'", "5e-324", "'Infinity'", "0.1"]),
    "by": ("bytea", "binary", ["'\\x'", "'\\x00ff5c'"]),
    "b": ("boolean", "boolean", ["true", "false"]),
    "a": ("int[]", "array<int>", ["'{1,NULL}'"]),  # read as text, cast as before
}
ROWS = max(len(v) for _, _, v in CASES.values())


@pytest.fixture
def fit_db(pg, source_uri, unique):
    db = f"fit_{unique}"
    pg.execute(f"CREATE DATABASE {db}")
    conn = psycopg2.connect(pg.dsn(db))
    conn.autocommit = True
    with conn.cursor() as cur:
        cols = ", ".join(f"{c} {t}" for c, (t, _, _) in CASES.items())
        cur.execute(f"CREATE TABLE public.fit (id bigint PRIMARY KEY, {cols})")
        for i in range(ROWS):
            vals = ", ".join(v[i] if i < len(v) else "NULL" for _, _, v in CASES.values())
            cur.execute(f"INSERT INTO public.fit (id, {', '.join(CASES)}) VALUES ({i}, {vals})")
    yield db, conn
    conn.close()
    for (slot,) in pg.execute(f"SELECT slot_name FROM pg_replication_slots WHERE database = '{db}'"):
        pg.execute(f"SELECT pg_drop_replication_slot('{slot}')")
    pg.execute(f"DROP DATABASE {db} WITH (FORCE)")


def _config(db: str, name: str, reader: str):
    return make_config(
        name,
        [],
        table="fit",
        source={"table": "fit", "shards": [{"conn_id": "cdc_test_source", "database": db, "schemas": ["public"]}]},
        column_types={"nn": CASES["nn"][1]},  # the others' lake types are their natural ones
        bootstrap={"reader": reader, "mode": "snapshot"},
    )


def _source_side(dsn: str) -> tuple[dict[int, str | None], dict[str, list[tuple[int, str | None]]]]:
    """Per row, PostgreSQL's misfit message; per column, every row's text as the stream prints it."""
    columns = [(c, t) for c, (_, t, _) in CASES.items()]
    with psycopg2.connect(dsn, options=SESSION_OPTIONS) as c, c.cursor() as cur:
        info = describe_table(cur, "public", "fit")
        assert info is not None
        pg_types = {col.name: col.pg_type for col in info.columns}  # format_type(), as preflight has them
        select = typed_select(columns, pg_types)
        texts = ", ".join(f"{text_select(n, pg_types[n], t)} AS t_{n}" for n, t in columns)
        cur.execute(f"SELECT id, {select.select_list()}, {texts} FROM public.fit ORDER BY id")
        names = [d.name for d in cur.description]
        rows = [dict(zip(names, r)) for r in cur.fetchall()]
    misfits = {r["id"]: r[MISFIT_COL] for r in rows}
    return misfits, {c: [(r["id"], r[f"t_{c}"]) for r in rows] for c, _ in columns}


def test_postgres_refuses_exactly_what_the_text_casts_refuse(pg, spark, fit_db):
    db, _ = fit_db
    misfits, texts = _source_side(pg.dsn(db))
    expected: dict[int, list[str]] = {}
    for c, (_, lake_type, _) in CASES.items():
        df = spark.createDataFrame(texts[c], "id bigint, raw string")
        refused = df.filter(F.col("raw").isNotNull() & cast_text(F.col("raw"), lake_type).isNull())
        for i, raw in refused.collect():
            expected.setdefault(i, []).append(f"column {c}: value '{raw[:60]}' does not fit {lake_type}")
    got = {i: m.split("; ") for i, m in misfits.items() if m}
    # Typed natively: every column but the array, which stays text and is checked in Spark.
    assert not any(m.startswith("column a:") for ms in got.values() for m in ms)
    assert got == {i: [m for m in ms if not m.startswith("column a:")] for i, ms in expected.items()}
    # The bounds are met on both sides: these cases have values that fit and values that do not.
    refused_cols = {m.split(":")[0].removeprefix("column ") for ms in got.values() for m in ms}
    assert refused_cols == {"n", "n12", "nn", "n38", "d", "tz", "ts", "ts3"}


@pytest.mark.parametrize("reader", ["copy", "jdbc"])
def test_values_that_fit_bootstrap_as_the_text_casts_make_them(pg, spark, lake, fit_db, reader):
    db, conn = fit_db
    misfits, texts = _source_side(pg.dsn(db))
    bad = sorted(i for i, m in misfits.items() if m)
    cfg = _config(db, f"fit_{reader}_{db[4:]}", reader)
    # A misfit stops the bootstrap with its raw text, before anything is written.
    with pytest.raises(Exception) as exc:
        bootstrap_table(spark, lake, cfg, run_id="fit-stop")
    text = str(exc.value)
    assert f"{cfg.name}: bootstrap stopped, nothing was written: row " in text
    assert "does not fit" in text and "Set column_types in the table config" in text
    for table in (cfg.current_table, cfg.changelog_table):
        assert spark.table(lake.qualified(table)).count() == 0

    with conn.cursor() as cur:
        cur.execute("DELETE FROM public.fit WHERE id = ANY(%s)", (bad,))
    bootstrap_table(spark, lake, cfg, run_id="fit")
    lake_rows = spark.table(lake.qualified(cfg.current_table))
    for c, (_, lake_type, _) in CASES.items():
        want = spark.createDataFrame([(i, t) for i, t in texts[c] if i not in bad], "id bigint, raw string").select(
            "id", spark_canonical(cast_text(F.col("raw"), lake_type), lake_type).alias("v")
        )
        got = lake_rows.select("id", spark_canonical(F.col(c), lake_type).alias("v"))
        assert sorted(got.collect()) == sorted(want.collect()), c
