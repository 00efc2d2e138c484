"""The maintenance job (spark_jobs/maintenance.py): compaction, expiry, orphans and the
latest-per-key view of replicated tables (--tables), of derived tables (--derived), or of one feed
consumer's Iceberg output (--feed-output with --consumer), in cdc_lakehouse.maintenance.maintain_table."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import TYPE_CHECKING

from cdc_lakehouse.config import OutputMaintenanceConfig
from cdc_lakehouse.jobs.params import JobParams, flag
from cdc_lakehouse.jobs.runner import (
    Loaded,
    Stage,
    StageResult,
    load_derived,
    load_tables,
    run_per_table,
    table_configs,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from cdc_lakehouse.config import TableConfig
    from cdc_lakehouse.derived.config import TreeConfig
    from cdc_lakehouse.settings import LakeSettings


@dataclass(frozen=True, kw_only=True)
class MaintenanceParams(JobParams):
    description = "Daily maintenance: compaction, expiry, orphans, latest-per-key view"

    tables: tuple[str, ...] = flag((), one_of="target", help="comma-separated table names (config 'name')")
    derived: tuple[str, ...] = flag((), one_of="target", help="comma-separated derived table names (config 'name')")
    feed_output: str | None = flag(None, one_of="target", help="namespace.table of a feed consumer's Iceberg output")
    consumer: str | None = flag(None, help="--feed-output: the consumer writing it")
    settings: OutputMaintenanceConfig | None = flag(None, help="--feed-output: its maintenance settings, JSON")
    derived_dir: str | None = flag(
        None, help="directory of the derived YAML files (default: $CDC_DERIVED_DIR, else derived/ beside the tables)"
    )
    run_id: str | None = flag(None, help="this run's id (default: <now>)")


@dataclass(frozen=True)
class FeedOutput:
    """A feed consumer's Iceberg output, as the consumer's DAG declares it (dag_parts.feed_consumer_dag)."""

    name: str  # the consumer
    output: str  # namespace.table
    settings: OutputMaintenanceConfig


def main(p: MaintenanceParams) -> int:
    run = p.run_id or datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    if p.derived:
        return run_per_table(
            "maintenance", p.app_name, lambda: load_derived(p.config_dir, p.derived_dir, p.derived), _derived(run)
        )
    if p.feed_output:
        load = partial(_feed_output, p.feed_output, p.consumer, p.settings)
        return run_per_table("maintenance", p.app_name, load, _feed_output_fn(run))

    def fn(spark: SparkSession, lake: LakeSettings, cfg: TableConfig, file: str | None) -> StageResult:
        from cdc_lakehouse.maintenance.maintain_table import maintain_table

        consumers = list(table_configs(p.config_dir).tables.values())
        return maintain_table(spark, lake, cfg, run_id=run, consumers=consumers)

    return run_per_table("maintenance", p.app_name, lambda: load_tables(p.config_dir, p.tables), fn)


def _derived(run: str) -> Stage[TreeConfig]:
    def fn(spark: SparkSession, lake: LakeSettings, dcfg: TreeConfig, file: str | None) -> StageResult:
        from cdc_lakehouse.maintenance.maintain_table import maintain_derived

        return maintain_derived(spark, lake, dcfg, run_id=run)

    return fn


def _feed_output(output: str, consumer: str | None, settings: OutputMaintenanceConfig | None) -> Loaded[FeedOutput]:
    from cdc_lakehouse.feed.models import check_consumer_name

    if not consumer:
        raise SystemExit("--feed-output needs --consumer: the consumer whose offsets its commits carry")
    return Loaded([FeedOutput(check_consumer_name(consumer), output, settings or OutputMaintenanceConfig())])


def _feed_output_fn(run: str) -> Stage[FeedOutput]:
    def fn(spark: SparkSession, lake: LakeSettings, out: FeedOutput, file: str | None) -> StageResult:
        from cdc_lakehouse.maintenance.maintain_table import maintain_feed_output

        return maintain_feed_output(spark, lake, out.name, out.output, out.settings, run_id=run)

    return fn
