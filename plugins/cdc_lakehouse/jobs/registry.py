"""Every Spark job, once: its name, which is also its file spark_jobs/<name>.py (what spark-submit
and a Spark Connect task run), its parameters (what the DAG passes, jobs.params) and its main.

The DAG factory and the operator look a job up here; each spark_jobs file is two lines calling
`run_job` with its own name. A new job: a module here with its parameters and main, an entry
below, and its spark_jobs file (tests/unit/test_jobs.py checks the three agree).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from cdc_lakehouse.jobs import audit, bootstrap, derive, export, feed_block_counts, history, ingest, maintenance, replay
from cdc_lakehouse.jobs.params import JobParams
from cdc_lakehouse.settings import PROJECT_ROOT

P = TypeVar("P", bound=JobParams)
JOBS_DIR = PROJECT_ROOT / "spark_jobs"


@dataclass(frozen=True)
class Job(Generic[P]):
    name: str
    params: type[P]
    main: Callable[[P], int]

    @property
    def file(self) -> Path:
        """The application file spark-submit runs (on the Airflow side: a cluster's driver gets
        the package as a zip, where this path means nothing)."""
        return JOBS_DIR / f"{self.name}.py"


JOBS: dict[str, Job[Any]] = {
    j.name: j
    for j in (
        Job("ingest", ingest.IngestParams, ingest.main),
        Job("bootstrap", bootstrap.BootstrapParams, bootstrap.main),
        Job("maintenance", maintenance.MaintenanceParams, maintenance.main),
        Job("audit", audit.AuditParams, audit.main),
        Job("replay", replay.ReplayParams, replay.main),
        Job("history", history.HistoryParams, history.main),
        Job("derive", derive.DeriveParams, derive.main),
        Job("export", export.ExportParams, export.main),
        Job("feed_block_counts", feed_block_counts.BlockCountsParams, feed_block_counts.main),
    )
}


def job(name: str) -> Job[Any]:
    try:
        return JOBS[name]
    except KeyError:
        raise ValueError(f"no Spark job {name!r}; the jobs (cdc_lakehouse.jobs.registry): {sorted(JOBS)}") from None


def run_job(name: str, argv: list[str] | None = None) -> int:
    """The job's main on the parameters its command line gives (None: this process's); its exit code."""
    j = job(name)
    return j.main(j.params.from_argv(argv))
