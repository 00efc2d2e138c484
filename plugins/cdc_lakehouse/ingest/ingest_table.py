"""Incremental ingest of one table: landing -> raw changelog -> current table.

    plan      which capture runs are pending (manifests above the table's watermark, in
              slot order, with no gap), and which files hold this table's events
    schema    compare the events' schemas with the lake table; evolve or stop
    validate  typed events; malformed ones to quarantine, within the error budget
    dedupe    at-least-once delivery: drop repeated (shard, commit LSN, seq)
    fill      unchanged TOAST columns get their value from earlier events or the table
    changelog append, with the changelog's own watermark in the same commit
    reduce    latest event per key
    merge     LSN-guarded MERGE, with the new watermark in the same commit

Each of the two commits filters events by its own table's watermark, so a crash between
them, a retry, a rerun of an old interval or a replayed landing file all converge.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, ClassVar

from cdc_lakehouse.columns import COMMIT_TS_COL, INGESTED_COL, LSN_COL, OP_COL, SEQ_COL, SHARD_COL, UNAVAILABLE_COL
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.identifiers import spark_ident
from cdc_lakehouse.ingest.backfill import (
    backfill_added_columns,
    columns_to_backfill,
    fill_quiet_shards,
    finish_backfill,
)
from cdc_lakehouse.ingest.batch import FusedBatch, ReducedTotals, fused_batch
from cdc_lakehouse.ingest.errors import ErrorBudgetExceeded, SchemaChangeError
from cdc_lakehouse.ingest.landed import Landed, read_landed
from cdc_lakehouse.ingest.quarantine import as_held, held_back, hold_dependents, write_quarantine
from cdc_lakehouse.ingest.records import BatchState, RunRecords, TableRecords, write_records
from cdc_lakehouse.ingest.reduce import latest_per_key
from cdc_lakehouse.ingest.renames import Renames, apply_renames, in_lake_names
from cdc_lakehouse.ingest.schema import (
    DROP_DECISIONS_PROP,
    DropDecisions,
    UndecidedDrop,
    apply_schema_actions,
    event_schemas,
    known_columns,
    manifest_schemas,
    schema_actions,
    wait_for_drop_decision,
)
from cdc_lakehouse.ingest.toast import BROADCAST_ROWS, NO_TABLE, UNAV_LEFT, fill_unavailable
from cdc_lakehouse.ingest.validate import REASONS, shard_expr
from cdc_lakehouse.lake.batches import BATCH_PROP, BATCH_STATE_PROP, BatchId, BatchStep, commit_once, committed
from cdc_lakehouse.lake.commits import (
    ConcurrentWriterError,
    fenced_commit,
    snapshot_summary,
)
from cdc_lakehouse.lake.freshness import freshness_rows
from cdc_lakehouse.lake.ingest_metrics import ALREADY_APPLIED, MERGE_COUNTS, OK, OK_WITH_GAPS, IngestMetrics
from cdc_lakehouse.lake.merge import lsn_newer, run_merge
from cdc_lakehouse.lake.snapshots import Snapshot, current_ancestors, read_watermark, summary_of
from cdc_lakehouse.lake.tables import (
    conform_to,
    partition_sql,
    props_sql,
    source_columns_of,
    table_exists,
    table_property,
)
from cdc_lakehouse.lake.writers import INGEST
from cdc_lakehouse.landing.errors import LandingGap, NotBootstrapped
from cdc_lakehouse.landing.reader import Plan, SparkLanding, plan_landing
from cdc_lakehouse.runtime.failpoints import crash_point
from cdc_lakehouse.runtime.phases import (
    Observed,
    SparkJobs,
    as_count,
    checkpoint_counted,
    job_phase,
    local_checkpoint,
    observed_counts,
    releasing_kept,
)
from cdc_lakehouse.runtime.session import session_conf
from cdc_lakehouse.settings import LakeSettings
from cdc_lakehouse.watermark import WATERMARK_PROP, PendingBackfill, Watermark, shard_lsn_map

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IngestResult:
    """What one ingest run did: its figures (the cdc_meta.ingest_runs record, and more) and the
    Spark jobs it took."""

    metrics: IngestMetrics
    spark_jobs: int | None  # None: not known (no Spark UI to count them on)
    spark_metadata_jobs: int | None  # of those, reads of Iceberg metadata tables
    spark_job_sites: list[str]  # what started each job, in order

    # What the ingest job's result line shows of the metrics (the whole run is in cdc_meta.ingest_runs).
    LINE: ClassVar[tuple[str, ...]] = (
        "events_read",
        "inserts",
        "updates",
        "deletes",
        "quarantined",
        "write_amplification",
        "apply_seconds",
        "total_seconds",
        "freshness_seconds",
        "landing_runs",
        "status",
    )

    def to_dict(self) -> dict[str, Any]:
        """For the job's result line (cdc_lakehouse.jobs): the LINE figures."""
        return {k: getattr(self.metrics, k) for k in self.LINE}


def ingest_table(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    *,
    upto_run: str | None,
    ingest_run: str,
    interval_end: str | None = None,
    config_file: str | None = None,
    records: RunRecords | None = None,
    ask_dropped: bool = False,
) -> IngestResult:
    """Apply every pending capture run (up to `upto_run`) to the table; returns the run's metrics,
    with the number of Spark jobs it took. records: a group run's (ingest.records), which commits
    the run's record and freshness rows with the other tables'; without, they are committed here.
    ask_dropped: a column dropped with no decision waits for one in Airflow (DropDecisionNeeded)
    when the table's approvals.dropped_columns is on, instead of stopping the table."""
    with SparkJobs(spark, f"ingest {cfg.name} {ingest_run}") as jobs, releasing_kept():
        ask = ask_dropped and cfg.approvals.dropped_columns
        m = apply_pending(spark, lake, cfg, upto_run, ingest_run, interval_end, config_file, records, ask)
    log.info(
        "ingest %s: %s Spark jobs (+%s metadata reads): %s", cfg.name, jobs.count, jobs.metadata, "; ".join(jobs.sites)
    )
    return IngestResult(m, jobs.count, jobs.metadata, jobs.sites)


