"""Other engines reading what we write: one full scan of our current table in Spark, Trino and DuckDB.

    make pg-start && python bench/readers_bench.py --rows 2000000 --changes 200000 [--repeat 5]

The table is the ingest benchmark's (bench/ingest_bench.py): its base rows, then one batch of
changes applied by our ingest (merge-on-read, so the readers apply position deletes). Each engine
runs the same query, the checksum every ingest engine is verified on (rows, sums of id and
version, the content's length), and must return the expected figures:
  spark    the classic session that wrote it (the reads after the first are warm)
  trino    Trino 476 (scripts/fetch_trino.sh), its Iceberg connector on the same JDBC catalog
  duckdb   DuckDB's iceberg_scan of the table's current metadata file
Figures: seconds per repeat, the median of the repeats after the first; the engine's start is
not counted. Results go to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "plugins"), str(ROOT)]
from bench.ingest_bench import WORK, bench_table_config, load_base, prepare  # noqa: E402
from bench.measure import provenance  # noqa: E402

CHECKSUM = "SELECT count(*), sum(id), sum(version), sum(length(content)) FROM {t}"


def timed(run, repeat: int) -> dict:
    secs, got = [], None
    for _ in range(repeat):
        t = time.time()
        got = run()
        secs.append(round(time.time() - t, 3))
    rows, sum_id, sum_version, sum_content = (int(v) for v in got)
    checksum = {"rows": rows, "sum_id": sum_id, "sum_version": sum_version, "sum_content": sum_content}
    return {"seconds": secs, "median_warm": statistics.median(secs[1:] or secs), "checksum": checksum}


def write_table(prep: dict, rows: int):
    """Our current table after one ingest; returns the lake, the table config and Spark's reads."""
    from cdc_lakehouse.config import parse_table_config
    from cdc_lakehouse.ingest.ingest_table import ingest_table
    from cdc_lakehouse.lake.meta import ensure_meta_tables
    from cdc_lakehouse.runtime.session import get_spark
    from cdc_lakehouse.settings import LakeSettings

    lake = LakeSettings.from_env().with_(
        warehouse=f"file://{WORK}/readers-warehouse", landing_uri=f"file://{prep['dir']}/landing"
    )
    spark = get_spark(
        "bench-readers", lake, classic=True, driver_memory=os.environ.get("CDC_BENCH_DRIVER_MEMORY", "8g")
    )
    ensure_meta_tables(spark, lake)
    cfg, errs = parse_table_config(bench_table_config(f"readers_{rows}", "merge-on-read"), "bench")
    assert not errs, errs
    load_base(spark, lake, cfg, prep)
    r = ingest_table(spark, lake, cfg, upto_run=None, ingest_run="bench-readers")
    assert r.metrics.status == "ok", r
    table = lake.qualified(cfg.current_table)
    deletes = spark.table(f"{table}.delete_files").count()
    print(f"  table {table}: {rows} base rows, {deletes} position delete file(s)", flush=True)
    return lake, cfg, spark


def trino_reads(lake, table: str, repeat: int) -> dict:
    from devstack.localstack import LocalTrino

    u = urlsplit(lake.catalog_uri)
    props = {
        "connector.name": "iceberg",
        "iceberg.catalog.type": "jdbc",
        "iceberg.jdbc-catalog.driver-class": "org.postgresql.Driver",
        "iceberg.jdbc-catalog.connection-url": f"jdbc:postgresql://{u.hostname}:{u.port}{u.path}",
        "iceberg.jdbc-catalog.connection-user": u.username or "postgres",
        "iceberg.jdbc-catalog.catalog-name": lake.catalog_name,
        "iceberg.jdbc-catalog.default-warehouse-dir": lake.warehouse,
        "fs.native-local.enabled": "true",
        "local.location": "/",
    }
    secret = {}
    if lake.catalog_password:
        props["iceberg.jdbc-catalog.connection-password"] = "${ENV:CDC_TRINO_CATALOG_PASSWORD}"
        secret["CDC_TRINO_CATALOG_PASSWORD"] = lake.catalog_password
    server = LocalTrino(WORK / "trino", {"lake": props}, secret_env=secret)
    t = time.time()
    server.start()
    print(f"  trino: ready in {time.time() - t:.1f}s", flush=True)
    ns, name = table.split(".")
    try:
        return timed(lambda: server.query(CHECKSUM.format(t=f'lake."{ns}"."{name}"'))[0], repeat)
    finally:
        server.stop()


def duckdb_reads(lake, table: str, repeat: int) -> dict:
    import importlib

    import duckdb
    from pyiceberg.catalog import load_catalog

    metadata = load_catalog(lake.catalog_name, **lake.pyiceberg_properties()).load_table(table).metadata_location
    con = duckdb.connect()
    for ext in ("avro", "iceberg"):
        pkg = Path(importlib.import_module(f"duckdb_extension_{ext}").__file__).parent
        con.load_extension(str(pkg / "extensions" / f"v{duckdb.__version__}" / f"{ext}.duckdb_extension"))
    query = CHECKSUM.format(t=f"iceberg_scan('{metadata.removeprefix('file://')}')")
    return timed(lambda: con.sql(query).fetchone(), repeat)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--changes", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    prep = prepare(args.rows, args.changes)
    lake, cfg, spark = write_table(prep, args.rows)
    table = lake.qualified(cfg.current_table)
    results = {"spark": timed(lambda: spark.sql(CHECKSUM.format(t=table)).collect()[0], args.repeat)}
    spark_version = spark.version
    spark.stop()
    results["trino"] = trino_reads(lake, cfg.current_table, args.repeat)
    results["duckdb"] = duckdb_reads(lake, cfg.current_table, args.repeat)

    print(f"\nfull scan of {args.rows} rows after {args.changes} changes (expected {prep['expected']}):")
    for engine, r in results.items():
        ok = r["checksum"] == prep["expected"]
        print(f"  {engine:7s} median {r['median_warm']:.2f}s  runs {r['seconds']}  verified={ok}")
    out = HERE / "results" / f"readers_{args.rows}.json"
    out.write_text(json.dumps({**provenance(spark_version), "args": vars(args), "results": results}, indent=2))
    print(f"results: {out}")
    return 0 if all(r["checksum"] == prep["expected"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
