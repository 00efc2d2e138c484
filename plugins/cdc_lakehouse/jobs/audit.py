"""The audit job (spark_jobs/audit.py): source keys vs lake keys, Great Expectations checks and
the optional repair, per table (audit.audit_table.audit_table). A failing verdict fails the table."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Literal

from cdc_lakehouse.jobs.params import JobParams, flag
from cdc_lakehouse.jobs.runner import StageResult, load_tables, run_per_table

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from cdc_lakehouse.config import TableConfig
    from cdc_lakehouse.settings import LakeSettings


@dataclass(frozen=True, kw_only=True)
class AuditParams(JobParams):
    description = "Audit: source keys vs lake keys, Great Expectations checks, optional repair"

    tables: tuple[str, ...] = flag(help="comma-separated table names (config 'name')")
    audit_run: str | None = flag(None, help="this run's id (default: manual-<now>)")
    repair: Literal["auto", "approved"] = flag(
        "auto",
        help="auto: audit.repair, up to approvals.repair_above_keys keys (more wait for an approval); "
        "approved: repair the persistent keys, however many (after cdc_audit__<table>'s approval)",
    )


def main(p: AuditParams) -> int:
    def fn(spark: SparkSession, lake: LakeSettings, cfg: TableConfig, file: str | None) -> StageResult:
        from cdc_lakehouse.audit.audit_table import audit_table
        from cdc_lakehouse.audit.errors import AuditFailed

        run = p.audit_run or datetime.now(UTC).strftime("manual-%Y%m%dT%H%M%S")
        if p.repair == "approved":
            result = audit_table(spark, lake, cfg, audit_run=run, repair=True)
        else:
            result = audit_table(spark, lake, cfg, audit_run=run, repair_limit=cfg.approvals.repair_limit())
        if result.verdict == "fail" and not result.waits_for_repair_approval:
            raise AuditFailed(result.message)
        return result

    return run_per_table("audit", p.app_name, lambda: load_tables(p.config_dir, p.tables), fn)
