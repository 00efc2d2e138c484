"""Approvals: an action that replaces or rewrites a table's data waits for a person (issue #53).

Airflow 3.3's ApprovalOperator (human in the loop, apache-airflow-providers-standard) parks its
task in the `awaiting_input` state until someone answers in the UI's Required Actions, or
through the REST API (PATCH /api/v2/dags/{dag}/dagRuns/{run}/taskInstances/approve/-1/hitlDetails
with `{"chosen_options": ["Approve"]}`). Before it, `review` reads what the action would change
and branches:

    review ─┬─> approve ────────────┬─> <the action>
            └─> no_approval_needed ─┘

The action runs after whichever branch was taken (trigger rule none_failed_min_one_success);
a rejection skips it, so nothing is written and the run ends successfully.

The actions, each with its review:
  cdc_bootstrap__T  a (re-)bootstrap or column backfill (RebootstrapPlan): no approval for a
                    first load (no complete position yet, or no rows) or a resumed chunked load
  cdc_replay__T     a quarantine replay (ReplayPlan): no approval when nothing is quarantined
  cdc_audit__T      a repair the audit left because it found more persistent keys than
                    approvals.repair_above_keys (RepairPlan); otherwise nothing follows the audit
  cdc_ingest__T     not an approval but a choice: keep or drop a column the source dropped with
                    no schema_changes.dropped_columns entry (dropped_column_decision, below)
A table's YAML turns one off (`approvals: {rebootstrap: false}`, `quarantine_replay: false`);
CDC_APPROVALS=off in the workers' environment turns all off (unattended deployments; `make demo`
runs so).

Parse time builds three small operators; the review's reads (pyiceberg, the source's
catalog) happen in the task.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from cdc_lakehouse.config import APPROVALS_ENV, TableConfig, approvals_enabled
from cdc_lakehouse.source.pgoutput import lsn_to_str

if TYPE_CHECKING:
    from cdc_lakehouse.settings import LakeSettings

log = logging.getLogger(__name__)
REVIEW_TASK, APPROVE_TASK, NOT_NEEDED_TASK = "review", "approve", "no_approval_needed"


class Plan:
    """What an action would change, as its review found it: the approval shows its subject and
    body; it is asked for unless `reason_not_needed` gives a reason."""

    @property
    def reason_not_needed(self) -> str:
        raise NotImplementedError

    @property
    def needs_approval(self) -> bool:
        return not self.reason_not_needed

    @property
    def has_work(self) -> bool:
        """False: the action has nothing to do, and is skipped with its approval."""
        return True

    def subject(self) -> str:
        raise NotImplementedError

    def body(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class LakeHolds:
    """What the lake's current table holds now: its rows (from the current snapshot's summary)
    and the complete position the ingest continues from."""

    rows: int
    snapshot_id: int
    committed_at: datetime
    positions: dict[str, int]  # shard -> LSN (exclusive) of the newest complete position
    fresh_to: dict[str, str | None] = field(default_factory=dict)  # shard -> the position's time


@dataclass(frozen=True)
class RebootstrapPlan(Plan):
    """What a triggered bootstrap (or column backfill) of one table would replace."""

    table: str
    lake_table: str
    shards: tuple[str, ...]  # the shards it loads
    columns: tuple[str, ...]  # a column backfill: only these columns of the rows the lake has
    lake: LakeHolds | None  # None: no complete position yet (a first load)
    resuming: frozenset[str] = frozenset()  # shards with an unfinished chunked load
    source_rows: dict[str, int | None] = field(default_factory=dict)  # shard -> estimate; None: unread
    approvals_on: bool = True

    @property
    def reason_not_needed(self) -> str:
        """Why the action may go ahead without a person; empty when it needs one."""
        if not self.approvals_on:
            return f"approvals are off ({APPROVALS_ENV}=off or approvals.rebootstrap: false)"
        if self.lake is None:
            return "a first load: the table has no complete position yet"
        if self.lake.rows == 0:
            return "the table has no rows"
        if not self.columns and set(self.shards) <= self.resuming:
            return f"resumes the unfinished chunked load of {', '.join(self.shards)}"
        return ""

    @property
    def action(self) -> str:
        if self.columns:
            return f"backfill of column(s) {', '.join(self.columns)}"
        return "re-bootstrap"

    def subject(self) -> str:
        return f"{self.action} of {self.table}: {len(self.shards)} shard(s)"

    def body(self) -> str:
        """Markdown, shown beside the Approve and Reject buttons."""
        lake = self.lake
        lines = [f"**{self.action.capitalize()}** of `{self.table}` (lake `{self.lake_table}`)."]
        if lake is not None:
            lines.append(
                f"The lake holds **{lake.rows:,} rows** in all shards (snapshot {lake.snapshot_id}, committed "
                f"{lake.committed_at:%Y-%m-%d %H:%M:%S} UTC)."
            )
        if self.columns:
            lines.append(
                "Every row of these shards gets the columns' values read from the source now; "
                "other columns and rows stay as they are."
            )
        else:
            lines.append(
                "The rows of these shards are replaced, in one commit, by a snapshot of the source; "
                "the changelog keeps its history and the ingest continues from the new position."
            )
        lines += ["", "| shard | position now | fresh to | source rows (estimate) |", "|---|---|---|---|"]
        for shard in self.shards:
            pos = None if lake is None else lake.positions.get(shard)
            when = None if lake is None else lake.fresh_to.get(shard)
            est = self.source_rows.get(shard)
            lines.append(
                f"| {shard} | {'none' if pos is None else lsn_to_str(pos)} | {when or '-'} | "
                f"{'unknown' if est is None else f'{est:,}'} |"
            )
        lines += ["", "Reject to leave the table as it is: nothing is written."]
        return "\n".join(lines)


def shards_asked(cfg: TableConfig, params: Mapping[str, Any]) -> tuple[str, ...]:
    """The shards a bootstrap run loads, from its params (as cdc_bootstrap__<table> has them)."""
    asked = [str(s) for s in params.get("shards") or []]
    endpoint = str(params.get("endpoint") or "")
    every = [shard for _, _, shard in cfg.shards()]
    if asked:
        return tuple(s for s in every if s in asked) or tuple(asked)
    if endpoint:
        return tuple(cfg.shards_on(endpoint))
    return tuple(every)


# --- the review's reads (in the task) ---------------------------------------------------------


def review_rebootstrap(
    cfg: TableConfig, params: Mapping[str, Any], lake: LakeSettings | None = None
) -> RebootstrapPlan:
    """The plan of a bootstrap run of `cfg` with `params`, read from the lake and the source."""
    from cdc_lakehouse.feed.arrow import load_catalog_for
    from cdc_lakehouse.orchestration.tasks import lake_settings

    lake = lake or lake_settings()
    catalog = load_catalog_for(lake)
    shards = shards_asked(cfg, params)
    return RebootstrapPlan(
        table=cfg.name,
        lake_table=cfg.current_table,
        shards=shards,
        columns=tuple(str(c) for c in params.get("columns") or []),
        lake=lake_holds(catalog, cfg.current_table),
        resuming=unfinished_chunked_loads(catalog, lake, cfg.name),
        source_rows=source_estimates(cfg, shards),
        approvals_on=approvals_enabled() and cfg.approvals.rebootstrap,
    )


def lake_holds(catalog: Any, lake_table: str) -> LakeHolds | None:
    """The current table's rows and newest complete position; None without one (or no table)."""
    from pyiceberg.exceptions import NoSuchTableError

    from cdc_lakehouse.feed.models import FeedError
    from cdc_lakehouse.feed.plan import complete_head
    from cdc_lakehouse.lake.ranges import pyiceberg_snapshots

    try:
        tbl = catalog.load_table(lake_table)
        _, wm = complete_head(lake_table, *pyiceberg_snapshots(tbl), None)
    except (NoSuchTableError, FeedError):  # no table, or no snapshot carries a position yet
        return None
    head = tbl.current_snapshot()
    summary = head.summary or {}
    deleted = sum(int(summary.get(k) or 0) for k in ("total-position-deletes", "total-equality-deletes"))
    return LakeHolds(
        rows=int(summary.get("total-records") or 0) - deleted,
        snapshot_id=int(head.snapshot_id),
        committed_at=datetime.fromtimestamp(head.timestamp_ms / 1000, UTC),
        positions=wm.shard_lsns(),
        fresh_to={shard: pos.ts for shard, pos in wm.shards.items()},
    )