def apply_pending(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    upto_run: str | None,
    ingest_run: str,
    interval_end: str | None,
    config_file: str | None,
    records: RunRecords | None = None,
    ask_dropped: bool = False,
) -> IngestMetrics:
    """The ingest's phases, in order: plan, prepare (one fused plan: validate, dedupe, split key
    changes, fill, reduce), quarantine, changelog, classify, MERGE (the watermark in the same
    commit), record."""
    resume_batch(spark, lake, cfg)
    m = IngestMetrics(
        table_name=cfg.name, ingest_run=ingest_run, interval_end=interval_end, write_mode=cfg.lake.write_mode
    )
    with phase(spark, m, "plan"):
        b = plan_batch(spark, lake, cfg, upto_run, ingest_run)
    m.landing_runs = [r.run_id for r in b.plan.manifests]
    m.status = OK_WITH_GAPS if b.gaps else OK
    if not b.plan.files:
        advance_watermark(spark, cfg, b, batch_state(m, b.plan, None))
        fill_quiet(spark, lake, cfg, m, b, ingest_run)
        return finish(spark, lake, cfg, m, b, records=records)
    landed = read_landed(spark, cfg, b.plan).renamed(b.renames, shard_expr(cfg.shard_map()))
    b.lake_cols = evolve_schema(spark, cfg, b, landed, config_file, ask_dropped)
    with phase(spark, m, "prepare"):
        fb = fused_batch(landed, cfg, b.lake_cols, b.wm, b.plan.landed_rows())
    m.events_read, m.already_applied = fb.counts.n, fb.counts.applied
    m.quarantined = quarantine_malformed(spark, lake, cfg, fb, m.events_read - m.already_applied, ingest_run)
    with phase(spark, m, "fill"):
        ch = prepare_changes(spark, cfg, b, fb)
    m.duplicates, m.truncates = ch.duplicates, fb.counts.truncates
    crash_point("ingest_before_changelog")
    with phase(spark, m, "changelog"):
        m.changelog_rows = append_changelog(spark, cfg, b, ch)
    crash_point("ingest_after_changelog")
    with phase(spark, m, "reduce_classify"):
        reduced, out = reduce_and_classify(spark, lake, cfg, b, ch, ingest_run)
    out.set_counts(m)
    m.quarantined += out.held
    pre, m.merge_join = before_merge(spark, lake, cfg, b)
    with phase(spark, m, "merge"), merge_source(spark, lake, cfg, reduced, m.merge_join) as source:
        state = batch_state(m, b.plan, fb.counts.shard_commits, None if out.counted else out.rows)
        published = commit_merge(spark, cfg, b, source, ch.truncated, ingest_run, state)
    crash_point("ingest_after_merge")
    if not published:
        return applied_by_another_run(spark, lake, cfg, m, b, ingest_run, records)
    # The run's figures are its MERGE's: a backfill below commits on its own (its rows, counted in
    # m.backfilled, then an empty append that carries the watermark).
    merge_figures(cfg, m, pre, merge_summary(spark, b.cur, b.batch), out)
    backfill_and_fill(spark, lake, cfg, m, b, ingest_run)
    m.apply_seconds = m.timings["merge"]
    m.set_lag(out.min_ts, out.max_ts)
    return finish(spark, lake, cfg, m, b, shard_commits=fb.counts.shard_commits, records=records)


@contextmanager
def phase(spark: SparkSession, m: IngestMetrics, name: str) -> Iterator[None]:
    """A named phase of the ingest: its seconds in the run's timings, its Spark jobs tagged with its
    name (what the job counts list per job: runtime.phases.SparkJobs.sites)."""
    with m.timed(name), job_phase(spark, name):
        yield


def backfill_and_fill(
    spark: SparkSession, lake: LakeSettings, cfg: TableConfig, m: IngestMetrics, b: Batch, ingest_run: str
) -> None:
    """The columns the batch added, for the rows that predate them, then the quiet shards' fills.
    A writer that moved the table first and finished the backfill made its own fills too."""
    if b.added:
        m.backfilled, mine = finish_backfill(spark, lake, cfg, b.cur, b.plan, b.added, ingest_run)
        if not mine:
            return
    fill_quiet(spark, lake, cfg, m, b, ingest_run)


def fill_quiet(
    spark: SparkSession, lake: LakeSettings, cfg: TableConfig, m: IngestMetrics, b: Batch, ingest_run: str
) -> None:
    """Shards that sent no relation message for columns the lake now has (ingest.backfill)."""
    n = fill_quiet_shards(spark, lake, cfg, b.cur, b.plan, b.wm, ingest_run)
    if n:
        m.backfilled = (m.backfilled or 0) + n


# --- plan -----------------------------------------------------------------------------------------


@dataclass
class Batch:
    """What the phases share: the two tables, the positions this run started from, the plan."""

    cur: str
    cl: str
    wm: Watermark  # the current table's watermark; the MERGE is fenced on it
    cl_wm: Watermark | None  # the changelog's (None before its first commit); its append is fenced on it
    plan: Plan
    lake_cols: list[tuple[str, str]]
    added: list[PendingBackfill]  # columns the batch adds at the source: backfilled after the MERGE
    new_wm_json: str  # both commits write the same new watermark
    gaps: bool  # landing problems skipped (missing_landing_files: skip)
    batch: BatchId  # every commit of the run carries it (lake.batches); the same for a retry of the same data
    renames: Renames = field(default_factory=Renames)  # source column renames (ingest.renames)


def plan_batch(
    spark: SparkSession, lake: LakeSettings, cfg: TableConfig, upto_run: str | None, ingest_run: str
) -> Batch:
    cur, cl = lake.qualified(cfg.current_table), lake.qualified(cfg.changelog_table)
    wm = start_position(spark, cfg, cur)
    cl_wm = read_watermark(spark, cl)
    from cdc_lakehouse.landing.debezium.plan import plan_debezium  # a Debezium-fed table reads the S3 sink's objects

    debezium = cfg.landing.kind == "debezium_s3"
    plan = (
        plan_debezium(spark, lake, cfg, wm)
        if debezium
        else plan_landing(SparkLanding(spark, lake.landing_uri), cfg, wm, upto_run)
    )
    gaps = check_landing(cfg, plan)
    # Source renames (DDL events) first: the lake's columns, and the plan's names, are the new ones.
    renames = Renames() if debezium else apply_renames(spark, cfg, cur, cl, plan, wm)
    lake_cols = source_columns_of(spark, cur, cfg)
    # A backfill of added columns that an earlier run committed as pending but did not finish.
    pending = plan.new_watermark.backfill
    if pending is not None:
        plan.new_watermark = plan.new_watermark.without_backfill()
    if pending:
        backfill_added_columns(spark, lake, cfg, pending, lake_cols, ingest_run)
    added = columns_to_backfill(cfg, plan, in_lake_names(wm, renames))
    if added:
        plan.new_watermark.backfill = added
    batch = ingest_batch_id(cur, wm, plan, ingest_run)
    return Batch(cur, cl, wm, cl_wm, plan, lake_cols, added, plan.new_watermark.to_json(), gaps, batch, renames)


