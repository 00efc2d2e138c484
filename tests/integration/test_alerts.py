"""Alerts delivered for real: a local SMTP server (aiosmtpd) and SNS on a local AWS server (moto in
server mode, the topic subscribed by an SQS queue the test reads), through Airflow's SMTP and
Amazon provider notifiers, by the code paths the DAGs run:

- task_failed: the on_failure_callback wired into every task of the built DAGs, with a realistic
  context, and (slow) a real `airflow dags test` whose capture fails on an unreachable source;
- wal_retained: a real capture of a real replication slot (capture_endpoint, as the capture task);
- audit_failing and freshness: the DAGs' check_alerts tasks over rows in the real cdc_meta
  tables, written by the jobs' own meta_append.

Every message must name the table, the figure and the threshold, and never the marker password.
These servers are private to this module (own ports), apart from the local stack's.
"""

from __future__ import annotations

import email
import email.policy
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import psycopg2
import pytest

from tests.conftest import ROOT
from tests.helpers import init_airflow_home

MARKER = "Marker-Pw-7f3c9e"
REGION = "us-east-1"


class _Sink:
    """aiosmtpd handler keeping every message it receives."""

    def __init__(self):
        self.messages: list[email.message.EmailMessage] = []
        self.lock = threading.Lock()

    async def handle_DATA(self, server, session, envelope):  # noqa: N802 - aiosmtpd's hook name
        msg = email.message_from_bytes(envelope.content, policy=email.policy.default)
        msg["X-Envelope-To"] = ", ".join(envelope.rcpt_tos)
        with self.lock:
            self.messages.append(msg)
        return "250 OK"

    def take(self, expected: int = 1, timeout: float = 15) -> list[dict[str, str]]:
        deadline = time.time() + timeout
        while time.time() < deadline:
            with self.lock:
                if len(self.messages) >= expected:
                    out, self.messages = self.messages, []
                    return [
                        {
                            "subject": str(m["Subject"]),
                            "to": str(m["X-Envelope-To"]),
                            "from": str(m["From"]),
                            "body": m.get_body(("html", "plain")).get_content(),
                        }
                        for m in out
                    ]
            time.sleep(0.1)
        raise AssertionError(f"expected {expected} e-mail(s), got {len(self.messages)}")


@pytest.fixture(scope="module")
def smtp():
    from aiosmtpd.controller import Controller

    from devstack.localstack import free_port

    sink = _Sink()
    controller = Controller(sink, hostname="127.0.0.1", port=free_port())
    controller.start()
    yield sink, controller.port
    controller.stop()


@pytest.fixture(scope="module")
def sns(tmp_path_factory):
    """A moto server of its own; a topic whose messages land in an SQS queue."""
    import boto3
    from moto.server import ThreadedMotoServer

    from devstack.localstack import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    kw = {
        "endpoint_url": url,
        "region_name": REGION,
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
    }
    sns_client, sqs = boto3.client("sns", **kw), boto3.client("sqs", **kw)
    topic = sns_client.create_topic(Name="cdc-alerts")["TopicArn"]
    queue = sqs.create_queue(QueueName="cdc-alerts-inbox")["QueueUrl"]
    queue_arn = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    sns_client.subscribe(TopicArn=topic, Protocol="sqs", Endpoint=queue_arn)

    def take(expected: int = 1, timeout: float = 15) -> list[dict]:
        got, deadline = [], time.time() + timeout
        while len(got) < expected and time.time() < deadline:
            r = sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10, WaitTimeSeconds=1)
            for m in r.get("Messages", []):
                got.append(json.loads(m["Body"]))  # the SNS envelope: Subject, Message, MessageAttributes
                sqs.delete_message(QueueUrl=queue, ReceiptHandle=m["ReceiptHandle"])
        assert len(got) >= expected, f"expected {expected} SNS message(s), got {len(got)}"
        return got

    yield SimpleNamespace(url=url, topic=topic, take=take)
    server.stop()