def unfinished_chunked_loads(catalog: Any, lake: LakeSettings, table: str) -> frozenset[str]:
    """The shards of `table` whose newest chunked-bootstrap progress row is not done: a run of
    the bootstrap resumes them (bootstrap/progress.py)."""
    from pyiceberg.exceptions import NoSuchTableError
    from pyiceberg.expressions import EqualTo

    from cdc_lakehouse.bootstrap.progress import PROGRESS_TABLE

    try:
        progress = catalog.load_table(lake.meta_table(PROGRESS_TABLE))
    except NoSuchTableError:
        return frozenset()
    condition = EqualTo("table_name", table)  # type: ignore[call-arg]  # pydantic model: mypy sees only its fields
    rows = progress.scan(row_filter=condition, selected_fields=("shard", "chunk", "done", "updated_at"))
    newest: dict[str, tuple[Any, int, bool]] = {}
    for r in rows.to_arrow().to_pylist():
        mark = (r["updated_at"], int(r["chunk"]), bool(r["done"]))
        if r["shard"] not in newest or mark[:2] > newest[r["shard"]][:2]:
            newest[r["shard"]] = mark
    return frozenset(shard for shard, (_, _, done) in newest.items() if not done)


def source_estimates(cfg: TableConfig, shards: tuple[str, ...]) -> dict[str, int | None]:
    """Each shard's row estimate (pg_class.reltuples) from its source; None where the source did
    not answer (the approval still shows what the lake holds; the log says why)."""
    import psycopg2

    from cdc_lakehouse.bootstrap.chunks import estimated_rows
    from cdc_lakehouse.orchestration.tasks import source_uri_from_connection
    from cdc_lakehouse.secrecy import redact
    from cdc_lakehouse.settings import SourceEndpoint

    out: dict[str, int | None] = dict.fromkeys(shards)
    for group in cfg.source.shards:
        mine = [(schema, shard) for g, schema, shard in cfg.shards() if g is group and shard in out]
        if not mine:
            continue
        try:
            ep = SourceEndpoint.from_uri(source_uri_from_connection(group.conn_id), group.database)
            conn = psycopg2.connect(ep.dsn(), connect_timeout=10)
            try:
                with conn.cursor() as cur:
                    for schema, shard in mine:
                        out[shard] = estimated_rows(cur, schema, cfg.source.table)
            finally:
                conn.close()
        except Exception as exc:  # noqa: BLE001 - an estimate only: the review goes on without it
            log.warning("%s: no row estimate from %s: %s", cfg.name, group.conn_id, redact(exc))
    return out


