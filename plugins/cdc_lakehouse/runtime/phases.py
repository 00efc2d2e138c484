"""What a job spends per named phase (seconds) and in Spark jobs: what the jobs log and return, and
what the bench reports."""

from __future__ import annotations

import logging
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypedDict, cast

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

log = logging.getLogger(__name__)


class SparkJobData(TypedDict, total=False):
    """One job as Spark's status REST API lists it (GET .../applications/<app>/jobs; Spark 4.1's
    JobData): the fields read here. A wire format, typed only as far as it is read."""

    jobId: int
    name: str
    status: str  # RUNNING | SUCCEEDED | FAILED | UNKNOWN
    stageIds: list[int]
    jobTags: list[str]


#: Observed metrics as Python (observed_counts): a count (int; a sum over no rows is None), a JSON
#: text (str) or, under a name ending in `_ts`, a timestamp.
ObservedValue = int | str | datetime | None
Observed = dict[str, ObservedValue]


def as_count(value: ObservedValue) -> int:
    """An observed count: a sum over no rows comes back NULL, which is 0 here."""
    if isinstance(value, datetime):
        raise TypeError(f"an observed count is a timestamp: {value}")
    return int(value or 0)


def as_time(value: ObservedValue) -> datetime | None:
    """An observed timestamp (`_ts`, turned back into a datetime by timestamps_from_micros)."""
    if value is not None and not isinstance(value, datetime):
        raise TypeError(f"an observed timestamp is {value!r}")
    return value


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
    fused ingest is held to (issue #16).

    Reads of a table's snapshot metadata (lake.snapshots, under `metadata_reads()`) are counted
    apart, in `metadata`: through Iceberg's Java API they started no job, through SQL (what Spark
    Connect allows) each is a small job over the metadata tables, never over data files. `count`
    stays the figure a new scan of data moves.

    The block's jobs carry a job tag of their own (SparkSession.addTag: public on a classic session
    and on Spark Connect alike); they are counted from the application's status REST API (what the
    Spark UI serves). Where that API is not reachable (the UI off, a remote server's UI behind a
    firewall) the count is None: a diagnostic, never a reason to fail a job."""

    def __init__(self, spark: SparkSession, label: str) -> None:
        self.spark = spark
        self.label = label
        self.tag = f"cdc-{uuid.uuid4().hex[:12]}"
        self.count: int | None = None
        self.metadata: int | None = None
        self.sites: list[str] = []

    def __enter__(self) -> SparkJobs:
        self.spark.addTag(self.tag)
        return self

    def __exit__(self, *exc: object) -> None:
        self.spark.removeTag(self.tag)
        jobs = _tagged_jobs(self.spark, self.tag)
        if jobs is not None:
            jobs.sort(key=lambda j: int(j.get("jobId", 0)))
            meta = [j for j in jobs if _has_tag(j, METADATA_TAG)]
            data = [j for j in jobs if not _has_tag(j, METADATA_TAG)]
            self.count, self.metadata = len(data), len(meta)
            # What started each job (e.g. "save at .../run.py:255"): where a budget regressed, this
            # says which line did it.
            self.sites = [_phase_of(j) + _site(self.spark, j) for j in data]


# The tag of a read of snapshot metadata (SparkJobs counts those jobs apart).
METADATA_TAG = "cdc-metadata-read"
# The tag of the jobs of a named phase (job_phase): SparkJobs.sites names it before each job.
PHASE_TAG = "cdc-phase-"


@contextmanager
def job_phase(spark: SparkSession, name: str) -> Iterator[None]:
    """The jobs started inside belong to phase `name` (what SparkJobs.sites shows per job)."""
    spark.addTag(PHASE_TAG + name)
    try:
        yield
    finally:
        spark.removeTag(PHASE_TAG + name)


def _phase_of(job: SparkJobData) -> str:
    for t in job.get("jobTags") or []:
        if PHASE_TAG in t:
            return "[" + t[t.index(PHASE_TAG) + len(PHASE_TAG) :] + "] "
    return ""


@contextmanager
def metadata_reads(spark: SparkSession) -> Iterator[None]:
    """The jobs started inside are reads of table metadata (SparkJobs.metadata)."""
    spark.addTag(METADATA_TAG)
    try:
        yield
    finally:
        spark.removeTag(METADATA_TAG)


def _has_tag(job: SparkJobData, tag: str) -> bool:
    # Spark 4 gives a session's tag its scope: on a Spark Connect server
    # "SparkConnect_Execute_User_<u>_Session_<s>_Tag_<tag>" (spark-connect 4.1, ExecuteHolder), on a
    # classic session "spark-session-<uuid>-thread-<uuid>-<tag>" (SparkSession.managedJobTags).
    return any(t == tag or t.endswith((f"_Tag_{tag}", f"-{tag}")) for t in job.get("jobTags") or [])


def _site(spark: SparkSession, job: SparkJobData) -> str:
    """A job's call site ("save at .../run.py:255"); for a Spark Connect client, whose jobs are
    named by their request, the request's SQL or the relation or command it ran."""
    import re

    name = str(job.get("name", "?"))
    if not name.startswith("Spark Connect"):
        return name
    details = _stage_details(spark, job)
    query = re.search(r'query: "((?:[^"\\]|\\.)*)"', details)
    if query:
        return "sql: " + query.group(1)[:160]
    nodes = [n for n in re.findall(r"^ +(\w+) \{", details, re.M) if n not in ("common", "root", "command", "plan")]
    return "connect: " + " > ".join(nodes[:4]) if nodes else name[:120]


