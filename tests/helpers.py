"""Helpers for integration tests: read a source exactly, compare it with the lake, tamper with landing."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path

import psycopg2
import pyarrow as pa
import pyarrow.parquet as pq
from cdc_lakehouse.columns import SHARD_COL
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.identifiers import pg_qualified
from cdc_lakehouse.lake.casts import cast_text
from cdc_lakehouse.lake.tables import source_columns_of
from cdc_lakehouse.source.catalog import describe_table, text_select
from cdc_lakehouse.source.session import SESSION_OPTIONS
from cdc_lakehouse.views.latest import latest_rows
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual


def source_df(spark, cfg: TableConfig, dsn: str, columns: list[tuple[str, str]]):
    """Every row of every shard, as the lake should hold it (text from PostgreSQL, typed like the lake)."""
    rows = []
    conn = psycopg2.connect(dsn, options=SESSION_OPTIONS)
    try:
        with conn.cursor() as cur:
            for _, schema, shard in cfg.shards():
                info = describe_table(cur, schema, cfg.source.table)
                pg_types = {c.name: c.pg_type for c in info.columns}
                sel = ", ".join(text_select(c, pg_types.get(c, ""), t) for c, t in columns)
                cur.execute(f"SELECT {sel} FROM {pg_qualified(schema, cfg.source.table)}")
                rows += [(shard, *r) for r in cur.fetchall()]
    finally:
        conn.close()
    schema = f"{SHARD_COL} string, " + ", ".join(f"`{c}` string" for c, _ in columns)
    df = spark.createDataFrame(rows, schema)
    return df.select(SHARD_COL, *[cast_text(F.col(c), t).alias(c) for c, t in columns])


def assert_lake_equals_source(
    spark, lake, cfg: TableConfig, dsn: str, *, check_changelog: bool = True, skip: tuple[str, ...] = ()
) -> int:
    """Every row and column of the lake equals the source's (`skip`: lake columns the source dropped)."""
    cur = lake.qualified(cfg.current_table)
    # Another application (a cluster job, an Airflow task) may have committed: Iceberg's catalog
    # cache would otherwise serve this session's older snapshot of either table until it expires
    # 30 s after its last use, so the comparison would pass or fail with the job's duration.
    for table in (cur, lake.qualified(cfg.changelog_table)) if check_changelog else (cur,):
        spark.sql(f"REFRESH TABLE {table}")
    cols = [(c, t) for c, t in source_columns_of(spark, cur, cfg) if c not in skip]
    expected = source_df(spark, cfg, dsn, cols)
    actual = spark.table(cur)
    if cfg.deletes == "soft":
        actual = actual.filter(~F.col(cfg.soft_delete_columns.flag))
    actual = actual.select(SHARD_COL, *[c for c, _ in cols])
    assertDataFrameEqual(actual, expected)
    if check_changelog:
        latest = latest_rows(spark, lake, cfg).select(SHARD_COL, *[c for c, _ in cols])
        assertDataFrameEqual(latest, expected)
    return expected.count()


def landing_root(lake) -> Path:
    return Path(lake.landing_uri.removeprefix("file://"))


def _manifest_file(lake, endpoint: str, run_id: str) -> Path:
    return landing_root(lake) / endpoint / "_manifests" / f"{run_id}.json"


def _update_manifest(lake, endpoint, run_id, fn):
    p = _manifest_file(lake, endpoint, run_id)
    m = json.loads(p.read_text())
    fn(m)
    p.write_text(json.dumps(m))


def duplicate_file(lake, endpoint: str, run_id: str, table: str) -> None:
    """At-least-once delivery: the same events twice in one run."""

    def fn(m):
        entry = next(e for e in m["tables"] if e["table"] == table)
        f = entry["files"][0]
        d = landing_root(lake) / entry["dir"]
        shutil.copy(d / f["name"], d / ("dup-" + f["name"]))
        entry["files"] = list(reversed(entry["files"] + [{**f, "name": "dup-" + f["name"]}]))  # out of order too

    _update_manifest(lake, endpoint, run_id, fn)


def pg_text(value):
    """A typed landing value as PostgreSQL printed it (what format 1 held): tests that read the
    landing files compare the text the source sent, whichever format carried it."""
    import datetime as dt
    import math
    from decimal import Decimal

    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "t" if value else "f"
    if isinstance(value, int | Decimal):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
        return repr(value)
    if isinstance(value, bytes):
        return "\\x" + value.hex()
    if isinstance(value, dt.datetime):
        text = value.strftime("%Y-%m-%d %H:%M:%S") + (
            f".{value.microsecond:06d}".rstrip("0") if value.microsecond else ""
        )
        return text + ("+00" if value.tzinfo is not None else "")
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, list):
        return json.dumps([pg_text(v) for v in value], separators=(",", ":"))
    raise TypeError(f"no text for {value!r}")


