"""Builds the per-table DAGs from the table configs (Airflow 3, airflow.sdk).

Parse-time work is reading small YAML files: no Spark, pyiceberg, Great Expectations or
pandas import, no connection lookups, no network. Everything that needs a connection
happens in the tasks.

For each table `T`:
  cdc_bootstrap__T    manual; loads every shard (or the shards given) from a snapshot
  cdc_ingest__T       interval-keyed; capture per endpoint, then the Spark ingest
  cdc_maintenance__T  daily; compaction, expiry, orphans, latest-per-key view
  cdc_audit__T        interval-keyed; key-set audit, Great Expectations, optional repair
Tables with `ingest.group: G` are ingested together by cdc_ingest_group__G (one Spark
application for the whole group) instead of cdc_ingest__T.

For each derived table `D` (include/derived/*.yaml, cdc_lakehouse.derived.config):
  cdc_derived__D      when any of its input tables changes (their current tables' assets)
  cdc_maintenance__D  daily; compaction (deletes applied), expiry, orphans of its two tables

For each serving export `E` (include/exports/*.yaml, cdc_lakehouse.serving.config):
  cdc_export__E       when its source table changes (its asset), or on its own schedule

A change-feed consumer `C` declared in a DAG file (feed_consumer_dag):
  cdc_feed__C         when its table changes; then, once per maintenance schedule, its output's
                      compaction and expiry (tasks of the same DAG: they never overlap)
"""

from __future__ import annotations

import functools
import operator
import os
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, get_args

from cdc_lakehouse.config import ConfigSet, OutputMaintenanceConfig, TableConfig, load_table_configs
from cdc_lakehouse.derived.config import DerivedSet, TreeConfig, load_derived_configs
from cdc_lakehouse.jobs.audit import AuditParams
from cdc_lakehouse.jobs.bootstrap import BootstrapParams
from cdc_lakehouse.jobs.derive import DeriveMode, DeriveParams
from cdc_lakehouse.jobs.export import ExportMode, ExportParams
from cdc_lakehouse.jobs.feed import FeedConsumerParams, FeedMode
from cdc_lakehouse.jobs.ingest import IngestParams
from cdc_lakehouse.jobs.maintenance import MaintenanceParams
from cdc_lakehouse.jobs.params import JobParams
from cdc_lakehouse.jobs.registry import job as registered_job
from cdc_lakehouse.lake.holds import DEFAULT_MAX_LAG_HOURS
from cdc_lakehouse.orchestration.dag_docs import (
    audit_doc,
    bootstrap_doc,
    derived_doc,
    derived_maintenance_doc,
    export_doc,
    group_doc,
    ingest_doc,
    maintenance_doc,
)
from cdc_lakehouse.serving.config import ExportConfig, ExportSet, load_export_configs, resolve_source
from cdc_lakehouse.settings import derived_dir, exports_dir, tables_dir

# What default_args, _tags and _dag need of a config: name, owner, retries, tags.
AnyConfig = TableConfig | TreeConfig | ExportConfig

START_DATE = datetime(2026, 1, 1, tzinfo=UTC)
SPARK_CONN_ID = os.environ.get("CDC_SPARK_CONN_ID", "spark_default")
PRESETS = {
    "@hourly": "0 * * * *",
    "@daily": "0 0 * * *",
    "@weekly": "0 0 * * 0",
    "@monthly": "0 0 1 * *",
    "@yearly": "0 0 1 1 *",
}
INTERVAL_END = "{{ data_interval_end.strftime('%Y%m%dT%H%M%SZ') }}"
# What Airflow renders into a job's command line at run time, by parameter (JobParams.to_argv).
INGEST_RUN = {
    "upto_run": INTERVAL_END,
    "ingest_run": "{{ run_id }}",
    "interval_end": "{{ data_interval_end.isoformat() }}",
}