@pytest.fixture(scope="module")
def alert_env(pg, lake, smtp, sns, tmp_path_factory):
    """Connections, table configs and the alerting file the tasks read, in this process's environment."""
    base = tmp_path_factory.mktemp("alerts")
    src_db = "alerts_src"
    pg.ensure_database(src_db)
    conn = psycopg2.connect(pg.dsn(src_db))
    conn.autocommit = True
    with conn.cursor() as cur:
        for s in ("s0", "s1"):
            cur.execute(f"CREATE SCHEMA IF NOT EXISTS {s}")
            cur.execute(f"CREATE TABLE IF NOT EXISTS {s}.item (id bigint PRIMARY KEY, v text)")
    conn.close()
    tables = base / "tables"
    tables.mkdir()
    (tables / "al_wal.yaml").write_text(
        textwrap.dedent("""
        name: al_wal
        source: {table: item, shards: [{conn_id: cdc_alert_src, schemas: [s0, s1]}]}
        primary_key: [id]
        lake: {namespace: alerts}
        alerts: {retained_wal_bytes: 1}     # any retained WAL is too much: the alert must fire
    """)
    )
    (tables / "al_audit.yaml").write_text(
        textwrap.dedent("""
        name: al_audit
        source: {table: item, shards: [{conn_id: cdc_alert_down, schemas: [s0, s1]}]}
        primary_key: [id]
        lake: {namespace: alerts}
        alert_emails: [owner@test.local]
        alerts: {audit_failed_runs: 3, freshness_sla: 30m, renotify_every_runs: 2}
    """)
    )
    alerting = base / "alerting.yaml"
    alerting.write_text(
        textwrap.dedent(f"""
        channels:
          - {{name: oncall, type: smtp, to: [oncall@test.local], smtp_conn_id: smtp_default,
              from_email: cdc@test.local}}
          - {{name: ops_sns, type: sns, target_arn: "{sns.topic}", aws_conn_id: aws_cdc_alerts,
              region_name: {REGION}}}
        alert_emails: {{smtp_conn_id: smtp_default, from_email: cdc@test.local}}
    """)
    )
    down_port = _closed_port()
    env = {
        "CDC_TABLES_DIR": str(tables),
        "CDC_ALERTING_FILE": str(alerting),
        "AIRFLOW_HOME": str(base / "airflow"),
        "AIRFLOW_CONN_SMTP_DEFAULT": json.dumps(
            {
                "conn_type": "smtp",
                "host": "127.0.0.1",
                "port": smtp[1],
                "extra": {"disable_tls": True, "disable_ssl": True, "timeout": 10, "retry_limit": 0},
            }
        ),
        "AIRFLOW_CONN_AWS_CDC_ALERTS": json.dumps(
            {
                "conn_type": "aws",
                "login": "testing",
                "password": "testing",
                "extra": {"endpoint_url": sns.url, "region_name": REGION},
            }
        ),
        "AIRFLOW_CONN_CDC_ALERT_SRC": pg.uri(src_db),
        # Unreachable, with a password that must never show up in an alert.
        "AIRFLOW_CONN_CDC_ALERT_DOWN": f"postgresql://cdc:{MARKER}@127.0.0.1:{down_port}/nowhere",
        "AIRFLOW_CONN_CDC_LAKE": json.dumps(
            {
                "conn_type": "generic",
                "host": "127.0.0.1",
                "port": pg.port,
                "schema": "lake_catalog",
                "login": "postgres",
                "extra": {"catalog_type": "jdbc", "warehouse": lake.warehouse, "landing_uri": lake.landing_uri},
            }
        ),
    }
    (base / "airflow").mkdir()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        yield SimpleNamespace(base=base, env=env, src_db=src_db, smtp=smtp[0], sns=sns)
    for row in pg.execute(f"SELECT slot_name FROM pg_replication_slots WHERE database = '{src_db}'"):
        pg.execute(f"SELECT pg_drop_replication_slot('{row[0]}')")
    pg.execute(f"DROP DATABASE IF EXISTS {src_db} WITH (FORCE)")


def _closed_port() -> int:
    from devstack.localstack import free_port

    return free_port()  # bound and released: nothing listens there


def _dags():
    from cdc_lakehouse.settings import tables_dir

    from tests.dag_files import dags_of

    return dags_of(tables_dir())


def _ti(dag_id: str, task_id: str, try_number: int = 1):
    return SimpleNamespace(
        dag_id=dag_id,
        task_id=task_id,
        try_number=try_number,
        map_index=-1,
        log_url=f"http://localhost:8080/dags/{dag_id}/runs/r/tasks/{task_id}",
    )


