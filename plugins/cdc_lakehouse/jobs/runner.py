"""How every job runs: its secrets, then its configs (a bad one costs no JVM), then one
SparkSession, the stage per table (one's failure never stops the others), one JSON result line per
table, and an exit code.

Secrets arrive by reference (CDC_SECRETS_FILE, see runtime.secrets.load_job_secrets) or through the
environment of a job started by hand (CDC_CATALOG_PASSWORD, CDC_SOURCE_URI__<CONN>), never as
arguments. A config directory left unset (None) is the job's environment's (settings.tables_dir(),
derived_dir(), exports_dir()): the DAG never passes one, since the driver may run elsewhere.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import date, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from cdc_lakehouse.config import ConfigSet, TableConfig, load_table_configs
from cdc_lakehouse.runtime.secrets import load_job_secrets
from cdc_lakehouse.settings import LakeSettings, derived_dir, tables_dir

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from cdc_lakehouse.derived.config import DerivedSet, TreeConfig

log = logging.getLogger("cdc_lakehouse.jobs")
C = TypeVar("C")


class Named(Protocol):
    """What a job runs its stage on: a table, derived table, export or feed output config."""

    @property
    def name(self) -> str: ...


N = TypeVar("N", bound=Named)
N_contra = TypeVar("N_contra", bound=Named, contravariant=True)


@dataclass(frozen=True)
class Loaded(Generic[N]):
    """A job's configs, loaded before Spark starts, and the config file of each by name (for the
    result rows that record it)."""

    configs: list[N]
    files: dict[str, str] = field(default_factory=dict)


class StageResult(Protocol):
    """What a job's function returns per table: a stage's typed result (ingest.ingest_table.IngestResult,
    audit.result.AuditResult, ...), printed on the job's result line as to_dict() gives it."""

    def to_dict(self) -> dict[str, Any]: ...


class Stage(Protocol[N_contra]):
    """A job's work on one config: (spark, lake, the config, its file) -> the stage's result."""

    def __call__(
        self, spark: SparkSession, lake: LakeSettings, cfg: N_contra, config_file: str | None, /
    ) -> StageResult: ...


class AfterStages(Protocol[N_contra]):
    """What a job does once its stages ran, whatever their outcome (in the same session)."""

    def __call__(self, spark: SparkSession, lake: LakeSettings, cfgs: Sequence[N_contra], /) -> None: ...


def _json_default(o: Any) -> Any:
    if isinstance(o, (datetime, date)):
        return o.isoformat()
    return str(o)


def _emit(kind: str, payload: dict[str, Any]) -> None:
    print(f"CDC_RESULT {kind} " + json.dumps(payload, default=_json_default, sort_keys=True), flush=True)


def table_configs(config_dir: str | None) -> ConfigSet:
    """The table configs of --config-dir, or of the job's environment."""
    return load_table_configs(config_dir or tables_dir())


def derived_configs(config_dir: str | None, derived: str | None) -> tuple[ConfigSet, DerivedSet]:
    from cdc_lakehouse.derived.config import load_derived_configs

    cs = table_configs(config_dir)
    return cs, load_derived_configs(derived or derived_dir(), cs.tables)


def pick(what: str, names: tuple[str, ...], found: Mapping[str, C], where: Any, errors: list[Any]) -> list[C]:
    """The configs `names` names, in order; a missing one stops the job before Spark starts,
    with the errors of the config files (one of which may be the missing one's)."""
    missing = [n for n in names if n not in found]
    if missing:
        errs = [str(e) for e in errors]
        raise SystemExit(
            f"{what} config(s) {missing} not found or invalid in {where}" + ("\n" + "\n".join(errs) if errs else "")
        )
    return [found[n] for n in names]


def load_tables(config_dir: str | None, names: tuple[str, ...]) -> Loaded[TableConfig]:
    cs = table_configs(config_dir)
    return Loaded(pick("table", names, cs.tables, config_dir or tables_dir(), cs.errors), cs.files)


def load_derived(config_dir: str | None, derived: str | None, names: tuple[str, ...]) -> Loaded[TreeConfig]:
    cs, ds = derived_configs(config_dir, derived)
    return Loaded(pick("derived", names, ds.derived, derived or derived_dir(), cs.errors + ds.errors), ds.files)


def run_tables(
    kind: str,
    spark,
    lake: LakeSettings,
    cfgs: Sequence[Named],
    fn: Callable[..., StageResult],
    *args: Any,
    parallel: int = 1,
) -> tuple[dict[str, dict[str, Any]], list[tuple[str, Exception]]]:
    """fn(spark, lake, cfg, *args) per table (or derived table); one's failure never stops the others.
    Returns each table's result line (as printed, in the order of cfgs) and the failures.

    parallel > 1: that many tables at once, each worker thread on a Spark session of its own
    (runtime.session.worker_session). A small table's run is mostly waiting (requests to the
    server, catalog commits, job scheduling), so tables overlap well even on few cores
    (bench/tables_bench.py: docs/benchmarks-history.md, #56)."""
    results: dict[str, dict[str, Any]] = {}
    failures: list[tuple[str, Exception]] = []
    if parallel <= 1 or len(cfgs) <= 1:
        for cfg in cfgs:
            name, results[cfg.name], exc = _run_one(kind, fn, lambda: spark, lake, cfg, *args)
            if exc is not None:
                failures.append((name, exc))
            _emit(kind, results[name])
        return results, failures
    with _WorkerSessions(spark, lake) as sessions, ThreadPoolExecutor(parallel, thread_name_prefix=kind) as pool:
        runs = [pool.submit(_run_one, kind, fn, sessions.mine, lake, cfg, *args) for cfg in cfgs]
        for run in runs:  # in the configs' order: each line as soon as its table and those before it are done
            name, results[name], exc = run.result()
            if exc is not None:
                failures.append((name, exc))
            _emit(kind, results[name])
    return results, failures