def _stage_details(spark: SparkSession, job: SparkJobData) -> str:
    import json
    import urllib.request

    base, stages = status_api(spark), job.get("stageIds") or []
    if base is None or not stages:
        return ""
    try:
        with urllib.request.urlopen(f"{base}/stages/{min(stages)}", timeout=5) as r:  # noqa: S310 - the driver's own UI
            return str((json.load(r) or [{}])[0].get("details", ""))
    except OSError:
        return ""


def status_api(spark: SparkSession) -> str | None:
    """The base URL of the application's status REST API, or None when the UI is off. Kept per
    Spark Connect session: each conf read is a request to the server, and the job counts asked
    for it about 50 times per ingest (4 reads each: 1,142 of a test file's 3,923 requests)."""
    session_id = getattr(spark, "session_id", None)  # Connect sessions only; classic reads are local
    if session_id is None:
        return _status_api(spark)
    if session_id not in _STATUS_API:
        _STATUS_API[session_id] = _status_api(spark)
    return _STATUS_API[session_id]


_STATUS_API: dict[str, str | None] = {}


def _status_api(spark: SparkSession) -> str | None:
    get = spark.conf.get
    if (get("spark.ui.enabled", "true") or "true").lower() != "true":
        return None
    app = get("spark.app.id", None)
    url = get("spark.ui.reverseProxyUrl", None) or None
    if url is None and getattr(spark, "session_id", None) is None:
        # A classic driver knows the port its UI bound: spark.ui.port is only the first one it
        # tried (another application on 4040 moves it to 4041, and the conf still says 4040).
        url = spark.sparkContext.uiWebUrl or None
    if url is None:
        host, port = get("spark.driver.host", None), get("spark.ui.port", "4040")
        if not host or not app:
            return None
        return _answering_ui(host, int(port or 4040), app)
    return f"{url.rstrip('/')}/api/v1/applications/{app}"


