"""What one audit returns."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, TypedDict


class ShardStats(TypedDict, total=False):
    """Per-shard counts; a kind that never occurred is absent (read with .get(kind, 0))."""

    mode: str
    buckets_compared: int
    buckets_differing: int
    source_rows: int | None  # None in full mode: the source is not counted separately
    missing: int
    extra: int
    different: int
    in_flight: int


class QualityCheck(TypedDict):
    """One expectation's outcome (audit.quality): a row of cdc_meta.quality_results without its
    table, run and time, an entry of the JSON report and of the job's result line. Its texts are
    JSON: the expectation with its arguments, the observed value, the details of a failure."""

    expectation: str
    success: bool
    observed: str
    details: str


@dataclass(frozen=True)
class AuditResult:
    verdict: str  # "ok" or "fail"
    message: str  # the multi-line summary the task log shows
    mode: str  # "full" or "checksum" (auto resolved)
    shards: dict[str, ShardStats]
    persistent: dict[str, int]  # shard -> keys at or over consecutive_mismatches
    repaired: int
    quality: list[QualityCheck]
    quarantine_reasons: dict[str, int]
    seconds: float
    timings: dict[str, float]
    spark_jobs: int | None = (
        0  # Spark jobs the audit started (runtime.phases.SparkJobs; None: not known), held to a budget
    )
    spark_job_sites: list[str] = field(default_factory=list)  # what started each, in order
    repair_pending: int = 0  # persistent keys left unrepaired for a person to approve (repair_limit)

    @property
    def waits_for_repair_approval(self) -> bool:
        """Failed only for want of an approved repair: the DAG's approval follows, not a failure."""
        return bool(self.repair_pending) and all(q["success"] for q in self.quality)

    def to_dict(self) -> dict[str, Any]:
        """For the job's result line. Not dataclasses.asdict: that deep-copies, and the stats
        dicts are meant to be shared."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