def ingest_batch_id(cur: str, wm: Watermark, plan: Plan, ingest_run: str) -> BatchId:
    """From the positions the batch moves the table between: a retry of the same data gets the
    same id. A run that moves nothing commits no data, so there is nothing to resume: its id is
    its own (a quiet table's runs each keep their run record)."""
    if plan.files or plan.new_watermark != wm:
        return BatchId.of(f"ingest:{cur}", wm.to_dict(), plan.new_watermark.to_dict())
    return BatchId.of(f"ingest:{cur}", wm.to_dict(), {"noop": ingest_run, "at": datetime.now(UTC).isoformat()})


def start_position(spark: SparkSession, cfg: TableConfig, cur: str) -> Watermark:
    """The current table's watermark; the ingest only continues what a bootstrap started."""
    if not table_exists(spark, cur):
        raise NotBootstrapped(
            f"{cfg.name}: lake table {cur} does not exist; trigger the DAG cdc_bootstrap__{cfg.name} to load it first"
        )
    wm = read_watermark(spark, cur)
    if wm is None:
        raise NotBootstrapped(
            f"{cfg.name}: {cur} has no cdc.watermark (not created by a bootstrap?); "
            f"re-bootstrap with cdc_bootstrap__{cfg.name}"
        )
    return wm


def check_landing(cfg: TableConfig, plan: Plan) -> bool:
    """Stop on landing problems unless the table allows skipping them; True if skipped."""
    if not plan.problems:
        return False
    msg = "\n".join(plan.problems)
    if cfg.ingest.missing_landing_files == "fail":
        raise LandingGap(
            msg + f"\nTo continue without those events set ingest.missing_landing_files: skip for "
            f"{cfg.name}; the hourly audit then finds the affected keys and its repair re-reads them"
        )
    log.warning("%s: continuing past landing problems (missing_landing_files: skip):\n%s", cfg.name, msg)
    return True


def advance_watermark(spark: SparkSession, cfg: TableConfig, b: Batch, state: str) -> None:
    """Nothing to apply (quiet shards): the heartbeats still move the watermark forward. The same
    two commits as a batch with events (changelog, then the current table with the batch's state)."""
    if b.plan.new_watermark == b.wm:
        return

    def _empty(table: str, props: dict[str, str], target: str) -> None:
        w = spark.createDataFrame([], spark.table(table).schema).writeTo(target)
        for k, v in {**props, **INGEST.props(), WATERMARK_PROP: b.new_wm_json}.items():
            w = w.option(f"snapshot-property.{k}", v)
        w.append()

    new = b.plan.new_watermark

    def _changelog(props: dict[str, str]) -> None:
        write = lambda t: _empty(b.cl, props, t)  # noqa: E731
        fenced_commit(spark, b.cl, b.cl_wm, new, write, what=f"{cfg.name} changelog watermark")

    commit_once(spark, b.batch, BatchStep("ingest_changelog", b.cl, _changelog, positioned=True))
    write = lambda t: _empty(b.cur, {**b.batch.props(), BATCH_STATE_PROP: state}, t)  # noqa: E731
    fenced_commit(spark, b.cur, b.wm, new, write, what=f"{cfg.name} watermark")


# --- schema, validate, quarantine -----------------------------------------------------------------


def evolve_schema(
    spark: SparkSession, cfg: TableConfig, b: Batch, landed: Landed, config_file: str | None, ask_dropped: bool = False
) -> list[tuple[str, str]]:
    """Additive schema changes applied before the data; anything else stops the table. Returns
    the lake columns the batch is written with. A dropped column takes the YAML's decision, else
    the one made in Airflow (DropDecisions, read only then), else waits for one (ask_dropped)."""
    schemas, latest = manifest_schemas(b.plan, cfg)
    announced: Plan | None = b.plan
    if not latest:
        schemas, latest = event_schemas(landed.table_schemas())  # runs written without schemas in their manifest
        announced = None  # the events' own schemas: each was announced in the batch
    known = known_columns(cfg, in_lake_names(b.wm, b.renames), announced)
    ddl, errors = schema_actions(cfg, b.lake_cols, schemas, latest, config_file or "", known)
    if any(isinstance(e, UndecidedDrop) for e in errors):
        # The choice may have been recorded since this session cached the table (by pyiceberg, in
        # the DAG's record_dropped): where Spark answers for the property, it reads it afresh.
        spark.sql(f"REFRESH TABLE {b.cur}")
        decisions = DropDecisions.from_json(table_property(spark, b.cur, DROP_DECISIONS_PROP))
        ddl, errors = schema_actions(cfg, b.lake_cols, schemas, latest, config_file or "", known, decisions.decided)
        undecided = [e for e in errors if isinstance(e, UndecidedDrop)]
        if ask_dropped and undecided and len(undecided) == len(errors):
            wait_for_drop_decision(spark, cfg, b.cur, decisions, undecided)
    if errors:
        raise SchemaChangeError("\n".join(errors))
    apply_schema_actions(spark, b.cur, b.cl, ddl)
    return source_columns_of(spark, b.cur, cfg) if ddl else b.lake_cols


def quarantine_malformed(
    spark: SparkSession, lake: LakeSettings, cfg: TableConfig, fb: FusedBatch, n_new: int, ingest_run: str
) -> int:
    """Malformed events to quarantine; over the error budget nothing is applied. Returns rows added."""
    n_bad = fb.counts.bad
    if not n_bad:
        return 0
    bad = fb.malformed()
    n = write_quarantine(spark, lake, cfg, bad, ingest_run)
    budget = cfg.ingest.error_budget
    if n_bad > budget.max_quarantined or (n_new and n_bad / n_new > budget.max_fraction):
        raise over_budget(lake, cfg, bad, n_bad, n_new)
    return n


def over_budget(lake: LakeSettings, cfg: TableConfig, bad: DataFrame, n_bad: int, n_new: int) -> ErrorBudgetExceeded:
    from pyspark.sql import functions as F

    budget = cfg.ingest.error_budget
    top = bad.select(F.explode(REASONS).alias("r")).groupBy("r").count().orderBy(F.desc("count")).limit(5).collect()
    return ErrorBudgetExceeded(
        f"{cfg.name}: {n_bad} of {n_new} events are malformed, over the error budget "
        f"(max_quarantined {budget.max_quarantined}, max_fraction {budget.max_fraction}). Top reasons: "
        + "; ".join(f"{r['r']} (x{r['count']})" for r in top)
        + f". They are in {lake.meta_table('quarantine')} (table_name = '{cfg.name}'); nothing was applied. "
        "Fix the source or the table config (e.g. column_types), or raise ingest.error_budget, then rerun."
    )


