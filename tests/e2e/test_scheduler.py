"""Airflow's real scheduler on the local stack (issue #14): api-server, scheduler (LocalExecutor
on SQLite) and dag-processor run for a few minutes in their own AIRFLOW_HOME with one small
table whose ingest and audit are scheduled every minute. Their Spark tasks are clients of the
session's Spark Connect server, as on the local stack (a spark-submit per task is covered by
tests/integration/test_secrets.py and test_cluster.py).

The bootstrap is triggered through the REST API and run by the scheduler; then the ingest and
audit DAGs are unpaused and nothing else is triggered. The test asserts from Airflow's metadata
(REST API v2) that scheduled ingest runs (capture + ingest) and audit runs happen on their own
and succeed, that the table's writers sharing the one-slot pool never overlap and one of them
waited for the slot, that a second ingest run's ingest started only after the first's ended,
and that the lake's current table equals the source after the source changed between runs.
Then a re-bootstrap of the table, which now holds rows, waits for a person (#53): rejected through
the REST API it writes nothing, approved it runs. And the ingest runs' freshness deadline (#53):
missed, shown on the run and alerted through the alert channels.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psutil
import psycopg2
import pytest

from devstack.localstack import free_port
from tests.conftest import ROOT
from tests.helpers import init_airflow_home

pytestmark = pytest.mark.slow

TABLE = "sched_item"
INGEST, AUDIT, BOOTSTRAP = f"cdc_ingest__{TABLE}", f"cdc_audit__{TABLE}", f"cdc_bootstrap__{TABLE}"
POOL = f"cdc_table__{TABLE}"
APPROVE = "approve"
SCHEMAS = ("s0", "s1")
ROWS = 30
DEADLINE = 8 * 60  # seconds from unpausing to the last expected run
CONFIG = f"""
name: {TABLE}
owner: data-platform
tags: [test]
source:
  table: item
  shards:
    - conn_id: cdc_sched_source
      schemas: [{", ".join(SCHEMAS)}]
primary_key: [id]
lake:
  namespace: sched
ingest:
  schedule: "* * * * *"
audit:
  schedule: "* * * * *"
  mode: full
alerts:
  # Shorter than the one-minute schedule: every scheduled ingest run misses its freshness
  # deadline (its interval's start + 30 s) on creation, so the deadline callback runs (#53).
  freshness_sla: 30s
"""

PROBE = f"probe__{TABLE}"
# A DAG of a user's own, scheduled the way the derived, export and feed DAGs are (on_assets): one
# run per partition key of the current table's asset events. Its task costs no Spark job.
PROBE_DAG = f"""
from airflow.sdk import DAG, task
from cdc_lakehouse.orchestration.dag_parts import START_DATE, asset, load_configs, on_assets

cfg = load_configs()[0].tables["{TABLE}"]
with DAG(dag_id="{PROBE}", schedule=on_assets(asset(cfg.current_table)), start_date=START_DATE,
         catchup=False, max_active_runs=1):
    task(lambda: None, task_id="seen")()
