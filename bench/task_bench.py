"""What one scheduled task pays, cold: spark-submit, JVM and session start included (issue #16).

    python bench/task_bench.py [--rows 100000] [--changes 19000] [--repeat 3]

The demo's hourly ingest task: a batch of raw change events (the bench workload of
bench/ingest_bench.py, recency-skewed, with TOAST-unchanged values, several changes per key)
into a table of `rows` rows. Each repeat gets its own freshly loaded table (set up beforehand in
one Spark application, not timed), then runs, each in a new process:

  ours         spark_jobs/ingest.py, started with the spark-submit command line the Airflow
               task builds (CdcSparkSubmitOperator: --jars, --py-files, base_conf, driver memory)
  ours-connect the same job file run as the Airflow task runs it on a `spark_connect`
               connection: a new Python process, a client of a Spark Connect server started
               once beforehand (devstack.localstack.LocalSparkConnect; its start is printed, not
               counted), timed from the spawn to the committed line
  spark-merge  a plain Spark MERGE of the already pre-combined batch, started the same way

Timed from the spawn of spark-submit to the line the job prints once its commit is done (the
task's own Airflow start, ~10 s, is not in it), and to the process's exit. Every final table
is checked against the expected state afterwards. Results go to bench/results/task-*.json.
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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "plugins"), str(ROOT)]
from bench.ingest_bench import WORK  # noqa: E402

COMMITTED = "CDC_RESULT "  # what cdc_lakehouse.jobs prints per table once its work is committed


def _lake(prep: dict):
    from cdc_lakehouse.settings import LakeSettings

    return LakeSettings.from_env().with_(
        warehouse=f"file://{WORK}/task-warehouse", landing_uri=f"file://{prep['dir']}/landing"
    )


def _names(rows: int, repeat: int) -> list[tuple[str, str]]:
    """(our table config name, plain MERGE table) per repeat."""
    return [(f"cold_{rows}_{i}", f"bench.cold_plain_{rows}_{i}") for i in range(repeat)]


def _server_names(rows: int, repeat: int) -> list[str]:
    """Our table config name per repeat of the Spark Connect runs."""
    return [f"warm_srv_{rows}_{i}" for i in range(repeat)]


def setup(prep: dict, rows: int, repeat: int, config_dir: Path) -> None:
    """Every repeat's tables, loaded in one Spark application (not timed), and their configs."""
    from cdc_lakehouse.config import parse_table_config
    from cdc_lakehouse.lake.meta import ensure_meta_tables
    from cdc_lakehouse.runtime.session import get_spark

    from bench.ingest_bench import bench_table_config, create_plain_table, load_base

    lake = _lake(prep)
    spark = get_spark("bench-task-setup", lake, classic=True)
    ensure_meta_tables(spark, lake)
    for _, plain in _names(rows, repeat):
        create_plain_table(spark, lake, lake.qualified(plain), prep)
    for name in [n for n, _ in _names(rows, repeat)] + _server_names(rows, repeat):
        doc = bench_table_config(name, "merge-on-read")
        # A directory each: configs that read the same source shards refuse each other.
        (config_dir / name).mkdir(parents=True, exist_ok=True)
        (config_dir / name / "table.yaml").write_text(yaml.safe_dump(doc))
        cfg, errs = parse_table_config(doc, "bench")
        assert not errs, errs
        load_base(spark, lake, cfg, prep)
    spark.stop()


def verify(prep: dict, rows: int, repeat: int) -> dict[str, bool]:
    """Each final table against the expected state (DuckDB's, from the inputs)."""
    from cdc_lakehouse.runtime.session import get_spark

    from bench.ingest_bench import table_checksum

    lake = _lake(prep)
    spark = get_spark("bench-task-verify", lake, classic=True)
    out = {}
    tables = [t for name, plain in _names(rows, repeat) for t in (f"bench.{name}", plain)]
    for table in tables + [f"bench.{n}" for n in _server_names(rows, repeat)]:
        out[table] = table_checksum(spark, lake.qualified(table)) == prep["expected"]
    spark.stop()
    return out


def submit_command(app: Path, args: list[str]) -> list[str]:
    """The spark-submit command line the Airflow task runs (orchestration.spark_backends.SubmitBackend)."""
    from cdc_lakehouse.orchestration.tasks import spark_jars
    from cdc_lakehouse.runtime.packaging import pyfiles_zip
    from cdc_lakehouse.runtime.session import base_conf

    conf = [a for k, v in base_conf().items() for a in ("--conf", f"{k}={v}")]
    jars = ",".join(spark_jars())
    memory = os.environ.get("CDC_SPARK_DRIVER_MEMORY", "4g")
    return [
        str(Path(sys.executable).parent / "spark-submit"),
        "--master",
        "local[*]",
        *conf,
        *(["--jars", jars] if jars else []),
        "--py-files",
        str(pyfiles_zip()),
        "--driver-memory",
        memory,
        "--name",
        f"cdc-{app.stem}",
        str(app),
        *args,
    ]


