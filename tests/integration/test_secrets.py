"""Secrets, for real: one spark-submit on local[2] through the operator (the job gets its secrets
from the 0600 file, the Spark UI shows none, no log line or alert holds one, no file is left
behind), a JVM started from Python (tests, `python spark_jobs/x.py` without a server) with no secret on
its command line, and libpq DSNs of passwords with spaces, quotes and backslashes against a
password-checking server. Among the secrets: a catalog property named innocently and marked
secret in the lake connection (secret by origin), and one named like a credential but given as a
plain property (secret by the name rule). spark-submit's argv for YARN and Kubernetes is built for
every master in tests/unit/test_secrets_transport.py."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg2
import pytest
import structlog
from cdc_lakehouse.settings import LakeSettings, SourceEndpoint

from devstack.localstack import LocalPostgres, free_port
from tests.conftest import ROOT
from tests.helpers import lake_connection_json
from tests.unit.test_secrets_transport import (
    APIKEY_KEY,
    APIKEY_MARKER,
    AWS_MARKER,
    LAKE_MARKER,
    PROP_MARKER,
    SRC_MARKER,
    TENANT_KEY,
    TENANT_MARKER,
    leaks,
)

CONN = "cdc_secret_probe_src"
SID_MARKER = "S1d-probe-value-789"


def sha(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def probe_connections(monkeypatch, pg, lake, tmp_path) -> Path:
    """The probe job's connections (Spark on local[2], the lake, the source), each with a marked
    password, and an empty directory for the task's secrets file, which it returns."""
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir()
    monkeypatch.setenv("CDC_SECRETS_DIR", str(secrets_dir))
    monkeypatch.delenv("CDC_CATALOG_PASSWORD", raising=False)
    # The session's PostgreSQL trusts local connections, so these passwords are accepted as given.
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_SECRETS_PROBE", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    conn = json.loads(lake_connection_json(pg, lake, password=LAKE_MARKER))
    conn["extra"] |= {
        "catalog_properties": {APIKEY_KEY: APIKEY_MARKER},
        "secret_catalog_properties": {TENANT_KEY: TENANT_MARKER},
    }
    monkeypatch.setenv("AIRFLOW_CONN_CDC_LAKE", json.dumps(conn))
    source = {"conn_type": "postgres", "host": "127.0.0.1", "port": pg.port, "schema": "src", "login": "postgres"}
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN.upper()}", json.dumps({**source, "password": SRC_MARKER}))
    return secrets_dir


def run_probe(op, capsys=None) -> tuple[list[str], dict]:
    """Run the probe task: no secret in its log, and the job got both secrets. (log lines, probe).
    With `capsys`: the job ran in this process (Spark Connect) and printed to its stdout."""
    with structlog.testing.capture_logs() as events:
        op.execute({})
    lines = [repr(e) for e in events]
    texts = [str(e.get("event")) for e in events]
    if capsys is not None:
        printed = capsys.readouterr().out.splitlines()
        lines, texts = lines + printed, texts + printed
    assert not [line for line in lines if leaks(line)], "a secret in the task log"
    probe = json.loads(next(t for t in texts if "CDC_PROBE " in t).split("CDC_PROBE ", 1)[1])
    # By spark-submit the secrets come in the task's 0600 file, which the job loads and deletes; on
    # Spark Connect the job runs in the task's own process, which holds them in its environment.
    assert probe["names"] == (
        []
        if capsys is not None
        else ["CDC_CATALOG_PASSWORD", "CDC_CATALOG_SECRET_PROPERTIES", f"CDC_SOURCE_URI__{CONN.upper()}"]
    )
    assert probe["catalog_password"] == sha(LAKE_MARKER)
    assert probe["source_password"] == sha(SRC_MARKER)
    return lines, probe


@pytest.mark.slow
def test_spark_submit_on_local_gets_its_secrets_and_shows_none(pg, lake, monkeypatch, tmp_path, unique):
    secrets_dir = probe_connections(monkeypatch, pg, lake, tmp_path)
    monkeypatch.setenv("CDC_SPARK_DRIVER_MEMORY", "1g")
    _, probe = run_probe(probe_task("spark_secrets_probe", unique))
    assert_probe_shows_none(probe, secrets_dir)
    check_alert_file(monkeypatch, tmp_path)