# --- prepare, changelog ---------------------------------------------------------------------------


@dataclass
class Changes:
    """The batch's valid events, deduplicated and TOAST-filled, as both commits take them."""

    events: DataFrame  # row changes in lake order, with UNAV_LEFT and NO_TABLE
    truncs: DataFrame  # truncates
    current: DataFrame  # the current table as read before the changelog commit
    latest: DataFrame  # the latest event per key (before truncates)
    totals: ReducedTotals | None  # latest's totals when the fused plan counted them (else counted later)
    toast_columns: list[str]  # unchanged TOAST columns somewhere in the batch
    truncated: list[str]  # shards truncated in the batch
    duplicates: int


def prepare_changes(spark: SparkSession, cfg: TableConfig, b: Batch, fb: FusedBatch) -> Changes:
    """The fused plan's events; the multi-pass TOAST fill only where one pass could not decide
    (a key change whose new key takes its unchanged TOAST value from the old key)."""
    current = spark.table(b.cur)
    names = fb.counts.unavailable
    events, latest = fb.events(), fb.latest()
    totals: ReducedTotals | None = fb.counts
    if fb.needs_multipass_fill():
        # Over the whole batch: narrowed to the keys key changes touch, it cost 7 Spark jobs more
        # and no time on the demo's batches (docs/benchmarks-history.md, "make demo"): the fill's cost is its
        # ~30 small jobs, not the rows.
        log.info("%s: multi-pass TOAST fill (pk_unresolved %d)", cfg.name, fb.counts.pk_unresolved)
        events = local_checkpoint(fill_unavailable(events.drop(UNAV_LEFT, NO_TABLE), current, cfg, names))
        latest, totals = latest_per_key(events, [SHARD_COL, *cfg.primary_key]), None
    return Changes(events, fb.truncates(), current, latest, totals, names, fb.counts.truncated, fb.counts.duplicates)


def append_changelog(spark: SparkSession, cfg: TableConfig, b: Batch, ch: Changes) -> int:
    """Append what the changelog does not have yet, with its new watermark; returns rows added."""
    from pyspark.sql import functions as F

    cl_floor = shard_lsn_map(b.cl_wm)
    ingested = F.current_timestamp()

    def _append(props: dict[str, str], target: str) -> None:
        rows = ch.events.unionByName(ch.truncs, allowMissingColumns=True).filter(
            F.col(LSN_COL) >= F.coalesce(cl_floor[F.col(SHARD_COL)], F.lit(0))
        )
        rows = conform_to(rows.withColumn(INGESTED_COL, ingested), spark.table(b.cl).schema)
        # The fused plan's rows are already hashed by key (shard first): no second shuffle to
        # cluster them by partition; the fanout writer keeps one file open per partition instead.
        w = rows.writeTo(target).option("distribution-mode", "none").option("fanout-enabled", "true")
        for k, v in {**props, **INGEST.props(), WATERMARK_PROP: b.new_wm_json}.items():
            w = w.option(f"snapshot-property.{k}", v)
        w.append()

    landed: list[bool] = []

    def _commit(props: dict[str, str]) -> None:
        write = lambda t: _append(props, t)  # noqa: E731
        landed.append(fenced_commit(spark, b.cl, b.cl_wm, b.plan.new_watermark, write, what=f"{cfg.name} changelog"))

    # A retry of a batch whose changelog commit landed skips it (the batch id, then the fence).
    commit_unless_landed(spark, b.batch, BatchStep("ingest_changelog", b.cl, _commit, positioned=True))
    return int(snapshot_summary(spark, b.cl).get("added-records", 0)) if any(landed) else 0


# --- reduce, classify, merge ----------------------------------------------------------------------


@dataclass
class Outcome:
    """What the MERGE will do: counted against the table before it runs, or (counted False)
    left to the MERGE's own snapshot summary."""

    rows: int  # rows of the reduced batch the MERGE is given
    held: int  # rows held back in quarantine (unchanged TOAST value unknown)
    min_ts: datetime | None  # commit time of the batch's oldest and newest applied events
    max_ts: datetime | None
    inserts: int = 0
    updates: int = 0
    deletes: int = 0
    redeleted: int = 0  # applied, but neither an update nor a delete (Classification.redeleted)
    counted: bool = True

    def set_counts(self, m: IngestMetrics) -> None:
        """Counted before the MERGE: into the run's metrics (the MERGE's summary does it otherwise)."""
        if self.counted:
            m.set_counts(self.rows, self.inserts, self.updates, self.deletes, unchanged=self.redeleted)


def needs_base() -> Column:
    """An upsert with unchanged TOAST columns the batch could not fill: the MERGE keeps the table's."""
    from pyspark.sql import functions as F

    return (F.col(OP_COL) != "d") & (F.size(UNAV_LEFT) > 0)


def current_columns(lake_cols: list[tuple[str, str]]) -> list[str]:
    return [SHARD_COL, *[c for c, _ in lake_cols], OP_COL, LSN_COL, SEQ_COL, COMMIT_TS_COL]


