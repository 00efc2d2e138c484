"""Checks on the run history in cdc_meta: retained WAL, failing audits, freshness.

Pure rules over rows the caller read, as the records of their tables (lake.meta_rows,
lake.ingest_metrics; a row given as a mapping is made a record first): each check says whether this
run alerts ("firing"), resolves or stays quiet (the storm rule, decide) and builds the alert.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.lake.ingest_metrics import IngestMetrics
from cdc_lakehouse.lake.meta_rows import AuditResult, CaptureRun, QualityResult, RawRow, ShardFreshness, as_records
from cdc_lakehouse.orchestration.alerts.alert import Alert, fmt_bytes, fmt_seconds
from cdc_lakehouse.orchestration.alerts.config import AlertingConfig, Rules, rules_for
from cdc_lakehouse.watermark import Watermark

if TYPE_CHECKING:
    from cdc_lakehouse.landing.format import Manifest

log = logging.getLogger(__name__)

R = TypeVar("R")


def decide(flags: list[bool], need: int, every: int) -> Literal["firing", "resolved"] | None:
    """The storm rule. flags: the condition per run, newest (this run) first.

    "firing" when the last `need` runs all had the condition and either it just reached `need`
    or another `every` runs have passed since; "resolved" on the first run without it after it
    fired; None otherwise."""
    if need <= 0 or not flags:
        return None
    now = _streak(flags)
    if now >= need:
        return "firing" if (now - need) % max(every, 1) == 0 else None
    if not flags[0] and _streak(flags[1:]) >= need:
        return "resolved"
    return None


def _streak(flags: list[bool]) -> int:
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


def _latest_per_run(
    rows: Sequence[R], run: Callable[[R], str], at: Callable[[R], datetime | None]
) -> dict[str, list[R]]:
    """run -> the rows of its last attempt (a retried run is counted once, as it ended), the
    newest run first. run, at: a row's run and its time (rows without one are left out)."""
    out: dict[str, list[R]] = {}
    latest: dict[str, datetime] = {}
    for r in rows:
        ts = at(r)
        if ts is None:
            continue
        key = run(r)
        if key not in out or ts > latest[key]:
            out[key], latest[key] = [r], ts
        elif ts == latest[key]:
            out[key].append(r)
    return {key: out[key] for key in sorted(out, key=lambda k: latest[k], reverse=True)}


def check_wal(
    manifest: Manifest,
    members: list[TableConfig],
    ac: AlertingConfig,
    history: Sequence[CaptureRun | RawRow] | None = None,
) -> Alert | None:
    """wal_retained: the capture's slot retains more WAL than the smallest threshold of its tables.

    history: earlier cdc_meta.capture_runs rows of the endpoint (any order); the current run is
    taken from the manifest."""
    after = manifest.slot_after or {}
    retained = after.get("retained_wal_bytes")
    rules = [rules_for(c, ac) for c in members]
    enabled = [r.retained_wal_bytes for r in rules if r.retained_wal_bytes > 0]
    if retained is None or not enabled:
        return None
    threshold = min(enabled)
    every = min(r.renotify_every_runs for r in rules)
    run_id = manifest.run_id
    finished = [r for r in as_records(CaptureRun, history or []) if r.run_id != run_id and r.finished_at]
    past = sorted(finished, key=lambda r: cast(datetime, r.finished_at), reverse=True)  # cast: all finished
    flags = [retained > threshold] + [(r.retained_wal_bytes or 0) > threshold for r in past]
    state = decide(flags, 1, every)
    if state is None:
        return None
    return _wal_alert(manifest, members, state, threshold, _streak(flags))