def probe_task(conn_id: str, unique: str):
    """The probe job as a task of the project's operator, on the Spark connection `conn_id`."""
    from cdc_lakehouse.orchestration.operators import CdcSparkSubmitOperator

    return CdcSparkSubmitOperator(
        task_id="probe",
        job="probe",
        job_args=[CONN, unique, f"{TENANT_KEY},{APIKEY_KEY}"],
        source_conn_ids=[CONN],
        conn_id=conn_id,
        conf={"spark.sql.shuffle.partitions": "2"},
        application=str(ROOT / "tests" / "jobs" / "secret_probe.py"),  # a test's job: in no registry
    )


def assert_probe_shows_none(probe: dict, secrets_dir: Path) -> None:
    assert probe["note_ok"] is True  # a table property with a quote and a backslash, read back
    assert probe["jdbc_ok"] is True  # a JDBC read of the source, with its password, succeeded
    # Both properties reached the job's catalog; the UI's environment and its SQL pages (which list
    # the settings set in the running session) show no secret: Spark redacts their keys.
    assert probe["properties"] == {TENANT_KEY: sha(TENANT_MARKER), APIKEY_KEY: sha(APIKEY_MARKER)}
    assert probe["sql_pages"] > 0 and probe["ui_leaks"] == []
    # Set in the running session (runtime.session.get_spark), so not in the SparkConf the UI lists.
    assert probe["ui_password_value"] is None
    assert list(secrets_dir.iterdir()) == []


@pytest.mark.slow
def test_a_spark_connect_task_gets_its_secrets_and_the_server_shows_none(
    pg, lake, spark_server, monkeypatch, tmp_path, unique, capsys
):
    """The task is a Spark Connect client of the suite's server (the `spark_default` connection):
    the secrets go to its session over the connection, never to the server's command line, its
    properties file, its UI (environment and every SQL page, every session's) or its log."""
    secrets_dir = probe_connections(monkeypatch, pg, lake, tmp_path)
    _, probe = run_probe(probe_task("spark_default", unique), capsys)
    assert_probe_shows_none(probe, secrets_dir)
    # The server process: its command line, the files it was started with, its log, its event log.
    assert list((spark_server.workdir / "events").iterdir()), "the server keeps no event log"
    cmdline = Path(f"/proc/{spark_server.pid}/cmdline").read_bytes().decode(errors="replace")
    assert "SparkConnectServer" in cmdline and not leaks(cmdline)
    for f in spark_server.workdir.rglob("*"):
        if f.is_file() and f.stat().st_size < 50_000_000:
            assert not leaks(f.read_text(errors="replace")), f"a secret in {f}"


def check_alert_file(monkeypatch, tmp_path) -> None:
    """A later failure whose error echoes the marked value where no key names it (a REST catalog's
    403, say): the alert file shows none of the task's secrets."""
    from cdc_lakehouse.orchestration.alerts import on_task_failure

    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    exc = RuntimeError(f"catalog answered 403 for route {TENANT_MARKER}; source {SRC_MARKER}")
    on_task_failure({"exception": exc, "run_id": "r", "dag": type("D", (), {"dag_id": "cdc_ingest__block"})()})
    alert = (tmp_path / "cdc_alerts.jsonl").read_text()
    assert "catalog answered 403" in alert and not leaks(alert), alert


# Run in a process of its own: the JVM must be one this script starts, as spark-submit's would be.
# The lake settings as a job receives them: the public ones in CDC_LAKE_SETTINGS, the secrets
# (catalog properties among them, whatever their names) from its secrets file.
_JVM_PROBE = """
import json, sys
from cdc_lakehouse.runtime.session import get_spark
from cdc_lakehouse.settings import LakeSettings
a = json.loads(sys.argv[1])
public = {"catalog_type": "jdbc", "catalog_uri": a["uri"], "warehouse": a["warehouse"], "catalog_name": "probe",
    "landing_uri": "s3://probe-bucket/landing", "s3_endpoint": "http://127.0.0.1:9", "s3_path_style": True}
lake = LakeSettings.from_env({"CDC_LAKE_SETTINGS": json.dumps(public), "CDC_CATALOG_PASSWORD": a["lake"],
    "CDC_CATALOG_SECRET_PROPERTIES": json.dumps(a["props"]), "AWS_ACCESS_KEY_ID": "AKIAPROBE",
    "AWS_SECRET_ACCESS_KEY": a["aws"]})
spark = get_spark("probe", lake, master="local[1]", driver_memory="1g", extra={"spark.ui.enabled": "false"})
pid = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()
print("PROBE " + json.dumps({
    "cmdline": open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace"),
    "password": spark.conf.get("spark.sql.catalog.probe.jdbc.password"),
    "props": {k: spark.conf.get("spark.sql.catalog.probe." + k) for k in a["props"]},
    "aws": spark.conf.get("fs.s3a.secret.key"),
    "namespaces": [r[0] for r in spark.sql("SHOW NAMESPACES IN probe").collect()],
}))
"""