def _no_secret(*texts: str) -> None:
    for t in texts:
        assert MARKER not in t, t


def test_failed_task_alert_through_the_dags_callback(alert_env):
    """The on_failure_callback of a built DAG's task, as the task runner calls it."""
    dag = _dags()["cdc_ingest__al_audit"]
    task = dag.get_task("capture__cdc_alert_down")
    callbacks = task.on_failure_callback
    assert callbacks, "the capture task has no failure callback"
    error = psycopg2.OperationalError(
        f'connection to server at "127.0.0.1", port 1 failed (dsn postgresql://cdc:{MARKER}@127.0.0.1:1/nowhere '
        f"password={MARKER}): Connection refused {{{{ conn.password }}}}"
    )
    ti = _ti(dag.dag_id, task.task_id, try_number=3)
    context = {
        "dag": dag,
        "task": task,
        "ti": ti,
        "task_instance": ti,
        "run_id": "scheduled__2026-03-01T00:00:00",
        "exception": error,
    }
    for cb in callbacks:
        cb(context)

    mails = alert_env.smtp.take(2)  # the channel and the table's alert_emails
    assert sorted(m["to"] for m in mails) == ["oncall@test.local", "owner@test.local"]
    for m in mails:
        assert m["subject"] == "[CDC FAILED] capture__cdc_alert_down of al_audit failed", m["subject"]
        body = m["body"]
        assert "table: al_audit" in body and "endpoint: cdc_alert_down" in body and "try: 3" in body
        assert "Connection refused" in body and "What to do:" in body and "{{ conn.password }}" in body
        _no_secret(m["subject"], body)
    (msg,) = alert_env.sns.take(1)
    assert msg["Subject"] == "[CDC FAILED] capture__cdc_alert_down of al_audit failed"
    assert "table: al_audit" in msg["Message"] and "scheduled__2026-03-01T00:00:00" in msg["Message"]
    assert msg["MessageAttributes"]["cdc_alert_kind"]["Value"] == "task_failed"
    _no_secret(msg["Message"], json.dumps(msg))
    log_lines = (alert_env.base / "airflow" / "cdc_alerts.jsonl").read_text().splitlines()
    rec = json.loads(log_lines[-1])
    assert rec["table"] == "al_audit" and sorted(rec["sent"]) == ["alert_emails", "oncall", "ops_sns"]
    _no_secret(*log_lines)


def test_wal_alert_from_a_real_capture(alert_env, spark):
    """capture_endpoint as the capture task runs it: the slot's retained WAL is over 1 byte; the first
    run alerts, the next one (still over) is quiet, as the storm rule says."""
    from cdc_lakehouse.orchestration.tasks import capture_endpoint

    dag_id, task_id = "cdc_ingest__al_wal", "capture__cdc_alert_src"
    conn = psycopg2.connect(alert_env.env["AIRFLOW_CONN_CDC_ALERT_SRC"].replace("postgres://", "postgresql://"))
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(
            "INSERT INTO s0.item SELECT g, repeat('x', 200) FROM generate_series(1, 500) g ON CONFLICT DO NOTHING"
        )
    conn.close()
    first = datetime(2026, 3, 1, 1, tzinfo=UTC)
    ctx = {"ti": _ti(dag_id, task_id), "run_id": "scheduled__2026-03-01T00:00:00"}
    out = capture_endpoint("cdc_alert_src", first, context=ctx)
    assert out["run_id"] == "20260301T010000Z"
    mails = alert_env.smtp.take(1)
    body = mails[0]["body"]
    assert mails[0]["subject"].startswith("[CDC WAL] slot ") and "of endpoint cdc_alert_src retains" in body
    assert "tables: al_wal" in body and "threshold: 1 B (1 bytes, alerts.retained_wal_bytes)" in body
    assert "retained WAL: " in body and "pg_drop_replication_slot(" in body and f"task {task_id}" in body
    (msg,) = alert_env.sns.take(1)
    assert msg["MessageAttributes"]["cdc_alert_kind"]["Value"] == "wal_retained" and "al_wal" in msg["Message"]
    rec = json.loads((alert_env.base / "airflow" / "cdc_alerts.jsonl").read_text().splitlines()[-1])
    assert rec["kind"] == "wal_retained" and rec["figure"] > rec["threshold"] == 1

    capture_endpoint("cdc_alert_src", first + timedelta(hours=1), context=ctx)  # still over: quiet
    time.sleep(1)
    assert alert_env.smtp.messages == []


