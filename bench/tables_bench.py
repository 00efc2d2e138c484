"""One hourly run over many small tables: what the grouped ingest costs.

    python bench/tables_bench.py --tables 100 [--rows 200] [--changes 20]

N small tables in two shard schemas of one database, bootstrapped once; each measured round
changes every table, captures once for the endpoint, then times what the hourly group DAG runs
for those tables (spark_jobs/ingest.py in a cold process: JVM start, every table, exit), and,
for comparison, the same tables one Spark application each on a sample of tables.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "plugins"), str(ROOT)]
SHARDS = ["s0", "s1"]
CONN_ID = "bench_tables"


def make_source(db: str, names: list[str], rows: int) -> str:
    """A new database of the tables, in every shard schema, and the bench's connection to it;
    returns its DSN. The endpoint's slot goes first, whichever --tables made it (its name is the
    connection id's)."""
    import psycopg2

    from bench.source_bench import _admin_dsn

    conn = psycopg2.connect(_admin_dsn())
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
            (f"cdc_lakehouse_{CONN_ID}",),
        )
        cur.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        cur.execute(f"CREATE DATABASE {db}")
    conn.close()
    dsn = _admin_dsn(db)
    pw = os.environ.get("CDC_LOCAL_PG_PASSWORD", "")
    port = os.environ.get("CDC_LOCAL_PG_PORT", "55432")
    os.environ[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = f"postgresql://postgres:{pw}@127.0.0.1:{port}/{db}"
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        for s in SHARDS:
            cur.execute(f"CREATE SCHEMA {s}")
            for t in names:
                cur.execute(
                    f"CREATE TABLE {s}.{t} (id bigint PRIMARY KEY, v int NOT NULL, note text, "
                    "updated_at timestamptz NOT NULL DEFAULT now())"
                )
                cur.execute(
                    f"INSERT INTO {s}.{t} (id, v, note) SELECT g, 0, 'row ' || g FROM generate_series(1, %s) g",
                    (rows,),
                )
    return dsn


def grouped_rounds(args, names, ep, dsn, store, job, env) -> tuple[list[dict], dict[int, float]]:
    """Each round: change every table, capture once, run the group's ingest job; returns the
    rounds and the median seconds per --parallel value."""
    import psycopg2
    from cdc_lakehouse.capture.capture_run import capture_run

    n = len(names)
    rounds = []
    # Each repeat times every --parallel value in turn, so the values meet the same machine.
    for r, par in enumerate(x for _ in range(args.repeat) for x in args.parallel):
        conn = psycopg2.connect(dsn)
        conn.autocommit = True
        with conn.cursor() as cur:
            for s in SHARDS:
                for t in names:
                    cur.execute(f"UPDATE {s}.{t} SET v = v + 1, updated_at = now() WHERE id <= %s", (args.changes,))
        conn.close()
        run_id = f"20260101T{r + 1:02d}0000Z"
        t = time.time()
        m = capture_run(ep, dsn, store, run_id).manifest
        cap = time.time() - t
        events = sum(f.rows for e in m.tables for f in e.files)
        t = time.time()
        res = subprocess.run(
            [*job, "--tables", ",".join(names), "--upto-run", run_id, "--parallel", str(par)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        secs = time.time() - t
        if args.job_log:
            Path(f"{args.job_log}.{r + 1}").write_text(res.stderr)
        if res.returncode != 0:
            print(res.stderr[-3000:])
            raise SystemExit(1)
        rounds.append(
            {
                "parallel": par,
                "events": events,
                "capture_seconds": cap,
                "group_ingest_seconds": secs,
                "per_table_seconds": secs / n,
            }
        )
        print(
            f"round {r + 1}: capture {events} events in {cap:.1f}s; grouped ingest of {n} tables in one cold Spark "
            f"application, {par} at once: {secs:.0f}s ({secs / n:.2f}s per table)",
            flush=True,
        )
    by_par = {
        par: statistics.median(x["group_ingest_seconds"] for x in rounds if x["parallel"] == par)
        for par in args.parallel
    }
    return rounds, by_par


def main() -> int:
    import psycopg2
    from cdc_lakehouse.capture.capture_run import capture_run
    from cdc_lakehouse.landing.stores import LocalLanding
    from cdc_lakehouse.source.catalog import EndpointTables

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", type=int, default=100)
    p.add_argument("--rows", type=int, default=200, help="rows per table and shard")
    p.add_argument("--changes", type=int, default=20, help="changed rows per table and shard per round")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--single-sample", type=int, default=3, help="tables timed one Spark application each")
    p.add_argument(
        "--parallel", type=int, nargs="+", default=[1, 4], help="the group run's parallel_tables, each timed"
    )
    p.add_argument("--job-log", type=Path, help="write each grouped round's job log here (<path>.<round>)")
    p.add_argument("--profile", type=Path, help="cProfile the grouped rounds' job into this file (the last round's)")
    args = p.parse_args()
    n = args.tables
    db = f"bench_tables_{n}"
    work = HERE / ".work" / f"tables{n}"
    shutil.rmtree(work, ignore_errors=True)  # the tables are bootstrapped again, the landing captured again
    cfg_dir = work / "configs"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    names = [f"t{i:03d}" for i in range(n)]
    dsn = make_source(db, names, args.rows)
    for t in names:
        (cfg_dir / f"{t}.yaml").write_text(
            yaml.safe_dump(
                {
                    "name": t,
                    "source": {"table": t, "shards": [{"conn_id": CONN_ID, "schemas": SHARDS}]},
                    "primary_key": ["id"],
                    "lake": {"namespace": "bench_many"},
                    "ingest": {"group": "many"},
                }
            )
        )
    lake_env = {"CDC_WAREHOUSE": f"file://{work}/warehouse", "CDC_LANDING_URI": f"file://{work}/landing"}
    os.environ.update(lake_env)
    from cdc_lakehouse.config import load_table_configs
    from cdc_lakehouse.settings import LakeSettings

    cs = load_table_configs(cfg_dir)
    assert not cs.errors, cs.errors
    endpoint = cs.tables[names[0]].source.shards[0].endpoint_id
    ep = EndpointTables(endpoint, CONN_ID, {t: (SHARDS, ["id"]) for t in names})
    store = LocalLanding(f"file://{work}/landing")
    capture_run(ep, dsn, store, "20260101T000000Z")  # slot and publication
    # Bootstrap every table in one Spark application (not what is measured).
    from cdc_lakehouse.bootstrap.bootstrap_table import bootstrap_table
    from cdc_lakehouse.lake.meta import ensure_meta_tables
    from cdc_lakehouse.runtime.session import get_spark

    lake = LakeSettings.from_env()
    forget_namespace(lake, "bench_many")
    spark = get_spark("bench-tables-bootstrap", lake, classic=True)
    ensure_meta_tables(spark, lake)
    t = time.time()
    for name in names:
        bootstrap_table(spark, lake, cs.tables[name], run_id="b", all_endpoint_tables={endpoint: ep.tables})
    print(f"bootstrapped {n} tables in {time.time() - t:.0f}s", flush=True)
    spark.stop()

    env = {**os.environ, "PYTHONPATH": str(ROOT / "plugins"), **lake_env}
    job = [sys.executable, str(ROOT / "spark_jobs" / "ingest.py"), "--config-dir", str(cfg_dir)]
    if args.profile:  # the job's Python side (the driver on a classic session, the client on Connect)
        job[1:1] = ["-m", "cProfile", "-o", str(args.profile)]
    rounds, by_par = grouped_rounds(args, names, ep, dsn, store, job, env)
    for par, secs in by_par.items():
        print(f"{n} tables, {par} at once: median {secs:.0f}s ({secs / n:.2f}s per table)")
    # The alternative: one Spark application per table (sampled, then extrapolated).
    singles = []
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        for s in SHARDS:
            for t in names[: args.single_sample]:
                cur.execute(f"UPDATE {s}.{t} SET v = v + 1 WHERE id <= %s", (args.changes,))
    conn.close()
    run_id = "20260101T200000Z"
    capture_run(ep, dsn, store, run_id)
    for name in names[: args.single_sample]:
        t = time.time()
        res = subprocess.run(
            [*job, "--tables", name, "--upto-run", run_id], env=env, capture_output=True, text=True, check=False
        )
        singles.append(time.time() - t)
        assert res.returncode == 0, res.stderr[-2000:]
    grouped = min(by_par.values())
    single = statistics.median(singles) if singles else None
    if single is not None:
        print(
            f"\n{n} tables: grouped {grouped:.0f}s (one application) vs {single:.1f}s per table alone "
            f"= {single * n:.0f}s for one application per table ({single * n / grouped:.1f}x)"
        )
    from bench.measure import machine

    out = HERE / "results" / f"tables-{n}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "tables": n,
                "rows_per_table": args.rows * len(SHARDS),
                "rounds": rounds,
                "median_grouped_seconds": grouped,
                "median_grouped_seconds_by_parallel": by_par,
                "single_app_seconds": singles,
                "extrapolated_one_app_per_table_seconds": None if single is None else single * n,
                "machine": machine(),
            },
            indent=2,
        )
    )
    print(f"results: {out}")
    return 0


def forget_namespace(lake, namespace: str) -> None:
    """The local stack's catalog database outlives this bench's work folder (and may name the
    files of another checkout's run): its tables of this namespace are forgotten, not loaded."""
    from urllib.parse import urlsplit

    import psycopg2

    if lake.catalog_type != "jdbc":
        return
    u = urlsplit(lake.catalog_uri)
    conn = psycopg2.connect(
        host=u.hostname, port=u.port, dbname=u.path.lstrip("/"), user=u.username, password=lake.catalog_password
    )
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("SELECT to_regclass('iceberg_tables')")
        if cur.fetchone()[0]:
            cur.execute("DELETE FROM iceberg_tables WHERE table_namespace = %s", (namespace,))
    conn.close()


if __name__ == "__main__":
    sys.exit(main())