def _timetable(schedule: str):
    # A plain cron string gives a trigger timetable with an empty data interval in Airflow 3;
    # these DAGs read their window from the data interval, so they need the interval timetable.
    from airflow.sdk import CronDataIntervalTimetable

    return CronDataIntervalTimetable(PRESETS.get(schedule, schedule), timezone="UTC")


def asset(lake_table: str):
    from airflow.sdk import Asset

    ns, name = lake_table.split(".", 1)
    return Asset(uri=f"iceberg://lake/{ns}/{name}", name=f"lake.{lake_table}")


def announce_snapshots(cfgs: list[TableConfig]):
    """The ingest task's post_execute: its current tables' Asset events carry the new complete
    snapshot id and watermark (orchestration.tasks.AnnounceLakeSnapshots, docs/change-feed.md)."""
    from cdc_lakehouse.orchestration.tasks import AnnounceLakeSnapshots

    return AnnounceLakeSnapshots({c.current_table: asset(c.current_table) for c in cfgs})


def default_args(
    cfg: AnyConfig | None, owner: str = "data-platform", retries: int = 2, tables: list[str] | None = None
) -> dict[str, Any]:
    from cdc_lakehouse.orchestration.alerts import CdcFailureNotifier

    args: dict[str, Any] = {
        "owner": cfg.owner if cfg else owner,
        # CDC_TASK_RETRIES overrides (the demo and tests want failures at once, not after backoff).
        "retries": int(os.environ.get("CDC_TASK_RETRIES", cfg.retries if cfg else retries)),
        "retry_delay": timedelta(minutes=2),
        "retry_exponential_backoff": True,
        "max_retry_delay": timedelta(minutes=30),
        # Alerts through the channels of include/alerting.yaml and the tables' alert_emails
        # (cdc_lakehouse.orchestration.alerts); Airflow's own failure e-mail stays off so nothing arrives twice.
        "on_failure_callback": CdcFailureNotifier(tables if tables is not None else [cfg.name] if cfg else []),
    }
    return args


def alert_check_task(kind: Literal["audit", "freshness"], tables: list[str]):
    """check_alerts: after the DAG's work, the audit-streak or freshness alerts of its tables.

    A teardown: it runs whatever the upstream state (all done) and is left out of the DAG run's
    state, so a failed ingest or audit still fails the run."""
    from airflow.sdk import task

    @task(task_id="check_alerts", execution_timeout=timedelta(minutes=10))
    def check_alerts(tables: list[str], **context: Any) -> dict[str, Any]:
        """Alerts on the run history in cdc_meta (see cdc_lakehouse.orchestration.alerts)."""
        from cdc_lakehouse.orchestration.alerts import run_checks

        return run_checks(kind, tables, context["run_id"], context)

    return check_alerts(tables).as_teardown()


def spark_task(
    task_id: str,
    job: str,
    params: JobParams,
    source_conn_ids: list[str],
    pool: str,
    *,
    templates: dict[str, str] | None = None,
    **kw: Any,
):
    """The task running `job` (jobs.registry) on `params`, with `templates` (Jinja, by parameter
    name) rendered into its command line at run time."""
    from cdc_lakehouse.orchestration.operators import CdcSparkSubmitOperator

    takes = registered_job(job).params
    if not issubclass(takes, type(params)):
        raise TypeError(f"job {job} takes {takes.__name__}, not {type(params).__name__}")
    return CdcSparkSubmitOperator(
        task_id=task_id,
        job=job,
        job_args=params.to_argv(**(templates or {})),
        source_conn_ids=source_conn_ids,
        pool=pool,
        conn_id=SPARK_CONN_ID,
        **kw,
    )