def _meta_append(spark, lake, name, rows):
    from cdc_lakehouse.lake.meta import meta_append

    meta_append(spark, lake, name, rows)


def _audit_rows(run: str, at: datetime, failing: bool) -> list[dict]:
    rows = []
    for shard in ("s0", "s1"):
        bad = failing and shard == "s1"
        rows.append(
            {
                "table_name": "al_audit",
                "audit_run": run,
                "shard": shard,
                "mode": "full",
                "source_rows": 1000,
                "lake_rows": 998 if bad else 1000,
                "missing": 2 if bad else 0,
                "extra": 0,
                "different": 5 if bad else 0,
                "in_flight": 0,
                "persistent": 7 if bad else 0,
                "buckets_compared": 0,
                "buckets_differing": 0,
                "sample_keys": json.dumps([{"kind": "missing", "id": 42}] if bad else []),
                "watermark_lsn": 1,
                "repaired": 0,
                "verdict": "fail" if bad else "ok",
                "seconds": 1.0,
                "audited_at": at,
            }
        )
    return rows


def test_audit_failing_alert_from_cdc_meta(alert_env, spark, lake):
    """The audit DAG's check_alerts task over cdc_meta.audit_results: quiet for 2 failed runs, alerts on
    the 3rd, quiet on the 4th, again on the 5th (every 2 runs), resolved when the audit passes."""
    task = _dags()["cdc_audit__al_audit"].get_task("check_alerts")
    assert task.is_teardown and task.upstream_task_ids == {"audit"}
    t0 = datetime.now(UTC) - timedelta(hours=10)
    results = []
    for i in range(1, 7):
        run = f"scheduled__audit_{i}"
        _meta_append(spark, lake, "audit_results", _audit_rows(run, t0 + timedelta(hours=i), failing=i <= 5))
        ti = _ti("cdc_audit__al_audit", "check_alerts")
        results.append(task.python_callable(["al_audit"], run_id=run, ti=ti, task_instance=ti)["al_audit"])
    assert results == [
        "no alert",
        "no alert",
        "audit_failing firing",
        "no alert",
        "audit_failing firing",
        "audit_failing resolved",
    ]
    mails = alert_env.smtp.take(6)  # 3 alerts x (channel + alert_emails)
    firing = [m for m in mails if m["to"] == "oncall@test.local"]
    assert [m["subject"] for m in firing] == [
        "[CDC AUDIT] audit of al_audit failed 3 runs in a row (alert at 3)",
        "[CDC AUDIT] audit of al_audit failed 5 runs in a row (alert at 3)",
        "[CDC RESOLVED] audit of al_audit passes again (run scheduled__audit_6)",
    ]
    body = firing[0]["body"]
    assert "failed runs in a row: 3" in body and "threshold: 3 runs (alerts.audit_failed_runs)" in body
    assert "shard s1: 7 persistent mismatching key(s): missing 2, extra 0, different 5" in body
    assert "shard s0" not in body and "cdc_bootstrap__al_audit with {&quot;shards&quot;: [&quot;s1&quot;]}" in body
    msgs = alert_env.sns.take(3)
    assert [m["Subject"] for m in msgs] == [m["subject"] for m in firing]
    _no_secret(*(m["body"] for m in mails), *(m["Message"] for m in msgs))


