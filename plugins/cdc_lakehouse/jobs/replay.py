"""The quarantine replay job (spark_jobs/replay.py): a table's quarantined events re-validated
against its config as it is now, those that pass merged (ingest.replay.replay_quarantine). Run by
cdc_replay__<table> after its approval; `python -m cdc_lakehouse.cli quarantine replay T` runs the
same replay in its own process."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from cdc_lakehouse.jobs.params import JobParams, flag
from cdc_lakehouse.jobs.runner import StageResult, load_tables, run_per_table

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from cdc_lakehouse.config import TableConfig
    from cdc_lakehouse.settings import LakeSettings


@dataclass(frozen=True, kw_only=True)
class ReplayParams(JobParams):
    description = "Quarantine replay: re-validate quarantined events, merge those that pass"

    tables: tuple[str, ...] = flag(help="comma-separated table names (config 'name')")
    replay_run: str | None = flag(None, help="this run's id (default: replay-<now>)")


def main(p: ReplayParams) -> int:
    def fn(spark: SparkSession, lake: LakeSettings, cfg: TableConfig, file: str | None) -> StageResult:
        from cdc_lakehouse.ingest.replay import replay_quarantine

        run = p.replay_run or datetime.now(UTC).strftime("replay-%Y%m%dT%H%M%SZ")
        return replay_quarantine(spark, lake, cfg, replay_run=run)

    return run_per_table("replay", p.app_name, lambda: load_tables(p.config_dir, p.tables), fn)