@dataclass(frozen=True)
class QuarantineHolds:
    """A table's quarantined events in cdc_meta.quarantine, as a replay would find them."""

    replayable: int  # with a landing payload: what the replay re-validates
    held: int  # held-back rows without one (TOAST): never replayed
    by_reason: tuple[tuple[str, int], ...] = ()  # the most frequent reasons, most first


@dataclass(frozen=True)
class ReplayPlan(Plan):
    """What a quarantine replay of one table would do."""

    table: str
    lake_table: str
    quarantine: QuarantineHolds
    approvals_on: bool = True

    @property
    def reason_not_needed(self) -> str:
        if not self.approvals_on:
            return f"approvals are off ({APPROVALS_ENV}=off or approvals.quarantine_replay: false)"
        if self.quarantine.replayable == 0:
            return "nothing is quarantined with a payload: the replay has nothing to apply"
        return ""

    def subject(self) -> str:
        return f"quarantine replay of {self.table}: {self.quarantine.replayable:,} event(s)"

    def body(self) -> str:
        q = self.quarantine
        lines = [
            f"**Quarantine replay** of `{self.table}` (lake `{self.lake_table}`): **{q.replayable:,} "
            "quarantined event(s)** are re-validated against the table's config as it is now. Those "
            "that pass are merged into the table (an event older than the table's row changes "
            "nothing); the others stay quarantined with their reason.",
            "",
            "| reason | events |",
            "|---|---|",
            *(f"| {reason.replace('|', '/')[:200]} | {n:,} |" for reason, n in q.by_reason),
            "",
            f"{q.held:,} held-back row(s) without a payload are not replayed.",
            "",
            "Reject to leave the table and the quarantine as they are: nothing is written.",
        ]
        return "\n".join(lines)