def test_freshness_alert_from_cdc_meta(alert_env, spark, lake):
    """The ingest DAG's check_alerts task over cdc_meta.ingest_runs: 45 min behind with a 30 min SLA."""
    task = _dags()["cdc_ingest__al_audit"].get_task("check_alerts")
    assert task.is_teardown and task.upstream_task_ids == {"ingest"}
    now = datetime.now(UTC)
    wm = {
        "v": 1,
        "shards": {
            "s0": {"lsn": 10, "ts": (now - timedelta(minutes=5)).isoformat()},
            "s1": {"lsn": 20, "ts": (now - timedelta(minutes=45)).isoformat()},
        },
    }
    row = {
        "table_name": "al_audit",
        "ingest_run": "scheduled__ingest_1",
        "interval_end": now.isoformat(),
        "landing_runs": ["20260301T010000Z"],
        "events_read": 12,
        "inserts": 12,
        "freshness_seconds": 2700.0,
        "watermark": json.dumps(wm),
        "write_mode": "merge-on-read",
        "started_at": now - timedelta(minutes=1),
        "committed_at": now,
        "status": "ok",
    }
    _meta_append(spark, lake, "ingest_runs", [row])
    ti = _ti("cdc_ingest__al_audit", "check_alerts")
    assert task.python_callable(["al_audit"], run_id="scheduled__ingest_1", ti=ti)["al_audit"] == "freshness firing"
    # a run that committed nothing (its ingest failed) is not judged here
    assert task.python_callable(["al_audit"], run_id="scheduled__ingest_2", ti=ti)["al_audit"] == "no alert"
    mails = alert_env.smtp.take(2)
    m = next(m for m in mails if m["to"] == "oncall@test.local")
    assert m["subject"] == "[CDC STALE] al_audit is 45 min behind its sources (SLA 30 min)"
    assert "freshness: 45 min (2700 s)" in m["body"] and "SLA: 30 min (1800 s, alerts.freshness_sla)" in m["body"]
    assert "stalest shard: s1" in m["body"]
    (msg,) = alert_env.sns.take(1)
    assert msg["Subject"] == m["subject"] and "stalest shard: s1" in msg["Message"]


def test_a_channel_that_cannot_deliver_fails_the_check_and_names_it(alert_env, spark, lake, monkeypatch):
    """SMTP down: SNS still gets the alert, and the check task fails naming the channel."""
    from cdc_lakehouse.orchestration.alerts import AlertDeliveryError

    monkeypatch.setenv(
        "AIRFLOW_CONN_SMTP_DEFAULT",
        json.dumps(
            {
                "conn_type": "smtp",
                "host": "127.0.0.1",
                "port": _closed_port(),
                "extra": {"disable_tls": True, "disable_ssl": True, "timeout": 5, "retry_limit": 0},
            }
        ),
    )
    now = datetime.now(UTC)
    _meta_append(
        spark,
        lake,
        "ingest_runs",
        [
            {
                "table_name": "al_audit",
                "ingest_run": "scheduled__ingest_3",
                "freshness_seconds": 30.0,
                "watermark": "{}",
                "committed_at": now,
                "status": "ok",
            }
        ],
    )  # fresh again after run 1: resolved
    task = _dags()["cdc_ingest__al_audit"].get_task("check_alerts")
    with pytest.raises(AlertDeliveryError, match="channel 'oncall' \\(smtp\\)"):
        task.python_callable(["al_audit"], run_id="scheduled__ingest_3", ti=_ti("cdc_ingest__al_audit", "check_alerts"))
    (msg,) = alert_env.sns.take(1)
    assert msg["Subject"].startswith("[CDC RESOLVED] al_audit is fresh again")


@pytest.mark.slow
def test_airflow_dags_test_of_a_failing_capture_alerts(alert_env):
    """A real DAG run (`airflow dags test`) whose capture cannot reach its source: the run fails, the
    failure callback delivers by e-mail and SNS, the check_alerts teardown runs, no password leaks."""
    env = {
        **os.environ,
        **alert_env.env,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT / "plugins"),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{alert_env.base}/airflow/airflow.db",
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "CDC_TASK_RETRIES": "0",
    }
    env.pop("CDC_LAKE_SETTINGS", None)
    init_airflow_home(env)
    r = subprocess.run(
        ["airflow", "dags", "test", "cdc_ingest__al_audit", "2026-03-02T00:00:00+00:00"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-4000:]
    mails = alert_env.smtp.take(2, timeout=30)
    subjects = {m["subject"] for m in mails}
    assert subjects == {"[CDC FAILED] capture__cdc_alert_down of al_audit failed"}, subjects
    body = mails[0]["body"]
    assert "table: al_audit" in body and "endpoint: cdc_alert_down" in body and "cdc_ingest__al_audit" in body
    (msg,) = alert_env.sns.take(1, timeout=30)
    assert msg["Subject"] == "[CDC FAILED] capture__cdc_alert_down of al_audit failed"
    _no_secret(*(m["body"] for m in mails), msg["Message"], out)
    assert "check_alerts" in out  # the teardown ran after the failed capture
