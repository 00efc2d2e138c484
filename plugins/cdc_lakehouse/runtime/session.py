"""The one SparkSession factory for jobs and tests.

Iceberg extensions and catalog, UTC, and settings sized for a small machine (2 cores):
few shuffle partitions, adaptive execution on. Under spark-submit the JVM already runs
with --jars and --conf; the same settings are applied here so a job started any other way
(tests, `python spark_jobs/x.py`) behaves the same.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from cdc_lakehouse.settings import LakeSettings, local_paths

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

ICEBERG_EXTENSIONS = "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions"
REDACTION_REGEX = r"(?i)secret|password|passwd|token|access[._-]?key|credential|authorization|private[._-]?key"


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
        # The UI's environment tab, event logs and history server show runtime-set confs too (the
        # catalog password, S3 keys set by get_spark): redact every credential-like key. Spark's
        # default, (?i)secret|password|token|access[.]key, misses Iceberg's s3.access-key-id.
        "spark.redaction.regex": REDACTION_REGEX,
        "spark.driver.extraJavaOptions": "-Duser.timezone=UTC",
        "spark.executor.extraJavaOptions": "-Duser.timezone=UTC",
    }


def spark_conf(
    lake: LakeSettings, *, include_secret: bool = True, shuffle_partitions: int | None = None
) -> dict[str, str]:
    conf = base_conf(shuffle_partitions)
    conf.update(lake.spark_catalog_conf(include_secret=include_secret))
    conf.update({f"spark.hadoop.{k}": v for k, v in lake.hadoop_s3_conf(include_secret).items()})
    return conf


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
    for k, v in lake.spark_catalog_conf().items():
        spark.conf.set(k, v)
    hconf = spark.sparkContext._jsc.hadoopConfiguration()
    for k, v in lake.hadoop_s3_conf().items():
        hconf.set(k, v)


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
    for k, v in {**spark_conf(lake), **(extra or {})}.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("CDC_SPARK_LOG_LEVEL", "WARN"))
    return spark
