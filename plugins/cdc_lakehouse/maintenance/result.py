"""What one maintenance run returns: per target table, what Iceberg's procedures did, and the
Spark jobs the run took. The job turns it into its result line with `to_dict()`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    from cdc_lakehouse.lake.tables import TableStats


class Rewritten(TypedDict, total=False):
    """What Iceberg's rewrite procedures reported (maintenance.rewrite); a key is missing when a
    procedure reported nothing, None when it could not run."""

    rewritten_data_files: int
    added_data_files: int
    rewritten_delete_files: int | None


class Expired(TypedDict):
    """What the expiry did (maintenance.expiry)."""

    expired_data_files: int
    orphan_files_removed: int
    holds_kept: list[str]
    holds_dropped: list[str]


@dataclass(frozen=True)
class TargetMaintenance:
    """One table compacted and expired. The rewrite counts are what Iceberg's procedures reported:
    None when a procedure was not run (position deletes of a format-1 table) or reported nothing."""

    before: TableStats  # before the run, and after it
    after: TableStats
    expired_data_files: int
    orphan_files_removed: int
    holds_kept: list[str]  # consumer holds (lake.holds) kept, and dropped (past their max lag)
    holds_dropped: list[str]
    seconds: float
    rewritten_data_files: int | None = None
    added_data_files: int | None = None
    rewritten_delete_files: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}


@dataclass(frozen=True)
class MaintenanceResult:
    """What one maintenance run did: each target table by its kind (output and unresolved for a
    derived table, feed_output for a feed consumer's output)."""

    table: str  # the owner: the derived table's config name, or the feed consumer
    run_id: str
    targets: dict[str, TargetMaintenance]
    spark_jobs: int | None  # None: not known (no Spark UI to count them on)

    def to_dict(self) -> dict[str, Any]:
        """For the job's result line: the targets by kind at the top level."""
        targets = {kind: t.to_dict() for kind, t in self.targets.items()}
        return {"table": self.table, "run_id": self.run_id, **targets, "spark_jobs": self.spark_jobs}


@dataclass(frozen=True)
class TableMaintenanceResult(MaintenanceResult):
    """A replicated table's maintenance: its current table and changelog, its latest-per-key view
    and its endpoints' landing retention."""

    spark_metadata_jobs: int | None  # of the Spark jobs, reads of Iceberg metadata tables
    spark_job_sites: list[str]  # what started each job, in order
    latest_rows: int | None  # rows in the latest-per-key view (None: maintenance.latest_view none)
    latest_mode: str | None  # table | view
    landing_runs_removed: dict[str, list[str]]  # endpoint -> landing runs removed

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.update(spark_metadata_jobs=self.spark_metadata_jobs, spark_job_sites=self.spark_job_sites)
        if self.latest_rows is not None:
            out.update(latest_rows=self.latest_rows, latest_mode=self.latest_mode)
        return {**out, "landing_runs_removed": self.landing_runs_removed}
