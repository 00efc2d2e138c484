"""Warm a freshly started Spark Connect server before the first task reaches it.

A new server's first ingest took 27.7 s where the next took 12.8 s (bench/task_bench.py,
docs/benchmarks-history.md "Spark Connect: the first task on a new server"): the JVM loads and compiles
Spark's planner, Iceberg's write path and the Parquet writers on first use. warm_server runs the
ingest's kinds of work once on a scratch catalog of its own (a Hadoop catalog in a local folder),
so none of it touches a lake and no secret is needed: a Parquet read, the per-key window, an
Iceberg append, a merge-on-read MERGE under an LSN guard and a read of the snapshots table.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)

CATALOG = "cdc_warmup"
ROUNDS = 2  # the second round runs what the first compiled: the JIT's hot methods get there


def warm_server(url: str, workdir: Path, rows: int = 20_000) -> float:
    """Run the warm-up on the server at `url`, in a session of its own; returns its seconds.
    workdir: a folder for the scratch catalog, emptied before and after. The server writes there
    and this process removes it, so it must be a folder both see: a server on this host (the
    local stack's, a team's single-machine server)."""
    from cdc_lakehouse.runtime.session import connect_session, release_spark

    started = time.monotonic()
    scratch = Path(workdir) / "warmup"
    shutil.rmtree(scratch, ignore_errors=True)
    spark = connect_session(url)
    try:
        _scratch_catalog(spark, scratch)
        for i in range(ROUNDS):
            _one_round(spark, scratch, rows, i)
    finally:
        release_spark(spark)
        shutil.rmtree(scratch, ignore_errors=True)
    seconds = time.monotonic() - started
    log.info("Spark Connect server %s warmed up in %.1fs", url, seconds)
    return seconds


def _scratch_catalog(spark: SparkSession, scratch: Path) -> None:
    for k, v in {
        "": "org.apache.iceberg.spark.SparkCatalog",
        ".type": "hadoop",
        ".warehouse": f"file://{scratch}/warehouse",
    }.items():
        spark.conf.set(f"spark.sql.catalog.{CATALOG}{k}", v)


def _one_round(spark: SparkSession, scratch: Path, rows: int, i: int) -> None:
    """One pass of the ingest's kinds of work on a table of `rows` rows and a batch of a tenth."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    table = f"{CATALOG}.w.t{i}"
    spark.sql(
        f"CREATE TABLE {table} (shard string, k bigint, v string, lsn bigint, seq bigint) USING iceberg "
        "PARTITIONED BY (shard) TBLPROPERTIES ('format-version'='2', 'write.merge.mode'='merge-on-read', "
        "'write.update.mode'='merge-on-read', 'write.delete.mode'='merge-on-read')"
    )

    def rows_of(n: int, lsn: int) -> DataFrame:
        return spark.range(n).select(
            F.concat(F.lit("s"), (F.col("id") % 2).cast("string")).alias("shard"),
            F.col("id").alias("k"),
            F.sha2(F.col("id").cast("string"), 256).alias("v"),
            F.lit(lsn).cast("bigint").alias("lsn"),
            (F.col("id") % 7).alias("seq"),
        )

    rows_of(rows, 1).writeTo(table).append()
    events = scratch / f"events{i}"
    rows_of(rows // 10, 2).union(rows_of(rows // 10, 3)).write.parquet(str(events))
    w = Window.partitionBy("shard", "k").orderBy(F.col("lsn").desc(), F.col("seq").desc())
    batch = spark.read.parquet(str(events)).withColumn("_rn", F.row_number().over(w)).filter("_rn = 1").drop("_rn")
    batch.createOrReplaceTempView("cdc_warmup_batch")
    spark.sql(
        f"MERGE INTO {table} t USING cdc_warmup_batch s ON t.shard = s.shard AND t.k = s.k "
        "WHEN MATCHED AND (s.lsn > t.lsn OR (s.lsn = t.lsn AND s.seq > t.seq)) THEN UPDATE SET * "
        "WHEN NOT MATCHED THEN INSERT *"
    )
    spark.sql(f"SELECT snapshot_id, summary FROM {table}.snapshots").collect()
    spark.table(table).groupBy("shard").count().collect()
    spark.sql(f"DROP TABLE {table} PURGE")