def reduce_and_classify(
    spark: SparkSession, lake: LakeSettings, cfg: TableConfig, b: Batch, ch: Changes, ingest_run: str
) -> tuple[DataFrame, Outcome]:
    """Latest event per key, minus the rows held back; the counts of what the MERGE will do."""
    key = [SHARD_COL, *cfg.primary_key]
    reduced = reduce_batch(cfg, b, ch)
    totals = ch.totals if ch.totals is not None and not ch.truncated else reduced_totals(reduced)
    tgt = table_positions(cfg, ch.current)
    # Rows whose unchanged TOAST value has no trustworthy source are held back (see held_back);
    # the MERGE then never sees them. Orphans (no row in the table either) are found by the
    # classification below, which scans the table's keys anyway.
    held = held_back(spark, lake, cfg, reduced, tgt, b.lake_cols, totals)
    n_held = hold_dependents(spark, lake, cfg, held, ingest_run)
    if held is not None and n_held:
        reduced = local_checkpoint(reduced.join(held.select(*key), key, "left_anti"))
    if counts_from_merge(cfg, totals):
        # Nothing to read from the table: the MERGE's snapshot summary counts what it did, so the
        # table is not scanned (bench/ingest_bench.py --toast-share 0: docs/benchmarks-history.md, #38).
        return reduced, Outcome(totals.reduced - n_held, n_held, totals.min_ts, totals.max_ts, counted=False)
    # The unchanged TOAST values the batch could not supply are read from the table here, with the
    # keys it scans anyway, for the matched rows only: the MERGE then never references the
    # table's TOAST columns, which would carry them (the widest columns) through its shuffle of
    # every row of the table (bench/ingest_bench.py: 8.5 GiB instead of 4.8 GiB at 20M rows).
    base_cols = list(ch.toast_columns) if totals.needs_base else []
    c, base = classify(reduced, table_positions(cfg, ch.current, base_cols), key, totals, base_cols)
    left_needing = reduced.filter(needs_base()).count() if n_held else totals.needs_base
    n_orphans = hold_orphans(spark, lake, cfg, reduced, tgt, ingest_run) if left_needing > c.based else 0
    if base is not None:
        # Still needing a value after the fill: orphans, just held in quarantine; never applied.
        reduced = fill_from_table(reduced, base, key, base_cols).filter(~needs_base())
    return reduced, Outcome(
        rows=totals.reduced - n_held - n_orphans,
        held=n_held + n_orphans,
        min_ts=totals.min_ts,
        max_ts=totals.max_ts,
        inserts=totals.upserts - n_held - c.matched_upserts - n_orphans,
        updates=c.updates,
        deletes=c.deletes,
        redeleted=c.redeleted,
    )


def counts_from_merge(cfg: TableConfig, totals: ReducedTotals) -> bool:
    """The MERGE's own counts (MERGE_COUNTS) suffice: no row takes a value from the table, and a
    delete is a delete (a soft delete is an update in them)."""
    return not totals.needs_base and cfg.deletes == "hard"


def reduce_batch(cfg: TableConfig, b: Batch, ch: Changes) -> DataFrame:
    reduced = ch.latest
    if ch.truncated:
        reduced = apply_truncates(reduced, ch.truncs)
    reduced = reduced.select(*current_columns(b.lake_cols), UNAV_LEFT, NO_TABLE, UNAVAILABLE_COL)
    if ch.totals is not None and not ch.truncated:
        return reduced  # a filter of the fused plan's materialized rows: computed, and deterministic
    # A local checkpoint: computed once, and a deterministic plan (copy-on-write MERGE requires it).
    return local_checkpoint(reduced)


def apply_truncates(reduced: DataFrame, truncs: DataFrame) -> DataFrame:
    """Keys whose last event precedes their shard's truncate are gone: they become its delete."""
    from pyspark.sql import functions as F

    tmax = truncs.groupBy(SHARD_COL).agg(F.max(F.struct(LSN_COL, SEQ_COL, COMMIT_TS_COL)).alias("_t"))
    reduced = reduced.join(F.broadcast(tmax), SHARD_COL, "left")
    before_t = F.col("_t").isNotNull() & lsn_newer(
        F.col("_t")[LSN_COL], F.col("_t")[SEQ_COL], F.col(LSN_COL), F.col(SEQ_COL)
    )
    return (
        reduced.withColumn(OP_COL, F.when(before_t, F.lit("d")).otherwise(F.col(OP_COL)))
        .withColumn(COMMIT_TS_COL, F.when(before_t, F.col("_t")[COMMIT_TS_COL]).otherwise(F.col(COMMIT_TS_COL)))
        .withColumn(SEQ_COL, F.when(before_t, F.col("_t")[SEQ_COL]).otherwise(F.col(SEQ_COL)))
        .withColumn(LSN_COL, F.when(before_t, F.col("_t")[LSN_COL]).otherwise(F.col(LSN_COL)))
        .drop("_t")
    )


def reduced_totals(reduced: DataFrame) -> ReducedTotals:
    """What the fused plan counts (ingest.batch._out_counters), for a batch it could not reduce."""
    from pyspark.sql import functions as F

    filled = (F.col(OP_COL) != "d") & (F.size(F.coalesce(UNAVAILABLE_COL, F.array())) > 0)
    observed = observed_counts(
        reduced,
        F.count(F.lit(1)).alias("reduced"),
        F.sum((F.col(OP_COL) != "d").cast("int")).alias("upserts"),
        F.sum(needs_base().cast("int")).alias("needs_base"),
        F.sum((needs_base() & F.col(NO_TABLE)).cast("int")).alias("needs_base_no_table"),
        F.sum(filled.cast("int")).alias("filled"),
        F.unix_micros(F.min(COMMIT_TS_COL)).alias("min_ts"),
        F.unix_micros(F.max(COMMIT_TS_COL)).alias("max_ts"),
    )
    return ReducedTotals.observed(observed)


def table_positions(cfg: TableConfig, current: DataFrame, values: list[str] | None = None) -> DataFrame:
    """The table's keys with their (LSN, seq) and whether the row is live (soft deletes); with
    `values`, those columns too, as `_base_<name>`."""
    from pyspark.sql import functions as F

    key = [SHARD_COL, *cfg.primary_key]
    live = ~F.col(cfg.soft_delete_columns.flag) if cfg.deletes == "soft" else F.lit(True)
    extra = [F.col(spark_ident(c)).alias(BASE_PREFIX + c) for c in values or []]
    return current.select(
        *key, F.col(LSN_COL).alias("_t_lsn"), F.col(SEQ_COL).alias("_t_seq"), live.alias("_t_live"), *extra
    )


BASE_PREFIX = "_base_"  # a table value fetched for an unchanged TOAST column (fill_from_table)
BASE_BROADCAST_BYTES = 32 * 1024 * 1024  # fetched TOAST values up to this size are broadcast (~6x that in memory)


@dataclass(frozen=True)
class Classification:
    """The batch's rows against the table's, counted in classify's one scan of the table's keys.
    An empty table gives none (its scan has no partition to run the observation on): zeros."""

    matched_upserts: int = 0  # upserts whose key the table has
    updates: int = 0  # of those, newer than the table's row: the MERGE updates them
    deletes: int = 0  # deletes newer than the table's live row: the MERGE deletes them
    redeleted: int = 0  # deletes newer than a soft-deleted row: the MERGE moves its position only
    stale: int = 0  # rows the table has at a newer position: the MERGE skips them
    based: int = 0  # matched rows that take unchanged TOAST values from the table (needs_base)
    base_bytes: int = 0  # the size of those values (with base_cols only)

    @classmethod
    def observed(cls, values: Observed) -> Classification:
        """From observed metrics, named as the fields (a sum over no rows comes back NULL: 0)."""
        return cls(**{k: as_count(v) for k, v in values.items()})