def _wal_alert(
    manifest: Manifest,
    members: list[TableConfig],
    state: Literal["firing", "resolved"],
    threshold: int,
    streak: int,
) -> Alert:
    after = manifest.slot_after or {}
    retained = after.get("retained_wal_bytes")
    run_id = manifest.run_id
    endpoint, slot = manifest.endpoint, after.get("slot") or manifest.slot
    tables = sorted(c.name for c in members)
    if state == "resolved":
        summary = f"slot {slot} of endpoint {endpoint} retains {fmt_bytes(retained)} of WAL again"
    else:
        summary = f"slot {slot} of endpoint {endpoint} retains {fmt_bytes(retained)} of WAL (> {fmt_bytes(threshold)})"
    details = {
        "tables": ", ".join(tables),
        "endpoint": f"{endpoint} (connection {manifest.conn_id})",
        "slot": slot,
        "retained WAL": f"{fmt_bytes(retained)} ({retained} bytes)",
        "threshold": f"{fmt_bytes(threshold)} ({threshold} bytes, alerts.retained_wal_bytes)",
        "unconfirmed (lag)": fmt_bytes(after.get("lag_bytes")),
        "wal_status": after.get("wal_status"),
        "runs over the threshold in a row": streak,
        "capture run": run_id,
    }
    fix = (
        f"the slot keeps WAL on the source until captures confirm it, so the source's disk fills while it "
        f"grows. Check that capture__{endpoint} runs and succeeds in every ingest DAG reading {endpoint} (a "
        f"paused DAG or a failing capture stops confirming); a capture capped by ingest.max_events_per_run / "
        f"max_bytes_per_run falls behind a busy source: raise the caps or run more often. A long transaction "
        f"on the source also holds WAL back. A slot nobody reads any more must be dropped "
        f"(SELECT pg_drop_replication_slot('{slot}')) once its tables are retired."
    )
    return Alert("wal_retained", summary, tables, details, fix, state=state, figure=retained, threshold=threshold)


def check_audit(
    cfg: TableConfig,
    audit_run: str,
    ac: AlertingConfig,
    results: Sequence[AuditResult | RawRow],
    quality: Sequence[QualityResult | RawRow],
) -> Alert | None:
    """audit_failing: the audit of the table failed in the last N runs (N = alerts.audit_failed_runs).

    A run failed when a shard's verdict is `fail` and it was not repaired, or a quality check
    failed (the same rule as the audit job's verdict). results/quality: the table's rows of
    cdc_meta.audit_results and cdc_meta.quality_results."""
    rules = rules_for(cfg, ac)
    if rules.audit_failed_runs <= 0:
        return None
    res = _latest_per_run(as_records(AuditResult, results), lambda r: r.audit_run, lambda r: r.audited_at)
    qual = _latest_per_run(as_records(QualityResult, quality), lambda q: q.audit_run, lambda q: q.checked_at)
    if audit_run not in res:
        log.info(
            "audit %s: run %s recorded no results (a failed audit job is alerted as a failed task)", cfg.name, audit_run
        )
        return None
    runs = list(res)  # newest first
    flags = [bool(_bad_shards(res.get(r, [])) or _bad_quality(qual.get(r, []))) for r in runs]
    state = decide(flags, rules.audit_failed_runs, rules.renotify_every_runs)
    if state is None:
        return None
    return _audit_alert(cfg, audit_run, rules, state, _streak(flags), res[audit_run], qual.get(audit_run, []))


def _bad_shards(rows: list[AuditResult]) -> list[AuditResult]:
    return [r for r in rows if r.verdict == "fail" and not r.repaired]


def _bad_quality(rows: list[QualityResult]) -> list[QualityResult]:
    return [q for q in rows if q.success is False]


def _audit_alert(
    cfg: TableConfig,
    audit_run: str,
    rules: Rules,
    state: Literal["firing", "resolved"],
    streak: int,
    results: list[AuditResult],
    quality: list[QualityResult],
) -> Alert:
    """The alert of one audit run; results/quality: that run's rows."""
    bad_shards = _bad_shards(results)
    if state == "resolved":
        summary = f"audit of {cfg.name} passes again (run {audit_run})"
    else:
        summary = f"audit of {cfg.name} failed {streak} runs in a row (alert at {rules.audit_failed_runs})"
    details: dict[str, Any] = {
        "table": cfg.name,
        "lake table": cfg.current_table,
        "failed runs in a row": streak,
        "threshold": f"{rules.audit_failed_runs} runs (alerts.audit_failed_runs)",
        "audit run": audit_run,
    }
    for r in sorted(bad_shards, key=lambda r: r.shard or ""):
        details[f"shard {r.shard}"] = (
            f"{r.persistent} persistent mismatching key(s): missing {r.missing}, extra {r.extra}, different "
            f"{r.different}; source rows {r.source_rows}, lake rows {r.lake_rows}; sample {r.sample_keys}"
        )
    for q in _bad_quality(quality):
        details[f"quality {q.expectation}"] = f"failed (observed {q.observed})"
    shards = [r.shard for r in bad_shards]
    fix = (
        f"read the audit in the task log and cdc_meta.audit_results / audit_mismatches (keys per shard, with "
        f"samples); quarantined events of those keys: `python -m cdc_lakehouse.cli quarantine list {cfg.name}`. "
        f"Set audit.repair: true to re-read persistent keys from the source, or re-bootstrap the shard(s): "
        f'trigger cdc_bootstrap__{cfg.name} with {{"shards": {json.dumps(shards)}}}. A failed quality check '
        f"names its expectation (freshness: see the ingest; row counts: see the shards)."
    )
    return Alert(
        "audit_failing",
        summary,
        [cfg.name],
        details,
        fix,
        state=state,
        figure=streak,
        threshold=rules.audit_failed_runs,
    )


