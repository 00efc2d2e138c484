"""End to end through real Airflow (`airflow dags test`): the demo on a small Notion-like source
in the test session's PostgreSQL, with its own AIRFLOW_HOME, catalog, warehouse and landing zone.

Bootstrap of three tables, two ingest intervals of a random workload (updates with recency
skew, inserts, deletes, key changes, TOAST-unchanged updates, an added column), audits and
maintenance; then a rerun of the first interval. The audit verdict must be clean and the lake's
(id, version) per shard must equal the source's before and after the rerun.

The Spark tasks are clients of the session's Spark Connect server, reached as the demo reaches the
local stack's (CDC_LOCAL_SPARK_PORT): a second server would cost its start and a second cold JIT
(about 100 s here, docs/benchmarks-history.md "Test suite"). Starting that server is what every session does
(tests/conftest.py spark_server); a spark-submit per task is covered by test_secrets.py and
test_cluster.py.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import psycopg2
import pytest

from tests.conftest import ROOT
from tests.helpers import init_airflow_home

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def statsd():
    """A StatsD server for Airflow's metrics: a UDP socket whose lines the test reads."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.2)
    lines: list[str] = []
    stop = threading.Event()

    def receive() -> None:
        while not stop.is_set():
            try:
                lines.extend(sock.recv(65535).decode().splitlines())
            except TimeoutError:
                continue

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    yield sock.getsockname()[1], lines
    stop.set()
    t.join()
    sock.close()


@pytest.fixture(scope="module")
def demo_env(pg, redis_server, spark_server, statsd, tmp_path_factory):
    base = tmp_path_factory.mktemp("demo")
    for db in ("notion", "e2e_catalog"):
        pg.ensure_database(db)
    lake_extra = {
        "catalog_type": "jdbc",
        "warehouse": f"file://{base}/warehouse",
        "landing_uri": f"file://{base}/landing",
    }
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        # The package, and the repository root for the development stack the demo is (devstack/).
        "PYTHONPATH": os.pathsep.join((str(ROOT / "plugins"), str(ROOT))),
        "AIRFLOW_HOME": str(base / "airflow"),
        # Its own local dir; the local stack's Spark Connect server is the session's (running, so
        # the demo does not start one), and so is the rerun's spark_default connection below.
        "CDC_LOCAL_DIR": str(base / "local"),
        "CDC_LOCAL_SPARK_PORT": str(spark_server.port),
        "CDC_LOCAL_SPARK_START": "never",  # never a second server on the session's port
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{base}/airflow/airflow.db",
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "CDC_TABLES_DIR": str(ROOT / "include" / "tables"),
        "CDC_LOCAL_PG_PORT": str(pg.port),
        "CDC_LOCAL_PG_PASSWORD": "",
        "AIRFLOW_CONN_CDC_SOURCE_LOCAL": pg.uri("notion"),
        "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps(
            {"conn_type": "spark_connect", "host": "127.0.0.1", "port": spark_server.port}
        ),
        "AIRFLOW_CONN_CDC_REDIS": redis_server.uri,
        "AIRFLOW_CONN_CDC_LAKE": json.dumps(
            {
                "conn_type": "generic",
                "host": "127.0.0.1",
                "port": pg.port,
                "schema": "e2e_catalog",
                "login": "postgres",
                "extra": lake_extra,
            }
        ),
        "CDC_CATALOG_TYPE": "jdbc",
        "CDC_CATALOG_URI": f"postgresql://postgres@127.0.0.1:{pg.port}/e2e_catalog",
        "CDC_CATALOG_PASSWORD": "",
        "CDC_WAREHOUSE": lake_extra["warehouse"],
        "CDC_LANDING_URI": lake_extra["landing_uri"],
        # Airflow's metrics to the test's StatsD listener (orchestration.metrics adds the cdc.* ones).
        "AIRFLOW__METRICS__STATSD_ON": "True",
        "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1",
        "AIRFLOW__METRICS__STATSD_PORT": str(statsd[0]),
        "AIRFLOW__METRICS__STATSD_PREFIX": "airflow",
        # OpenLineage events of every task to a file (orchestration.lineage adds the datasets and
        # the cdc_* facets). In a thread: the provider's default forked emitter was killed by its
        # own timeout on this loaded machine (2 cores), and only the DAG's event arrived.
        "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(
            {"type": "file", "log_file_path": str(base / "lineage.jsonl"), "append": True}
        ),
        "AIRFLOW__OPENLINEAGE__NAMESPACE": "cdc_demo",
        "AIRFLOW__OPENLINEAGE__EXECUTE_IN_THREAD": "True",
    }
    env.pop("CDC_LAKE_SETTINGS", None)
    init_airflow_home(env)
    return env