def classify(
    reduced: DataFrame, tgt: DataFrame, key: list[str], totals: ReducedTotals, base_cols: list[str] | None = None
) -> tuple[Classification, DataFrame | None]:
    """Exact insert/update/delete counts: the batch's keys are broadcast and the table's key
    columns scanned once. With base_cols (tgt from table_positions(..., base_cols)), the same scan
    also returns the table's values of those columns for the matched rows that need them
    (needs_base), materialized: (key, _base_<col>...); else None."""
    from pyspark.sql import functions as F

    keys = reduced.select(*key, LSN_COL, SEQ_COL, OP_COL, needs_base().alias("_needs_base"))
    if totals.reduced <= BROADCAST_ROWS:
        keys = F.broadcast(keys)
    newer = lsn_newer(F.col(LSN_COL), F.col(SEQ_COL), F.col("_t_lsn"), F.col("_t_seq"))
    is_del = F.col(OP_COL) == "d"
    counts = (
        F.sum((~is_del).cast("int")).alias("matched_upserts"),
        F.sum((~is_del & newer).cast("int")).alias("updates"),
        F.sum((is_del & newer & F.col("_t_live")).cast("int")).alias("deletes"),
        F.sum((is_del & newer & ~F.col("_t_live")).cast("int")).alias("redeleted"),
        F.sum((~newer).cast("int")).alias("stale"),
        F.sum(F.col("_needs_base").cast("int")).alias("based"),
    )
    matched = tgt.join(keys, key, "inner")
    if not base_cols:
        return Classification.observed(observed_counts(matched, *counts)), None
    size = sum(F.coalesce(F.octet_length(F.col(BASE_PREFIX + c).cast("string")), F.lit(0)) for c in base_cols)
    base_bytes = F.sum(F.when(F.col("_needs_base"), size)).alias("base_bytes")
    # The matched rows checkpointed once (the values only where needed), counted by the job that
    # fills the checkpoint (see ingest.batch.fused_batch).
    needed = [F.when(F.col("_needs_base"), F.col(BASE_PREFIX + c)).alias(BASE_PREFIX + c) for c in base_cols]
    kept, seen = checkpoint_counted(
        matched.select(*key, LSN_COL, SEQ_COL, OP_COL, "_t_lsn", "_t_seq", "_t_live", "_needs_base", *needed),
        *counts,
        base_bytes,
    )
    c = Classification.observed(seen)
    base = kept.filter("_needs_base").select(*key, *[BASE_PREFIX + c for c in base_cols])
    # Small enough (the common case): joined to the batch without a shuffle, in the MERGE's own jobs.
    return c, (F.broadcast(base) if c.base_bytes <= BASE_BROADCAST_BYTES else base)


def fill_from_table(reduced: DataFrame, base: DataFrame, key: list[str], base_cols: list[str]) -> DataFrame:
    """The unchanged TOAST values the batch could not supply, from the table's row (classify):
    what the MERGE used to take from its target row. Rows without a table row keep UNAV_LEFT."""
    from pyspark.sql import functions as F

    found = F.col("_base_found")
    out = reduced.join(base.withColumn("_base_found", F.lit(True)), key, "left")
    for c in base_cols:
        take = found.isNotNull() & F.array_contains(UNAV_LEFT, c)
        out = out.withColumn(c, F.when(take, F.col(BASE_PREFIX + c)).otherwise(F.col(c)))
    left = F.when(found.isNotNull(), F.filter(UNAV_LEFT, lambda _: F.lit(False))).otherwise(F.col(UNAV_LEFT))
    return out.withColumn(UNAV_LEFT, left).select(*reduced.columns)


def hold_orphans(
    spark: SparkSession, lake: LakeSettings, cfg: TableConfig, reduced: DataFrame, tgt: DataFrame, ingest_run: str
) -> int:
    """An unchanged TOAST value whose key is neither earlier in the batch nor in the table: the
    value exists nowhere we can read. The MERGE does not insert such rows; they are kept in
    quarantine rather than given a NULL. Returns how many."""
    from pyspark.sql import functions as F

    key = [SHARD_COL, *cfg.primary_key]
    orphans = reduced.filter(needs_base()).join(tgt.select(*key), key, "left_anti")
    reason = F.concat(
        F.lit("unchanged TOAST column(s) "),
        F.array_join(UNAV_LEFT, ", "),
        F.lit(" not sent by the source and the key has no earlier row in the batch or the lake"),
    )
    return hold_dependents(spark, lake, cfg, as_held(orphans.withColumn(REASONS, F.array(reason)), key), ingest_run)


def before_merge(spark: SparkSession, lake: LakeSettings, cfg: TableConfig, b: Batch) -> tuple[dict[str, str], str]:
    """The table's snapshot summary before the MERGE (its figures are measured against it) and
    the MERGE's join, chosen from the table's size; the staged batches of killed runs dropped."""
    pre = snapshot_summary(spark, b.cur)
    join = merge_join_for(cfg, int(pre.get("total-records", 0)))
    drop_stale_staging(spark, lake, cfg, datetime.now(UTC))
    return pre, join


def merge_join_for(cfg: TableConfig, table_rows: int) -> str:
    """shuffle or colocated (ingest.merge_join): auto stages the batch only for a large table
    the MERGE can join partition by partition."""
    mode = cfg.ingest.merge_join
    if mode == "auto":
        big = table_rows >= cfg.ingest.colocated_min_rows
        return "colocated" if big and cfg.colocatable else "shuffle"
    return mode


# Spark's storage-partitioned join: two Iceberg scans partitioned alike are joined partition by
# partition, without an exchange. Set only around a colocated MERGE.
COLOCATED_CONF = {
    "spark.sql.sources.v2.bucketing.enabled": "true",
    "spark.sql.sources.v2.bucketing.pushPartValues.enabled": "true",
    "spark.sql.requireAllClusterKeysForCoPartition": "false",  # the join key is (shard, key), the partition shard
    "spark.sql.sources.v2.bucketing.partiallyClusteredDistribution.enabled": "true",
    "spark.sql.iceberg.planning.preserve-data-grouping": "true",
}


