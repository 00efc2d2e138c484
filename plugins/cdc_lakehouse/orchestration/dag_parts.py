"""The parts the DAG files in dags/ are built of (Airflow 3, airflow.sdk): the configs they loop
over, the DAG settings they share (start date, timetables, tags, default_args with the failure
alerts), the assets, the pools, and the builders of their tasks (spark_task, capture_tasks,
alert_check_task). The graphs themselves are wired in the DAG files, one file per DAG kind:

  dags/cdc_ingest.py       cdc_ingest__T, cdc_ingest_group__G      capture per endpoint >> ingest >> check_alerts
  dags/cdc_bootstrap.py    cdc_bootstrap__T                        review >> approve >> bootstrap (manual)
  dags/cdc_replay.py       cdc_replay__T                           review >> approve >> replay (manual)
  dags/cdc_maintenance.py  cdc_maintenance__T, cdc_maintenance__D  maintenance (daily)
  dags/cdc_history.py      cdc_history__T                          rebuild (manual; tables keeping a history)
  dags/cdc_audit.py        cdc_audit__T                            audit >> check_alerts
  dags/cdc_derived.py      cdc_derived__D                          derive (on its inputs' assets)
  dags/cdc_export.py       cdc_export__E                           export (on its source's asset, or a schedule)
  dags/cdc_feed_*.py       cdc_feed__C                             consume >> maintenance_due >> maintenance (feed_consumer_dag)

T: a table (include/tables/*.yaml); G: an ingest group (`ingest.group`: its tables in one Spark
application); D: a derived table (include/derived/*.yaml); E: a serving export
(include/exports/*.yaml); C: a change-feed consumer declared in its own DAG file.

Parse-time work is reading small YAML files: no Spark, pyiceberg, Great Expectations or
pandas import, no connection lookups, no network. Everything that needs a connection
happens in the tasks. Broken configs are left out here and reported by dags/cdc_config_check.py.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, get_args

from cdc_lakehouse.config import ConfigSet, OutputMaintenanceConfig, TableConfig, load_table_configs, switched_on
from cdc_lakehouse.derived.config import DerivedSet, TreeConfig, load_derived_configs
from cdc_lakehouse.jobs.feed import FeedConsumerParams, FeedMode
from cdc_lakehouse.jobs.maintenance import MaintenanceParams
from cdc_lakehouse.jobs.params import JobParams
from cdc_lakehouse.jobs.registry import job as registered_job
from cdc_lakehouse.lake.holds import DEFAULT_MAX_LAG_HOURS
from cdc_lakehouse.orchestration.dag_docs import feed_doc
from cdc_lakehouse.serving.config import ExportConfig, ExportSet, load_export_configs
from cdc_lakehouse.settings import derived_dir, exports_dir, tables_dir

# What default_args and dag_tags need of a config: name, owner, retries, tags.
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


def timetable(schedule: str):
    # A plain cron string gives a trigger timetable with an empty data interval in Airflow 3;
    # these DAGs read their window from the data interval, so they need the interval timetable.
    from airflow.sdk import CronDataIntervalTimetable

    return CronDataIntervalTimetable(PRESETS.get(schedule, schedule), timezone="UTC")


# "off": the asset events carry no partition key and the downstream DAGs are scheduled on the
# plain assets, for a deployment whose own DAGs consume ours that way (Airflow queues a DAG that
# is not partition-aware for no event that carries a key). Read where the DAG files are parsed:
# the dag-processor and the workers must agree.
PARTITIONS_ENV = "CDC_PARTITIONED_ASSETS"


def partitioned_assets() -> bool:
    return switched_on(os.environ, PARTITIONS_ENV)


def on_assets(condition: Any):
    """The schedule of a DAG that runs when the assets of `condition` change: one run per
    partition key of their events (PartitionedAssetTimetable, the identity mapper), so two
    ingests landing close together give two runs, and a re-run of one interval gives one more."""
    if not partitioned_assets():
        return condition
    from airflow.sdk import PartitionedAssetTimetable

    return PartitionedAssetTimetable(assets=condition)


def asset(lake_table: str):
    from airflow.sdk import Asset

    ns, name = lake_table.split(".", 1)
    return Asset(uri=f"iceberg://lake/{ns}/{name}", name=f"lake.{lake_table}")


def point_asset(endpoint: str):
    """The endpoint's newest consistent point across its tables (lake.points)."""
    from airflow.sdk import Asset

    return Asset(uri=f"cdc://points/{endpoint}", name=f"points.{endpoint}")


def announce_snapshots(cfgs: list[TableConfig]):
    """The ingest task's post_execute: its current tables' Asset events carry the new complete
    snapshot id and watermark, its endpoints' the newest consistent point
    (orchestration.tasks.AnnounceLakeSnapshots, docs/change-feed.md)."""
    from cdc_lakehouse.orchestration.tasks import AnnounceLakeSnapshots

    return AnnounceLakeSnapshots(
        {c.current_table: asset(c.current_table) for c in cfgs}, {e: point_asset(e) for e in endpoint_ids(cfgs)}
    )