def _capture_tasks(cs: ConfigSet, endpoint_ids: list[str]):
    from airflow.sdk import task

    @task(execution_timeout=timedelta(minutes=50))
    def capture(endpoint_id: str, **context: Any) -> dict[str, Any]:
        """One bounded capture run of the endpoint's replication slot into the landing zone."""
        from cdc_lakehouse.orchestration.tasks import capture_endpoint

        return capture_endpoint(endpoint_id, context["data_interval_end"], context=context)

    return [capture.override(task_id=f"capture__{e}", pool=f"cdc_capture__{e}")(e) for e in endpoint_ids]


def _tags(kind: str, cfg: AnyConfig | None = None, group: str | None = None) -> list[str]:
    tags = ["cdc", kind]
    if cfg:
        tags += [f"table:{cfg.name}", *cfg.tags]
    if group:
        tags.append(f"group:{group}")
    return tags


def _dag(dag_id: str, schedule, cfg: AnyConfig, tags: list[str], doc_md: str, description: str, **extra: Any):
    """The DAG settings every CDC DAG shares: one run at a time, no catch-up, the table's retries
    and alert callbacks (default_args)."""
    from airflow.sdk import DAG

    return DAG(
        dag_id=dag_id,
        schedule=schedule,
        start_date=START_DATE,
        catchup=False,
        max_active_runs=1,
        default_args=extra.pop("default_args", None) or default_args(cfg),
        tags=tags,
        doc_md=doc_md,
        description=description,
        **extra,
    )


def _endpoint_ids(cfgs: list[TableConfig]) -> list[str]:
    """Endpoints to capture before the ingest; a Debezium-fed table has none (its events come
    from the Kafka Connect S3 sink, and a slot of ours would only retain WAL)."""
    return sorted({g.endpoint_id for c in cfgs if c.landing.kind == "capture" for g in c.source.shards})


def _conn_ids(cfgs: list[TableConfig]) -> list[str]:
    return sorted({g.conn_id for c in cfgs for g in c.source.shards})


def ingest_dag(cfg: TableConfig, cs: ConfigSet):
    with _dag(
        f"cdc_ingest__{cfg.name}",
        _timetable(cfg.ingest.schedule),
        cfg,
        _tags("ingest", cfg),
        ingest_doc(cfg),
        f"Hourly CDC ingest of {cfg.name} into {cfg.current_table}",
    ) as dag:
        captures = _capture_tasks(cs, _endpoint_ids([cfg]))
        ingest = spark_task(
            "ingest",
            "ingest",
            IngestParams(tables=(cfg.name,)),
            _conn_ids([cfg]),
            table_pool(cfg),
            templates=INGEST_RUN,
            outlets=[asset(cfg.current_table), asset(cfg.changelog_table)],
            post_execute=announce_snapshots([cfg]),
            execution_timeout=timedelta(hours=2),
        )
        captures >> ingest >> alert_check_task("freshness", [cfg.name])
    return dag


def group_ingest_dag(group: str, cfgs: list[TableConfig], cs: ConfigSet):
    with _dag(
        f"cdc_ingest_group__{group}",
        _timetable(cfgs[0].ingest.schedule),
        cfgs[0],
        _tags("ingest", group=group),
        group_doc(group, cfgs),
        f"CDC ingest of {len(cfgs)} tables in one Spark application",
        default_args=default_args(cfgs[0], tables=[c.name for c in cfgs]),
    ) as dag:
        captures = _capture_tasks(cs, _endpoint_ids(cfgs))
        outlets = [a for c in cfgs for a in (asset(c.current_table), asset(c.changelog_table))]
        ingest = spark_task(
            "ingest",
            "ingest",
            IngestParams(tables=tuple(c.name for c in cfgs)),
            _conn_ids(cfgs),
            group_pool(group),
            templates=INGEST_RUN,
            outlets=outlets,
            post_execute=announce_snapshots(cfgs),
            execution_timeout=timedelta(hours=3),
        )
        captures >> ingest >> alert_check_task("freshness", [c.name for c in cfgs])
    return dag


def group_pool(group: str) -> str:
    return f"cdc_group__{group}"


