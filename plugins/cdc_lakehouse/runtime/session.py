"""The one SparkSession factory for jobs and tests.

Iceberg extensions and catalog, UTC, and settings sized for a small machine (2 cores):
few shuffle partitions, adaptive execution on. Under spark-submit the JVM already runs
with --jars and --conf; the same settings are applied here so a job started any other way
(tests, `python spark_jobs/x.py`) behaves the same.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from cdc_lakehouse.secrecy import SPARK_REDACTION_REGEX, Secret, is_secret_setting, reveal, spark_redaction_regex
from cdc_lakehouse.settings import LakeSettings, local_paths

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

ICEBERG_EXTENSIONS = "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions"
SparkSettings = dict[str, "str | Secret"]  # secret values are Secrets (cdc_lakehouse.secrecy)


def default_jars() -> list[str]:
    """CDC_SPARK_JARS (comma-separated paths) or the jars scripts/fetch_jars.sh cached."""
    env = os.environ.get("CDC_SPARK_JARS")
    if env:
        return [j for j in env.split(",") if j]
    return sorted(glob.glob(str(local_paths()["jars"] / "*.jar")))


def base_conf(shuffle_partitions: int | None = None) -> dict[str, str]:
    cores = os.cpu_count() or 2
    return {
        "spark.sql.extensions": ICEBERG_EXTENSIONS,
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.shuffle.partitions": str(shuffle_partitions or max(4, cores * 2)),
        "spark.default.parallelism": str(max(4, cores * 2)),
        "spark.sql.adaptive.enabled": "true",
        "spark.sql.adaptive.coalescePartitions.enabled": "true",
        # Landing files are small and many; let Spark pack them into few tasks.
        "spark.sql.files.maxPartitionBytes": str(128 * 1024 * 1024),
        "spark.sql.files.openCostInBytes": str(1024 * 1024),
        # Failed casts must yield NULL so validation can detect and quarantine them.
        "spark.sql.ansi.enabled": "false",
        "spark.sql.legacy.timeParserPolicy": "CORRECTED",
        "spark.sql.parquet.int96RebaseModeInWrite": "CORRECTED",
        "spark.sql.parquet.datetimeRebaseModeInWrite": "CORRECTED",
        "spark.sql.parquet.datetimeRebaseModeInRead": "CORRECTED",
        "spark.serializer": "org.apache.spark.serializer.KryoSerializer",
        "spark.ui.showConsoleProgress": "false",
        # Spark keeps 100 generated classes; one ingest's MERGE, writes and meta tables generate
        # more, so the next run's fused plan recompiled and ran its new classes unwarmed (about 2 s
        # of its 6 s, measured; see BENCHMARKS.md). A long-lived JVM (job server) keeps them all.
        "spark.sql.codegen.cache.maxEntries": "1000",
        # The UI's environment tab, event logs and history server show runtime-set confs too (the
        # catalog password, S3 keys set by get_spark): redact every credential-like key. Spark's
        # default, (?i)secret|password|token|access[.]key, misses Iceberg's s3.access-key-id.
        # get_spark adds the keys of the settings that are secret by origin only.
        "spark.redaction.regex": SPARK_REDACTION_REGEX,
        "spark.driver.extraJavaOptions": "-Duser.timezone=UTC",
        "spark.executor.extraJavaOptions": "-Duser.timezone=UTC",
    }


def spark_conf(
    lake: LakeSettings, *, include_secret: bool = True, shuffle_partitions: int | None = None
) -> SparkSettings:
    return {**base_conf(shuffle_partitions), **lake_conf(lake, include_secret=include_secret)}


def lake_conf(lake: LakeSettings, *, include_secret: bool = True) -> SparkSettings:
    """The lake's catalog and its Hadoop (S3A) settings, as Spark configuration."""
    hadoop = {f"spark.hadoop.{k}": v for k, v in lake.hadoop_s3_conf(include_secret).items()}
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
        for k, v in prev.items():
            spark.conf.set(k, v) if v is not None else spark.conf.unset(k)


def attach_lake(spark: SparkSession, lake: LakeSettings) -> None:
    """Make a second lake (another catalog name) usable in a running session: catalogs are
    created on first use, and new Hadoop FileSystem instances read the live Hadoop conf."""
    set_live(spark, lake_conf(lake))


def builder_settings(conf: SparkSettings) -> tuple[dict[str, str], SparkSettings]:
    """(builder settings, settings to set live). pyspark starts a JVM with every builder setting as
    a `--conf k=v` argument, which any local user can read (/proc/<pid>/cmdline, ps): the secrets
    (by origin, or named like one: secrecy.is_secret_setting) are set once the session runs.
    Catalogs are created on first use and read them then (tests/integration/test_secrets.py).
    Spark redacts their keys in its UI, event logs and SQL pages, the innocently named ones too."""
    secrets = {k: v for k, v in conf.items() if is_secret_setting(k, v)}
    public = {k: v for k, v in conf.items() if k not in secrets}
    return {**public, "spark.redaction.regex": spark_redaction_regex(secrets)}, secrets