# What makes a Python process a Spark Connect client (the suite's server; pyspark's own mark).
_CONNECT_ENV = ("CDC_SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE")


@pytest.mark.slow
def test_a_jvm_started_from_python_has_no_secret_on_its_command_line(scram_pg, tmp_path):
    """pyspark starts the JVM with every builder setting as a `--conf k=v` argument, which any local
    user reads in /proc/<pid>/cmdline or `ps`: the secrets must reach the session after the start.
    The catalog is on a password-checking server, so listing it proves the password arrived."""
    conn = psycopg2.connect(scram_pg.dsn())
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("DROP DATABASE IF EXISTS cdc_probe")
        cur.execute("DROP ROLE IF EXISTS cdc_probe")
        cur.execute("CREATE ROLE cdc_probe LOGIN PASSWORD %s", (LAKE_MARKER,))
        cur.execute("CREATE DATABASE cdc_probe OWNER cdc_probe")
    conn.close()
    uri = f"postgresql://cdc_probe@127.0.0.1:{scram_pg.port}/cdc_probe"
    props = {"custom.token": PROP_MARKER, "custom.session-id": SID_MARKER}
    props |= {TENANT_KEY: TENANT_MARKER, APIKEY_KEY: APIKEY_MARKER}  # innocently named; named like a credential
    args = {
        "uri": uri,
        "warehouse": f"file://{tmp_path / 'wh'}",
        "lake": LAKE_MARKER,
        "props": props,
        "aws": AWS_MARKER,
    }
    out = subprocess.run(
        [sys.executable, "-c", _JVM_PROBE, json.dumps(args)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        # A classic session whose JVM this script starts (not the suite's Spark Connect server).
        env={**{k: v for k, v in os.environ.items() if k not in _CONNECT_ENV}, "PYTHONPATH": str(ROOT / "plugins")},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    probe = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("PROBE ")).split(" ", 1)[1])
    cmdline = probe["cmdline"].replace("\x00", " ")
    assert "spark.driver.memory" in cmdline  # the JVM's own settings do travel that way
    markers = (LAKE_MARKER, AWS_MARKER, *props.values())
    assert [m for m in markers if m in cmdline] == []
    keys = ("jdbc.password", "secret.key", "custom.token", "session-id", TENANT_KEY, APIKEY_KEY)
    assert [k for k in keys if k in cmdline] == []
    # ... and the session has every one of them; the catalog answered with the password.
    assert (probe["password"], probe["aws"], probe["props"]) == (LAKE_MARKER, AWS_MARKER, props)
    assert probe["namespaces"] == []


@pytest.fixture(scope="module")
def scram_pg(tmp_root):
    server = LocalPostgres(tmp_root / "pg-scram", free_port(), password="init-pw", fast=True)
    server.start()
    yield server
    server.destroy()


@pytest.mark.parametrize("password", [SRC_MARKER, LAKE_MARKER, "plain", "trailing\\", "'", " lead and trail "])
def test_libpq_dsn_with_awkward_passwords_authenticates(scram_pg, password):
    conn = psycopg2.connect(scram_pg.dsn())
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("DROP ROLE IF EXISTS cdc_pw_test")
        cur.execute("CREATE ROLE cdc_pw_test LOGIN PASSWORD %s", (password,))
    conn.close()
    ep = SourceEndpoint("127.0.0.1", scram_pg.port, "postgres", "cdc_pw_test", password)
    lake = LakeSettings(
        catalog_uri=f"postgresql://cdc_pw_test@127.0.0.1:{scram_pg.port}/postgres",
        warehouse="w",
        landing_uri="l",
        catalog_password=password,
    )
    for dsn in (ep.dsn(), lake.catalog_dsn()):
        with psycopg2.connect(dsn) as c, c.cursor() as cur:
            cur.execute("SELECT current_user")
            assert cur.fetchone() == ("cdc_pw_test",)
    with pytest.raises(psycopg2.OperationalError) as err:
        psycopg2.connect(SourceEndpoint("127.0.0.1", scram_pg.port, "postgres", "cdc_pw_test", password + "x").dsn())
    assert "password authentication failed" in str(err.value)
    assert not Path(scram_pg.datadir.parent / f".{scram_pg.datadir.name}.pw").exists()