def _lake_versions(env) -> dict[tuple[str, int], int]:
    from cdc_lakehouse.settings import LakeSettings
    from pyiceberg.catalog import load_catalog

    lake = LakeSettings.from_env(env)
    cat = load_catalog(lake.catalog_name, **lake.pyiceberg_properties())
    t = cat.load_table("notion.block").scan(selected_fields=("_cdc_shard", "id", "version")).to_arrow()
    return {
        (s.split(".")[-1], i): v
        for s, i, v in zip(t["_cdc_shard"].to_pylist(), t["id"].to_pylist(), t["version"].to_pylist(), strict=True)
    }


def _source_versions(pg) -> dict[tuple[str, int], int]:
    from devstack.demo import SHARDS

    out = {}
    conn = psycopg2.connect(pg.dsn("notion"))
    try:
        with conn.cursor() as cur:
            for s in SHARDS:
                cur.execute(f"SELECT id, version FROM {s}.block")
                out.update({(s, i): v for i, v in cur.fetchall()})
    finally:
        conn.close()
    return out


def _metrics(lines: list[str], prefix: str) -> dict[str, str]:
    """StatsD lines `name:value|type` whose name starts with `prefix`: name -> `value|type` (the last)."""
    return {n: v for n, _, v in (line.partition(":") for line in lines) if n.startswith(prefix)}


def _assert_cdc_metrics(lines: list[str], shards: list[str]) -> None:
    """The run's figures went out through Airflow's metrics, per endpoint, table and shard."""
    cdc = _metrics(lines, "airflow.cdc.")
    assert cdc, f"no cdc.* metric among {len(lines)} StatsD lines: {lines[:20]}"
    for kind in ("lag_bytes", "retained_wal_bytes", "events", "duration"):
        assert any(n.startswith(f"airflow.cdc.capture.{kind}.") for n in cdc), (kind, sorted(cdc))
    assert cdc["airflow.cdc.ingest.quarantined_rows.block"] == "0.0|g", sorted(cdc)
    assert cdc["airflow.cdc.ingest.duration.block"].endswith("|ms"), sorted(cdc)
    for s in shards:  # the shard label ends with the schema (the source's `<endpoint>.<schema>`)
        fresh = [v for n, v in cdc.items() if n.startswith("airflow.cdc.freshness_seconds.block.") and n.endswith(s)]
        assert fresh and all(v.endswith("|g") for v in fresh), (s, sorted(cdc))
        audit = [v for n, v in cdc.items() if n.startswith("airflow.cdc.audit.mismatches.block.") and n.endswith(s)]
        assert audit == ["0.0|g"], (s, sorted(cdc))  # the audit was clean


def _complete(events: list[dict], task: str) -> list[dict]:
    """The COMPLETE events of a task (`<dag_id>.<task_id>`, the provider's job name)."""
    return [e for e in events if e.get("eventType") == "COMPLETE" and e["job"]["name"] == task]


def _names(datasets: list[dict]) -> set[tuple[str, str]]:
    return {(d["namespace"], d["name"]) for d in datasets}


def _symlink(d: dict) -> str | None:
    ids = d.get("facets", {}).get("symlinks", {}).get("identifiers", [])
    return ids[0]["name"] if ids else None