"""


def _ts(value: str | None) -> datetime | None:
    return None if value is None else datetime.fromisoformat(value.replace("Z", "+00:00"))


class Source:
    """The source table `item` in shards s0 and s1 of a scratch database."""

    def __init__(self, pg, db: str):
        self.pg, self.db = pg, db
        self.next_id = ROWS + 1

    def execute(self, *sql: str, params=None) -> None:
        conn = psycopg2.connect(self.pg.dsn(self.db))
        try:
            with conn, conn.cursor() as cur:
                for s in sql:
                    cur.execute(s, params)
        finally:
            conn.close()

    def create(self) -> None:
        for s in SCHEMAS:
            self.execute(
                f"CREATE SCHEMA {s}",
                f"CREATE TABLE {s}.item (id bigint PRIMARY KEY, name text NOT NULL, qty int NOT NULL)",
                f"INSERT INTO {s}.item SELECT g, 'item ' || g, g FROM generate_series(1, {ROWS}) g",
            )

    def change(self, round_no: int) -> None:
        """Inserts, updates and deletes in every shard, in one transaction per shard."""
        new = list(range(self.next_id, self.next_id + 5))
        self.next_id += 5
        for s in SCHEMAS:
            self.execute(
                f"INSERT INTO {s}.item SELECT g, 'new ' || g, 0 FROM unnest(%(new)s::bigint[]) g",
                f"UPDATE {s}.item SET qty = qty + 100, name = name || ' r{round_no}' WHERE id %% 7 = {round_no}",
                f"DELETE FROM {s}.item WHERE id IN (%(d1)s, %(d2)s)",
                params={"new": new, "d1": 2 * round_no, "d2": 2 * round_no + 11},
            )

    def rows(self, columns: str = "id, name, qty") -> dict[tuple[str, int], tuple[str, int]]:
        out = {}
        conn = psycopg2.connect(self.pg.dsn(self.db))
        try:
            with conn.cursor() as cur:
                for s in SCHEMAS:
                    cur.execute(f"SELECT {columns} FROM {s}.item")
                    out.update({(s, i): (n, q) for i, n, q in cur.fetchall()})
        finally:
            conn.close()
        return out

    def drop(self) -> None:
        for slot, pid in self.pg.execute(
            f"SELECT slot_name, active_pid FROM pg_replication_slots WHERE database = '{self.db}'"
        ):
            if pid:
                self.pg.execute(f"SELECT pg_terminate_backend({int(pid)})")
                time.sleep(1)
            self.pg.execute(f"SELECT pg_drop_replication_slot('{slot}')")
        self.pg.execute(f"DROP DATABASE IF EXISTS {self.db} WITH (FORCE)")


@pytest.fixture(scope="module")
def sched_env(pg, spark_server, tmp_path_factory):
    """A fresh AIRFLOW_HOME (its metadata in a scratch PostgreSQL database, LocalExecutor), a tables dir with one small table, its
    source in a scratch database, and a private catalog, warehouse and landing zone."""
    base = tmp_path_factory.mktemp("sched")
    home = base / "airflow"
    tables = base / "tables"
    dags = base / "dags"
    for d in (home, tables, dags):
        d.mkdir()
    (tables / f"{TABLE}.yaml").write_text(CONFIG)
    # The project's DAG files, and a partition-aware consumer of the table's asset (PROBE_DAG).
    for f in (ROOT / "dags").glob("*.py"):
        (dags / f.name).symlink_to(f)
    (dags / "probe.py").write_text(PROBE_DAG)
    suffix = uuid.uuid4().hex[:8]
    db, catalog_db, airflow_db = f"sched_{suffix}", f"sched_cat_{suffix}", f"sched_airflow_{suffix}"
    for name in (db, catalog_db, airflow_db):
        pg.ensure_database(name)
    source = Source(pg, db)
    source.create()
    port = free_port()
    lake_extra = {
        "catalog_type": "jdbc",
        "warehouse": f"file://{base}/warehouse",
        "landing_uri": f"file://{base}/landing",
    }
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT / "plugins"),
        "AIRFLOW_HOME": str(home),
        # PostgreSQL, as in production: on SQLite the scheduler's writes lock the database, and a
        # backfill's creation is refused then (503 "not supported on SQLite under concurrent
        # access"; a CI run of this test hit it).
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"postgresql+psycopg2://postgres@127.0.0.1:{pg.port}/{airflow_db}",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__PARALLELISM": "4",
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
        "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(16),
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
        "CDC_TABLES_DIR": str(tables),
        "CDC_TASK_RETRIES": "0",
        "AIRFLOW_CONN_CDC_SCHED_SOURCE": pg.uri(db),
        "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps(
            {"conn_type": "spark_connect", "host": "127.0.0.1", "port": spark_server.port}
        ),
        "AIRFLOW_CONN_CDC_LAKE": json.dumps(
            {
                "conn_type": "generic",
                "host": "127.0.0.1",
                "port": pg.port,
                "schema": catalog_db,
                "login": "postgres",
                "extra": lake_extra,
            }
        ),
        "CDC_CATALOG_TYPE": "jdbc",
        "CDC_CATALOG_URI": f"postgresql://postgres@127.0.0.1:{pg.port}/{catalog_db}",
        "CDC_CATALOG_PASSWORD": "",
        "CDC_WAREHOUSE": lake_extra["warehouse"],
        "CDC_LANDING_URI": lake_extra["landing_uri"],
    }
    env.pop("CDC_LAKE_SETTINGS", None)
    init_airflow_home(env)
    yield env, base, port, source
    source.drop()
    for name in (catalog_db, airflow_db):
        pg.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@dataclass
class Stack:
    """The running Airflow processes, their logs and the REST API v2."""

    url: str
    home: Path
    logs: dict[str, Path]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def api(self, method: str, path: str, body: dict | None = None, prefix: str = "/api/v2") -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"{self.url}{prefix}{path}", data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{method} {path}: {exc.code} {exc.read()[:2000]!r}") from exc

    def runs(self, dag_id: str) -> list[dict]:
        return self.api("GET", f"/dags/{dag_id}/dagRuns?limit=100&order_by=run_after")["dag_runs"]

    def task_instances(self, dag_id: str) -> list[dict]:
        return self.api("GET", f"/dags/{dag_id}/dagRuns/~/taskInstances?limit=200")["task_instances"]

    def set_paused(self, dag_id: str, paused: bool) -> None:
        self.api("PATCH", f"/dags/{dag_id}", {"is_paused": paused})

    def report(self) -> str:
        """Tails of the process logs and of the newest task logs, for a failure message."""
        parts = []
        for name, p in self.logs.items():
            text = p.read_text(errors="replace") if p.exists() else "(no log)"
            parts.append(f"===== {name} ({p}) =====\n{text[-3000:]}")
        task_logs = sorted((self.home / "logs").rglob("attempt=*.log"), key=lambda p: p.stat().st_mtime)
        for p in task_logs[-4:]:
            parts.append(f"===== task log {p.relative_to(self.home)} =====\n{p.read_text(errors='replace')[-4000:]}")
        return "\n".join(parts)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to a process group we started and to every descendant of its
    leader (task supervisors and spark-submit JVMs may sit in groups of their own)."""
    try:
        victims = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        victims = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        for v in victims:
            try:
                v.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        _, victims = psutil.wait_procs(victims, timeout=20)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            continue
        if not victims:
            return