@contextmanager
def merge_source(
    spark: SparkSession, lake: LakeSettings, cfg: TableConfig, reduced: DataFrame, join: str
) -> Iterator[str]:
    """What the MERGE reads the batch from. Usually a temp view: the MERGE then shuffles every row
    of the table to meet the batch. For a colocated join (merge_join_for) the batch is staged in
    an Iceberg table with the current table's partitioning, and the MERGE runs with
    COLOCATED_CONF: partitions of the table meet their batch rows where they are read (at 20M rows
    the plain MERGE of bench/ingest_bench.py went from 9.5 to 4.8 s, staging included). The
    staging table has a name of its own per run, so a stray run cannot swap another batch in,
    and is dropped afterwards. No TOAST column is read from the table: reduce_and_classify filled
    them (fill_from_table)."""
    view = f"cdc_batch_{cfg.name}"
    reduced.createOrReplaceTempView(view)
    if join == "shuffle":
        yield view
        return
    stage = lake.qualified(lake.meta_table(f"{STAGING_PREFIX}{cfg.name}_{uuid.uuid4().hex[:12]}"))
    try:
        spark.sql(
            f"CREATE TABLE {stage} USING iceberg {partition_sql(cfg)} "
            f"{props_sql({'format-version': '2', STAGED_AT_PROP: datetime.now(UTC).isoformat()})} "
            f"AS SELECT * FROM {view}"
        )
        with session_conf(spark, COLOCATED_CONF):
            yield stage
    finally:
        try:
            spark.sql(f"DROP TABLE IF EXISTS {stage} PURGE")
        except Exception as e:  # the MERGE's outcome (committed or its error) is what counts
            log.warning("%s: could not drop the staged batch %s (%s); drop it by hand", cfg.name, stage, e)


STAGING_PREFIX = "merge_batch_"
STAGED_AT_PROP = "cdc.staged-at"
# A staged batch outlives its run only when the run was killed between staging and its drop. No
# ingest task may run this long (the DAGs' ingest timeouts are 2-3 h), so an older one is nobody's.
STAGING_KEPT_FOR = timedelta(hours=24)


def drop_stale_staging(spark: SparkSession, lake: LakeSettings, cfg: TableConfig, now: datetime) -> list[str]:
    """Drop this table's staged batches (merge_source) left by killed runs; returns their names.
    A staged batch without a readable timestamp predates it, so it is stale too. Best effort: a
    leftover that cannot be dropped now is logged and left to the next run, never a failed ingest."""
    ns = f"{lake.catalog_name}.{lake.meta_namespace}"
    own = re.compile(rf"{STAGING_PREFIX}{re.escape(cfg.name)}_[0-9a-f]{{12}}")
    dropped: list[str] = []
    try:
        names = [r.tableName for r in spark.sql(f"SHOW TABLES IN {ns} LIKE '{STAGING_PREFIX}*'").collect()]
    except Exception as e:  # noqa: BLE001 - see the docstring
        log.warning("%s: could not list staged batches in %s (%s)", cfg.name, ns, e)
        return dropped
    for name in names:
        if not own.fullmatch(name):
            continue  # another table's (a name that merely starts like this one's included)
        table = lake.qualified(lake.meta_table(name))
        try:
            if now - _staged_at(spark, table) < STAGING_KEPT_FOR:
                continue  # maybe a run still going
            spark.sql(f"DROP TABLE IF EXISTS {table} PURGE")
        except Exception as e:  # noqa: BLE001 - see the docstring
            log.warning("%s: could not drop the staged batch %s (%s); the next run tries again", cfg.name, table, e)
            continue
        log.warning("%s: dropped %s, a batch staged by a run that did not finish", cfg.name, table)
        dropped.append(table)
    return dropped


def _staged_at(spark: SparkSession, table: str) -> datetime:
    """When the batch was staged (UTC if the value has no zone); the epoch if unknown or unreadable."""
    try:
        at = datetime.fromisoformat(table_property(spark, table, STAGED_AT_PROP) or "")
    except ValueError:
        return datetime.fromtimestamp(0, UTC)
    return at if at.tzinfo else at.replace(tzinfo=UTC)


# The MERGE writes its rows as the join leaves them, without clustering them by partition first:
# that was a shuffle of every changed row and a Spark job of its own (issue #56). Each task then
# writes a file per partition it holds; maintenance compacts them.
MERGE_CONF = {"spark.sql.iceberg.distribution-mode": "none"}


def commit_merge(
    spark: SparkSession, cfg: TableConfig, b: Batch, source: str, truncated: list[str], ingest_run: str, state: str
) -> bool:
    """The LSN-guarded MERGE of the reduced batch in `source` (lake.merge.run_merge), with the new watermark, the batch id and the batch's
    state (what resume_batch needs to record the run if it is stopped after this commit) in the
    same commit; fenced (lake.commits), so it is published only while the watermark is b.wm.
    False when another run of the same batch published it first (nothing of this one is)."""
    props = {WATERMARK_PROP: b.new_wm_json, "cdc.ingest-run": ingest_run, BATCH_STATE_PROP: state, **INGEST.props()}
    published: list[bool] = []

    def _merge(batch_props: dict[str, str]) -> None:
        columns = current_columns(b.lake_cols)
        write = lambda target: run_merge(spark, cfg, target, source, columns, {**props, **batch_props}, truncated)  # noqa: E731
        with session_conf(spark, MERGE_CONF):
            published.append(fenced_commit(spark, b.cur, b.wm, b.plan.new_watermark, write, what=f"{cfg.name} merge"))

    commit_unless_landed(spark, b.batch, BatchStep("ingest_merge", b.cur, _merge, positioned=True))
    return any(published)


def commit_unless_landed(spark: SparkSession, batch: BatchId, step: BatchStep) -> None:
    """commit_once, and when its fence finds the table moved: converge if another run of the same
    batch landed this step, whatever that run (or another) committed after it (a backfill's
    closing commit, a quiet shard's fill, a later batch); else the ConcurrentWriterError stands."""
    try:
        commit_once(spark, batch, step)
    except ConcurrentWriterError:
        if not committed(spark, step.table, batch):
            raise
        log.info(
            "batch %s: %s landed by another run of the batch, then %s moved on", batch.value, step.name, step.table
        )


def applied_by_another_run(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    m: IngestMetrics,
    b: Batch,
    ingest_run: str,
    records: RunRecords | None,
) -> IngestMetrics:
    """Another run of the same batch (two ingests started at once: a second deployment, a manual
    run) published its MERGE first. The table is exact, and that run reports the MERGE; this one
    reports no insert, update or delete, and the changelog rows only if its own append landed
    (#51: both reported the same events, and the history and the metrics counted the batch
    twice). Its record is its own (not the batch's, which the other run writes or a later run
    resumes) and carries no freshness rows."""
    log.warning(
        "%s: batch %s was merged by another run of the same batch (a second deployment or a manual run?); this "
        "run applied no row to the table and reports so (status %s, changelog rows %d)",
        cfg.name, b.batch.value, ALREADY_APPLIED, m.changelog_rows,
    )  # fmt: skip
    m.merged_by_another_run()
    own = replace(b, batch=BatchId.of(f"ingest:{b.cur}", b.wm.to_dict(), {"run": ingest_run, "lost_to": b.batch.value}))
    return finish(spark, lake, cfg, m, own, records=records, freshness=False)