def table_pool(cfg: TableConfig) -> str:
    """Writers of a table share one pool slot; grouped tables share their group's."""
    return group_pool(cfg.ingest.group) if cfg.ingest.group else cfg.pool


def bootstrap_dag(cfg: TableConfig):
    from airflow.sdk import Param

    with _dag(
        f"cdc_bootstrap__{cfg.name}",
        None,
        cfg,
        _tags("bootstrap", cfg),
        bootstrap_doc(cfg),
        f"Snapshot bootstrap of {cfg.name} (all shards, or those in the 'shards' param)",
        params={
            "shards": Param([], type="array", description="shards to (re-)bootstrap; empty = all"),
            # Chunked mode (bootstrap.mode): pause after about N chunks; the next run resumes there.
            "pause_after_chunks": Param(
                0,
                type="integer",
                minimum=0,
                description="chunked mode: stop cleanly at the end of the round (one chunk per shard) "
                "in which this many chunks completed (0 = to the end); trigger again to resume after "
                "the last completed chunk",
            ),
        },
    ) as dag:
        spark_task(
            "bootstrap",
            "bootstrap",
            BootstrapParams(tables=(cfg.name,)),
            _conn_ids([cfg]),
            table_pool(cfg),
            templates={
                "shards": "{{ params.shards | join(',') }}",
                "run_id": "{{ ts_nodash }}",
                "pause_after_chunks": "{{ params.pause_after_chunks }}",
            },
            outlets=[asset(cfg.current_table), asset(cfg.changelog_table)],
            post_execute=announce_snapshots([cfg]),
            execution_timeout=timedelta(hours=24),
        )
    return dag


def maintenance_dag(cfg: TableConfig):
    with _dag(
        f"cdc_maintenance__{cfg.name}",
        _timetable(cfg.maintenance.schedule),
        cfg,
        _tags("maintenance", cfg),
        maintenance_doc(cfg),
        f"Daily maintenance of {cfg.name}",
    ) as dag:
        outlets = [asset(cfg.latest_view)] if cfg.maintenance.latest_view != "none" else []
        spark_task(
            "maintenance",
            "maintenance",
            MaintenanceParams(tables=(cfg.name,)),
            [],
            table_pool(cfg),
            templates={"run_id": "{{ ts_nodash }}"},
            inlets=[asset(cfg.current_table), asset(cfg.changelog_table)],
            outlets=outlets,
            execution_timeout=timedelta(hours=6),
        )
    return dag


def audit_dag(cfg: TableConfig):
    with _dag(
        f"cdc_audit__{cfg.name}",
        _timetable(cfg.audit.schedule),
        cfg,
        _tags("audit", cfg),
        audit_doc(cfg),
        f"Hourly source-vs-lake audit of {cfg.name}",
    ) as dag:
        audit = spark_task(
            "audit",
            "audit",
            AuditParams(tables=(cfg.name,)),
            _conn_ids([cfg]),
            table_pool(cfg),
            templates={"audit_run": "{{ run_id }}"},
            inlets=[asset(cfg.current_table)],
            execution_timeout=timedelta(hours=1),
        )
        audit >> alert_check_task("audit", [cfg.name])
    return dag


def derived_dag(dcfg: TreeConfig, tables: dict[str, TableConfig]):
    from airflow.sdk import Param

    inputs = [tables[n] for n in dict.fromkeys(dcfg.input_names)]
    inlets = [asset(t.current_table) for t in inputs]
    with _dag(
        f"cdc_derived__{dcfg.name}",
        # Asset-driven (AssetAny): a new snapshot of either input's current table triggers a run.
        functools.reduce(operator.or_, inlets),
        dcfg,
        _tags("derived", dcfg),
        derived_doc(dcfg, inputs),
        f"Derived tree {dcfg.output_table} from {', '.join(t.current_table for t in inputs)}",
        params={
            "mode": Param(
                "auto",
                type="string",
                enum=list(get_args(DeriveMode)),
                description="auto: incremental; full: recompute all",
            )
        },
    ) as dag:
        spark_task(
            "derive",
            "derive",
            DeriveParams(derived=(dcfg.name,)),
            [],  # reads the lake only, never a source
            dcfg.pool,
            templates={"mode": "{{ params.mode }}"},
            inlets=inlets,
            outlets=[asset(dcfg.output_table)],
            execution_timeout=timedelta(hours=2),
        )
    return dag