def timed(cmd: list[str], env: dict[str, str]) -> dict:
    """Seconds from the spawn to the committed line and to the exit; the job's result line."""
    t = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    commit, result, lines = None, None, []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(COMMITTED) and commit is None:
            commit = time.monotonic() - t
            result = json.loads(line.split(" ", 2)[2])
    err = proc.stderr.read()
    proc.wait()
    if proc.returncode != 0 or commit is None:
        out = "".join(lines)[-3000:]
        raise RuntimeError(f"{cmd[-3:]} failed (exit {proc.returncode}):\n{out}\n{err[-3000:]}")
    return {"to_commit": commit, "to_exit": time.monotonic() - t, "result": result}


@contextmanager
def connect_server() -> Iterator[str]:
    """A local Spark Connect server for the Connect runs (its start printed, not timed); its URL."""
    from cdc_lakehouse.runtime.connect_auth import TOKEN_FILE_ENV

    from devstack.localstack import LocalSparkConnect

    server = LocalSparkConnect(WORK / "task-connect", memory=os.environ.get("CDC_SPARK_DRIVER_MEMORY", "4g"))
    t = time.time()
    server.start()
    os.environ[TOKEN_FILE_ENV] = str(server.token_file)  # the job processes send its token
    print(f"Spark Connect server started (not timed): {time.time() - t:.1f}s", flush=True)
    warm = os.environ.get("CDC_BENCH_WARM_SERVER", "")
    if warm == "1":
        from cdc_lakehouse.runtime.warmup import warm_server

        print(f"... and warmed up (not timed): {warm_server(server.url, server.workdir):.1f}s", flush=True)
    elif warm == "ingest":
        from devstack.warm import warm_local_server

        print(
            f"... and warmed up with an ingest (not timed): {warm_local_server(server.url, server.workdir):.1f}s",
            flush=True,
        )
    try:
        yield server.url
    finally:
        server.stop()


def connect_command(app: Path, args: list[str]) -> list[str]:
    """The job file as the task runs it on Spark Connect (orchestration.spark_backends.ConnectBackend: runpy in the
    task's process; here a process of its own, as each Airflow task is)."""
    return [sys.executable, str(app), *args]


def job_env(prep: dict) -> dict[str, str]:
    """What the task hands the job: the public lake settings as CDC_LAKE_SETTINGS and PYTHONPATH
    without the checkout (the package comes from --py-files); the catalog password in the
    environment (a job started by hand), never on the command line."""
    lake = _lake(prep)
    plugins = str(ROOT / "plugins")
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != plugins]
    return {**os.environ, **lake.to_env(), "PYTHONPATH": os.pathsep.join(path)}


def merge_main(table: str, rows: int, changes: int) -> int:
    """Inside spark-submit: the plain MERGE, then the same kind of line the jobs print."""
    from cdc_lakehouse.runtime.session import get_spark
    from cdc_lakehouse.settings import LakeSettings

    from bench.ingest_bench import plain_merge, prepare

    lake = LakeSettings.from_env()
    spark = get_spark("cdc-plain-merge", lake)
    t = time.time()
    plain_merge(spark, lake.qualified(table), prepare(rows, changes))
    print(COMMITTED + "merge " + json.dumps({"table": table, "seconds": time.time() - t}), flush=True)
    spark.stop()
    return 0


AUDIT_CONN = "bench_task_audit"
AUDIT_SHARDS = ["s0", "s1"]


