"""Per-shard freshness: the alert rule over cdc_meta.freshness rows and the latest row per shard
(pure logic; the rows themselves are written and read for real in tests/integration/test_freshness.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from cdc_lakehouse.config import parse_table_config
from cdc_lakehouse.lake.freshness import latest_per_shard
from cdc_lakehouse.orchestration.alerts import AlertingConfig, check_shard_freshness

T0 = datetime(2026, 3, 1, tzinfo=UTC)


def _cfg():
    cfg, errors = parse_table_config(
        {
            "name": "orders",
            "source": {"table": "orders", "shards": [{"conn_id": "pg_a", "schemas": ["s0", "s1"]}]},
            "primary_key": ["id"],
            "lake": {"namespace": "t"},
            "alerts": {"freshness_sla": "30m", "renotify_every_runs": 2},
        },
        "orders.yaml",
    )
    assert not errors, errors
    return cfg


def _rows(run: str, at: datetime, s0: float, s1: float) -> list[dict]:
    return [
        {
            "table_name": "orders",
            "ingest_run": run,
            "shard": shard,
            "endpoint": "pg_a",
            "source_schema": shard,
            "freshness_seconds": secs,
            "fresh_to": at - timedelta(seconds=secs),
            "last_heartbeat_ts": at - timedelta(seconds=secs),
            "last_source_commit_ts": T0,
            "lake_snapshot_id": 7,
            "lake_committed_at": at,
            "updated_at": at,
        }
        for shard, secs in (("s0", s0), ("s1", s1))
    ]


def test_the_alert_names_the_stale_shard_its_endpoint_and_the_fix():
    cfg, ac = _cfg(), AlertingConfig()
    rows = _rows("r1", T0, 60, 90) + _rows("r2", T0 + timedelta(hours=1), 60, 3 * 3600)
    assert check_shard_freshness(cfg, "r1", ac, rows) is None  # within the SLA
    a = check_shard_freshness(cfg, "r2", ac, rows)
    assert a is not None and a.kind == "freshness" and a.state == "firing"
    assert a.summary == "orders shard s1 is 3.0 h behind its source (SLA 30 min)"
    assert a.figure == 3 * 3600 and a.threshold == 1800
    text = a.text()
    assert "shard s1: 3.0 h behind (10800 s) on endpoint pg_a (schema s1)" in text and "shard s0:" not in text
    assert "capture__pg_a runs and succeeds" in text and "cdc_meta.freshness (table_name = 'orders')" in text
    # Judging r1 again later ignores r2 (the rule looks at the run and those before it).
    assert check_shard_freshness(cfg, "r1", ac, rows) is None


def test_storm_rule_and_resolution_per_shard():
    cfg, ac = _cfg(), AlertingConfig()
    rows = []
    for i, stale in enumerate([True, True, True, False]):
        rows += _rows(f"r{i}", T0 + timedelta(hours=i), 4000 if stale else 10, 10)
    states = [getattr(check_shard_freshness(cfg, f"r{i}", ac, rows), "state", None) for i in range(4)]
    assert states == ["firing", None, "firing", "resolved"]  # re-notified every 2 runs
    assert check_shard_freshness(cfg, "r3", ac, rows).summary.startswith("orders is fresh again")
    assert check_shard_freshness(cfg, "missing", ac, rows) is None


def test_latest_row_per_shard_wins():
    rows = _rows("r1", T0, 5, 6) + _rows("r2", T0 + timedelta(minutes=5), 7, 8)
    latest = latest_per_shard(rows)
    assert {s: (f.ingest_run, f.freshness_seconds) for s, f in latest.items()} == {"s0": ("r2", 7), "s1": ("r2", 8)}
    assert latest["s1"].stale_seconds(T0 + timedelta(minutes=10)) == 300 + 8


def test_an_ingest_dags_deadline_is_its_strictest_freshness_bound_from_the_runs_interval_start():
    """#53: the DeadlineAlert of an ingest DAG (its missed deadline runs for real in
    tests/e2e/test_scheduler.py) and the alert its callback sends."""
    from cdc_lakehouse.orchestration.alerts.deadlines import deadline_alert, freshness_bound, freshness_deadline

    strict = _cfg()  # 30m
    loose, errors = parse_table_config(
        {**strict.model_dump(), "name": "items", "alerts": {"freshness_sla": "2h"}}, "items.yaml"
    )
    off, errors_off = parse_table_config(
        {**strict.model_dump(), "name": "quiet", "alerts": {"freshness_sla": "off"}}, "q.yaml"
    )
    assert not errors and not errors_off
    ac = AlertingConfig()
    assert freshness_bound([loose, strict, off], ac) == 1800
    assert freshness_bound([off], ac) == 0 and freshness_deadline([off], ac) is None
    deadline = freshness_deadline([loose, strict], ac)
    assert deadline.name == "freshness" and deadline.interval == timedelta(minutes=30)
    assert type(deadline.reference).__name__ == "DagRunLogicalDateDeadline"
    assert deadline.callback.kwargs == {"tables": ["items", "orders"], "bound_seconds": 1800}

    from cdc_lakehouse.orchestration.alerts.deadlines import deadlines_wanted

    assert deadlines_wanted(["airflow", "scheduler"], {}) and deadlines_wanted(["x"], {"CDC_DEADLINES": "on"})
    assert not deadlines_wanted(["airflow", "dags", "test", "cdc_ingest__t"], {})  # apache/airflow#73428
    assert not deadlines_wanted(["airflow", "scheduler"], {"CDC_DEADLINES": "off"})

    run = {"dag_run_id": "scheduled__x", "dag_id": "cdc_ingest_group__g", "state": "running", "logical_date": "T"}
    alert = deadline_alert(["items", "orders"], 1800, {"dag_run": run, "deadline": {"deadline_time": "T+30m"}})
    assert alert.kind == "freshness" and alert.subject.startswith(
        "[CDC STALE] items, orders: ingest run not finished 30 min"
    )
    assert alert.details["run"] == "scheduled__x" and alert.details["deadline"] == "T+30m" and alert.threshold == 1800


def test_a_deadline_alerts_only_for_a_scheduled_run_still_unfinished(monkeypatch):
    """A backfill's deadline passed before it was created; a failed run's task_failed alert went
    out already (Airflow keeps its deadline: apache/airflow#60927)."""
    from cdc_lakehouse.orchestration.alerts import deadlines

    sent: list = []
    monkeypatch.setattr(deadlines, "deliver", lambda alert, *a: sent.append(alert))
    monkeypatch.setattr(deadlines, "load_table_configs", lambda _d: type("CS", (), {"tables": {}})())
    for run_type, state in (("backfill", "running"), ("scheduled", "failed")):
        deadlines.freshness_deadline_missed(["t"], 60, {"dag_run": {"run_type": run_type, "state": state}})
    assert sent == []
    deadlines.freshness_deadline_missed(["t"], 60, {"dag_run": {"run_type": "scheduled", "state": "running"}})
    assert [a.kind for a in sent] == ["freshness"]
