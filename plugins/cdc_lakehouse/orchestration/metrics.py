"""Airflow metrics from the records the jobs keep in cdc_meta: freshness per shard, lag in bytes,
quarantined rows, audit mismatches and run durations, sent through Airflow's own `Stats` (StatsD
or OpenTelemetry, whichever the deployment's `[metrics]` section turns on; nothing is sent when
neither is on).

Names carry the table and the shard, because plain StatsD drops tags; the same values also go
out as tags (table, shard, endpoint) for the tag-capable forms (Datadog, InfluxDB, OpenTelemetry):

  cdc.capture.lag_bytes.<endpoint>             gauge   WAL the slot has not confirmed yet, after the run
  cdc.capture.retained_wal_bytes.<endpoint>    gauge   WAL the slot holds back on the source
  cdc.capture.events.<endpoint>                gauge   events landed by the run
  cdc.capture.duration.<endpoint>              timer   the run, from start to confirmed manifest
  cdc.ingest.events.<table>                    gauge   events read by the ingest run
  cdc.ingest.quarantined_rows.<table>          gauge   events of the run kept in cdc_meta.quarantine
  cdc.ingest.{inserted,updated,deleted}_rows.<table>  gauge   the run's rows

Per-run figures are gauges (the figure of the latest run), never counters: a retried or cleared
task sends its run's figures again, and a gauge set twice still says the same.
  cdc.ingest.duration.<table>                  timer
  cdc.freshness_seconds.<table>.<shard>        gauge   how far the lake's shard is behind its source
  cdc.audit.mismatches.<table>.<shard>         gauge   missing + extra + different keys seen
  cdc.audit.persistent.<table>.<shard>         gauge   mismatches seen N audits in a row
  cdc.audit.duration.<table>                   timer

Best effort, like the alerts: a metric never fails the task whose figures it reports.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cdc_lakehouse.lake.ingest_metrics import IngestMetrics
    from cdc_lakehouse.lake.meta_rows import AuditResult, CaptureRun, ShardFreshness

log = logging.getLogger(__name__)

PREFIX = "cdc"
# Airflow's stat-name validator accepts letters, digits, '_', '.' and '-'; a shard such as
# "ep.s0" would otherwise add a level to the name.
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def name(*parts: str) -> str:
    """cdc.<part>.<part>..., each part made safe for a StatsD name (dots inside a part become '_')."""
    return ".".join([PREFIX, *(_UNSAFE.sub("_", p) for p in parts)])


def _stats():
    from airflow.sdk.observability.stats import Stats

    return Stats


def _send(sends: Iterable[tuple[str, str, float, dict[str, str]]]) -> int:
    """(kind, name, value, tags) through Stats; the number sent. Never raises."""
    n = 0
    try:
        stats = _stats()
        for kind, stat, value, tags in sends:
            if kind == "gauge":
                stats.gauge(stat, value, tags=tags)
            else:  # timing, in milliseconds
                stats.timing(stat, value, tags=tags)
            n += 1
    except Exception as exc:  # noqa: BLE001 - metrics must never fail the task they describe
        log.warning("metrics not sent: %s", exc)
    return n


def capture_metrics(run: CaptureRun) -> int:
    ep = run.endpoint
    tags = {"endpoint": ep}
    sends = [("gauge", name("capture", "events", ep), float(run.events or 0), tags)]
    if run.lag_bytes is not None:
        sends.append(("gauge", name("capture", "lag_bytes", ep), float(run.lag_bytes), tags))
    if run.retained_wal_bytes is not None:
        sends.append(("gauge", name("capture", "retained_wal_bytes", ep), float(run.retained_wal_bytes), tags))
    if run.seconds is not None:
        sends.append(("timing", name("capture", "duration", ep), run.seconds * 1000, tags))
    return _send(sends)


def ingest_metrics(runs: Iterable[IngestMetrics]) -> int:
    sends = []
    for m in runs:
        t, tags = m.table_name, {"table": m.table_name}
        # Gauges, not counters: the check_alerts teardown that sends them can be retried or
        # cleared, and a counter would count the run again each time.
        sends += [
            ("gauge", name("ingest", "events", t), float(m.events_read or 0), tags),
            ("gauge", name("ingest", "quarantined_rows", t), float(m.quarantined or 0), tags),
        ]
        # Unknown counts (None: see IngestMetrics.take_merge_counts) are not sent as zeros.
        counts = {"inserted_rows": m.inserts, "updated_rows": m.updates, "deleted_rows": m.deletes}
        sends += [("gauge", name("ingest", k, t), float(v), tags) for k, v in counts.items() if v is not None]
        if m.total_seconds is not None:
            sends.append(("timing", name("ingest", "duration", t), m.total_seconds * 1000, tags))
    return _send(sends)


def freshness_metrics(rows: Iterable[ShardFreshness]) -> int:
    return _send(
        ("gauge", name("freshness_seconds", r.table_name, r.shard), r.freshness_seconds, _shard_tags(r))
        for r in rows
        if r.freshness_seconds is not None
    )


def audit_metrics(rows: Iterable[AuditResult]) -> int:
    sends = []
    longest: dict[str, float] = {}
    for r in rows:
        tags = {"table": r.table_name, "shard": r.shard}
        seen = (r.missing or 0) + (r.extra or 0) + (r.different or 0)
        sends.append(("gauge", name("audit", "mismatches", r.table_name, r.shard), float(seen), tags))
        sends.append(("gauge", name("audit", "persistent", r.table_name, r.shard), float(r.persistent or 0), tags))
        if r.seconds is not None:  # one audit run covers every shard: its time once per table
            longest[r.table_name] = max(longest.get(r.table_name, 0.0), r.seconds)
    sends += [("timing", name("audit", "duration", t), s * 1000, {"table": t}) for t, s in longest.items()]
    return _send(sends)


def _shard_tags(r: ShardFreshness) -> dict[str, str]:
    return {"table": r.table_name, "shard": r.shard, "endpoint": r.endpoint}
