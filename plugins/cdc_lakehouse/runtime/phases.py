"""What a job spends per named phase (seconds) and in Spark jobs: what the jobs log and return, and
what the bench reports."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession


class PhaseClock:
    """`with clock.phase("merge"): ...` adds the seconds spent to that phase (a phase entered twice
    counts both times)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - t

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 1) for k, v in self.seconds.items()}


class SparkJobs:
    """Counts the Spark jobs a block of driver code starts: `with SparkJobs(spark, "ingest t") as
    jobs: ...; jobs.count`. Every action (count, collect, a write, each job of a MERGE) is one or
    more jobs, and each costs scheduling and a pass over its input: the number is the budget the
    fused ingest is held to (issue #16), measured through Spark's status tracker."""

    def __init__(self, spark: SparkSession, label: str) -> None:
        self.sc = spark.sparkContext
        self.label = label
        self.group = f"cdc-{uuid.uuid4().hex[:12]}"
        self.count = 0
        self.sites: list[str] = []
        self._previous: str | None = None

    def __enter__(self) -> SparkJobs:
        self._previous = self.sc.getLocalProperty("spark.jobGroup.id")
        self.sc.setJobGroup(self.group, self.label)
        return self

    def __exit__(self, *exc: object) -> None:
        tracker = self.sc.statusTracker()
        ids = sorted(tracker.getJobIdsForGroup(self.group))
        self.count = len(ids)
        # What started each job (its last stage's call site, e.g. "save at .../run.py:255"):
        # where a budget regressed, this says which line did it.
        self.sites = [_call_site(tracker, j) for j in ids]
        # Leave the thread as it was: a job group outlives the block otherwise.
        self.sc.setLocalProperty("spark.jobGroup.id", self._previous)  # type: ignore[arg-type]
        self.sc.setLocalProperty("spark.job.description", None)  # type: ignore[arg-type]


def _call_site(tracker: Any, job_id: int) -> str:
    job = tracker.getJobInfo(job_id)
    stages = [tracker.getStageInfo(s) for s in (job.stageIds if job else [])]
    names = [st.name for st in stages if st is not None]
    return names[-1] if names else "?"


def observed_counts(df: DataFrame, *exprs: Column) -> dict[str, Any]:
    """Aggregates over df, computed while a no-op write scans it: one Spark job, where
    `df.groupBy().agg(...).collect()` takes two under adaptive execution (its shuffle stage runs
    as a job of its own). Returns {alias: value}."""
    from pyspark.sql import Observation

    obs = Observation(f"cdc_{uuid.uuid4().hex[:8]}")
    df.observe(obs, *exprs).write.format("noop").mode("overwrite").save()
    return timestamps_from_micros(obs.get)


def timestamps_from_micros(values: dict[str, Any]) -> dict[str, Any]:
    """Observed metrics reach Python as JVM objects unless primitive: timestamps are therefore
    observed as `unix_micros(...)` under a name ending in `_ts`, and turned back here into naive
    UTC datetimes (what collect() gives in a UTC session)."""
    epoch = datetime(1970, 1, 1, tzinfo=UTC).replace(tzinfo=None)
    return {
        k: (epoch + timedelta(microseconds=v) if k.endswith("_ts") and v is not None else v) for k, v in values.items()
    }