def review_replay(cfg: TableConfig, params: Mapping[str, Any], lake: LakeSettings | None = None) -> ReplayPlan:
    """The plan of a quarantine replay of `cfg`, read from cdc_meta.quarantine."""
    from cdc_lakehouse.feed.arrow import load_catalog_for
    from cdc_lakehouse.orchestration.tasks import lake_settings

    lake = lake or lake_settings()
    return ReplayPlan(
        table=cfg.name,
        lake_table=cfg.current_table,
        quarantine=quarantine_holds(load_catalog_for(lake), lake, cfg.name),
        approvals_on=approvals_enabled() and cfg.approvals.quarantine_replay,
    )


def quarantine_holds(catalog: Any, lake: LakeSettings, table: str, top: int = 10) -> QuarantineHolds:
    """The table's quarantined events (pyiceberg: the quarantine is partitioned by table)."""
    from collections import Counter

    from pyiceberg.exceptions import NoSuchTableError
    from pyiceberg.expressions import EqualTo

    try:
        quarantine = catalog.load_table(lake.meta_table("quarantine"))
    except NoSuchTableError:
        return QuarantineHolds(0, 0)
    condition = EqualTo("table_name", table)  # type: ignore[call-arg]  # pydantic model: mypy sees only its fields
    rows = quarantine.scan(row_filter=condition, selected_fields=("reason", "landing_file")).to_arrow().to_pylist()
    replayable = [r for r in rows if r["landing_file"] is not None]
    reasons = Counter(str(r["reason"] or "(no reason)") for r in replayable)
    return QuarantineHolds(len(replayable), len(rows) - len(replayable), tuple(reasons.most_common(top)))


# --- the DAG part -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RepairPlan(Plan):
    """An audit's repair left for a person: the audit found more persistent keys than
    approvals.repair_above_keys (audit.audit_table's repair_limit) and repaired none."""

    table: str
    audit_run: str
    limit: int | None  # None: no limit (approvals off), so the audit repaired at once
    repair_on: bool  # audit.repair
    shards: tuple[tuple[str, int, str], ...] = ()  # (shard, persistent keys, sample keys JSON)
    repaired: int = 0

    @property
    def pending(self) -> int:
        return sum(n for _, n, _ in self.shards)

    @property
    def has_work(self) -> bool:
        return self.repair_on and self.limit is not None and not self.repaired and self.pending > self.limit

    @property
    def reason_not_needed(self) -> str:
        return "" if self.has_work else "no repair waits: the audit repaired what it found, or found nothing"

    def subject(self) -> str:
        return f"audit repair of {self.table}: {self.pending:,} key(s)"

    def body(self) -> str:
        lines = [
            f"**Audit repair** of `{self.table}` (audit run `{self.audit_run}`): **{self.pending:,} key(s)** "
            f"differed from the source in consecutive audits, more than `approvals.repair_above_keys` "
            f"({self.limit}). Approved, each is read again from its source and merged at the table's "
            "position (a newer change from the stream still wins); a key the source no longer has is deleted.",
            "",
            "| shard | persistent keys | sample keys |",
            "|---|---|---|",
            *(f"| {shard} | {n:,} | {samples[:300]} |" for shard, n, samples in self.shards if n),
            "",
            "Reject to leave the table as it is: the audit run fails, the mismatches stay and alert.",
        ]
        return "\n".join(lines)


def review_repair(cfg: TableConfig, params: Mapping[str, Any], lake: LakeSettings | None = None) -> RepairPlan:
    """The repair this audit run (params["run_id"], which approval_gate adds) left for a person,
    read from its rows in cdc_meta.audit_results."""
    from pyiceberg.expressions import And, EqualTo

    from cdc_lakehouse.feed.arrow import load_catalog_for
    from cdc_lakehouse.orchestration.tasks import lake_settings

    lake = lake or lake_settings()
    run_id = str(params["run_id"])
    results = load_catalog_for(lake).load_table(lake.meta_table("audit_results"))
    condition = And(EqualTo("table_name", cfg.name), EqualTo("audit_run", run_id))  # type: ignore[call-arg]
    rows = results.scan(row_filter=condition, selected_fields=("shard", "persistent", "sample_keys", "repaired"))
    found = rows.to_arrow().to_pylist()
    return RepairPlan(
        table=cfg.name,
        audit_run=run_id,
        limit=cfg.approvals.repair_limit(),
        repair_on=cfg.audit.repair,
        shards=tuple((r["shard"], int(r["persistent"] or 0), str(r["sample_keys"] or "")) for r in found),
        repaired=sum(int(r["repaired"] or 0) for r in found),
    )