@pytest.fixture(scope="module")
def stack(sched_env):
    env, base, port, _ = sched_env
    airflow = str(Path(sys.executable).with_name("airflow"))
    commands = {
        "api-server": [airflow, "api-server", "--port", str(port), "--host", "127.0.0.1", "--workers", "1"],
        "scheduler": [airflow, "scheduler"],
        "dag-processor": [airflow, "dag-processor"],
    }
    st = Stack(
        url=f"http://127.0.0.1:{port}",
        home=Path(env["AIRFLOW_HOME"]),
        logs={name: base / f"{name}.log" for name in commands},
    )
    handles = []
    try:
        for name, cmd in commands.items():
            log = open(st.logs[name], "w")  # noqa: SIM115 - closed in teardown
            handles.append(log)
            st.procs[name] = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.time() + 180
        while True:
            try:
                health = st.api("GET", "/monitor/health")
                if health.get("scheduler", {}).get("status") == "healthy":
                    break
            except (OSError, AssertionError):
                pass
            dead = [n for n, p in st.procs.items() if p.poll() is not None]
            if dead or time.time() > deadline:
                pytest.fail(f"Airflow did not start (exited: {dead}):\n{st.report()}")
            time.sleep(2)
        yield st
    finally:
        for dag_id in (INGEST, AUDIT):
            try:
                st.set_paused(dag_id, True)
            except Exception:  # noqa: BLE001 - best effort before the kill
                pass
        # The scheduler and the dag-processor together (each waits out its own shutdown; one after
        # the other took 25 s), the api-server last: tasks report to it.
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(_stop, [st.procs[n] for n in ("scheduler", "dag-processor") if n in st.procs]))
        if "api-server" in st.procs:
            _stop(st.procs["api-server"])
        for h in handles:
            h.close()


def _wait(st: Stack, what: str, cond, deadline: float, interval: float = 3):
    while True:
        value = cond()
        if value:
            return value
        failed = [
            (d, r["dag_run_id"]) for d in (BOOTSTRAP, INGEST, AUDIT) for r in st.runs(d) if r["state"] == "failed"
        ]
        dead = [n for n, p in st.procs.items() if p.poll() is not None]
        if failed or dead or time.time() > deadline:
            pytest.fail(
                f"waiting for {what}: failed runs {failed}, exited processes {dead}, "
                f"{'deadline passed' if time.time() > deadline else ''}\n{st.report()}"
            )
        time.sleep(interval)


def _lake_rows(env) -> dict[tuple[str, int], tuple[str, int]]:
    from cdc_lakehouse.settings import LakeSettings
    from pyiceberg.catalog import load_catalog

    lake = LakeSettings.from_env(env)
    cat = load_catalog(lake.catalog_name, **lake.pyiceberg_properties())
    t = cat.load_table(f"sched.{TABLE}").scan(selected_fields=("_cdc_shard", "id", "name", "qty")).to_arrow()
    cols = [t[c].to_pylist() for c in ("_cdc_shard", "id", "name", "qty")]
    return {(s, i): (n, q) for s, i, n, q in zip(*cols)}