def _assert_lineage(path: Path, shards: list[str]) -> None:
    """Source shards -> landing -> changelog and current table, and the audit's verdict, as
    OpenLineage events with this project's facets; the graph joins on the landing datasets."""
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    captures = [e for e in events if e.get("eventType") == "COMPLETE" and ".capture__" in e["job"]["name"]]
    assert captures, sorted({e["job"]["name"] for e in events})
    cap = captures[-1]
    assert {n.split(".")[-2] for _, n in _names(cap["inputs"]) if n.endswith(".block")} == set(shards), cap["inputs"]
    assert all(ns.startswith("postgres://") for ns, _ in _names(cap["inputs"])), cap["inputs"]
    facet = cap["run"]["facets"]["cdc_capture"]
    assert facet["endLsn"] and "/" in facet["endLsn"] and facet["events"] is not None, facet
    landed = _names(cap["outputs"])
    ingests = _complete(events, "cdc_ingest__block.ingest")
    assert ingests, sorted({e["job"]["name"] for e in events})
    ing = ingests[-1]
    assert {n for n in _names(ing["inputs"]) if n[1].endswith("/block")} <= landed, (ing["inputs"], landed)
    assert {_symlink(d) for d in ing["outputs"]} == {"notion.block", "notion.block__changelog"}, ing["outputs"]
    figures = ing["run"]["facets"]["cdc_ingest"]["tables"]["block"]
    assert figures["rowsQuarantined"] == 0 and figures["eventsRead"] >= 0, figures
    assert {s.split(".")[-1] for s in figures["shards"]} == set(shards), figures
    assert all(v["watermarkLsn"] and v["snapshotId"] for v in figures["shards"].values()), figures
    audits = _complete(events, "cdc_audit__block.audit")
    assert audits, sorted({e["job"]["name"] for e in events})
    [table] = [d for d in audits[-1]["inputs"] if _symlink(d) == "notion.block"]
    checks = table["inputFacets"]["dataQualityAssertions"]["assertions"]
    assert len(checks) == len(shards) and all(c["success"] for c in checks), checks
    # On to the derived tree and its serving export: current table -> tree -> the Redis store.
    [derive] = _complete(events, "cdc_derived__block_tree.derive")[-1:]
    assert "notion.block" in {_symlink(d) for d in derive["inputs"]}, derive["inputs"]
    trees = {_symlink(d) for d in derive["outputs"]}
    [export] = _complete(events, "cdc_export__block_tree_serving.export")[-1:]
    assert {_symlink(d) for d in export["inputs"]} <= trees and export["inputs"], (export["inputs"], trees)
    assert export["outputs"] and all(d["namespace"].startswith("redis://") for d in export["outputs"]), export


def test_demo_through_airflow_is_clean_and_a_rerun_converges(pg, demo_env, statsd):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "devstack.demo",
            "run",
            "--blocks",
            "400",
            "--changes",
            "400",
            "--intervals",
            "2",
        ],
        env=demo_env,
        capture_output=True,
        text=True,
        timeout=2400,
        check=False,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    assert "AUDIT VERDICT: clean" in out, out[-3000:]
    assert "maintenance block current" in out, out[-3000:]
    # The derived tree ran through its DAG (full after interval 1, incremental after 2) and placed the blocks.
    tree = re.search(r"derived block_tree: (\d+) nodes resolved", out)
    assert tree and int(tree.group(1)) > 1000, out[-3000:]
    # So did the export (full, then incremental into the same version): one key per resolved node.
    exported = re.search(r"export block_tree_serving: redis namespace block_tree version (\d+) .*?, (\d+) keys", out)
    assert exported and exported.group(1) == "1" and exported.group(2) == tree.group(1), out[-3000:]
    source = _source_versions(pg)
    assert len(source) > 1000
    assert _lake_versions(demo_env) == source
    from devstack.demo import SHARDS

    _assert_cdc_metrics(statsd[1], list(SHARDS))
    _assert_lineage(Path(demo_env["AIRFLOW_HOME"]).parent / "lineage.jsonl", list(SHARDS))
    # Rerun the first interval (clearing a past run in the UI does the same): nothing changes.
    first = next(line for line in out.splitlines() if "interval 1/2" in line)
    hour = first.split("[", 2)[2].split("-")[0]  # "HH:MM"
    from datetime import UTC, datetime, timedelta

    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    logical = next(
        now - timedelta(hours=h) for h in range(1, 6) if (now - timedelta(hours=h)).strftime("%H:%M") == hour
    )
    rr = subprocess.run(
        ["airflow", "dags", "test", "cdc_ingest__block", logical.isoformat()],
        env=demo_env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert rr.returncode == 0, (rr.stdout + rr.stderr)[-4000:]
    assert _lake_versions(demo_env) == source
