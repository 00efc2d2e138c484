"""The job server (runtime.server) for real: the test session's SparkSession is the server's, served
on a thread over a Unix socket; jobs arrive through the same client the Airflow operator uses.

A job must see every commit made since the last one (no Iceberg table cache survives a job), leave
no setting, cached frame or environment variable behind, get its secrets by file reference and
show none, be refused when the package differs, and be cancelled when its task goes away."""

from __future__ import annotations

import json
import os
import re
import socket
import time

import pytest
import yaml
from cdc_lakehouse.runtime.jobs import JOBS
from cdc_lakehouse.runtime.server import EXIT_MARK, JobServer, submit

from tests.conftest import ROOT
from tests.integration.test_secrets import CONN, probe_connections, run_probe


@pytest.fixture
def server(spark, tmp_path):
    """A job server on the session's SparkSession, plus two test-only jobs."""
    seen: dict[str, str] = {}

    def slow(argv):  # runs until cancelled; records how it ended
        print("started", flush=True)
        try:
            spark.range(10**13).selectExpr("sum(id)").collect()
            seen["slow"] = "finished"
        except Exception as exc:  # noqa: BLE001 - the cancellation is what the test wants
            seen["slow"] = str(exc)
        return 1

    def probe(argv):
        import importlib.util

        spec = importlib.util.spec_from_file_location("secret_probe", ROOT / "tests" / "jobs" / "secret_probe.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.main(*argv)

    def leave(argv):  # what a careless job leaves in its session
        from cdc_lakehouse.runtime.session import get_spark, release_spark
        from cdc_lakehouse.settings import LakeSettings

        s = get_spark("leave", LakeSettings.from_env())
        s.conf.set("spark.sql.shuffle.partitions", "7")
        s.range(3).createOrReplaceTempView("left_behind")
        s.range(5).persist().count()
        release_spark(s)
        return 0

    def look(argv):  # what the next job finds
        from cdc_lakehouse.runtime.session import get_spark, release_spark
        from cdc_lakehouse.settings import LakeSettings

        s = get_spark("look", LakeSettings.from_env())
        seen["look"] = {
            "partitions": s.conf.get("spark.sql.shuffle.partitions"),
            "views": [t.name for t in s.catalog.listTables() if t.isTemporary],
        }
        release_spark(s)
        return 0

    jobs = {**JOBS, "slow": slow, "probe": probe, "leave": leave, "look": look}
    srv = JobServer(spark, tmp_path / "s" / "jobs.sock", jobs=jobs)
    thread = srv.start_thread()
    srv.seen = seen
    yield srv
    srv.stop()
    thread.join(timeout=30)


def run(srv, job, *argv, env=None):
    lines: list[str] = []
    rc = submit(srv.sock_path, job, list(argv), env or {}, lines.append)
    return rc, "\n".join(lines)


def catalog_connections(pg) -> int:
    """Open connections to the lake's catalog database (each Iceberg JDBC catalog holds a pool)."""
    import psycopg2

    with psycopg2.connect(pg.uri()) as c, c.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = 'lake_catalog'")
        return cur.fetchone()[0]


def test_jobs_see_outside_commits_and_leave_nothing_behind(server, source, spark, lake, pg, tmp_path):
    s = source
    s.capture()
    s.bootstrap(s.block)
    conf_dir = tmp_path / "tables"
    conf_dir.mkdir()
    (conf_dir / f"{s.block.name}.yaml").write_text(
        yaml.safe_dump(s.block.model_dump(mode="json", exclude_defaults=True))
    )
    args = ("--tables", s.block.name, "--config-dir", str(conf_dir))
    env_before, partitions = dict(os.environ), spark.conf.get("spark.sql.shuffle.partitions")

    rc, out = run(server, "audit", *args, env={"CDC_TEST_JOB_MARK": "x"})
    assert rc == 0, out
    result = json.loads(out.split("CDC_RESULT audit ", 1)[1].splitlines()[0])
    assert (result["status"], result["verdict"]) == ("ok", "ok"), result

    # A commit from another session (another application, as far as the jobs know): the next job
    # must see it, where a catalog cache kept from the first job would still hold every row.
    cur = lake.qualified(s.block.current_table)
    ids = [r.id for r in spark.table(cur).orderBy("id").limit(3).collect()]
    spark.sql(f"DELETE FROM {cur} WHERE id IN ({', '.join(map(str, ids))})")
    open_before = catalog_connections(pg)
    rc, out = run(server, "audit", *args)
    assert rc == 1, out
    failed = json.loads(out.split("CDC_RESULT audit ", 1)[1].splitlines()[0])
    assert failed["status"] == "failed", failed
    assert sum(int(m) for m in re.findall(r"missing (\d+)", failed["error"])) == len(ids), failed

    # Nothing of the jobs stays: environment, SQL settings, cached or checkpointed frames.
    assert dict(os.environ) == env_before
    assert spark.conf.get("spark.sql.shuffle.partitions") == partitions
    assert spark.sparkContext._jsc.sc().getPersistentRDDs().size() == 0
    # Nor its catalogs' connection pools (one more connection per job, before release_spark closed
    # them). A closed connection's backend leaves pg_stat_activity a moment later: wait for it.
    deadline = time.time() + 10
    while catalog_connections(pg) > open_before and time.time() < deadline:
        time.sleep(0.2)
    assert catalog_connections(pg) == open_before

    # A bad request fails the job with the reason; the server keeps serving.
    rc, out = run(server, "audit", "--tables", "nope", "--config-dir", str(conf_dir))
    assert rc == 1 and "['nope'] not found" in out, out
    rc, out = run(server, "no_such_job")
    assert rc == 2 and "unknown job 'no_such_job'" in out, out
    with socket.socket(socket.AF_UNIX) as c:  # a task built from another version of the package
        c.connect(str(server.sock_path))
        c.sendall((json.dumps({"job": "audit", "argv": list(args), "fingerprint": "other"}) + "\n").encode())
        reply = c.makefile().read()
    assert f"{EXIT_MARK}2" in reply and "restart it" in reply, reply
    assert server.jobs_run == 3  # the unknown job and the other package never ran


def test_a_job_finds_nothing_the_previous_one_left(server, spark):
    """SQL settings and temporary views are per job session; cached frames are dropped after each
    job; the server's context keeps running (a job's release stops nothing)."""
    expected = spark.conf.get("spark.sql.shuffle.partitions")
    assert run(server, "leave")[0] == 0
    assert spark.sparkContext._jsc.sc().getPersistentRDDs().size() == 0
    assert run(server, "look")[0] == 0
    assert server.seen["look"] == {"partitions": expected, "views": []}
    assert expected != "7"
    assert spark.range(2).count() == 2


def test_a_task_that_goes_away_cancels_its_spark_work(server):
    before = server.jobs_run
    with socket.socket(socket.AF_UNIX) as c:
        c.connect(str(server.sock_path))
        c.sendall((json.dumps({"job": "slow", "argv": [], "fingerprint": server.fingerprint}) + "\n").encode())
        assert c.makefile().readline().strip() == "started"
    deadline = time.time() + 300  # a bound on waiting, not a timing assertion
    while server.jobs_run == before and time.time() < deadline:
        time.sleep(0.5)
    assert server.jobs_run == before + 1, "the job never ended"
    assert "cancel" in server.seen["slow"].lower(), server.seen["slow"]


@pytest.mark.slow
def test_operator_on_the_server_gets_its_secrets_and_shows_none(server, pg, lake, monkeypatch, tmp_path, unique):
    """The operator's server path: same secrets by reference as spark-submit (test_secrets.py), no
    secret in the task log or the Spark UI, no file left, and the server's environment restored."""
    from cdc_lakehouse.orchestration.operators import CdcSparkSubmitOperator

    secrets_dir = probe_connections(monkeypatch, pg, lake, tmp_path)
    monkeypatch.setenv("CDC_SPARK_SERVER", str(server.sock_path))
    op = CdcSparkSubmitOperator(
        task_id="probe", job="probe", job_args=[CONN, unique], source_conn_ids=[CONN], conn_id="spark_secrets_probe"
    )
    env_before = dict(os.environ)
    lines, probe = run_probe(op)
    assert any("on the job server" in line for line in lines), lines[:5]
    # The test session has no Spark UI (test_secrets.py checks the UI of a spark-submit job).
    assert (probe["ui_leaks"], probe["ui_password_value"]) == ([], None)
    assert list(secrets_dir.iterdir()) == []
    assert dict(os.environ) == env_before, "the job's secrets stayed in the server's environment"


def test_a_job_needing_other_hadoop_settings_is_refused(spark, lake):
    """S3 keys and endpoint live in the SparkContext's Hadoop settings, which a job session cannot
    change: the job is refused naming the settings (never their values), not run with the server's."""
    from cdc_lakehouse.runtime.session import get_spark, share_session

    s3_lake = lake.with_(warehouse="s3a://bucket/wh", s3_endpoint="http://127.0.0.1:9")
    share_session(spark)
    try:
        with pytest.raises(ValueError, match=r"spark\.hadoop\.fs\.s3a\.endpoint") as exc:
            get_spark("refused", s3_lake)
        assert "127.0.0.1:9" not in str(exc.value)
        job = get_spark("accepted", lake)
        assert job is not spark and job.sparkContext is spark.sparkContext
    finally:
        share_session(None)
        # get_spark made the job session this thread's active one: the next tests use the suite's.
        spark.sparkContext._jvm.org.apache.spark.sql.SparkSession.setActiveSession(spark._jsparkSession)


def test_a_killed_demos_server_is_stopped_by_the_next_demo(spark, tmp_path):
    """`make demo` names its server's socket for its pid; a demo killed with SIGKILL leaves that
    server running. The next demo stops it, removes a dead server's socket, and leaves a live
    demo's alone."""
    import subprocess

    from cdc_lakehouse.dev.demo import stop_orphaned_servers

    def gone_pid() -> int:  # a process that has exited (and been reaped)
        proc = subprocess.Popen(["true"])  # noqa: S607
        proc.wait()
        return proc.pid

    folder = tmp_path / "srv"
    orphan = JobServer(spark, folder / f"demo-{gone_pid()}.sock", jobs={})
    thread = orphan.start_thread()
    stale = folder / f"demo-{gone_pid()}.sock"
    stale.touch()  # a socket whose server died with its demo
    live = folder / f"demo-{os.getpid()}.sock"
    live.touch()
    try:
        assert set(stop_orphaned_servers(folder)) == {orphan.sock_path, stale}
        thread.join(timeout=30)
        assert not thread.is_alive() and not orphan.sock_path.exists() and not stale.exists()
        assert live.exists()
    finally:
        orphan.stop()