def _run_one(
    kind: str, fn: Callable[..., StageResult], session: Callable[[], Any], lake: LakeSettings, cfg: Named, *args: Any
) -> tuple[str, dict[str, Any], Exception | None]:
    """fn on one table, with the session `session()` gives (a worker's may fail to start: that
    table's failure, like any other)."""
    from cdc_lakehouse.runtime.phases import releasing_kept

    t = time.time()
    try:
        with releasing_kept():  # the table's checkpoints go with its run, not with the job
            result = fn(session(), lake, cfg, *args)
        return cfg.name, {"table": cfg.name, "status": "ok", "seconds": time.time() - t, **result.to_dict()}, None
    except Exception as exc:  # noqa: BLE001 - reported per table, the run fails at the end
        if getattr(exc, "waits_for_person", False):  # e.g. ingest.errors.DropDecisionNeeded: not a failure
            log.warning("%s %s waits: %s", kind, cfg.name, exc)
            return (
                cfg.name,
                {"table": cfg.name, "status": "waiting", "reason": str(exc), "seconds": time.time() - t},
                None,
            )
        log.error("%s %s failed: %s\n%s", kind, cfg.name, exc, traceback.format_exc())
        return cfg.name, {"table": cfg.name, "status": "failed", "error": str(exc), "seconds": time.time() - t}, exc


class _WorkerSessions:
    """One Spark session per worker thread, made on the thread's first table and ended with the
    block (runtime.session.worker_session)."""

    def __init__(self, spark, lake: LakeSettings) -> None:
        self.spark, self.lake = spark, lake
        self.local = threading.local()
        self.made: list[Any] = []  # appended by the workers (list.append is atomic)

    def __enter__(self) -> _WorkerSessions:
        return self

    def mine(self):
        from cdc_lakehouse.runtime.session import worker_session

        if not hasattr(self.local, "spark"):
            self.local.spark = worker_session(self.spark, self.lake)
            self.made.append(self.local.spark)
        return self.local.spark

    def __exit__(self, *exc: object) -> None:
        from cdc_lakehouse.runtime.session import release_worker

        for worker in self.made:
            try:
                release_worker(worker)
            except Exception as e:  # noqa: BLE001 - the tables' outcomes are what count
                log.warning("could not end a worker's Spark session: %s", e)


def run_per_table(
    kind: str,
    app_name: str | None,
    load: Callable[[], Loaded[N]],
    fn: Stage[N],
    after: AfterStages[N] | None = None,
    *,
    parallel: int = 1,
) -> int:
    """fn(spark, lake, cfg, config_file) per config `load` returns, in one Spark session (`parallel`
    tables at once: run_tables); 1 when any failed. `load` runs after the secrets are in place and before Spark starts. Then
    after(spark, lake, cfgs), in the same session, whatever the tables' outcome; its failure is
    logged and fails nothing (what it does must be derivable again later)."""
    from cdc_lakehouse.lake.meta import ensure_meta_tables
    from cdc_lakehouse.runtime.session import get_spark, release_spark

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    load_job_secrets()  # before anything reads CDC_CATALOG_PASSWORD, CDC_SOURCE_URI__*, AWS_*
    loaded = load()
    cfgs, files = loaded.configs, loaded.files
    lake = LakeSettings.from_env()
    t0 = time.time()
    names = ",".join(c.name for c in cfgs)
    spark = get_spark(app_name or f"cdc-{kind}-{names[:40]}", lake)
    try:  # a failed job still ends its Spark Connect session on the server
        ensure_meta_tables(spark, lake)
        log.info("%s: Spark session ready in %.1fs (package %s)", kind, time.time() - t0, Path(__file__).parents[1])

        def run(s: SparkSession, lk: LakeSettings, c: N) -> StageResult:
            return fn(s, lk, c, files.get(c.name))

        _, failures = run_tables(kind, spark, lake, cfgs, run, parallel=parallel)
        if after is not None:
            try:
                after(spark, lake, cfgs)
            except Exception as after_exc:  # noqa: BLE001 - see the docstring
                log.warning(
                    "%s: %s failed after the tables ran: %s", kind, getattr(after, "__name__", after), after_exc
                )
    finally:
        release_spark(spark)
    if failures:
        print(f"{kind}: {len(failures)} of {len(cfgs)} table(s) failed:", file=sys.stderr)
        for name, exc in failures:
            print(f"  {name}: {exc}", file=sys.stderr)
        return 1
    return 0
