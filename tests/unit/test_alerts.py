"""Alert logic without servers: configuration, thresholds, the storm rule, messages, redaction.

Delivery through real SMTP and SNS servers is tested in tests/integration/test_alerts.py."""

from __future__ import annotations

import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml
from cdc_lakehouse.config import parse_table_config
from cdc_lakehouse.landing.format import Manifest
from cdc_lakehouse.orchestration.alerts import (
    AlertConfigError,
    AlertingConfig,
    CdcFailureNotifier,
    SlackChannel,
    alerting_errors,
    channels_for,
    check_audit,
    check_freshness,
    check_wal,
    decide,
    failure_alert,
    load_alerting,
    redact,
    rules_for,
)

ROOT = Path(__file__).resolve().parents[2]
SECRET = "Hunter2-marker-pw"
T0 = datetime(2026, 3, 1, tzinfo=UTC)


def table(**alerts_and_more):
    data = {
        "name": "block",
        "source": {"table": "block", "shards": [{"conn_id": "pg_a", "schemas": ["s0", "s1"]}]},
        "primary_key": ["id"],
        **alerts_and_more,
    }
    cfg, errors = parse_table_config(data, "block.yaml")
    assert not errors, errors
    return cfg


def test_table_thresholds_parse_sizes_durations_and_off():
    cfg = table(
        alerts={"audit_failed_runs": 2, "retained_wal_bytes": "10GiB", "freshness_sla": "90m", "renotify_every_runs": 4}
    )
    assert cfg.alerts.retained_wal_bytes == 10 * 1024**3 and cfg.alerts.freshness_sla == 5400
    off = yaml.safe_load("alerts: {audit_failed_runs: off, retained_wal_bytes: off, freshness_sla: off}")
    cfg = table(**off)
    r = rules_for(cfg, AlertingConfig())
    assert (r.audit_failed_runs, r.retained_wal_bytes, r.freshness_sla) == (0, 0, 0)


@pytest.mark.parametrize(
    "alerts, field",
    [
        ({"freshness_sla": "2 fortnights"}, "alerts.freshness_sla"),
        ({"freshness_sla": 90}, "alerts.freshness_sla"),
        ({"retained_wal_bytes": "lots"}, "alerts.retained_wal_bytes"),
        ({"audit_failed_runs": -1}, "alerts.audit_failed_runs"),
        ({"renotify_every_runs": 0}, "alerts.renotify_every_runs"),
        ({"fresh": "2h"}, "alerts.fresh"),
    ],
)
def test_bad_thresholds_name_the_field(alerts, field):
    data = {
        "name": "block",
        "source": {"table": "block", "shards": [{"conn_id": "pg_a", "schemas": ["s0"]}]},
        "primary_key": ["id"],
        "alerts": alerts,
    }
    _, errors = parse_table_config(data, "block.yaml")
    assert [e.field for e in errors] == [field], errors


def test_thresholds_inherit_table_then_project_then_builtin():
    ac = AlertingConfig.model_validate({"defaults": {"retained_wal_bytes": "1GiB", "renotify_every_runs": 2}})
    r = rules_for(table(alerts={"retained_wal_bytes": "5GiB"}, audit={"freshness_sla_minutes": 45}), ac)
    assert r.retained_wal_bytes == 5 * 1024**3 and r.renotify_every_runs == 2
    assert r.freshness_sla == 45 * 60 and r.audit_failed_runs == 3  # audit SLA, built-in default


def test_project_file_and_its_commented_examples_validate(monkeypatch, tmp_path):
    monkeypatch.delenv("CDC_ALERTING_FILE", raising=False)
    ac = load_alerting(ROOT / "include" / "alerting.yaml")
    assert ac.channels == [] and ac.defaults.audit_failed_runs == 3
    text = (ROOT / "include" / "alerting.yaml").read_text()
    block = text.split("channels: []", 1)[1].split("# Thresholds", 1)[0]
    example = "channels:\n" + "\n".join(line[1:] for line in block.splitlines() if line.startswith("#  "))
    chans = AlertingConfig.model_validate(yaml.safe_load(example)).channels
    assert [c.type for c in chans] == ["smtp", "sns", "slack", "notifier"]
    bad = tmp_path / "alerting.yaml"
    bad.write_text("channels:\n  - {type: sns, topic: x}\n")
    with pytest.raises(AlertConfigError, match=r"channels\.0\.sns"):
        load_alerting(bad)
    bad.write_text("channels:\n  - {type: smtp, name: a, to: [x@y]}\n  - {type: smtp, name: a, to: [z@y]}\n")
    with pytest.raises(AlertConfigError, match="used twice"):
        load_alerting(bad)