def _audit_source(db: str, rows: int) -> None:
    """A fresh database with `rows` rows of block over the shard schemas, analyzed."""
    import psycopg2

    from bench.source_bench import _admin_dsn

    conn = psycopg2.connect(_admin_dsn())
    conn.autocommit = True
    with conn.cursor() as cur:
        # A previous run's slot pins the database (and a capture would find it half-gone).
        cur.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = %s", (db,))
        cur.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        cur.execute(f"CREATE DATABASE {db}")
    conn.close()
    conn = psycopg2.connect(_admin_dsn(db))
    conn.autocommit = True
    with conn.cursor() as cur:
        for i, s in enumerate(AUDIT_SHARDS):
            cur.execute(
                f"CREATE SCHEMA {s}; CREATE TABLE {s}.block (id bigint PRIMARY KEY, version int NOT NULL, "
                "content text, updated_at timestamptz NOT NULL DEFAULT now())"
            )
            cur.execute(
                f"INSERT INTO {s}.block (id, version, content) SELECT g, g %% 7, repeat(md5(g::text), 4) "
                "FROM generate_series(%s, %s) g",
                (i * rows + 1, i * rows + rows // len(AUDIT_SHARDS)),
            )
            cur.execute(f"ANALYZE {s}.block")
    conn.close()


def audit_setup(rows: int, config_dir: Path) -> tuple[str, dict[str, str]]:
    """A source of `rows` rows over two shard schemas in the local PostgreSQL, its slot (capture),
    and its bootstrap into the lake (one Spark application, not timed). Returns the table config
    name and the environment the job needs (the source URI, in the environment only)."""
    from cdc_lakehouse.bootstrap.bootstrap_table import bootstrap_table
    from cdc_lakehouse.capture.capture_run import capture_run
    from cdc_lakehouse.config import load_table_configs
    from cdc_lakehouse.lake.meta import ensure_meta_tables
    from cdc_lakehouse.landing.stores import LocalLanding
    from cdc_lakehouse.runtime.session import get_spark
    from cdc_lakehouse.settings import LakeSettings
    from cdc_lakehouse.source.catalog import EndpointTables

    from bench.source_bench import _admin_dsn

    db, name = f"bench_task_audit_{rows}", f"audit_{rows}"
    _audit_source(db, rows)
    doc = {
        "name": name,
        "source": {"table": "block", "shards": [{"conn_id": AUDIT_CONN, "schemas": AUDIT_SHARDS}]},
        "primary_key": ["id"],
        "lake": {"namespace": "bench_audit"},
    }
    config_dir.mkdir(parents=True, exist_ok=True)
    (config_dir / f"{name}.yaml").write_text(yaml.safe_dump(doc))
    pw, port = os.environ.get("CDC_LOCAL_PG_PASSWORD", ""), os.environ.get("CDC_LOCAL_PG_PORT", "55432")
    env = {f"AIRFLOW_CONN_{AUDIT_CONN.upper()}": f"postgresql://postgres:{pw}@127.0.0.1:{port}/{db}"}
    os.environ.update(env)
    cfg = load_table_configs(config_dir).tables[name]
    landing = f"file://{WORK}/task-audit-landing"
    # A previous run's landing holds a manifest of this run id for the slot dropped above.
    shutil.rmtree(WORK / "task-audit-landing", ignore_errors=True)
    ep = EndpointTables(cfg.source.shards[0].endpoint_id, AUDIT_CONN, {"block": (AUDIT_SHARDS, ["id"])})
    capture_run(ep, _admin_dsn(db), LocalLanding(landing), "20260101T000000Z")  # slot and publication
    lake = LakeSettings.from_env().with_(warehouse=f"file://{WORK}/task-warehouse", landing_uri=landing)
    spark = get_spark("bench-task-audit-setup", lake, classic=True)
    ensure_meta_tables(spark, lake)
    for t in (cfg.current_table, cfg.changelog_table):
        spark.sql(f"DROP TABLE IF EXISTS {lake.qualified(t)} PURGE")
    bootstrap_table(spark, lake, cfg, run_id="b", all_endpoint_tables={ep.endpoint_id: ep.tables})
    spark.stop()
    return name, {**env, **lake.to_env()}


def run_audits(rows: int, repeat: int) -> tuple[list[dict], list[dict]]:
    """The audit task of a clean table, cold, `repeat` times by spark-submit and as many on Spark
    Connect, alternated (it changes nothing: one setup)."""
    config_dir = WORK / f"task-audit-configs-{rows}"
    t = time.time()
    name, extra = audit_setup(rows, config_dir)
    print(f"audit setup (not timed): {time.time() - t:.0f}s", flush=True)
    env = {**job_env({"dir": str(WORK)}), **extra}
    out, on_connect = [], []
    with connect_server() as url:
        for i in range(repeat):
            args = ["--tables", name, "--config-dir", str(config_dir), "--audit-run", f"cold-{i}"]
            out.append(timed(submit_command(ROOT / "spark_jobs" / "audit.py", args), env))
            connect_env = {**env, "CDC_SPARK_REMOTE": url, "PYTHONPATH": str(ROOT / "plugins")}
            args[-1] = f"connect-{i}"
            on_connect.append(timed(connect_command(ROOT / "spark_jobs" / "audit.py", args), connect_env))
            for how, r in (("spark-submit", out[-1]), ("Spark Connect", on_connect[-1])):
                print(
                    f"audit repeat {i + 1} by {how}: {r['to_commit']:.1f}s to result ({r['to_exit']:.1f}s to exit); "
                    f"in the job {r['result'].get('seconds', 0):.1f}s, {r['result'].get('spark_jobs')} Spark jobs, "
                    f"verdict {r['result'].get('verdict')}",
                    flush=True,
                )
    return out, on_connect


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def run_ingests(prep: dict, rows: int, changes: int, repeat: int) -> tuple[list[dict], list[dict], list[dict]]:
    """Ours by spark-submit, ours on Spark Connect and the plain MERGE, alternated per repeat
    (a drift of the shared machine's speed then hits all alike)."""
    config_dir = WORK / f"task-configs-{rows}"
    t = time.time()
    setup(prep, rows, repeat, config_dir)
    print(f"setup (not timed): {time.time() - t:.0f}s", flush=True)
    env = job_env(prep)
    ours, served, plain = [], [], []
    with connect_server() as url:
        on_connect = {**env, "CDC_SPARK_REMOTE": url, "PYTHONPATH": str(ROOT / "plugins")}
        for i, ((name, plain_table), srv_name) in enumerate(zip(_names(rows, repeat), _server_names(rows, repeat))):
            ingest = ["--tables", name, "--config-dir", str(config_dir / name), "--ingest-run", f"cold-{i}"]
            ours.append(timed(submit_command(ROOT / "spark_jobs" / "ingest.py", ingest), env))
            on_server = ["--tables", srv_name, "--config-dir", str(config_dir / srv_name), "--ingest-run", f"srv-{i}"]
            served.append(timed(connect_command(ROOT / "spark_jobs" / "ingest.py", on_server), on_connect))
            merge = ["--merge-table", plain_table, "--rows", str(rows), "--changes", str(changes)]
            plain.append(timed(submit_command(Path(__file__).resolve(), merge), env))
            print(
                f"repeat {i + 1}: ours {ours[-1]['to_commit']:.1f}s to commit ({ours[-1]['to_exit']:.1f}s to exit; "
                f"{ours[-1]['result'].get('seconds', 0):.1f}s in the job), ours on Spark Connect "
                f"{served[-1]['to_commit']:.1f}s ({served[-1]['result'].get('seconds', 0):.1f}s in the job), "
                f"plain MERGE {plain[-1]['to_commit']:.1f}s "
                f"({plain[-1]['to_exit']:.1f}s; {plain[-1]['result'].get('seconds', 0):.1f}s in the job)",
                flush=True,
            )
    o, v, m = _median(ours, "to_commit"), _median(served, "to_commit"), _median(plain, "to_commit")
    print(
        f"task, start -> commit (median of {repeat}): ours by spark-submit {o:.1f}s, ours on Spark Connect "
        f"{v:.1f}s, plain MERGE by spark-submit {m:.1f}s; ratios {o / m:.2f} and {v / m:.2f}"
    )
    return ours, served, plain


def main() -> int:
    from bench.ingest_bench import prepare
    from bench.measure import machine

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--changes", type=int, default=19_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--audit-rows", type=int, default=100_000, help="rows of the audited table")
    p.add_argument("--parts", default="ingest,verify,audit", help="verify: the ingest tables a run left")
    p.add_argument("--merge-table", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.merge_table:
        return merge_main(args.merge_table, args.rows, args.changes)
    parts = set(args.parts.split(","))
    prep = prepare(args.rows, args.changes)
    print(f"batch: {prep['events']} events over {prep['keys']} keys; table {args.rows} rows", flush=True)
    ours, served, plain = run_ingests(prep, args.rows, args.changes, args.repeat) if "ingest" in parts else ([], [], [])
    checks = verify(prep, args.rows, args.repeat) if "verify" in parts else {}
    if checks:
        print(f"verified: {all(checks.values())} {checks}", flush=True)
    audits, audits_connect = run_audits(args.audit_rows, args.repeat) if "audit" in parts else ([], [])
    if audits:
        print(
            f"audit of {args.audit_rows} rows, spawn -> result (median): by spark-submit "
            f"{_median(audits, 'to_commit'):.1f}s, on Spark Connect {_median(audits_connect, 'to_commit'):.1f}s"
        )
    out = HERE / "results" / f"task-{args.rows}-{args.changes}-{'-'.join(sorted(parts))}.json"
    out.parent.mkdir(exist_ok=True)
    result = {
        "batch": prep,
        "ours": ours,
        "ours_connect": served,
        "plain_merge": plain,
        "audit": audits,
        "audit_connect": audits_connect,
    }
    result["verified"] = checks
    out.write_text(json.dumps({**result, "machine": machine()}, indent=2, default=str))
    print(f"results: {out}")
    return 0 if all(checks.values()) and all(a["result"].get("verdict") == "ok" for a in audits + audits_connect) else 1


if __name__ == "__main__":
    sys.exit(main())
