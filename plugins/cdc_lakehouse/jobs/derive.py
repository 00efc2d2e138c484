"""The derive job (spark_jobs/derive.py): derived tables, trees over current lake tables, per
derived table (derived.derive_tree.derive_tree; docs/derived-trees.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from cdc_lakehouse.jobs.params import JobParams, flag
from cdc_lakehouse.jobs.runner import StageResult, load_derived, run_per_table, table_configs

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from cdc_lakehouse.derived.config import TreeConfig
    from cdc_lakehouse.settings import LakeSettings

DeriveMode = Literal["auto", "full"]


@dataclass(frozen=True, kw_only=True)
class DeriveParams(JobParams):
    description = "Derived tables: trees over current lake tables (docs/derived-trees.md)"

    derived: tuple[str, ...] = flag(help="comma-separated derived table names (config 'name')")
    derived_dir: str | None = flag(
        None, help="directory of the derived YAML files (default: $CDC_DERIVED_DIR, else derived/ beside the tables)"
    )
    mode: DeriveMode = flag("auto", help="auto: incremental when possible; full: recompute")


def main(p: DeriveParams) -> int:
    def fn(spark: SparkSession, lake: LakeSettings, dcfg: TreeConfig, file: str | None) -> StageResult:
        from cdc_lakehouse.derived.derive_tree import derive_tree

        tables = table_configs(p.config_dir).tables
        return derive_tree(spark, lake, dcfg, tables, full=p.mode == "full")

    return run_per_table("derive", p.app_name, lambda: load_derived(p.config_dir, p.derived_dir, p.derived), fn)