def merge_summary(spark: SparkSession, cur: str, batch: BatchId) -> dict[str, str]:
    """The summary of the batch's MERGE commit (the newest ancestor with the batch's id and state),
    not of whatever is the head by now: another writer (a compaction, a late run of the same
    batch) may have committed since. The head's if there is none."""
    for snap in current_ancestors(spark, cur):
        s = summary_of(snap)
        if s.get(BATCH_PROP) == batch.value and BATCH_STATE_PROP in s:
            return s
    return snapshot_summary(spark, cur)


def merge_figures(cfg: TableConfig, m: IngestMetrics, pre: dict[str, str], post: dict[str, str], out: Outcome) -> None:
    """The MERGE's counts (unless counted before it), files and bytes, from its snapshot summary."""
    if not out.counted:
        merge_counts(cfg, m, post, out.rows)
    m.add_commit_stats(pre, post)


def merge_counts(cfg: TableConfig, m: IngestMetrics, summary: dict[str, str], rows: int) -> None:
    """The MERGE's counts from its snapshot summary (Outcome.counted False)."""
    if not m.take_merge_counts(summary, rows):
        log.error(
            "%s: the MERGE's snapshot summary has no usable row counts (spark.merge-into.*: %s; written by "
            "Iceberg 1.11+ on Spark 4.1+, for the %d rows it was given); inserts, updates and deletes are "
            "recorded as unknown. If the keys are missing, use the Iceberg runtime of requirements-jvm.txt",
            cfg.name,
            {k: summary.get(v) for k, v in MERGE_COUNTS.items()},
            rows,
        )


def finish(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    m: IngestMetrics,
    b: Batch,
    shard_commits: dict[str, dict[str, int]] | None = None,
    records: RunRecords | None = None,
    freshness: bool = True,
) -> IngestMetrics:
    """Record the run in cdc_meta.ingest_runs and cdc_meta.freshness (now, or with the group's
    records) and log its summary; returns the metrics. shard_commits: the newest source commit
    per shard in the batch, when the fused plan observed it (else freshness reads the landing
    files for it)."""
    m.committed_at = datetime.now(UTC)
    m.total_seconds = m.elapsed()
    with job_phase(spark, "record"):
        since_ms = int(m.started_at.timestamp() * 1000)
        rec = run_records(spark, lake, cfg, m, b.plan, b.batch, since_ms, shard_commits, freshness)
        if records is not None:
            records.add(rec)
        else:
            write_records(spark, lake, [rec])
    log.info("%s", m.summary())
    return m


def run_records(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    m: IngestMetrics,
    plan: Plan,
    batch: BatchId,
    since_ms: int,
    shard_commits: dict[str, dict[str, int]] | None,
    freshness: bool = True,
) -> TableRecords:
    """The batch's run record and freshness rows (written by ingest.records).
    since_ms: no earlier commit can carry the batch (lake.batches.committed)."""
    m.watermark = plan.new_watermark.to_json()
    ts = [p.ts for p in plan.new_watermark.shards.values() if p.ts]
    if ts and m.committed_at is not None:
        m.freshness_seconds = (m.committed_at - min(datetime.fromisoformat(t) for t in ts)).total_seconds()
    fresh = (
        freshness_rows(spark, lake, cfg, plan, m.ingest_run, m.committed_at, shard_commits=shard_commits)
        if freshness
        else []
    )
    return TableRecords(cfg.name, batch, since_ms, m.meta_row(), fresh)


# --- a batch stopped after its data committed ------------------------------------------------------


def batch_state(
    m: IngestMetrics, plan: Plan, shard_commits: dict[str, dict[str, int]] | None, merge_rows: int | None = None
) -> str:
    """The batch's state (ingest.records.BatchState) as committed with the current table's commit.
    merge_rows: the rows the MERGE is given, when its own summary counts them (not m)."""
    run = {k: v for k, v in m.meta_row().items() if v is not None and k != "watermark"}
    run["started_at"] = m.started_at.isoformat()
    state = BatchState.of(run, plan.manifests)
    state.shard_commits = shard_commits or {}
    if merge_rows is not None:
        state.merge_rows = merge_rows
    return state.to_json()


def last_batch_commit(spark: SparkSession, cur: str) -> tuple[Snapshot, Snapshot | None] | None:
    """(snapshot, its parent) of the current table's newest ingest batch commit, or None when a
    commit that is no ingest batch (a bootstrap, a repair) made the current position instead.
    Commits that move only the watermark (a finished backfill) or none (maintenance) are passed."""
    it = current_ancestors(spark, cur)
    for snap in it:
        s = summary_of(snap)
        if BATCH_STATE_PROP in s and BATCH_PROP in s:
            return snap, next(it, None)
        moved_data = any(
            int(s.get(k, 0) or 0) for k in ("added-data-files", "deleted-data-files", "added-delete-files")
        )
        if WATERMARK_PROP in s and moved_data:
            return None
    return None


def resume_batch(spark: SparkSession, lake: LakeSettings, cfg: TableConfig) -> None:
    """A run stopped between its current table's commit and its run record or freshness rows left
    a batch half recorded: write what it did not (the data commits are done; never again)."""
    cur = lake.qualified(cfg.current_table)
    found = last_batch_commit(spark, cur) if table_exists(spark, cur) else None
    if found is None:
        return
    snap, parent = found
    s = summary_of(snap)
    state = BatchState.model_validate_json(s[BATCH_STATE_PROP])
    m = IngestMetrics(**{**state.run, "started_at": datetime.fromisoformat(state.run["started_at"])})
    if state.merge_rows is not None:
        merge_counts(cfg, m, s, state.merge_rows)
    m.add_commit_stats(summary_of(parent) if parent is not None else {}, s)
    since_ms = int(snap.timestamp_ms)
    m.committed_at = datetime.fromtimestamp(since_ms / 1000, UTC)  # when its data became visible
    plan = Plan(state.heartbeat_runs(), [], Watermark.from_json(s[WATERMARK_PROP]))
    rec = run_records(spark, lake, cfg, m, plan, BatchId(s[BATCH_PROP]), since_ms, state.shard_commits)
    write_records(spark, lake, [rec])