def test_scheduled_ingest_and_audit_run_on_their_own_one_writer_at_a_time(sched_env, stack):
    env, _, _, source = sched_env
    st = stack
    t0 = time.time()

    # The probe listens from the start: Airflow queues no run of a paused DAG for an asset event.
    _wait(
        st,
        "the probe DAG",
        lambda: any(d["dag_id"] == PROBE for d in st.api("GET", "/dags?limit=100")["dags"]),
        t0 + 120,
    )
    st.set_paused(PROBE, False)
    # Bootstrap through the scheduler (a manual run), so the ingest and audit have a lake table.
    st.set_paused(BOOTSTRAP, False)
    st.api("POST", f"/dags/{BOOTSTRAP}/dagRuns", {"logical_date": datetime.now(UTC).isoformat()})
    _wait(st, "the bootstrap", lambda: any(r["state"] == "success" for r in st.runs(BOOTSTRAP)), t0 + 300)
    t_boot = time.time()

    source.change(1)  # for the first scheduled ingest
    for dag_id in (INGEST, AUDIT):
        st.set_paused(dag_id, False)
    deadline = time.time() + DEADLINE

    def first_capture_done():
        return [
            ti for ti in st.task_instances(INGEST) if ti["task_id"].startswith("capture__") and ti["state"] == "success"
        ]

    _wait(st, "a scheduled capture", first_capture_done, deadline, interval=2)
    source.change(2)  # after the first capture: only a later run can bring these
    t_change2 = datetime.now(UTC)

    def done():
        ingest_ok = [r for r in st.runs(INGEST) if r["run_type"] == "scheduled" and r["state"] == "success"]
        audit_ok = [r for r in st.runs(AUDIT) if r["run_type"] == "scheduled" and r["state"] == "success"]
        ok_ids = {r["dag_run_id"] for r in ingest_ok}
        after_change2 = [
            ti
            for ti in st.task_instances(INGEST)
            if ti["task_id"].startswith("capture__")
            and ti["dag_run_id"] in ok_ids
            and _ts(ti["start_date"]) > t_change2
        ]
        return len(ingest_ok) >= 2 and audit_ok and after_change2

    _wait(st, "two scheduled ingests (one captured after the second change) and an audit", done, deadline)
    t_done = time.time()
    for dag_id in (INGEST, AUDIT):
        st.set_paused(dag_id, True)

    # --- the metadata ---------------------------------------------------------------------
    ingest_runs = [r for r in st.runs(INGEST) if r["run_type"] == "scheduled"]
    audit_runs = [r for r in st.runs(AUDIT) if r["run_type"] == "scheduled"]
    tis = st.task_instances(INGEST) + st.task_instances(AUDIT)
    by_run: dict[tuple[str, str], list[dict]] = {}
    for ti in tis:
        by_run.setdefault((ti["dag_id"], ti["dag_run_id"]), []).append(ti)
    context = (
        f"ingest runs {[(r['dag_run_id'], r['state']) for r in ingest_runs]}\n"
        f"audit runs {[(r['dag_run_id'], r['state']) for r in audit_runs]}\n"
        + "\n".join(
            f"{ti['dag_id']} {ti['dag_run_id']} {ti['task_id']} {ti['state']} pool={ti['pool']} "
            f"scheduled={ti['scheduled_when']} start={ti['start_date']} end={ti['end_date']}"
            for ti in sorted(tis, key=lambda t: t["start_date"] or "~")
        )
    )
    assert not [r for r in ingest_runs + audit_runs if r["state"] == "failed"], context + st.report()
    # Nothing but the scheduler started them.
    assert {r["run_type"] for d in (INGEST, AUDIT) for r in st.runs(d)} == {"scheduled"}, context
    ok_ingest = [r for r in ingest_runs if r["state"] == "success"]
    ok_audit = [r for r in audit_runs if r["state"] == "success"]
    assert len(ok_ingest) >= 2 and ok_audit, context
    for dag_id, runs, tasks in (
        (INGEST, ok_ingest, {"capture__cdc_sched_source", "ingest"}),
        (AUDIT, ok_audit, {"audit"}),
    ):
        for r in runs:
            states = {ti["task_id"]: ti["state"] for ti in by_run[(dag_id, r["dag_run_id"])]}
            # Every task the DAG has beyond these (e.g. a teardown) is not this test's business.
            assert {t: states.get(t) for t in tasks} == dict.fromkeys(tasks, "success"), (
                r["dag_run_id"],
                states,
                context,
            )

    # The table's writers (ingest and audit tasks) share the one-slot pool: never two at a time.
    writers = [ti for ti in tis if ti["task_id"] in ("ingest", "audit") and ti["start_date"]]
    assert {ti["pool"] for ti in writers} == {POOL}, context
    writers.sort(key=lambda ti: _ts(ti["start_date"]))
    for a, b in zip(writers, writers[1:]):
        assert a["end_date"] and _ts(b["start_date"]) >= _ts(a["end_date"]), (
            f"{b['dag_id']}/{b['dag_run_id']} started while {a['dag_id']}/{a['dag_run_id']} held {POOL}\n{context}"
        )
    # ... and one of them was ready while another held the slot and waited for it.
    waited = [
        (a, b)
        for a, b in zip(writers, writers[1:])
        if b["scheduled_when"] and _ts(b["scheduled_when"]) < _ts(a["end_date"])
    ]
    assert waited, "no writer ever waited for the pool slot\n" + context

    # A second scheduled ingest run started only after the first ended, and so did its ingest task.
    started = sorted((r for r in ingest_runs if r["start_date"]), key=lambda r: _ts(r["start_date"]))
    for a, b in zip(started, started[1:]):
        assert a["end_date"] and _ts(b["start_date"]) >= _ts(a["end_date"]), context
    ingest_tis = sorted(
        (ti for ti in writers if ti["dag_id"] == INGEST and ti["state"] == "success"),
        key=lambda ti: _ts(ti["start_date"]),
    )
    assert len(ingest_tis) >= 2, context
    assert _ts(ingest_tis[1]["start_date"]) >= _ts(ingest_tis[0]["end_date"]), context

    # The ingest task's post_execute announced the endpoint's consistent point (lake.points) in
    # its Asset event: read from the catalog after the commit, in the real worker.
    events = st.api("GET", "/assets/events?limit=100&order_by=-timestamp")["asset_events"]
    points = [e for e in events if str(e.get("name") or e.get("uri") or "").startswith(("points.", "cdc://points/"))]
    assert points, f"no consistent-point asset event among {[e.get('name') for e in events]}\n{context}"
    newest = points[0]["extra"].get("point")
    assert newest and newest["snapshots"] and newest["lsn"] > 0, (points[0], context)

    # --- the lake: both rounds of changes arrived, nothing else ----------------------------
    expected = source.rows()
    assert len(expected) == len(SCHEMAS) * (ROWS + 10 - 4)
    assert _lake_rows(env) == expected
    print(
        f"\nbootstrap {t_boot - t0:.0f}s, scheduled runs {t_done - t_boot:.0f}s: {len(ok_ingest)} ingest, "
        f"{len(ok_audit)} audit ok; {len(waited)} pool wait(s)\n{context}"
    )