def set_live(spark: SparkSession, conf: SparkSettings) -> None:
    """Settings into a running session: `spark.hadoop.*` into the SparkContext's Hadoop conf (new
    FileSystem instances and every later job's copy read it), the rest into the session's conf."""
    hconf = spark.sparkContext._jsc.hadoopConfiguration()
    for k, v in conf.items():
        if k.startswith("spark.hadoop."):
            hconf.set(k[len("spark.hadoop.") :], reveal(v))
        elif k.startswith("spark.sql."):
            spark.conf.set(k, reveal(v))
        else:  # a Spark core setting (spark.ssl.*, spark.authenticate.secret) is fixed at start
            raise ValueError(f"{k} cannot be set in a running session: give it to spark-submit's configuration")


# Set by the job server (runtime.server) in its process: jobs then get a new session of its one
# long-lived SparkContext instead of starting a JVM.
_SHARED: SparkSession | None = None


def share_session(spark: SparkSession | None) -> None:
    """Make get_spark hand out new sessions of `spark` (None: back to one session per process)."""
    global _SHARED
    _SHARED = spark


def release_spark(spark: SparkSession) -> None:
    """The end of a job: stop its session, unless it is one of the job server's (the SparkContext
    outlives the job there; the server drops what the job cached)."""
    if not getattr(spark, "_cdc_job_session", False):
        spark.stop()
        return
    try:
        _close_catalogs(spark)
    except Exception as exc:  # noqa: BLE001 - the job's work stands; a pool stays open
        logging.getLogger(__name__).warning("could not close the job session's Iceberg catalogs: %s", exc)


def _close_catalogs(spark: SparkSession) -> None:
    """Close the Iceberg catalogs a job session opened: each holds a JDBC pool to the catalog
    database that nothing else closes (one connection more per job on the job server otherwise,
    measured). Iceberg's CachingCatalog keeps the closeable catalog in a private field."""
    jvm = spark.sparkContext._jvm
    manager = spark._jsparkSession.sessionState().catalogManager()
    closeable = jvm.java.lang.Class.forName("java.io.Closeable")
    for name in getattr(spark, "_cdc_catalogs", ()):
        if not manager.isCatalogRegistered(name):
            continue  # never used by the job: nothing was opened
        catalog = manager.catalog(name)
        if catalog.getClass().getName() != "org.apache.iceberg.spark.SparkCatalog":
            continue
        inner = catalog.icebergCatalog()
        if inner.getClass().getName() == "org.apache.iceberg.CachingCatalog":
            field = inner.getClass().getDeclaredField("catalog")
            field.setAccessible(True)
            inner = field.get(inner)
        if closeable.isInstance(inner):
            inner.close()


def _job_session(conf: SparkSettings) -> SparkSession:
    """A new session of the shared SparkContext: its own SQL settings, temporary views and catalog
    instances, so Iceberg's table cache starts empty and sees every commit made since the last job
    (by this server or any other writer). Static settings (extensions, master, jars) are the
    server's; the rest of `conf` is applied. Made the thread's active session because Iceberg's
    procedures find their session with SparkSession.active() on the JVM side."""
    assert _SHARED is not None
    # Hadoop settings (the landing's S3 keys and endpoint) belong to the SparkContext and its cached
    # FileSystem instances, not to a session: a job that needs other ones than the server started
    # with cannot run there.
    hconf = _SHARED.sparkContext._jsc.hadoopConfiguration()
    differ = sorted(
        k
        for k, v in conf.items()
        if k.startswith("spark.hadoop.") and hconf.get(k[len("spark.hadoop.") :]) != reveal(v)
    )
    if differ:
        raise ValueError(
            f"the job server's Hadoop settings differ from this job's ({', '.join(differ)}): restart the "
            "server from the tasks' environment, or unset CDC_SPARK_SERVER to run the job by spark-submit"
        )
    spark = _SHARED.newSession()
    spark._cdc_job_session = True  # type: ignore[attr-defined]
    spark._cdc_catalogs = sorted(  # type: ignore[attr-defined]
        {k.split(".")[3] for k in conf if k.startswith("spark.sql.catalog.") and k.count(".") == 3}
    )
    # A new session starts from the server's SparkConf: catalog settings of the lake the server was
    # started with must not fill in what this job's lake leaves unset (a password, an io-impl).
    own = {k for k in conf if k.startswith("spark.sql.catalog.")}
    for k, _ in _SHARED.sparkContext.getConf().getAll():
        if k.startswith("spark.sql.catalog.") and k not in own:
            spark.conf.unset(k)
    for k, v in conf.items():
        if spark.conf.isModifiable(k) or k.startswith("spark.sql.catalog."):
            spark.conf.set(k, reveal(v))
    spark.sparkContext._jvm.org.apache.spark.sql.SparkSession.setActiveSession(spark._jsparkSession)
    return spark


def get_spark(
    app_name: str,
    lake: LakeSettings,
    *,
    master: str | None = None,
    jars: list[str] | None = None,
    extra: dict[str, str] | None = None,
    driver_memory: str | None = None,
) -> SparkSession:
    from pyspark.sql import SparkSession

    if _SHARED is not None:
        return _job_session({**spark_conf(lake), **(extra or {})})
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
    conf, secrets = builder_settings({**spark_conf(lake), **(extra or {})})
    for k, v in conf.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    set_live(spark, secrets)
    spark.sparkContext.setLogLevel(os.environ.get("CDC_SPARK_LOG_LEVEL", "WARN"))
    return spark
