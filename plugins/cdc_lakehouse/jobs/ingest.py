"""The ingest job (spark_jobs/ingest.py): landing -> changelog -> current table, per table
(ingest.ingest_table.ingest_table), then the table's history where it keeps one
(history.maintain). The DAG passes the data interval: capture runs up to its end apply."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Literal

from cdc_lakehouse.jobs.params import JobParams, flag
from cdc_lakehouse.jobs.runner import StageResult, load_tables, run_per_table

if TYPE_CHECKING:
    from collections.abc import Sequence

    from pyspark.sql import SparkSession

    from cdc_lakehouse.config import TableConfig
    from cdc_lakehouse.history.maintain import HistoryResult
    from cdc_lakehouse.settings import LakeSettings


@dataclass(frozen=True, kw_only=True)
class IngestParams(JobParams):
    description = "Incremental ingest: landing -> changelog -> current table"

    tables: tuple[str, ...] = flag(help="comma-separated table names (config 'name')")
    upto_run: str | None = flag(None, help="apply capture runs up to this run id (the data interval end)")
    ingest_run: str | None = flag(None, help="this run's id (default: manual-<now>)")
    interval_end: str | None = flag(None, help="the data interval's end, ISO 8601 (recorded with the run's metrics)")
    undecided_drop: Literal["stop", "ask"] = flag(
        "stop",
        help="a source column dropped with no schema_changes.dropped_columns entry: stop the table (fails "
        "the job), or ask (the table reports `waiting` for the ingest DAG's keep/drop choice)",
    )
    parallel: int = flag(
        1,
        help="tables ingested at once, each on a Spark session of its own (a group's DAG passes "
        "its tables' ingest.parallel_tables)",
    )


@dataclass(frozen=True)
class WithHistory:
    """An ingest's result and its table's history maintenance (history.maintain), on one line."""

    ingest: StageResult
    history: HistoryResult

    def to_dict(self) -> dict[str, object]:  # the job's result line (jobs.runner.StageResult)
        h = self.history
        return {**self.ingest.to_dict(), "history": {"mode": h.mode, "written": h.written, "late": h.late}}


def main(p: IngestParams) -> int:
    from cdc_lakehouse.ingest.records import RunRecords

    # The tables' run records and freshness rows, committed once for the group (ingest.records).
    records = RunRecords()

    def fn(spark: SparkSession, lake: LakeSettings, cfg: TableConfig, file: str | None) -> StageResult:
        from cdc_lakehouse.ingest.ingest_table import ingest_table

        run = p.ingest_run or datetime.now(UTC).strftime("manual-%Y%m%dT%H%M%S")
        result = ingest_table(
            spark,
            lake,
            cfg,
            upto_run=p.upto_run,
            ingest_run=run,
            interval_end=p.interval_end,
            config_file=file,
            records=records,
            ask_dropped=p.undecided_drop == "ask",
        )
        if not cfg.history.enabled:
            return result
        # The history follows the changelog this run appended (docs/history-tables.md): a
        # failure here leaves the ingest's commits alone, and the next run catches up.
        from cdc_lakehouse.history.maintain import maintain_history

        return WithHistory(result, maintain_history(spark, lake, cfg))

    def record_points(spark: SparkSession, lake: LakeSettings, cfgs: Sequence[TableConfig]) -> None:
        """The group's run records, then the endpoints' new consistent points into
        cdc_meta.consistent_points (lake.points)."""
        from cdc_lakehouse.jobs.runner import table_configs
        from cdc_lakehouse.lake.points import record_points

        try:
            records.commit(spark, lake)
        finally:  # the points read the tables' watermarks, not their records
            endpoints = {g.endpoint_id for c in cfgs for g in c.source.shards}
            record_points(spark, lake, table_configs(p.config_dir), endpoints, p.ingest_run or "manual")

    load = lambda: load_tables(p.config_dir, p.tables)  # noqa: E731
    return run_per_table("ingest", p.app_name, load, fn, record_points, parallel=p.parallel)