def derived_maintenance_dag(dcfg: TreeConfig):
    """Compaction and expiry of a derived table's output and unresolved tables, in its pool."""
    with _dag(
        f"cdc_maintenance__{dcfg.name}",
        _timetable(dcfg.maintenance.schedule),
        dcfg,
        _tags("maintenance", dcfg),
        derived_maintenance_doc(dcfg),
        f"Daily maintenance of derived table {dcfg.name}",
    ) as dag:
        spark_task(
            "maintenance",
            "maintenance",
            MaintenanceParams(derived=(dcfg.name,)),
            [],
            dcfg.pool,
            templates={"run_id": "{{ ts_nodash }}"},
            inlets=[asset(dcfg.output_table)],
            execution_timeout=timedelta(hours=6),
        )
    return dag


def export_dag(ecfg: ExportConfig, tables: dict[str, TableConfig], derived: dict[str, TreeConfig]):
    from airflow.sdk import Param

    source = resolve_source(ecfg, tables, derived).table
    with _dag(
        f"cdc_export__{ecfg.name}",
        _timetable(ecfg.schedule) if ecfg.schedule else asset(source),
        ecfg,
        _tags("export", ecfg),
        export_doc(ecfg, source),
        f"Serving export of {source} into {ecfg.store.kind} namespace {ecfg.store.namespace}",
        params={
            "mode": Param(
                "auto",
                type="string",
                enum=list(get_args(ExportMode)),
                description="auto: incremental; full: a new version; rollback: alias back to the previous "
                "version, held there; resume: release the hold",
            )
        },
    ) as dag:
        spark_task(
            "export",
            "export",
            ExportParams(exports=(ecfg.name,)),
            [],  # reads the lake only
            ecfg.pool,
            templates={"mode": "{{ params.mode }}"},
            store_conns=[(ecfg.store.kind, ecfg.store.conn_id)],
            inlets=[asset(source)],
            execution_timeout=timedelta(hours=2),
        )
    return dag


# The newest triggering Asset event's snapshot id ('' when the run was not triggered by one, or
# the event carries none): the consumer then reads exactly up to what that ingest completed.
FEED_UPTO = (
    "{% set evs = (triggering_asset_events.values() | list) if triggering_asset_events else [] %}"
    "{{ ((evs[0][-1].extra or {}).get('snapshot_id', '')) if evs and evs[0] else '' }}"
)


