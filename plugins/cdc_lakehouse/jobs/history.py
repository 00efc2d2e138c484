"""The history job (spark_jobs/history.py): a table's history (docs/history-tables.md) brought up
to its changelog, or rebuilt from it (history.maintain.maintain_history). The ingest job keeps
the history after each batch; this job is for a rebuild (cdc_history__<table>, triggered by hand)
and for catching up without an ingest."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from cdc_lakehouse.jobs.params import JobParams, flag
from cdc_lakehouse.jobs.runner import StageResult, load_tables, run_per_table

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from cdc_lakehouse.config import TableConfig
    from cdc_lakehouse.settings import LakeSettings


@dataclass(frozen=True, kw_only=True)
class HistoryParams(JobParams):
    description = "History tables: catch up with the changelog, or rebuild from it"

    tables: tuple[str, ...] = flag(help="comma-separated table names (config 'name'); each needs history.enabled")
    mode: Literal["incremental", "rebuild"] = flag(
        "incremental",
        help="incremental: the changelog rows appended since the history's last commit (what the ingest "
        "job runs); rebuild: every version again from the whole changelog, in one commit",
    )


class HistoryNotEnabled(ValueError):
    """A table whose config keeps no history."""


def main(p: HistoryParams) -> int:
    def fn(spark: SparkSession, lake: LakeSettings, cfg: TableConfig, file: str | None) -> StageResult:
        from cdc_lakehouse.history.maintain import maintain_history

        if not cfg.history.enabled:
            raise HistoryNotEnabled(
                f"{cfg.name}: its config keeps no history ({file or 'its YAML'}): add `history: {{enabled: true}}` "
                f"to keep {cfg.history_table}"
            )
        return maintain_history(spark, lake, cfg, full=p.mode == "rebuild")

    return run_per_table("history", p.app_name, lambda: load_tables(p.config_dir, p.tables), fn)
