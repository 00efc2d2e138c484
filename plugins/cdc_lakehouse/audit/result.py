"""What one audit returns.

AuditResult is a Mapping: callers (the Spark job's JSON line, tests, the bench) read it as
`r["shards"]` / `r.get("timings")`, as they did when it was a plain dict.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
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


@dataclass(eq=False)
class AuditResult(Mapping[str, Any]):
    verdict: str  # "ok" or "fail"
    message: str  # the multi-line summary the task log shows
    mode: str  # "full" or "checksum" (auto resolved)
    shards: dict[str, ShardStats]
    persistent: dict[str, int]  # shard -> keys at or over consecutive_mismatches
    repaired: int
    quality: list[dict[str, Any]]
    quarantine_reasons: dict[str, int]
    seconds: float
    timings: dict[str, float]
    spark_jobs: int = 0  # Spark jobs the audit started (runtime.phases.SparkJobs), held to a budget
    spark_job_sites: list[str] = field(default_factory=list)  # what started each, in order

    def as_dict(self) -> dict[str, Any]:
        # Not dataclasses.asdict: that deep-copies, and the stats dicts are meant to be shared.
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __getitem__(self, name: str) -> Any:
        if name not in self._names():
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