def _answering_ui(host: str, port: int, app: str) -> str | None:
    """The status API of application `app` on `host`, from spark.ui.port up: a UI whose port was
    taken when the server started binds the next free one (spark.port.maxRetries, 16 by default),
    and spark.ui.port still names the first. The port it names then may be another program's,
    whose answers (a 404 for this application, seen in CI) are not this application's."""
    import json
    import urllib.error
    import urllib.request

    named = f"http://{host}:{port}/api/v1/applications/{app}"
    for p in range(port, port + 17):
        base = f"http://{host}:{p}/api/v1/applications/{app}"
        try:
            # A busy driver answers its UI slowly: the port it names gets the time the other
            # status reads get; the later ones are only tried when that one is not the UI.
            with urllib.request.urlopen(base, timeout=10 if p == port else 2) as r:  # noqa: S310 - the driver's UI
                if json.load(r).get("id") == app:
                    return base
        except urllib.error.HTTPError:
            continue  # another program's, or another application's UI
        except (OSError, ValueError, AttributeError) as exc:
            if isinstance(getattr(exc, "reason", exc), TimeoutError):
                return named if p == port else None  # as before this check: the named port
            continue  # nothing listens there (any more), or not a Spark UI
    return None


def _tagged_jobs(spark: SparkSession, tag: str) -> list[SparkJobData] | None:
    import json
    import urllib.request

    base = status_api(spark)
    if base is None:
        return None
    # The listener bus records a job's end asynchronously: the last job of the block may be
    # listed a moment after its action returned.
    for _ in range(20):
        try:
            with urllib.request.urlopen(f"{base}/jobs", timeout=5) as r:  # noqa: S310 - the driver's own UI
                jobs = json.load(r)
        except OSError:
            return None
        mine = [j for j in jobs if _has_tag(j, tag)]
        if all(j.get("status") != "RUNNING" for j in mine):
            return mine
        time.sleep(0.05)
    return mine


def local_checkpoint(df: DataFrame, eager: bool = True) -> DataFrame:
    """df computed once (eagerly) and kept by its session for the rest of the stage; the plan of
    what follows starts from the kept rows. eager=False: kept by the first action over it, which
    must compute every partition (checkpoint_counted). pyspark's Spark Connect client (4.1.3)
    attaches a checkpoint's result to SparkSession.active(), not to the frame's own session
    (pyspark/sql/connect/conversion.py, proto_to_remote_cached_dataframe): in a process with
    several sessions (a test suite, overlapping writers, a job run in a task's process) the result
    named a frame the other session did not have ("No DataFrame with id ... is found in the
    session"). The frame's session is made this thread's active one for the call."""
    session = df.sparkSession
    local = getattr(type(session), "_active_session", None)  # Connect's thread-local active session
    if local is None:
        return _kept(df.localCheckpoint(eager=eager), connect=False)
    before = getattr(local, "session", None)
    local.session = session
    try:
        return _kept(df.localCheckpoint(eager=eager), connect=True)
    finally:
        local.session = before


# What the checkpoints made inside the innermost releasing_kept() of this thread hold (None:
# outside one), each as a function giving it back, or None once it is gone. On Spark Connect that
# is the frame's plan (a CachedRemoteRelation: every frame derived from the checkpoint shares it,
# and the server's copy is dropped when it is collected), held weakly: one Python frees by itself
# is released then, as before. On classic Spark, the checkpointed frame itself, held until the
# block ends: the RDD stays until every frame over it is gone, which a weak handle cannot tell.
_KEPT: ContextVar[list[Callable[[], Any]] | None] = ContextVar("cdc_kept_checkpoints", default=None)


def _kept(df: DataFrame, *, connect: bool) -> DataFrame:
    kept = _KEPT.get()
    if kept is not None:
        kept.append(weakref.ref(cast(Any, df)._plan) if connect else (lambda: df))
    return df