def check_freshness(
    cfg: TableConfig, ingest_run: str, ac: AlertingConfig, runs: Sequence[IngestMetrics | RawRow]
) -> Alert | None:
    """freshness: the ingest's freshness_seconds (age of the oldest shard's last applied change or
    heartbeat when it committed) is beyond the SLA. runs: the table's cdc_meta.ingest_runs rows."""
    rules = rules_for(cfg, ac)
    if rules.freshness_sla <= 0:
        return None
    per_run = _latest_per_run(as_records(IngestMetrics, runs), lambda r: r.ingest_run, lambda r: r.committed_at)
    if ingest_run not in per_run:
        log.info(
            "freshness %s: ingest run %s committed no metrics (a failed ingest is alerted as a failed task)",
            cfg.name,
            ingest_run,
        )
        return None
    order = list(per_run)  # newest first
    flags = [(per_run[r][0].freshness_seconds or 0) > rules.freshness_sla for r in order]
    state = decide(flags, 1, rules.renotify_every_runs)
    if state is None:
        return None
    return _freshness_alert(cfg, ingest_run, rules, state, _streak(flags), per_run[ingest_run][0])


def _stalest_shard(row: IngestMetrics) -> tuple[str | None, str | None]:
    """(shard, ts) of the oldest position in an ingest run's watermark; (None, None) if unreadable."""
    try:
        shards = Watermark.from_json(row.watermark).shards if row.watermark else {}
        ts = {s: p.ts for s, p in shards.items() if p.ts}
        if ts:
            stalest = min(ts, key=lambda s: datetime.fromisoformat(ts[s]))
            return stalest, ts[stalest]
    except (ValueError, TypeError, AttributeError):
        pass
    return None, None


def _freshness_alert(
    cfg: TableConfig,
    ingest_run: str,
    rules: Rules,
    state: Literal["firing", "resolved"],
    streak: int,
    row: IngestMetrics,
) -> Alert:
    """The alert of one ingest run; row: that run's cdc_meta.ingest_runs row."""
    fresh = row.freshness_seconds
    stalest, stalest_ts = _stalest_shard(row)
    if state == "resolved":
        summary = f"{cfg.name} is fresh again: {fmt_seconds(fresh)} behind its sources"
    else:
        summary = f"{cfg.name} is {fmt_seconds(fresh)} behind its sources (SLA {fmt_seconds(rules.freshness_sla)})"
    details = {
        "table": cfg.name,
        "lake table": cfg.current_table,
        "freshness": f"{fmt_seconds(fresh)} ({fresh:.0f} s)" if fresh is not None else None,
        "SLA": f"{fmt_seconds(rules.freshness_sla)} ({rules.freshness_sla:.0f} s, alerts.freshness_sla)",
        "stalest shard": f"{stalest} (last change or heartbeat applied: {stalest_ts})" if stalest else None,
        "runs over the SLA in a row": streak,
        "ingest run": ingest_run,
        "events read": row.events_read,
    }
    fix = (
        "freshness is the age of the oldest shard's last applied transaction or heartbeat. Check the capture "
        "tasks of the shard's endpoint (failing, or capped by ingest.max_events_per_run / max_bytes_per_run "
        "so each run applies only part of the backlog), that the ingest DAG is not paused or queued behind "
        "a long maintenance or bootstrap in the table's pool, and that the source writes heartbeats "
        "(_cdc_heartbeat of each shard); per-run figures are in cdc_meta.ingest_runs."
    )
    return Alert(
        "freshness", summary, [cfg.name], details, fix, state=state, figure=fresh, threshold=rules.freshness_sla
    )