def _hitl(st: Stack, run_id: str, dag_id: str = BOOTSTRAP, task_id: str = APPROVE) -> dict | None:
    """The approval's human-in-the-loop detail, once its task waits for an answer and the
    scheduler has taken in the end of the workload that parked it.

    Airflow 3.3.2 race, seen in CI: an answer given within about a second of the park, before the
    scheduler processed the parking workload's executor event ("success"), re-queued the task;
    the late event then made the scheduler mark the re-queued task failed ("Executor reported
    that the task instance ... finished with state success, but the task instance's state
    attribute is queued"). A person takes longer than that; this test waits for the event."""
    tis = {ti["task_id"]: ti for ti in st.task_instances(dag_id) if ti["dag_run_id"] == run_id}
    if (tis.get(task_id) or {}).get("state") != "awaiting_input":
        return None
    parked = f"Received executor event with state success for task instance TaskInstanceKey(dag_id='{dag_id}', task_id='{task_id}', run_id='{run_id}'"
    if parked not in st.logs["scheduler"].read_text(errors="replace"):
        return None
    return st.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/-1/hitlDetails")


def _run_states(st: Stack, run_id: str, dag_id: str = BOOTSTRAP) -> tuple[str, dict[str, str]]:
    run = next(r for r in st.runs(dag_id) if r["dag_run_id"] == run_id)
    tis = {ti["task_id"]: ti["state"] for ti in st.task_instances(dag_id) if ti["dag_run_id"] == run_id}
    return run["state"], tis


def _current_snapshot(env) -> int:
    from cdc_lakehouse.settings import LakeSettings
    from pyiceberg.catalog import load_catalog

    lake = LakeSettings.from_env(env)
    cat = load_catalog(lake.catalog_name, **lake.pyiceberg_properties())
    return cat.load_table(f"sched.{TABLE}").current_snapshot().snapshot_id


ARTIFACTS = ROOT / ".local" / "test-artifacts"