def feed_consumer_dag(
    table: str,
    consumer: str,
    job: str,
    output: str,
    about: str,
    config_dir: str | None = None,
    *,
    max_lag_hours: int = DEFAULT_MAX_LAG_HOURS,
    maintenance: dict[str, Any] | None = None,
):
    """`cdc_feed__<consumer>`: a change-feed consumer (cdc_lakehouse.feed) of one table, run by the
    job `job` (jobs.registry: spark_jobs/<job>.py, taking jobs.feed.FeedConsumerParams) whenever
    the table's ingest or bootstrap completes a snapshot. The job takes a mode (auto | full: a
    reset) and max_lag_hours (how long the table keeps its offset's snapshot, lake.holds). Its Iceberg output is maintained by the same DAG once per
    `maintenance.schedule` (OutputMaintenanceConfig): after a consume, never beside one."""
    from airflow.sdk import Param

    cs = load_table_configs(config_dir or tables_dir())
    cfg = cs.tables.get(table)
    if cfg is None:
        raise ValueError(
            f"feed consumer {consumer}: table config {table!r} is missing or invalid in {config_dir or tables_dir()}; "
            "fix the table's YAML (python -m cdc_lakehouse.cli validate) or point the consumer at another table"
        )
    settings = OutputMaintenanceConfig.model_validate(maintenance or {})
    source = asset(cfg.current_table)
    with _dag(
        f"cdc_feed__{consumer}",
        source,
        cfg,
        _tags("feed", cfg),
        feed_doc(cfg, consumer, output, about, max_lag_hours),
        f"Change-feed consumer {consumer} of {cfg.current_table} into {output}",
        params={
            "mode": Param(
                "auto",
                type="string",
                enum=list(get_args(FeedMode)),
                description="auto: incremental; full: reset, every row",
            )
        },
    ) as dag:
        consume = spark_task(
            "consume",
            job,
            FeedConsumerParams(tables=(table,), consumer=consumer, output=output, max_lag_hours=max_lag_hours),
            [],  # reads the lake only
            "default_pool",  # writes only its own output; max_active_runs=1 keeps its runs apart
            templates={"mode": "{{ params.mode }}", "upto": FEED_UPTO},
            inlets=[source],
            outlets=[asset(output)],
            execution_timeout=timedelta(hours=1),
        )
        consume >> _feed_output_maintenance(consumer, output, settings)
    return dag


def _feed_output_maintenance(consumer: str, output: str, settings: OutputMaintenanceConfig):
    """maintenance_due (skips the rest unless a tick of the schedule passed since the last
    successful run) >> maintenance (of the output, in the consumer's DAG run: never beside a consume)."""
    from airflow.sdk import task

    @task.short_circuit(task_id="maintenance_due", execution_timeout=timedelta(minutes=5))
    def maintenance_due(schedule: str, **context: Any) -> bool:
        """True when a tick of the output's maintenance schedule passed since the last successful run."""
        from cdc_lakehouse.orchestration.tasks import schedule_tick_passed

        return schedule_tick_passed(schedule, context.get("prev_start_date_success"), datetime.now(UTC))

    run = spark_task(
        "maintenance",
        "maintenance",
        MaintenanceParams(feed_output=output, consumer=consumer, settings=settings),
        [],
        "default_pool",
        templates={"run_id": "{{ run_id }}"},
        inlets=[asset(output)],
        execution_timeout=timedelta(hours=6),
    )
    cron = PRESETS.get(settings.schedule, settings.schedule)
    if cron.startswith("@"):  # @once, @continuous: no ticks to ride along with
        raise ValueError(
            f"feed consumer {consumer}: maintenance schedule {settings.schedule!r} has no recurring ticks; "
            f"give a 5-field cron expression or one of {sorted(PRESETS)}"
        )
    gate = maintenance_due(cron)
    gate >> run
    return gate


def feed_doc(cfg: TableConfig, consumer: str, output: str, about: str, max_lag_hours: int) -> str:
    return f"""# Change-feed consumer: `{consumer}`

{about}

## What it does
Runs when `lake.{cfg.current_table}` gets a complete snapshot (its ingest's or bootstrap's
Asset event, which carries the snapshot id). It reads the table's net changes since the offset
committed with `lake.{output}` (one row per key: upsert or delete), applies them, and commits
the output and the new offset in one Iceberg commit: a run killed anywhere neither skips nor
repeats a change. Contract: docs/change-feed.md.

## How to operate it
- **Where it is**: the offset is the `cdc.feed.offsets` property of the output's newest
  snapshot: `SELECT committed_at, summary['cdc.feed.offsets'] FROM lake.{output}.snapshots`.
- **Failed**: the task log names the cause; fix it and clear the task (it starts from the
  committed offset). An `OffsetConflictError` means another run committed first: look for a
  second deployment; nothing was written by the failed run.
- **Start over**: trigger with `{{"mode": "full"}}` (every live row replaces the output, one
  commit with the new offset), or drop `lake.{output}`; the next run rebuilds it.
- **Too far behind** (`ConsumerLagError`): `lake.{cfg.current_table}` keeps the offset's snapshot
  for {max_lag_hours} h after the consumer's last run (tag `cdc_consumer_feed_{consumer}`); a run
  after that finds it expired and stops, naming the fix: trigger with `{{"mode": "full"}}`.
- **Maintenance**: the `maintenance` task compacts and expires `lake.{output}` once per schedule,
  after a consume (`maintenance_due` skips it otherwise); it never removes the offsets' snapshot.
"""