@contextmanager
def releasing_kept() -> Iterator[None]:
    """The checkpoints local_checkpoint makes inside are released when the block ends without an
    error (a stage's, whose results are plain values; a chunked bootstrap's round). Otherwise a
    classic driver keeps a checkpoint's RDD blocks until Python collects its frames, and a
    checkpointed frame sits in a reference cycle there: only Python's cyclic collector frees it,
    at times of its own. In one process running ingest after ingest (a group run, a bench) the
    driver's heap grew by each batch's checkpoints until such a collection: 2 RDDs per ingest,
    and 423 MB to 1.95 GB of heap kept after 20 batches of 200k events (bench/churn_bench.py,
    docs/benchmarks-history.md "Format v3 under churn"). On Spark Connect the frames were freed
    on return already (their cached relations dropped).
    After an error nothing is released here: on Connect each release is a request that pyspark
    retries for minutes when the server is gone; the session's end drops them all anyway."""
    token = _KEPT.set([])
    try:
        yield
    except BaseException:
        _KEPT.reset(token)
        raise
    held = [h for h in (get() for get in _KEPT.get() or []) if h is not None]
    _KEPT.reset(token)
    released = sum(_release(h) for h in held)
    if held:
        log.info("%d of %d checkpoint(s) still held at the end of the stage released", released, len(held))


def _release(held: Any) -> bool:
    """A checkpoint's rows released now (no frame over them is read after); False, with a warning,
    when they could not be. On Connect, True means the server was asked: pyspark logs, and does
    not raise, a removal that failed."""
    try:
        if type(held).__name__ == "CachedRemoteRelation":  # Connect (pyspark.sql.connect.plan)
            if held._relation_id is not None:
                held.__del__()  # what it does when collected (pyspark 4.1); asked now, not again then
                held._relation_id = None
            return True
        analyzed = held._jdf.queryExecution().analyzed()  # classic: a LogicalRDD over a persisted RDD
        if analyzed.getClass().getSimpleName() != "LogicalRDD":
            raise TypeError(f"its plan is a {analyzed.getClass().getSimpleName()}, not a LogicalRDD")
        analyzed.rdd().unpersist(False)
        return True
    except Exception as e:  # noqa: BLE001 - its memory comes back later anyway; never fail a stage over it
        log.warning("could not release a checkpoint: %s", e)
        return False


def checkpoint_counted(df: DataFrame, *exprs: Column) -> tuple[DataFrame, Observed]:
    """df kept as local_checkpoint keeps it, and aggregates over it (observed_counts), in one Spark
    job where an eager checkpoint and its count took two: the checkpoint is made lazily, and the
    count's no-op write, which computes every partition, fills it. (Spark Connect delivers no
    observed metrics to the checkpoint's own command.) Adaptive execution still runs the shuffle
    and broadcast stages of df's plan as jobs of their own, when the checkpoint is made; the
    count's job then reads their output, so this relies on Spark keeping a query's shuffle files
    past its end (spark.sql.classic.shuffleDependency.fileCleanup.enabled, off unless
    SPARK_TESTING is set). Issue #56."""
    kept = local_checkpoint(df, eager=False)
    return kept, observed_counts(kept, *exprs)


def observed_counts(df: DataFrame, *exprs: Column) -> Observed:
    """Aggregates over df, computed while a no-op write scans it: one Spark job, where
    `df.groupBy().agg(...).collect()` takes two under adaptive execution (its shuffle stage runs
    as a job of its own). Returns {alias: value}."""
    from pyspark.sql import Observation

    obs = Observation(f"cdc_{uuid.uuid4().hex[:8]}")
    df.observe(obs, *exprs).write.format("noop").mode("overwrite").save()
    return timestamps_from_micros(obs.get)


def timestamps_from_micros(values: dict[str, ObservedValue]) -> Observed:
    """Observed metrics reach Python as JVM objects unless primitive: timestamps are therefore
    observed as `unix_micros(...)` under a name ending in `_ts`, and turned back here into naive
    UTC datetimes (what collect() gives in a UTC session)."""
    epoch = datetime(1970, 1, 1, tzinfo=UTC).replace(tzinfo=None)
    return {
        k: (epoch + timedelta(microseconds=v) if k.endswith("_ts") and isinstance(v, int) else v)
        for k, v in values.items()
    }