Review = Callable[[TableConfig, Mapping[str, Any]], Plan]


def approval_gate(
    cfg: TableConfig, review_action: Review, *, fail_on_reject: bool = False, timeout: timedelta | None = None
) -> list[Any]:
    """review >> [approve, no_approval_needed]: the tasks an action's task goes after (with
    trigger_rule none_failed_min_one_success). `review_action` reads what the action would change
    (in the task, from the run's params); when it has nothing to do, both are skipped, and so is
    the action. fail_on_reject: a rejection fails the run (a repair: the audit's failure stands)."""
    from airflow.providers.standard.operators.empty import EmptyOperator
    from airflow.providers.standard.operators.hitl import ApprovalOperator
    from airflow.sdk import task

    @task.branch(task_id=REVIEW_TASK)
    def review(**context: Any) -> str | list[str]:
        """What the run would change; to the approval only when there is something to lose."""
        plan = review_action(cfg, {**context["params"], "run_id": context["run_id"]})
        context["ti"].xcom_push(key="subject", value=plan.subject())
        context["ti"].xcom_push(key="body", value=plan.body())
        if not plan.has_work:
            log.info("nothing to do: %s", plan.reason_not_needed)
            return []
        if not plan.needs_approval:
            log.info("no approval needed: %s", plan.reason_not_needed)
            return NOT_NEEDED_TASK
        return APPROVE_TASK

    hours = cfg.approvals.response_timeout_hours
    approve = ApprovalOperator(
        task_id=APPROVE_TASK,
        subject=f"{{{{ ti.xcom_pull(task_ids='{REVIEW_TASK}', key='subject') }}}}",
        body=f"{{{{ ti.xcom_pull(task_ids='{REVIEW_TASK}', key='body') }}}}",
        response_timeout=timedelta(hours=hours) if hours is not None else timeout,
        fail_on_reject=fail_on_reject,
    )
    not_needed = EmptyOperator(task_id=NOT_NEEDED_TASK)
    review() >> [approve, not_needed]
    return [approve, not_needed]


def rebootstrap_approval(cfg: TableConfig) -> list[Any]:
    return approval_gate(cfg, review_rebootstrap)


def replay_approval(cfg: TableConfig) -> list[Any]:
    return approval_gate(cfg, review_replay)


# An audit run waiting for its repair's approval holds back the next audit (one run at a time):
# unanswered, it fails when the next hourly audit would start, which asks again.
REPAIR_APPROVAL_TIMEOUT = timedelta(minutes=55)


def repair_approval(cfg: TableConfig) -> list[Any]:
    return approval_gate(cfg, review_repair, fail_on_reject=True, timeout=REPAIR_APPROVAL_TIMEOUT)


# --- a column dropped at the source: keep it or drop it -------------------------------------------
# Not an approval but a choice: the ingest found source columns dropped with no
# schema_changes.dropped_columns entry, recorded them as pending on the table and left its batch
# unapplied (status `waiting`). The ingest DAG then runs
#
#   ingest >> review_dropped >> decide_dropped >> record_dropped >> ingest_again
#
# review_dropped skips the rest when nothing is pending; decide_dropped (a HITLOperator) asks
# `keep_null` or `drop` for the listed columns; record_dropped keeps the answer on the table
# (ingest.schema.DropDecisions, which every later ingest reads); ingest_again applies the batch.
# Unanswered, decide_dropped fails after REPAIR_APPROVAL_TIMEOUT (the next run asks again).
REVIEW_DROPPED_TASK, DECIDE_DROPPED_TASK, RECORD_DROPPED_TASK = "review_dropped", "decide_dropped", "record_dropped"


@dataclass(frozen=True)
class DroppedColumns:
    """Per table (lake current table), the dropped columns waiting for a decision and their shards."""

    pending: dict[str, dict[str, list[str]]]

    def subject(self) -> str:
        cols = sorted({c for p in self.pending.values() for c in p})
        return f"Source column(s) {', '.join(cols)} dropped: keep them or drop them from the lake?"

    def body(self) -> str:
        lines = ["Columns the source dropped, with no `schema_changes.dropped_columns` entry in the YAML:", ""]
        for table, cols in sorted(self.pending.items()):
            lines += [
                f"- `lake.{table}`: " + "; ".join(f"`{c}` (shards {', '.join(s)})" for c, s in sorted(cols.items()))
            ]
        lines += [
            "",
            "- **keep_null**: the column stays in the current table, NULL for rows changed from now on.",
            "- **drop**: the column leaves the current table; the changelog keeps its history.",
            "",
            "The answer applies to every column listed and is kept on the table (a YAML entry wins "
            "over it). The table's batch waits unapplied; it is applied right after the answer.",
        ]
        return "\n".join(lines)


