"""What a job spends per named phase (seconds) and in Spark jobs: what the jobs log and return, and
what the bench reports."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


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
        self._previous: str | None = None

    def __enter__(self) -> SparkJobs:
        self._previous = self.sc.getLocalProperty("spark.jobGroup.id")
        self.sc.setJobGroup(self.group, self.label)
        return self

    def __exit__(self, *exc: object) -> None:
        self.count = len(self.sc.statusTracker().getJobIdsForGroup(self.group))
        # Leave the thread as it was: a job group outlives the block otherwise.
        self.sc.setLocalProperty("spark.jobGroup.id", self._previous)  # type: ignore[arg-type]
        self.sc.setLocalProperty("spark.job.description", None)  # type: ignore[arg-type]