def test_missing_provider_is_a_config_error_naming_the_package(monkeypatch, tmp_path):
    f = tmp_path / "alerting.yaml"
    f.write_text("channels:\n  - {type: slack, name: team, channel: '#x'}\n")
    monkeypatch.setenv("CDC_ALERTING_FILE", str(f))
    cfg = table(alerts={"channels": ["team", "nope"]})
    errors = alerting_errors({"block": cfg})
    assert any("apache-airflow-providers-slack" in e and "team" in e for e in errors), errors
    assert any("'nope'" in e and "alerts.channels" in e for e in errors), errors
    ch = SlackChannel(type="slack", name="team")
    alert = failure_alert({"dag": None, "run_id": "r", "exception": ValueError("x")}, ["block"])
    with pytest.raises(AlertConfigError, match="pip install apache-airflow-providers-slack"):
        ch.notifier(alert)


def test_channels_per_table_and_alert_emails():
    ac = AlertingConfig.model_validate(
        {
            "channels": [
                {"type": "smtp", "name": "mail", "to": ["a@x"]},
                {
                    "type": "sns",
                    "name": "sns",
                    "target_arn": "arn:aws:sns:us-east-1:000000000000:t",
                    "kinds": ["task_failed"],
                },
            ],
            "alert_emails": {"smtp_conn_id": "smtp_ops", "from_email": "cdc@x"},
        }
    )
    chans = channels_for([table(alert_emails=["owner@x"])], ac)
    assert [c.name for c in chans] == ["mail", "sns", "alert_emails"]
    assert chans[2].to == ["owner@x"] and chans[2].smtp_conn_id == "smtp_ops"
    assert [c.name for c in channels_for([table(alerts={"channels": ["sns"]})], ac)] == ["sns"]
    assert not chans[1].wants("freshness") and chans[1].wants("task_failed")


@pytest.mark.parametrize(
    "text",
    [
        f"connection failed: host=db port=5432 user=cdc password={SECRET} dbname=src",
        f"could not connect to postgresql://cdc:{SECRET}@db:5432/src",
        f"could not connect to postgresql://cdc:{SECRET}@with@at@db:5432/src",
        f'conn extra {{"password": "{SECRET}", "token": "{SECRET}"}}',
        f"env PGPASSWORD={SECRET} CDC_CATALOG_PASSWORD='{SECRET}'",
    ],
)
def test_redact_removes_passwords(text):
    out = redact(text)
    assert SECRET not in out and "***" in out, out


def test_storm_rule():
    assert decide([True], 1, 3) == "firing"  # starts
    assert [decide([True] * n, 1, 3) for n in range(2, 8)] == [None, None, "firing", None, None, "firing"]
    assert decide([False, True, True], 1, 3) == "resolved"
    assert decide([False, False, True], 1, 3) is None
    assert [decide([True] * n, 3, 6) for n in (1, 2, 3, 4, 9)] == [None, None, "firing", None, "firing"]
    assert decide([False, True, True], 3, 6) is None  # never fired: nothing to resolve
    assert decide([True] * 5, 0, 1) is None  # off


def test_failure_alert_names_table_task_and_redacts():
    class TI:
        dag_id, task_id, try_number = "cdc_ingest__block", "capture__pg_a", 3

    exc = RuntimeError(f"connection to postgresql://cdc:{SECRET}@db/src failed; password={SECRET} {{{{ 7*7 }}}}")
    a = failure_alert({"ti": TI(), "run_id": "scheduled__2026", "exception": exc})
    text = a.text()
    assert a.tables == ["block"] and "capture__pg_a of block failed" in a.summary
    assert "endpoint: pg_a" in text and "try: 3" in text and "{{ 7*7 }}" in text and SECRET not in text
    assert SECRET not in a.html() and SECRET not in str(a.record())
    assert a.subject.startswith("[CDC FAILED]") and len(a.subject) <= 100
    group = failure_alert(
        {"ti": type("TI", (), {"dag_id": "cdc_ingest_group__g", "task_id": "ingest"})()}, ["permission", "space"]
    )
    assert "permission, space" in group.summary and "quarantine list <table>" in group.fix


def test_failure_notifier_never_raises_and_records(monkeypatch, tmp_path):
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    monkeypatch.setenv("CDC_ALERTING_FILE", str(ROOT / "include" / "alerting.yaml"))
    CdcFailureNotifier(["block"]).notify({"run_id": "r1", "exception": ValueError(f"password={SECRET}")})
    CdcFailureNotifier(["block"]).notify({})  # no task instance, no exception
    lines = (tmp_path / "cdc_alerts.jsonl").read_text().splitlines()
    assert len(lines) == 2 and SECRET not in lines[0] and '"table": "block"' in lines[0]


def _audit_rows(run: str, at: datetime, fail: bool, repaired: int = 0):
    return [
        {
            "audit_run": run,
            "shard": "s0",
            "verdict": "fail" if fail else "ok",
            "repaired": repaired,
            "persistent": 4 if fail else 0,
            "missing": 1,
            "extra": 0,
            "different": 3,
            "source_rows": 100,
            "lake_rows": 99,
            "sample_keys": '[{"kind": "different", "id": 7}]',
            "audited_at": at,
        },
        {
            "audit_run": run,
            "shard": "s1",
            "verdict": "ok",
            "repaired": 0,
            "persistent": 0,
            "missing": 0,
            "extra": 0,
            "different": 0,
            "source_rows": 50,
            "lake_rows": 50,
            "sample_keys": "[]",
            "audited_at": at,
        },
    ]