def check_shard_freshness(
    cfg: TableConfig, ingest_run: str, ac: AlertingConfig, rows: Sequence[ShardFreshness | RawRow]
) -> Alert | None:
    """freshness, per shard: a shard whose position in the lake (fresh_to: its last applied change or
    heartbeat) was older than the SLA when the ingest run finished. rows: the table's
    cdc_meta.freshness rows (one per shard and run)."""
    rules = rules_for(cfg, ac)
    if rules.freshness_sla <= 0:
        return None
    per_run = _latest_per_run(as_records(ShardFreshness, rows), lambda r: r.ingest_run, lambda r: r.updated_at)
    if ingest_run not in per_run:
        log.info(
            "freshness %s: ingest run %s recorded no freshness (a failed ingest fails its task)", cfg.name, ingest_run
        )
        return None
    # This run and the ones before it, newest first (a check of an older run ignores later ones).
    at = per_run[ingest_run][0].updated_at
    order = sorted((r for r in per_run if per_run[r][0].updated_at <= at), key=lambda r: per_run[r][0].updated_at)
    flags = [bool(_stale_shards(per_run[r], rules.freshness_sla)) for r in reversed(order)]
    state = decide(flags, 1, rules.renotify_every_runs)
    if state is None:
        return None
    return _shard_freshness_alert(cfg, ingest_run, rules, state, _streak(flags), per_run[ingest_run])


def _stale_shards(rows: list[ShardFreshness], sla: float) -> list[ShardFreshness]:
    """The run's shards beyond the SLA, stalest first."""
    stale = [r for r in rows if (r.freshness_seconds or 0) > sla]
    return sorted(stale, key=lambda r: -(r.freshness_seconds or 0))


def _shard_line(r: ShardFreshness) -> str:
    fresh = r.freshness_seconds
    return (
        f"{fmt_seconds(fresh)} behind ({fresh:.0f} s) on endpoint {r.endpoint} (schema {r.source_schema}); "
        f"lake position {r.fresh_to}, last heartbeat {r.last_heartbeat_ts}, last source commit "
        f"{r.last_source_commit_ts}, made visible by lake snapshot {r.lake_snapshot_id} at {r.lake_committed_at}"
    )


def _shard_freshness_alert(
    cfg: TableConfig,
    ingest_run: str,
    rules: Rules,
    state: Literal["firing", "resolved"],
    streak: int,
    rows: list[ShardFreshness],
) -> Alert:
    """The alert of one ingest run; rows: that run's cdc_meta.freshness rows (one per shard)."""
    stale = _stale_shards(rows, rules.freshness_sla)
    worst = max((r.freshness_seconds or 0 for r in rows), default=0.0)
    sla = fmt_seconds(rules.freshness_sla)
    if state == "resolved":
        summary = f"{cfg.name} is fresh again: every shard within {sla} of its source"
    elif len(stale) == 1:
        summary = f"{cfg.name} shard {stale[0].shard} is {fmt_seconds(worst)} behind its source (SLA {sla})"
    else:
        summary = f"{cfg.name}: {len(stale)} shards up to {fmt_seconds(worst)} behind their sources (SLA {sla})"
    details: dict[str, Any] = {
        "table": cfg.name,
        "lake table": cfg.current_table,
        "SLA": f"{sla} ({rules.freshness_sla:.0f} s, alerts.freshness_sla)",
        "runs over the SLA in a row": streak,
        "ingest run": ingest_run,
    }
    for r in stale:
        details[f"shard {r.shard}"] = _shard_line(r)
    endpoints = sorted({str(r.endpoint) for r in stale})
    fix = (
        f"a shard's lake position only moves when a capture of its endpoint ({', '.join(endpoints) or '-'}) lands a "
        "run and this ingest applies it; the capture's heartbeat moves it on quiet shards. Check that "
        + ", ".join(f"capture__{e}" for e in endpoints)
        + " runs and succeeds (source reachable, slot active), that it is not capped by ingest.max_events_per_run / "
        "max_bytes_per_run, that the ingest DAG is not paused or queued behind a maintenance or bootstrap in the "
        "table's pool, and that the shard's _cdc_heartbeat table takes writes. Per-shard history: "
        f"cdc_meta.freshness (table_name = '{cfg.name}')."
    )
    return Alert(
        "freshness", summary, [cfg.name], details, fix, state=state, figure=worst, threshold=rules.freshness_sla
    )