def _screenshot(url: str, must_show: list[str], name: str) -> None:
    """Open `url` in headless Chromium (tests/ui/test_airflow_ui.py's way), wait until the page
    shows every text of `must_show`, and keep a screenshot in .local/test-artifacts."""
    import shutil

    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=shutil.which("chromium") or "/usr/bin/chromium",
            headless=True,
            args=["--disable-background-networking", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"],
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(60_000)
            page.goto(url)
            try:
                for text in must_show:
                    page.get_by_text(text).first.wait_for()
            finally:
                page.screenshot(path=str(ARTIFACTS / name), full_page=True)
        finally:
            browser.close()


def test_a_rebootstrap_of_a_table_with_rows_waits_for_an_approval(sched_env, stack):
    """#53: the first bootstrap (above) went ahead without asking; a second one, now that the
    table holds rows, waits in `awaiting_input` with what it would replace. Rejected through the
    REST API it writes nothing; approved, it re-bootstraps the table to equal the source. Then the
    quarantine replay's DAG, with nothing quarantined, goes ahead without one and its job runs."""
    env, _, _, source = sched_env
    st = stack
    first = next(r for r in st.runs(BOOTSTRAP) if r["state"] == "success")
    _, first_tis = _run_states(st, first["dag_run_id"])
    assert first_tis == {
        "review": "success",
        APPROVE: "skipped",
        "no_approval_needed": "success",
        "bootstrap": "success",
    }

    def trigger(shards: list[str]) -> str:
        run = st.api(
            "POST",
            f"/dags/{BOOTSTRAP}/dagRuns",
            {"logical_date": datetime.now(UTC).isoformat(), "conf": {"shards": shards}},
        )
        return run["dag_run_id"]

    # Rejected: the bootstrap is skipped, the run ends, the lake has not moved.
    before = _current_snapshot(env)
    rejected = trigger(["s1"])
    detail = _wait(st, "the approval to wait", lambda: _hitl(st, rejected), time.time() + 180, interval=2)
    assert detail["subject"] == f"re-bootstrap of {TABLE}: 1 shard(s)", detail
    assert (
        "| s1 |" in detail["body"]
        and "| s0 |" not in detail["body"]
        and " rows** in all shards (snapshot" in detail["body"]
    ), detail
    assert detail["options"] == ["Approve", "Reject"] and detail["response_received"] is False, detail
    # As a person sees it: Airflow's Required Actions page in headless Chromium, kept as an artefact.
    _screenshot(
        f"{st.url}/required_actions?response_received=false",
        [f"re-bootstrap of {TABLE}: 1 shard(s)", BOOTSTRAP],
        "approval-waiting.png",
    )
    _screenshot(
        f"{st.url}/dags/{BOOTSTRAP}/runs/{rejected}/tasks/{APPROVE}/required_actions",
        ["Reject to leave the table as it is", "Approve"],
        "approval-details.png",
    )
    st.api(
        "PATCH",
        f"/dags/{BOOTSTRAP}/dagRuns/{rejected}/taskInstances/{APPROVE}/-1/hitlDetails",
        {"chosen_options": ["Reject"]},
    )
    _wait(st, "the rejected run to end", lambda: _run_states(st, rejected)[0] == "success", time.time() + 180)
    assert _run_states(st, rejected)[1] == {
        "review": "success",
        APPROVE: "success",
        "no_approval_needed": "skipped",
        "bootstrap": "skipped",
    }
    assert _current_snapshot(env) == before

    # Approved: the re-bootstrap runs and the lake equals the source, changed since.
    source.change(3)
    approved = trigger([])
    _wait(st, "the second approval to wait", lambda: _hitl(st, approved), time.time() + 180, interval=2)
    st.api(
        "PATCH",
        f"/dags/{BOOTSTRAP}/dagRuns/{approved}/taskInstances/{APPROVE}/-1/hitlDetails",
        {"chosen_options": ["Approve"]},
    )
    _wait(st, "the approved run to end", lambda: _run_states(st, approved)[0] == "success", time.time() + 300)
    assert _run_states(st, approved)[1]["bootstrap"] == "success"
    assert _current_snapshot(env) != before
    assert _lake_rows(env) == source.rows()

    # The quarantine replay's DAG: nothing is quarantined, so it needs no approval and its job
    # (spark_jobs/replay.py) runs through the scheduler and examines nothing.
    replay_dag = f"cdc_replay__{TABLE}"
    st.set_paused(replay_dag, False)
    replay_run = st.api("POST", f"/dags/{replay_dag}/dagRuns", {"logical_date": datetime.now(UTC).isoformat()})
    run_id = replay_run["dag_run_id"]

    def replay_states() -> dict[str, str] | None:
        run = next(r for r in st.runs(replay_dag) if r["dag_run_id"] == run_id)
        assert run["state"] != "failed", st.report()
        if run["state"] != "success":
            return None
        return {ti["task_id"]: ti["state"] for ti in st.task_instances(replay_dag) if ti["dag_run_id"] == run_id}

    states = _wait(st, "the replay run", replay_states, time.time() + 300)
    assert states == {"review": "success", APPROVE: "skipped", "no_approval_needed": "success", "replay": "success"}
    assert _current_snapshot(env) != before and _lake_rows(env) == source.rows()


def test_an_ingest_run_past_its_freshness_bound_misses_its_deadline_and_alerts(sched_env, stack):
    """#53: the scheduled ingest runs above started after their deadline (the table's 30 s bound,
    from the start of a one-minute interval). Airflow marks each run's deadline missed (what the
    UI's run page shows) and its executor runs the callback, which records a `freshness` alert
    naming the table and the run."""
    env, _, _, _ = sched_env
    st = stack
    runs = [r["dag_run_id"] for r in st.runs(INGEST) if r["run_type"] == "scheduled"]
    assert runs
    alerts_file = Path(env["AIRFLOW_HOME"]) / "cdc_alerts.jsonl"

    def deadline_alerts() -> list[dict]:
        lines = alerts_file.read_text().splitlines() if alerts_file.exists() else []
        return [
            a
            for a in map(json.loads, lines)
            if a["kind"] == "freshness" and a["dag_id"] == INGEST and "not finished" in a["summary"]
        ]

    found = _wait(st, "a deadline alert", deadline_alerts, time.time() + 180)
    assert {a["run_id"] for a in found} <= set(runs), (found, runs)
    first = found[0]
    assert first["tables"] == [TABLE] and first["threshold"] == 30 and first["details"]["bound"].startswith("30"), first
    for run_id in {a["run_id"] for a in found}:
        shown = st.api("GET", f"/dags/{INGEST}/dagRuns/{run_id}/deadlines", prefix="/ui")["deadlines"]
        assert [(d["alert_name"], d["missed"]) for d in shown] == [("freshness", True)], shown


def _key(run: dict) -> str:
    """The partition key of a producer run's asset events (orchestration.tasks.run_partition_key)."""
    from types import SimpleNamespace

    from cdc_lakehouse.orchestration.tasks import run_partition_key

    dag_run = SimpleNamespace(partition_key=run.get("partition_key"), run_after=_ts(run["run_after"]))
    return run_partition_key(
        {
            "dag_run": dag_run,
            "data_interval_start": _ts(run["data_interval_start"]),
            "logical_date": _ts(run["logical_date"]),
        }
    )


def _produced(st: Stack) -> list[str]:
    """The key of each run whose ingest or bootstrap task succeeded."""
    keys = []
    for dag_id, task_id in ((INGEST, "ingest"), (BOOTSTRAP, "bootstrap")):
        ok = {
            ti["dag_run_id"]
            for ti in st.task_instances(dag_id)
            if ti["task_id"] == task_id and ti["state"] == "success"
        }
        keys += [_key(r) for r in st.runs(dag_id) if r["dag_run_id"] in ok]
    return keys


def _probe_keys(st: Stack) -> list[str] | None:
    """The partition keys of the probe's runs, once none is left to start or finish."""
    runs = st.runs(PROBE)
    if any(r["state"] in ("queued", "running") for r in runs):
        return None
    assert all(r["state"] == "success" for r in runs), runs
    return sorted(r["partition_key"] for r in runs)


def test_a_backfill_or_a_rerun_of_one_interval_reruns_that_intervals_dependents_and_no_others(sched_env, stack):
    """#53: every asset event of the ingest and the bootstrap carries its run's partition key, and
    a partition-aware consumer (the probe, scheduled like the derived, export and feed DAGs) runs
    once per key: the keys of the runs above, two of them a minute apart, each once; a
    backfill of two intervals, once each; a re-run of one of them, once more for that key only."""
    st = stack
    t0 = time.time()
    produced = _produced(st)
    assert len(produced) >= 3, produced  # the first bootstrap, the approved one, the scheduled ingests
    keys = _wait(
        st,
        "the probe's runs of the keys so far",
        lambda: (k := _probe_keys(st)) and len(k) >= len(produced) and k,
        t0 + 180,
    )
    assert keys == sorted(produced), (keys, produced)

    # A backfill of two one-minute intervals, an hour back (a paused DAG's runs do not start).
    start = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(hours=1)
    st.set_paused(INGEST, False)
    try:
        st.api(
            "POST",
            "/backfills",
            {
                "dag_id": INGEST,
                "from_date": start.isoformat(),
                "to_date": (start + timedelta(minutes=1)).isoformat(),
                "max_active_runs": 1,
            },
        )

        def backfilled() -> list[dict] | None:
            runs = [r for r in st.runs(INGEST) if r["run_type"] == "backfill"]
            return runs if len(runs) == 2 and all(r["state"] == "success" for r in runs) else None

        runs = _wait(st, "the backfill's two ingest runs", backfilled, time.time() + 300)
        filled = sorted(_key(r) for r in runs)
        assert filled == [
            start.strftime("%Y-%m-%dT%H:%M:%S"),
            (start + timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M:%S"),
        ]

        def probe_has(expected: dict[str, int]):
            def check():
                got = _probe_keys(st)
                return got is not None and {k: got.count(k) for k in expected} == expected and got

            return check

        _wait(st, "the probe's runs of the backfill", probe_has(dict.fromkeys(filled, 1)), time.time() + 180)

        # A re-run of one backfilled interval (its ingest task cleared, as from the UI).
        rerun = next(r for r in runs if _key(r) == filled[0])
        st.api(
            "POST",
            f"/dags/{INGEST}/clearTaskInstances",
            {"dry_run": False, "dag_run_id": rerun["dag_run_id"], "task_ids": ["ingest"], "only_failed": False},
        )

        def rerun_done() -> bool:
            tis = [
                ti
                for ti in st.task_instances(INGEST)
                if ti["dag_run_id"] == rerun["dag_run_id"] and ti["task_id"] == "ingest"
            ]
            return bool(tis) and tis[0]["try_number"] >= 2 and tis[0]["state"] == "success"

        _wait(st, "the re-run of one backfilled interval", rerun_done, time.time() + 300)
        got = _wait(st, "the probe's run of the re-run", probe_has({filled[0]: 2, filled[1]: 1}), time.time() + 180)
    finally:
        st.set_paused(INGEST, True)
    # The re-run's dependent run as the UI shows it: its partition key, and the event behind it.
    probe_run = [r for r in st.runs(PROBE) if r["partition_key"] == filled[0]][-1]["dag_run_id"]
    _screenshot(
        f"{st.url}/dags/{PROBE}/runs/{urllib.parse.quote(probe_run, safe='')}",
        ["Partition Key", filled[0]],
        "partitioned-run.png",
    )
    print(f"\nprobe runs by key: {got}")


def test_a_column_dropped_at_the_source_waits_for_keep_or_drop_then_its_batch_applies(sched_env, stack):
    """#53 (last: the source loses a column): the scheduled ingest finds `qty` dropped with no
    decision in the YAML; its table waits (the task succeeds, nothing applied) and decide_dropped
    asks in `awaiting_input`. Answered `drop` through the REST API, record_dropped keeps the
    choice on the table and ingest_again applies the batch: the lake loses `qty`, equals the source."""
    env, _, _, source = sched_env
    st = stack
    source.execute(
        *(f"ALTER TABLE {s}.item DROP COLUMN qty" for s in SCHEMAS),
        *(f"UPDATE {s}.item SET name = name || ' after drop' WHERE id = {ROWS}" for s in SCHEMAS),
    )
    st.set_paused(INGEST, False)
    try:

        def asking() -> tuple[str, dict] | None:
            for r in st.runs(INGEST):
                if r["run_type"] == "scheduled" and (details := _hitl(st, r["dag_run_id"], INGEST, "decide_dropped")):
                    return r["dag_run_id"], details
            return None

        run_id, details = _wait(st, "the keep/drop question", asking, time.time() + 240)
        assert details["options"] == ["keep_null", "drop"] and "qty" in details["subject"], details
        assert "s0" in details["body"] and "changelog keeps its history" in details["body"], details["body"]
        st.api(
            "PATCH",
            f"/dags/{INGEST}/dagRuns/{run_id}/taskInstances/decide_dropped/-1/hitlDetails",
            {"chosen_options": ["drop"]},
        )
        final = _wait(
            st,
            "the ingest after the choice",
            lambda: (s := _run_states(st, run_id, INGEST))[0] in ("success", "failed") and s,
            time.time() + 240,
        )
    finally:
        st.set_paused(INGEST, True)
    assert final[0] == "success" and final[1]["ingest_again"] == "success", final
    assert final[1]["record_dropped"] == "success" and final[1]["ingest"] == "success", final

    from cdc_lakehouse.settings import LakeSettings
    from pyiceberg.catalog import load_catalog

    lake = LakeSettings.from_env(env)
    table = load_catalog(lake.catalog_name, **lake.pyiceberg_properties()).load_table(f"sched.{TABLE}")
    assert "qty" not in [f.name for f in table.schema().fields]
    assert json.loads(table.metadata.properties["cdc.dropped-columns"]) == {"decided": {"qty": "drop"}, "pending": {}}
    got = table.scan(selected_fields=("_cdc_shard", "id", "name")).to_arrow().to_pylist()
    expected = {(s, i): n for (s, i), (n, _) in source.rows(columns="id, name, 0").items()}
    assert {(r["_cdc_shard"], r["id"]): r["name"] for r in got} == expected