def load_configs(
    config_dir: str | None, derived_config_dir: str | None, exports_config_dir: str | None = None
) -> tuple[ConfigSet, DerivedSet, ExportSet]:
    cs = load_table_configs(config_dir or tables_dir())
    ds = load_derived_configs(derived_config_dir or derived_dir(), cs.tables)
    return cs, ds, load_export_configs(exports_config_dir or exports_dir(), cs.tables, ds.derived)


def build_dags(config_dir: str | None = None, derived_config_dir: str | None = None) -> dict[str, Any]:
    """Every DAG of every valid table and derived config; broken configs are reported by cdc_config_check.py."""
    cs, ds, es = load_configs(config_dir, derived_config_dir)
    dags: dict[str, Any] = {}
    groups: dict[str, list[TableConfig]] = {}
    for cfg in cs.tables.values():
        if cfg.ingest.group:
            groups.setdefault(cfg.ingest.group, []).append(cfg)
        else:
            d = ingest_dag(cfg, cs)
            dags[d.dag_id] = d
        for build in (bootstrap_dag, maintenance_dag, audit_dag):
            d = build(cfg)
            dags[d.dag_id] = d
    for group, cfgs in sorted(groups.items()):
        d = group_ingest_dag(group, cfgs, cs)
        dags[d.dag_id] = d
    for dcfg in ds.derived.values():
        for d in (derived_dag(dcfg, cs.tables), derived_maintenance_dag(dcfg)):
            dags[d.dag_id] = d
    for ecfg in es.exports.values():
        d = export_dag(ecfg, cs.tables, ds.derived)
        dags[d.dag_id] = d
    return dags


def config_errors(config_dir: str | None = None, derived_config_dir: str | None = None) -> list[str]:
    from cdc_lakehouse.orchestration.alerts import alerting_errors

    cs, ds, es = load_configs(config_dir, derived_config_dir)
    return [str(e) for e in cs.errors + ds.errors + es.errors] + alerting_errors(cs.tables)


def pools(config_dir: str | None = None, derived_config_dir: str | None = None) -> dict[str, dict[str, Any]]:
    """Airflow pools the DAGs use (for `airflow pools import`): one slot each."""
    cs, ds, es = load_configs(config_dir, derived_config_dir)
    out: dict[str, dict[str, Any]] = {}
    for cfg in cs.tables.values():
        out[table_pool(cfg)] = {
            "slots": 1,
            "description": f"writers of {cfg.name} (one at a time)",
            "include_deferred": False,
        }
    for endpoint in cs.endpoints():
        out[f"cdc_capture__{endpoint}"] = {
            "slots": 1,
            "description": f"capture slot of endpoint {endpoint}",
            "include_deferred": False,
        }
    for dcfg in ds.derived.values():
        out[dcfg.pool] = {
            "slots": 1,
            "description": f"writer of derived table {dcfg.name} (one at a time)",
            "include_deferred": False,
        }
    for ecfg in es.exports.values():
        out[ecfg.pool] = {
            "slots": 1,
            "description": f"writer of serving namespace {ecfg.store.namespace} (one at a time)",
            "include_deferred": False,
        }
    return out