def test_audit_alert_after_n_failed_runs_counting_retries_once():
    cfg = table(alerts={"audit_failed_runs": 2})
    ac = AlertingConfig()
    rows = _audit_rows("r1", T0, True)
    assert check_audit(cfg, "r1", ac, rows, []) is None  # 1 of 2
    # r2 ran twice: the first attempt passed, the retry (later) failed -> counts as one failed run
    rows += _audit_rows("r2", T0 + timedelta(hours=1), False) + _audit_rows(
        "r2", T0 + timedelta(hours=1, minutes=5), True
    )
    a = check_audit(cfg, "r2", ac, rows, [])
    assert a and a.state == "firing" and a.figure == 2 and a.threshold == 2
    text = a.text()
    assert "audit of block failed 2 runs in a row" in text and "shard s0: 4 persistent" in text
    assert "shard s1" not in text and '"shards": ["s0"]' in text
    # a failed quality check alone fails a run; a repaired shard does not
    rows += _audit_rows("r3", T0 + timedelta(hours=2), True, repaired=4)
    quality = [
        {
            "audit_run": "r3",
            "expectation": "freshness",
            "success": False,
            "observed": "300",
            "checked_at": T0 + timedelta(hours=2),
        }
    ]
    assert check_audit(cfg, "r3", ac, rows, quality) is None  # streak 3: between re-notifications
    rows += _audit_rows("r4", T0 + timedelta(hours=3), False)
    resolved = check_audit(cfg, "r4", ac, rows, quality)
    assert resolved and resolved.state == "resolved" and resolved.subject.startswith("[CDC RESOLVED]")
    assert check_audit(cfg, "missing-run", ac, rows, quality) is None


def test_freshness_alert_names_the_stalest_shard():
    cfg = table(alerts={"freshness_sla": "2h"})
    wm = '{"v": 1, "shards": {"s0": {"lsn": 1, "ts": "2026-03-01T05:00:00+00:00"}, "s1": {"lsn": 2, "ts": "2026-03-01T01:00:00+00:00"}}}'
    runs = [
        {"ingest_run": "r1", "freshness_seconds": 600.0, "committed_at": T0, "watermark": "{}", "events_read": 5},
        {
            "ingest_run": "r2",
            "freshness_seconds": 5 * 3600.0,
            "committed_at": T0 + timedelta(hours=1),
            "watermark": wm,
            "events_read": 0,
        },
    ]
    a = check_freshness(cfg, "r2", AlertingConfig(), runs)
    assert a and a.figure == 18000 and a.threshold == 7200
    assert "5.0 h behind" in a.summary and "SLA 2.0 h" in a.summary and "stalest shard: s1" in a.text()
    assert check_freshness(cfg, "r1", AlertingConfig(), runs[:1]) is None


def test_wal_alert_uses_the_smallest_threshold_of_the_slots_tables():
    a_cfg = table(alerts={"retained_wal_bytes": "1MiB"})
    b_cfg = table(name="other", alerts={"retained_wal_bytes": "off"})
    manifest = Manifest(
        run_id="20260301T010000Z",
        end_lsn=100,
        endpoint="pg_a",
        conn_id="pg_a",
        slot_after={"slot": "cdc_pg_a", "retained_wal_bytes": 3 * 1024**2, "lag_bytes": 10, "wal_status": "reserved"},
    )
    a = check_wal(manifest, [a_cfg, b_cfg], AlertingConfig(), [])
    assert a and a.tables == ["block", "other"] and a.threshold == 1024**2
    assert "slot cdc_pg_a of endpoint pg_a retains 3.0 MiB of WAL (> 1.0 MiB)" in a.summary
    assert "pg_drop_replication_slot('cdc_pg_a')" in a.fix
    past = [{"run_id": "20260301T000000Z", "retained_wal_bytes": 2 * 1024**2, "finished_at": T0}]
    assert check_wal(manifest, [a_cfg], AlertingConfig(), past) is None  # second run over: quiet
    assert check_wal(manifest, [b_cfg], AlertingConfig(), []) is None  # disabled


def test_dag_alert_wiring_is_cheap_to_parse(tmp_path):
    from tests.dag_files import dags_of

    (tmp_path / "t.yaml").write_text(
        textwrap.dedent("""
        name: t
        source: {table: t, shards: [{conn_id: pg_a, schemas: [s0]}]}
        primary_key: [id]
        alert_emails: [owner@example.com]
    """)
    )
    dags = dags_of(tmp_path)
    for dag in dags.values():
        for task in dag.tasks:
            notifiers = [c for c in task.on_failure_callback if isinstance(c, CdcFailureNotifier)]
            assert notifiers and notifiers[0].tables == ["t"], (dag.dag_id, task.task_id)
            assert not task.email, "Airflow's own failure e-mail would duplicate the alert"
    assert dags["cdc_audit__t"].get_task("check_alerts").is_teardown
    assert dags["cdc_ingest__t"].get_task("check_alerts").upstream_task_ids == {"ingest"}
