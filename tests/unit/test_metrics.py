"""orchestration.metrics: the names and values sent for each cdc_meta record (Stats recorded;
the real StatsD path is tests/e2e/test_demo_airflow.py)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from cdc_lakehouse.lake.ingest_metrics import IngestMetrics
from cdc_lakehouse.lake.meta_rows import AuditResult, CaptureRun, ShardFreshness
from cdc_lakehouse.orchestration import metrics


class _Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.sent: list[tuple[str, str, float, dict[str, str]]] = []
        self.fail = fail

    def _add(self, kind: str, stat: str, value: float, tags: dict[str, str]) -> None:
        if self.fail:
            raise OSError("statsd unreachable")
        self.sent.append((kind, stat, value, tags))

    def gauge(self, stat, value, *, tags):
        self._add("gauge", stat, value, tags)

    def timing(self, stat, dt, *, tags):
        self._add("timing", stat, dt, tags)


@pytest.fixture
def stats(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(metrics, "_stats", lambda: rec)
    return rec


def test_names_keep_one_level_per_part():
    assert metrics.name("freshness_seconds", "block", "ep.s0") == "cdc.freshness_seconds.block.ep_s0"
    assert metrics.name("audit", "mismatches", "a b/c", "x:y|z") == "cdc.audit.mismatches.a_b_c.x_y_z"


def test_each_record_sends_its_figures(stats):
    run = CaptureRun(endpoint="ep", run_id="r1", events=12, lag_bytes=4096, retained_wal_bytes=8192, seconds=1.5)
    assert metrics.capture_metrics(run) == 4
    m = IngestMetrics(table_name="block", ingest_run="r1", write_mode="merge-on-read", events_read=9, quarantined=2)
    m.total_seconds = 3.0
    metrics.ingest_metrics([m])
    now = datetime.now(UTC)
    metrics.freshness_metrics(
        [
            ShardFreshness(
                table_name="block",
                shard="ep.s0",
                endpoint="ep",
                source_schema="s0",
                freshness_seconds=7.5,
                ingest_run="r1",
                updated_at=now,
            ),
            ShardFreshness(
                table_name="block",
                shard="ep.s1",
                endpoint="ep",
                source_schema="s1",
                freshness_seconds=None,
                ingest_run="r1",
                updated_at=now,
            ),
        ]
    )
    metrics.audit_metrics(
        [
            AuditResult(
                table_name="block", audit_run="a", shard="ep.s0", missing=1, different=2, persistent=1, seconds=4
            ),
            AuditResult(table_name="block", audit_run="a", shard="ep.s1", seconds=5),
        ]
    )
    got = {(kind, stat): value for kind, stat, value, _ in stats.sent}
    assert got[("gauge", "cdc.capture.lag_bytes.ep")] == 4096
    assert got[("timing", "cdc.capture.duration.ep")] == 1500
    assert got[("gauge", "cdc.ingest.quarantined_rows.block")] == 2
    assert got[("gauge", "cdc.ingest.events.block")] == 9
    assert got[("timing", "cdc.ingest.duration.block")] == 3000
    assert got[("gauge", "cdc.freshness_seconds.block.ep_s0")] == 7.5
    assert ("gauge", "cdc.freshness_seconds.block.ep_s1") not in got  # no position time: nothing invented
    assert got[("gauge", "cdc.audit.mismatches.block.ep_s0")] == 3
    assert got[("gauge", "cdc.audit.mismatches.block.ep_s1")] == 0
    assert got[("timing", "cdc.audit.duration.block")] == 5000  # one audit run: its longest shard, once
    tags = {stat: t for _, stat, _, t in stats.sent}
    assert tags["cdc.freshness_seconds.block.ep_s0"] == {"table": "block", "shard": "ep.s0", "endpoint": "ep"}


def test_a_broken_metrics_backend_never_fails_the_task(monkeypatch):
    monkeypatch.setattr(metrics, "_stats", lambda: _Recorder(fail=True))
    assert metrics.capture_metrics(CaptureRun(endpoint="ep", run_id="r1", events=1)) == 0


def test_the_fields_the_alert_checks_read_are_enough_for_the_metrics(stats, caplog):
    """The check_alerts tasks read only some columns of cdc_meta (alerts.task_checks); the metrics they
    send are made from those records, so every field a metric needs must be among them."""
    from cdc_lakehouse.lake.meta_rows import from_row
    from cdc_lakehouse.orchestration.alerts import task_checks as run

    def partial(record, fields, **values):
        return from_row(record, {f: values.get(f, 1) for f in fields})

    now = datetime.now(UTC)
    fresh = partial(ShardFreshness, run._SHARD_FRESHNESS_FIELDS, table_name="t", shard="ep.s0", updated_at=now)
    audit = partial(AuditResult, run._AUDIT_FIELDS, table_name="t", shard="ep.s0", audited_at=now)
    ingest = partial(IngestMetrics, run._INGEST_METRIC_FIELDS, table_name="t", committed_at=now)
    assert metrics.freshness_metrics([fresh]) == 1
    assert metrics.audit_metrics([audit]) == 3
    assert metrics.ingest_metrics([ingest]) == 6
    assert "metrics not sent" not in caplog.text


@pytest.mark.parametrize(
    ("summary", "rows", "want"),
    [
        ({"inserted": "3", "matched-updated": "5", "matched-deleted": "1"}, 10, (3, 5, 1, 1)),
        ({}, 0, (0, 0, 0, 0)),  # a MERGE given no rows: Spark records no counts
        ({}, 10, (None, None, None, None)),  # an Iceberg that does not record them
        ({"inserted": "8", "matched-updated": "5", "matched-deleted": "1"}, 10, (None, None, None, None)),  # 14 > 10
    ],
)
def test_merge_counts_are_taken_only_when_they_add_up(stats, summary, rows, want):
    """IngestMetrics.take_merge_counts: the MERGE's counts, or unknown (never zeros sent as a quiet run)."""
    m = IngestMetrics(table_name="block", ingest_run="r1", write_mode="merge-on-read")
    keys = {k: f"spark.merge-into.num-target-rows-{k}" for k in ("inserted", "matched-updated", "matched-deleted")}
    assert m.take_merge_counts({keys[k]: v for k, v in summary.items()}, rows) == (want[0] is not None)
    assert (m.inserts, m.updates, m.deletes, m.stale_skipped) == want
    metrics.ingest_metrics([m])
    sent = {stat for _, stat, _, _ in stats.sent}
    assert ("cdc.ingest.inserted_rows.block" in sent) == (want[0] is not None)
