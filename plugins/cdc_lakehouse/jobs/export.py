"""The export job (spark_jobs/export.py): lake tables into key-value stores, per export
(serving.export.export, rollback_export; docs/serving-export.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from cdc_lakehouse.jobs.params import JobParams, flag
from cdc_lakehouse.jobs.runner import Loaded, StageResult, derived_configs, pick, run_per_table
from cdc_lakehouse.settings import exports_dir

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from cdc_lakehouse.config import TableConfig
    from cdc_lakehouse.derived.config import TreeConfig
    from cdc_lakehouse.serving.config import ExportConfig
    from cdc_lakehouse.settings import LakeSettings

ExportMode = Literal["auto", "full", "rollback", "resume"]


@dataclass(frozen=True, kw_only=True)
class ExportParams(JobParams):
    description = "Serving exports: lake tables into key-value stores (docs/serving-export.md)"

    exports: tuple[str, ...] = flag(help="comma-separated export names (config 'name')")
    derived_dir: str | None = flag(
        None, help="directory of the derived YAML files (default: $CDC_DERIVED_DIR, else derived/ beside the tables)"
    )
    exports_dir: str | None = flag(
        None, help="directory of the export YAML files (default: $CDC_EXPORTS_DIR, else exports/ beside the tables)"
    )
    mode: ExportMode = flag(
        "auto",
        help="auto: incremental when possible; full: a new version; rollback: alias back to the previous "
        "version, held there; resume: release a held alias and catch up incrementally",
    )


@dataclass(frozen=True)
class Export:
    """One export to run, with the table and derived configs its source is resolved in."""

    cfg: ExportConfig
    tables: dict[str, TableConfig]
    derived: dict[str, TreeConfig]

    @property
    def name(self) -> str:
        return self.cfg.name


def _load(p: ExportParams) -> Loaded[Export]:
    from cdc_lakehouse.serving.config import load_export_configs

    cs, ds = derived_configs(p.config_dir, p.derived_dir)
    where = p.exports_dir or exports_dir()
    es = load_export_configs(where, cs.tables, ds.derived)
    ecfgs = pick("export", p.exports, es.exports, where, cs.errors + ds.errors + es.errors)
    return Loaded([Export(e, cs.tables, ds.derived) for e in ecfgs], es.files)


def main(p: ExportParams) -> int:
    def fn(spark: SparkSession, lake: LakeSettings, e: Export, file: str | None) -> StageResult:
        from cdc_lakehouse.serving.export import export, rollback_export

        if p.mode == "rollback":
            return rollback_export(e.cfg)
        return export(spark, lake, e.cfg, e.tables, e.derived, mode=p.mode)

    return run_per_table("export", p.app_name, lambda: _load(p), fn)