def landed_rows(source) -> list[dict]:
    """The events of a landing file (a path or a file object) in format 1's shape whatever format
    it is in: images as (column, text) pairs; a typed image's value as PostgreSQL printed it
    (pg_text; the text kept at capture for a value that did not fit), its unchanged TOAST columns
    absent, and an old image's columns the source did not send (key-only) absent."""
    t = pq.read_table(source)
    rows = t.to_pylist()
    if "after_raw" not in t.schema.names:
        return rows
    for r in rows:
        for image in ("before", "after"):
            values, raw = r[image], dict(r.pop(image + "_raw") or [])
            if values is None:
                continue
            skip = set(r["unavailable"] or [])
            pairs = [(k, raw.get(k, pg_text(v))) for k, v in values.items() if k not in skip]
            r[image] = [(k, v) for k, v in pairs if v is not None] if image == "before" else pairs
    return rows


def append_malformed(lake, endpoint: str, run_id: str, table: str, rows: list[dict]) -> None:
    """Malformed events written into a run (as a broken producer would): rows built from a real event."""

    def fn(m):
        entry = next(e for e in m["tables"] if e["table"] == table)
        f = entry["files"][0]
        path = landing_root(lake) / entry["dir"] / f["name"]
        t = pq.read_table(path)
        base = t.slice(0, 1).to_pylist()[0]
        extra = []
        for i, r in enumerate(rows):
            ev = copy.deepcopy(base)
            ev["source"]["seq"] = 900_000 + i
            for k, v in r.items():
                if k == "source":
                    ev["source"].update(v)
                elif f.get("columns") and k in ("before", "after"):
                    ev[k], ev[k + "_raw"] = _typed_image(v, dict(f["columns"]))
                else:
                    ev[k] = v
            extra.append(ev)
        new = pa.concat_tables([t, pa.Table.from_pylist(extra, schema=t.schema)])
        pq.write_table(new, path)
        f["rows"] = new.num_rows
        f["bytes"] = path.stat().st_size

    _update_manifest(lake, endpoint, run_id, fn)


def as_text_run(lake, endpoint: str, run_id: str) -> None:
    """Rewrite a captured run as the capture wrote it before typed landing (format 1: images as
    maps of PostgreSQL text, no columns per file): a run in flight across the upgrade."""
    from cdc_lakehouse.landing.format import TEXT_FORMAT, landing_arrow_schema

    def fn(m):
        m["format"] = TEXT_FORMAT
        for entry in m["tables"]:
            for f in entry["files"]:
                path = landing_root(lake) / entry["dir"] / f["name"]
                pq.write_table(pa.Table.from_pylist(landed_rows(path), schema=landing_arrow_schema()), path)
                f.pop("columns", None)
                f["bytes"] = path.stat().st_size

    _update_manifest(lake, endpoint, run_id, fn)


def _typed_image(pairs, types: dict[str, str]):
    """(column, text) pairs as a typed landing image and its kept text, as the capture lands them
    (landing.values): a text that does not fit its column's type is kept as text."""
    from cdc_lakehouse.landing.values import typed_column

    if pairs is None:
        return None, None
    image, raw = dict.fromkeys(types), []
    for k, text in pairs:
        if k in types:
            arr, misfits = typed_column([text], types[k])
            image[k] = arr[0].as_py()
            raw += [(k, text)] if misfits else []
    return image, raw or None


def init_airflow_home(env: dict[str, str]) -> None:
    """scripts/airflow_init.sh in the given environment: database migrated, pools, DAGs parsed."""
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(
        ["bash", str(root / "scripts" / "airflow_init.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def lake_connection_json(pg, lake, password: str | None = None) -> str:
    """AIRFLOW_CONN_CDC_LAKE for `lake`: its JDBC catalog in the session's PostgreSQL."""
    extra = {
        "catalog_type": "jdbc",
        "catalog_name": lake.catalog_name,
        "warehouse": lake.warehouse,
        "landing_uri": lake.landing_uri,
    }
    if lake.landing_conn_id:
        extra["landing_conn_id"] = lake.landing_conn_id
    conn = {
        "conn_type": "generic",
        "host": "127.0.0.1",
        "port": pg.port,
        "schema": "lake_catalog",
        "login": "postgres",
        "extra": extra,
    }
    if password:
        conn["password"] = password
    return json.dumps(conn)


def suite_spark_session(lake, url: str):
    """A session of the suite's Spark Connect server with `lake`'s catalog: unit tests (a Hadoop
    catalog, no PostgreSQL) and integration tests (a JDBC catalog) each get their own session of
    the one server."""
    from cdc_lakehouse.runtime.session import get_spark

    return get_spark("cdc-tests", lake, remote=url, extra={"spark.sql.shuffle.partitions": "4"})