def ingest_outlets(cfgs: list[TableConfig]) -> list[Any]:
    """What an ingest task updates: each table's current and changelog tables, and the
    consistent points of its endpoints."""
    return [a for c in cfgs for a in (asset(c.current_table), asset(c.changelog_table))] + [
        point_asset(e) for e in endpoint_ids(cfgs)
    ]


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
    if kw.get("outlets") and partitioned_assets():
        from cdc_lakehouse.orchestration.tasks import KeyOutletEvents

        kw["post_execute"] = KeyOutletEvents(then=kw.get("post_execute"))
    return CdcSparkSubmitOperator(
        task_id=task_id,
        job=job,
        job_args=params.to_argv(**(templates or {})),
        source_conn_ids=source_conn_ids,
        pool=pool,
        conn_id=SPARK_CONN_ID,
        **kw,
    )


def capture_tasks(endpoint_ids: list[str]):
    """capture__<endpoint>: one task per source endpoint, each in its endpoint's one-slot pool."""
    from cdc_lakehouse.orchestration.operators import CdcCaptureOperator

    return [
        CdcCaptureOperator(
            task_id=f"capture__{e}",
            endpoint_id=e,
            pool=f"cdc_capture__{e}",
            execution_timeout=timedelta(minutes=50),
            doc_md="One bounded capture run of the endpoint's replication slot into the landing zone.",
        )
        for e in endpoint_ids
    ]


def mode_param(modes: Any, description: str) -> Any:
    """The `mode` a derived, export or feed run takes ("auto" unless triggered otherwise); the
    choices are the job's Literal `modes`."""
    from airflow.sdk import Param

    return Param("auto", type="string", enum=list(get_args(modes)), description=description)


def dag_tags(kind: str, cfg: AnyConfig | None = None, group: str | None = None) -> list[str]:
    tags = ["cdc", kind]
    if cfg:
        tags += [f"table:{cfg.name}", *cfg.tags]
    if group:
        tags.append(f"group:{group}")
    return tags


def endpoint_ids(cfgs: list[TableConfig]) -> list[str]:
    """Endpoints to capture before the ingest; a Debezium-fed table has none (its events come
    from the Kafka Connect S3 sink, and a slot of ours would only retain WAL)."""
    return sorted({g.endpoint_id for c in cfgs if c.landing.kind == "capture" for g in c.source.shards})


def configs_by_endpoint(cs: ConfigSet) -> dict[str, list[TableConfig]]:
    """endpoint id -> the tables read through it (the capture's endpoints only), by name."""
    out: dict[str, list[TableConfig]] = {}
    for endpoint, members in sorted(cs.endpoints().items()):
        cfgs = {t.name: t for t, _ in members if t.landing.kind == "capture"}
        if cfgs:
            out[endpoint] = [cfgs[n] for n in sorted(cfgs)]
    return out


def conn_ids(cfgs: list[TableConfig]) -> list[str]:
    """The source connections the job reads (their URIs are resolved at run time, in the task)."""
    return sorted({g.conn_id for c in cfgs for g in c.source.shards})


def ingest_groups(cs: ConfigSet) -> dict[str, list[TableConfig]]:
    """Ingest group -> its tables, by group name; tables without `ingest.group` are in none."""
    groups: dict[str, list[TableConfig]] = {}
    for cfg in cs.tables.values():
        if cfg.ingest.group:
            groups.setdefault(cfg.ingest.group, []).append(cfg)
    return dict(sorted(groups.items()))


def group_pool(group: str) -> str:
    return f"cdc_group__{group}"


def table_pool(cfg: TableConfig) -> str:
    """Writers of a table share one pool slot; grouped tables share their group's."""
    return group_pool(cfg.ingest.group) if cfg.ingest.group else cfg.pool


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
    reset) and max_lag_hours (how long the table keeps its offset's snapshot, lake.holds). Its
    Iceberg output is maintained by the same DAG once per
    `maintenance.schedule` (OutputMaintenanceConfig): after a consume, never beside one."""
    from airflow.sdk import DAG

    cs = load_table_configs(config_dir or tables_dir())
    cfg = cs.tables.get(table)
    if cfg is None:
        raise ValueError(
            f"feed consumer {consumer}: table config {table!r} is missing or invalid in {config_dir or tables_dir()}; "
            "fix the table's YAML (python -m cdc_lakehouse.cli validate) or point the consumer at another table"
        )
    settings = OutputMaintenanceConfig.model_validate(maintenance or {})
    source = asset(cfg.current_table)
    with DAG(
        dag_id=f"cdc_feed__{consumer}",
        schedule=on_assets(source),
        start_date=START_DATE,
        catchup=False,
        max_active_runs=1,
        default_args=default_args(cfg),
        tags=dag_tags("feed", cfg),
        doc_md=feed_doc(cfg, consumer, output, about, max_lag_hours),
        description=f"Change-feed consumer {consumer} of {cfg.current_table} into {output}",
        params={"mode": mode_param(FeedMode, "auto: incremental; full: reset, every row")},
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


def load_configs(
    config_dir: str | None = None, derived_config_dir: str | None = None, exports_config_dir: str | None = None
) -> tuple[ConfigSet, DerivedSet, ExportSet]:
    """The table, derived and export configs (settings.tables_dir and its siblings by default); the
    DAG files build DAGs of the valid ones, cdc_config_check.py reports the others."""
    cs = load_table_configs(config_dir or tables_dir())
    ds = load_derived_configs(derived_config_dir or derived_dir(), cs.tables)
    return cs, ds, load_export_configs(exports_config_dir or exports_dir(), cs.tables, ds.derived)


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