def review_dropped(cfgs: list[TableConfig], lake: LakeSettings | None = None) -> DroppedColumns:
    """The tables' pending drop decisions, from their current tables' properties (pyiceberg)."""
    from cdc_lakehouse.feed.arrow import load_catalog_for
    from cdc_lakehouse.ingest.schema import DROP_DECISIONS_PROP, DropDecisions
    from cdc_lakehouse.orchestration.tasks import lake_settings

    catalog = load_catalog_for(lake or lake_settings())
    pending = {}
    for cfg in cfgs:
        props = catalog.load_table(cfg.current_table).metadata.properties
        found = DropDecisions.from_json(props.get(DROP_DECISIONS_PROP)).pending
        if found:
            pending[cfg.current_table] = found
    return DroppedColumns(pending)


def record_dropped(cfgs: list[TableConfig], choice: str, lake: LakeSettings | None = None) -> dict[str, str]:
    """Every pending column of the tables decided `choice`, kept on each current table."""
    from cdc_lakehouse.feed.arrow import load_catalog_for
    from cdc_lakehouse.ingest.schema import DROP_DECISIONS_PROP, DropDecisions
    from cdc_lakehouse.orchestration.tasks import lake_settings

    catalog = load_catalog_for(lake or lake_settings())
    done: dict[str, str] = {}
    for cfg in cfgs:
        table = catalog.load_table(cfg.current_table)
        decisions = DropDecisions.from_json(table.metadata.properties.get(DROP_DECISIONS_PROP))
        if decisions.pending:
            with table.transaction() as tx:
                tx.set_properties({DROP_DECISIONS_PROP: decisions.decide(choice).to_json()})
            done.update({f"{cfg.name}.{c}": choice for c in decisions.pending})
    log.info("dropped columns decided: %s", done)
    return done


def asks_dropped(cfgs: list[TableConfig]) -> bool:
    """Whether the ingest of `cfgs` asks for dropped columns (IngestParams.undecided_drop)."""
    return approvals_enabled() and any(c.approvals.dropped_columns for c in cfgs)


def dropped_column_decision(cfgs: list[TableConfig]) -> tuple[Any, Any] | None:
    """(review_dropped, record_dropped), with decide_dropped between them: the ingest goes before
    the first, its second run after the last. None when no table asks (asks_dropped)."""
    from airflow.providers.standard.operators.hitl import HITLOperator
    from airflow.sdk import task

    from cdc_lakehouse.ingest.schema import DROP_CHOICES

    if not asks_dropped(cfgs):
        return None

    @task.branch(task_id=REVIEW_DROPPED_TASK)
    def review(**context: Any) -> str | list[str]:
        found = review_dropped(cfgs)
        if not found.pending:
            return []
        context["ti"].xcom_push(key="subject", value=found.subject())
        context["ti"].xcom_push(key="body", value=found.body())
        return DECIDE_DROPPED_TASK

    hours = min((c.approvals.response_timeout_hours or 0) for c in cfgs) or None
    decide = HITLOperator(
        task_id=DECIDE_DROPPED_TASK,
        subject=f"{{{{ ti.xcom_pull(task_ids='{REVIEW_DROPPED_TASK}', key='subject') }}}}",
        body=f"{{{{ ti.xcom_pull(task_ids='{REVIEW_DROPPED_TASK}', key='body') }}}}",
        options=list(DROP_CHOICES),
        response_timeout=timedelta(hours=hours) if hours else REPAIR_APPROVAL_TIMEOUT,
    )

    @task(task_id=RECORD_DROPPED_TASK)
    def record(**context: Any) -> dict[str, str]:
        answer = context["ti"].xcom_pull(task_ids=DECIDE_DROPPED_TASK)
        return record_dropped(cfgs, answer["chosen_options"][0])

    first, recorded = review(), record()
    first >> decide >> recorded
    return first, recorded
