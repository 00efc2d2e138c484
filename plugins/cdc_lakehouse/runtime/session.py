"""The one SparkSession factory for jobs, tasks, benchmarks and tests.

Two ways to reach Spark; the code after them is the same (no JVM access from Python):

- Spark Connect (`CDC_SPARK_REMOTE=sc://host:port`, or an Airflow Spark Connect connection): this
  process is a client of a long-lived Spark, the local stack's (devstack.localstack.LocalSparkConnect)
  or a team's own. Each job gets a session of its own on the server.
- A classic session: under spark-submit (YARN, Kubernetes: the JVM is already there), or a JVM
  started here (`python spark_jobs/x.py` with no remote).

Settings, split by where Spark reads them:
- server_conf(): fixed when the JVM starts (Iceberg's extensions, jars, serializer, UI redaction).
  The Connect server gets them in a 0600 properties file, never on its command line.
- sql_conf(): per session (time zone, shuffle partitions, ANSI off, Parquet rebase modes).
- lake_conf(): the lake's catalog and the landing's S3A settings, per session. Credentials among
  them (catalog password, S3 keys) are set into the running session: over the Connect channel,
  or after a classic JVM started, never as a `--conf` of a command line anyone can read.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from cdc_lakehouse.secrecy import SPARK_REDACTION_REGEX, Secret, is_secret_setting, reveal, spark_redaction_regex
from cdc_lakehouse.settings import LakeSettings, local_paths

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

ICEBERG_EXTENSIONS = "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions"
SparkSettings = dict[str, "str | Secret"]  # secret values are Secrets (cdc_lakehouse.secrecy)
# A Spark Connect server cannot learn per session which settings are secret (its redaction regex
# is fixed at start), and a secret is one by origin, whatever its name: the server redacts every
# catalog and S3A setting in its UI, event log and SQL pages, public ones included.
SERVER_REDACTION_REGEX = SPARK_REDACTION_REGEX + r"|^spark\.sql\.catalog\.|^fs\.s3a?\."
REMOTE_ENV = "CDC_SPARK_REMOTE"  # sc://host:port of a Spark Connect server
SESSION_CONF_ENV = "CDC_SPARK_SESSION_CONF"  # JSON: a task's own session settings (the operator's conf)
CONNECT_SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"


def default_jars() -> list[str]:
    """CDC_SPARK_JARS (comma-separated paths) or what scripts/fetch_jars.sh resolved from
    requirements-jvm.txt."""
    env = os.environ.get("CDC_SPARK_JARS")
    if env:
        return [j for j in env.split(",") if j]
    return sorted(glob.glob(str(local_paths()["jars"] / "*.jar")))


def server_conf() -> dict[str, str]:
    """Settings a JVM reads once, at its start."""
    cores = os.cpu_count() or 2
    return {
        "spark.sql.extensions": ICEBERG_EXTENSIONS,
        "spark.default.parallelism": str(max(4, cores * 2)),
        "spark.serializer": "org.apache.spark.serializer.KryoSerializer",
        "spark.ui.showConsoleProgress": "false",
        # Spark keeps 100 generated classes; one ingest's MERGE, writes and meta tables generate
        # more, so the next run's fused plan recompiled and ran its new classes unwarmed (about 2 s
        # of its 6 s, measured; see docs/benchmarks-history.md). A long-lived server keeps them all.
        "spark.sql.codegen.cache.maxEntries": "1000",
        # The UI's environment and SQL tabs, event logs and history server show session settings
        # too (the catalog password, S3 keys set per session). Spark's default,
        # (?i)secret|password|token|access[.]key, misses Iceberg's s3.access-key-id; a classic
        # session adds the keys of its settings that are secret by origin only (_classic).
        "spark.redaction.regex": SERVER_REDACTION_REGEX,
        "spark.driver.extraJavaOptions": "-Duser.timezone=UTC",
        "spark.executor.extraJavaOptions": "-Duser.timezone=UTC",
    }


def sql_conf(shuffle_partitions: int | None = None) -> dict[str, str]:
    """Settings each session sets for itself."""
    cores = os.cpu_count() or 2
    return {
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.shuffle.partitions": str(shuffle_partitions or max(4, cores * 2)),
        "spark.sql.adaptive.enabled": "true",
        "spark.sql.adaptive.coalescePartitions.enabled": "true",
        # Landing files are small and many; let Spark pack them into few tasks.
        "spark.sql.files.maxPartitionBytes": str(128 * 1024 * 1024),
        "spark.sql.files.openCostInBytes": str(1024 * 1024),
        # Failed casts must yield NULL so validation can detect and quarantine them (Spark 4
        # turned ANSI mode on by default).
        "spark.sql.ansi.enabled": "false",
        "spark.sql.legacy.timeParserPolicy": "CORRECTED",
        "spark.sql.parquet.int96RebaseModeInWrite": "CORRECTED",
        "spark.sql.parquet.datetimeRebaseModeInWrite": "CORRECTED",
        "spark.sql.parquet.datetimeRebaseModeInRead": "CORRECTED",
    }


def base_conf(shuffle_partitions: int | None = None) -> dict[str, str]:
    """Everything but the lake: what spark-submit gives a classic driver."""
    return {**server_conf(), **sql_conf(shuffle_partitions)}


def spark_conf(
    lake: LakeSettings, *, include_secret: bool = True, shuffle_partitions: int | None = None
) -> SparkSettings:
    return {**base_conf(shuffle_partitions), **lake_conf(lake, include_secret=include_secret)}


def lake_conf(lake: LakeSettings, *, include_secret: bool = True) -> SparkSettings:
    """The lake's catalog and the landing's S3A settings, as session settings. S3A keys go without
    the `spark.hadoop.` prefix: a session's settings reach the Hadoop configuration of its file
    reads and writes as they are named (SessionState.newHadoopConf)."""
    hadoop = lake.hadoop_s3_conf(include_secret)
    if hadoop and lake.s3_credentials is not None:
        # Hadoop caches one FileSystem per scheme and bucket for the whole JVM, built with the
        # settings of the session that asked first: on a shared server another lake's session
        # would get these credentials, or this one another's.
        hadoop = {**hadoop, "fs.s3a.impl.disable.cache": "true", "fs.s3.impl.disable.cache": "true"}
    return {**lake.spark_catalog_conf(include_secret=include_secret), **hadoop}


@contextmanager
def session_conf(spark: SparkSession, conf: dict[str, str]) -> Iterator[None]:
    """SQL settings for the statements run inside, restored afterwards (unset if they were)."""
    prev = {k: spark.conf.get(k, None) for k in conf}
    for k, v in conf.items():
        spark.conf.set(k, v)
    try:
        yield
    finally:
        for k, old in prev.items():
            spark.conf.set(k, old) if old is not None else spark.conf.unset(k)


def attach_lake(spark: SparkSession, lake: LakeSettings) -> None:
    """Make a second lake (another catalog name) usable in a running session: catalogs are
    created on first use."""
    set_session(spark, lake_conf(lake))


def set_session(spark: SparkSession, conf: SparkSettings) -> None:
    """Settings into the running session (over the Connect channel, or into a classic session's
    SQL conf), secrets revealed only here."""
    for k, v in conf.items():
        spark.conf.set(k, reveal(v))


def set_task_conf(spark: SparkSession, conf: dict[str, str]) -> None:
    """A task's own settings (the operator's `conf`) into its Spark Connect session. A running
    server takes SQL settings per session; settings a JVM reads at its start (executor or driver
    memory, jars, ...) it refuses, and the error says where they go instead."""
    for k, v in conf.items():
        try:
            spark.conf.set(k, v)
        except Exception as exc:
            if "CANNOT_MODIFY_CONFIG" not in str(exc) and "static" not in str(exc).lower():
                raise
            raise ValueError(
                f"task conf {k!r}: a running Spark Connect server cannot take it per session (Spark reads it "
                "when the server starts). Set it in the server's own settings, or run this task by "
                "spark-submit (a `spark` connection instead of `spark_connect`)"
            ) from exc


def builder_settings(conf: SparkSettings) -> tuple[dict[str, str], SparkSettings]:
    """(settings a new classic JVM may start with, settings to set once it runs). pyspark starts a
    JVM with every builder setting as a `--conf k=v` argument, which any local user can read
    (/proc/<pid>/cmdline, ps): secrets (by origin, or named like one: secrecy.is_secret_setting)
    wait for the session, and Spark redacts their keys in its UI, event logs and SQL pages."""
    secrets = {k: v for k, v in conf.items() if is_secret_setting(k, v)}
    public = {k: reveal(v) for k, v in conf.items() if k not in secrets}
    return {**public, "spark.redaction.regex": SERVER_REDACTION_REGEX + "|" + spark_redaction_regex(secrets)}, secrets


# --- Spark Connect ---------------------------------------------------------------------------------


def connect_server_argv(
    workdir: Path, port: int, ui_port: int, memory: str, *, token: str, ui: bool = True
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a local Spark Connect server: its settings in a 0600
    properties file in `workdir` (public ones only: the lake and its secrets come per session);
    the token every client must send in its environment (runtime.connect_auth). `ui`: its web
    UI, which every local user can read (job and session pages), on or off."""
    import pyspark

    from cdc_lakehouse.runtime.connect_auth import SERVER_TOKEN_ENV

    conf = {
        **server_conf(),
        "spark.master": os.environ.get("CDC_SPARK_MASTER", "local[*]"),
        "spark.app.name": "cdc-spark-connect",
        "spark.jars": ",".join(default_jars()),
        "spark.driver.memory": memory,
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.connect.grpc.binding.port": str(port),
        "spark.ui.enabled": str(ui).lower(),
        "spark.ui.port": str(ui_port),
        "spark.driver.host": "127.0.0.1",
        # An event log for the history server (and for the secret-marker tests: it records every
        # session's SQL settings, redacted by SERVER_REDACTION_REGEX like the UI).
        "spark.eventLog.enabled": "true",
        "spark.eventLog.dir": (workdir / "events").as_uri(),
    }
    (workdir / "events").mkdir(mode=0o700, parents=True, exist_ok=True)
    props = workdir / "spark-connect.properties"
    fd = os.open(props, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.writelines(f"{k}={v}\n" for k, v in sorted(conf.items()))
    submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
    argv = [str(submit), "--class", CONNECT_SERVER_CLASS, "--properties-file", str(props), "spark-internal"]
    # Python UDFs (the serving export's writers, the Debezium conversion) run in worker processes
    # of this Python, which has the project's dependencies; the package itself comes per session
    # as an artifact (configure_session).
    # The secrets of the process that starts it stay out of its environment (which its Python UDFs
    # inherit): every session brings its own settings and secrets (configure_session).
    env = {k: v for k, v in os.environ.items() if not SERVER_ENV_DROPPED.search(k)}
    return argv, {**env, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1", SERVER_TOKEN_ENV: token}


# Variables a local Spark Connect server does not inherit: secrets by name or by origin (Airflow's
# connections and its metadata database URL, the sources' URIs, the secrets file of a task), AWS
# keys among them (#51: whoever reached the server read its starter's). A lake's S3 keys come per
# session; a lake without keys of its own uses the SDK's chain without them: AWS_PROFILE and the
# shared credentials file (readable by its owner only), or the machine's role.
SERVER_ENV_DROPPED = re.compile(
    r"(?i)password|secret|token|credential|^AWS_ACCESS_KEY_ID$|^AIRFLOW_CONN_|^AIRFLOW__DATABASE__|"
    r"^CDC_SOURCE_URI|^CDC_SECRETS_FILE$|^CDC_SPARK_CONNECT_TOKEN_FILE$"
)


_LIVE: list[SparkSession] = []  # this process's Connect sessions, for interrupt_all


def connect_session(url: str) -> SparkSession:
    """A new session on a Spark Connect server (its own settings, views and catalog instances):
    on loopback, only the expected user's server, with the token (runtime.connect_auth)."""
    from pyspark.sql import SparkSession

    from cdc_lakehouse.runtime.connect_auth import client_url

    release_pool_without_waiting()
    spark = SparkSession.builder.remote(client_url(url)).create()
    _LIVE.append(spark)
    return spark


def release_pool_without_waiting() -> None:
    """pyspark 4.1's Spark Connect client shuts its process-wide pool of ReleaseExecute calls down
    whenever a session's client closes (SparkSession.stop, and SparkSession.__del__ when the
    garbage collector takes a session), and joins the pool's threads while holding the pool's
    lock. When the collector runs a session's __del__ in one of those threads, that thread waits
    for the lock and the closing thread waits for it: both hang. The suite's warm-up test hung so
    for 20 minutes (2026-11-29), until pytest's timeout interrupted the join; a group run's
    worker sessions can meet it the same way. Upstream: apache/spark#54145 (SPARK-55362: do not
    wait) and apache/spark#54189 (SPARK-55406: a pool per use), after 4.1. Here, for 4.1: the
    pool is taken out under the lock and left to the collector, not shut down: even
    `shutdown(wait=False)` takes the pool's own lock, which a thread in the middle of submitting
    to it holds, and the collector can run a session's __del__ right there (a fresh clone's suite
    hung so on 2026-11-30: py-spy showed ThreadPoolExecutor.submit -> SparkSession.__del__ ->
    shutdown, one thread waiting for itself). The pool is taken out without the iterator's lock
    either: `_release_until` holds that lock while submit starts a thread, and the collector can
    run a session's __del__ in the new thread before it signals that it started (CI on 29dd126,
    2026-12-01: Thread._bootstrap -> SparkSession.__del__ -> shutdown waiting for the lock, the
    submitting thread waiting in Thread.start). One attribute store needs no lock, but pyspark's
    `_get_or_create_release_thread_pool` reads the attribute twice and could return the None a
    store left between the reads (its callers would then fail the query on None._shutdown); the
    shim's version reads it once and always returns a pool. A caller that reads None before
    asking skips its release, which the server makes up for (below). An idle pool's threads end
    when it is collected (concurrent.futures wakes them from a weakref callback), after the calls
    already queued; the server releases what an unsent ReleaseExecute would have (it drops
    abandoned executions)."""
    from concurrent.futures import ThreadPoolExecutor

    import pyspark
    from pyspark.sql.connect.client.reattach import ExecutePlanResponseReattachableIterator as Reattachable

    if not pyspark.__version__.startswith("4.1.") or getattr(Reattachable.shutdown, "_cdc_no_wait", False):
        return

    def shutdown(cls: type[Reattachable]) -> None:
        cls._release_thread_pool_instance = None

    def get_or_create(cls: type[Reattachable]) -> ThreadPoolExecutor:
        pool = cls._release_thread_pool_instance
        if pool is not None:
            return pool
        with cls._lock:
            pool = cls._release_thread_pool_instance
            if pool is None:
                pool = cls._release_thread_pool_instance = ThreadPoolExecutor(max_workers=os.cpu_count() or 8)
            return pool

    shutdown._cdc_no_wait = True  # type: ignore[attr-defined]
    Reattachable.shutdown = classmethod(shutdown)  # type: ignore[method-assign,assignment]
    Reattachable._get_or_create_release_thread_pool = classmethod(get_or_create)  # type: ignore[method-assign,assignment]


# Connect session id -> (its server's url, the settings get_spark gave it): what worker_session
# makes a sibling session of.
_MADE: dict[str, tuple[str, dict[str, str] | None]] = {}


def worker_session(spark: SparkSession, lake: LakeSettings) -> SparkSession:
    """Another session of the same Spark, for a worker thread of a job that runs its tables at
    once (jobs.runner): settings, temp views and catalog instances of its own, so one table's
    session settings (the MERGE's distribution mode, a colocated join's) never reach another's
    statements. On Spark Connect a new session on the same server, set up as get_spark sets one up;
    on a classic driver a new session of the same SparkContext, with the lake's settings again
    (they are session settings, which a new session does not inherit). End it with
    release_worker."""
    made = _MADE.get(_connect_id(spark) or "")
    if made is not None:
        url, extra = made
        worker = connect_session(url)
        configure_session(worker, lake, extra)
        _MADE[_connect_id(worker) or ""] = made
        return worker
    worker = spark.newSession()
    set_session(worker, {k: v for k, v in {**sql_conf(), **lake_conf(lake)}.items() if _session_setting(k)})
    return worker


def _connect_id(spark: SparkSession) -> str | None:
    """A Spark Connect session's id (None for a classic session)."""
    return getattr(spark, "session_id", None)


def _session_setting(key: str) -> bool:
    return not key.startswith("spark.") or key.startswith("spark.sql.")


def release_worker(spark: SparkSession) -> None:
    """The end of a worker_session: a Connect session is released on its server; a classic one is
    left to the garbage collector (stopping it would stop the SparkContext every session shares)."""
    if _connect_id(spark) is not None:
        release_spark(spark)


def interrupt_all() -> None:
    """Stop the Spark work of this process's Connect sessions on their server (a killed task)."""
    for spark in list(_LIVE):
        try:
            spark.interruptAll()
        except Exception:  # noqa: BLE001, S110 - best effort: the session may be gone already
            pass


def configure_session(spark: SparkSession, lake: LakeSettings, extra: dict[str, str] | None = None) -> None:
    """A Connect session's own settings, the lake's catalog with its secrets, and the package for
    the Python functions Spark runs on the server (shipped as an artifact of the session)."""
    from cdc_lakehouse.runtime.packaging import pyfiles_zip

    own = json.loads(os.environ.get(SESSION_CONF_ENV) or "{}")
    set_session(spark, {**sql_conf(), **lake_conf(lake), **(extra or {})})
    set_task_conf(spark, own)
    with _ARTIFACTS:
        spark.addArtifacts(str(pyfiles_zip()), pyfile=True)


# pyspark's addArtifacts calls importlib.invalidate_caches(), which deletes stale entries of
# sys.path_importer_cache while iterating it: two threads at once (a group run's workers opening
# their sessions, jobs.runner) fail one with KeyError '<...>/python311.zip' (seen in CI, 2026-11-29;
# the same race: saltstack/salt#69790). One at a time.
_ARTIFACTS = threading.Lock()


def _snapshots_by_pyiceberg(lake: LakeSettings) -> None:
    """Snapshot metadata read by pyiceberg where it has the lake's catalog (runtime.catalogs)."""
    from cdc_lakehouse.runtime.catalogs import read_with_pyiceberg

    if os.environ.get("CDC_SNAPSHOTS_BY_SPARK") == "1":  # the metadata tables (A/B; a catalog pyiceberg misreads)
        return
    try:
        props = lake.pyiceberg_properties()
    except ValueError:  # a catalog type pyiceberg has not: the metadata tables
        return
    read_with_pyiceberg(lake.catalog_name, props)


# --- the factory ----------------------------------------------------------------------------------


def get_spark(
    app_name: str,
    lake: LakeSettings,
    *,
    remote: str | None = None,
    classic: bool = False,
    master: str | None = None,
    jars: list[str] | None = None,
    extra: dict[str, str] | None = None,
    driver_memory: str | None = None,
) -> SparkSession:
    """A session for `lake`: on the Spark Connect server at `remote` (default CDC_SPARK_REMOTE),
    else a classic one (the running JVM under spark-submit, or a new local one). `classic`: a
    local JVM of its own whatever the environment says (the benchmarks: its memory, its UI and
    its status store are theirs to measure)."""
    # Under spark-submit the JVM is this job's own: the server a task's environment names is not.
    under_submit = "PYSPARK_GATEWAY_PORT" in os.environ
    url = None if classic or under_submit else remote or os.environ.get(REMOTE_ENV)
    _snapshots_by_pyiceberg(lake)
    if url:
        spark = connect_session(url)
        configure_session(spark, lake, extra)
        _MADE[_connect_id(spark) or ""] = (url, extra)
        return spark
    return _classic(app_name, lake, master=master, jars=jars, extra=extra, driver_memory=driver_memory)


def _classic(
    app_name: str,
    lake: LakeSettings,
    *,
    master: str | None,
    jars: list[str] | None,
    extra: dict[str, str] | None,
    driver_memory: str | None,
) -> SparkSession:
    from pyspark.sql import SparkSession

    # pyspark marks a process that made a Connect session (SPARK_CONNECT_MODE_ENABLED, inherited by
    # its children: spark-submit, a script it starts) and then refuses a classic session in it.
    os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)
    builder = SparkSession.builder.appName(app_name)
    under_submit = "PYSPARK_GATEWAY_PORT" in os.environ  # the JVM exists, launched by spark-submit
    if not under_submit:
        builder = builder.master(master or os.environ.get("CDC_SPARK_MASTER", "local[*]"))
        jar_list = default_jars() if jars is None else jars
        if jar_list:
            builder = builder.config("spark.jars", ",".join(jar_list))
        builder = builder.config(
            "spark.driver.memory", driver_memory or os.environ.get("CDC_SPARK_DRIVER_MEMORY", "4g")
        )
    session = {**sql_conf(), **lake_conf(lake), **(extra or {})}
    start, _ = builder_settings({**server_conf(), **(extra or {}), **session})
    for k, v in start.items():
        if k.startswith("spark.") and not k.startswith("spark.sql.catalog."):
            builder = builder.config(k, v)
    spark = builder.getOrCreate()
    # The lake's settings (secrets among them) into the running session: catalogs are created on
    # first use and read them then (tests/integration/test_secrets.py).
    set_session(spark, {k: v for k, v in session.items() if _session_setting(k)})
    spark.sparkContext.setLogLevel(os.environ.get("CDC_SPARK_LOG_LEVEL", "WARN"))
    return spark


def release_spark(spark: SparkSession) -> None:
    """The end of a job: its session goes (on a Connect server, the server's session is released)."""
    if spark in _LIVE:
        _LIVE.remove(spark)
    _MADE.pop(_connect_id(spark) or "", None)
    spark.stop()


def release_all() -> None:
    """End every Connect session of this process, before its server goes: pyspark's client
    releases each checkpointed frame when Python collects it, and against a server that is gone it
    retries with backoff, which held a finished test run at its exit for minutes."""
    for spark in list(_LIVE):
        try:
            release_spark(spark)
        except Exception:  # noqa: BLE001, S110 - best effort: the session may be gone already
            pass
