"""Three ways to compute a batch once and count it on Spark Connect, side by side: a lazy local
checkpoint filled by the observed pass that counts it (runtime.phases.checkpoint_counted: what
ingest.batch.fused_batch and the classification do), an eager local checkpoint then an observed
pass over the kept rows (what they did before, issue #56), and a persisted plan observed by the
no-op write that fills its cache. Spark Connect delivers no observed metrics to a checkpoint
itself.

    python bench/observe_bench.py [--rows 200000] [--repeat 3]

The batch stands for the ingest's: `--rows` events of 12 text columns over rows/3 keys, a
window per key (lead, lag), then one later use of the kept rows (a filter and a no-op write).
Per repeat and way: seconds (compute, count, use) and Spark jobs (runtime.phases.SparkJobs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "plugins"), str(ROOT)]
from bench.measure import machine  # noqa: E402

WORK = Path(os.environ.get("CDC_BENCH_WORK", HERE / ".work"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    from cdc_lakehouse.runtime.connect_auth import TOKEN_FILE_ENV
    from cdc_lakehouse.runtime.phases import SparkJobs, checkpoint_counted, local_checkpoint, observed_counts
    from cdc_lakehouse.runtime.session import connect_session
    from pyspark import StorageLevel
    from pyspark.sql import Observation, Window
    from pyspark.sql import functions as F

    from devstack.localstack import LocalSparkConnect

    print(machine())
    server = LocalSparkConnect(WORK / "observe-connect", memory="3g")
    server.start()
    os.environ[TOKEN_FILE_ENV] = str(server.token_file)
    try:
        spark = connect_session(server.url)
        spark.conf.set("spark.sql.shuffle.partitions", "4")
        n = args.rows
        text = [F.concat(F.lit("v"), F.col("id").cast("string"), F.lit("x" * 40)).alias(f"c{i}") for i in range(12)]
        base = spark.range(n).select((F.col("id") % max(1, n // 3)).alias("k"), F.col("id").alias("lsn"), *text)

        def batch():
            w = Window.partitionBy("k").orderBy("lsn")
            return base.withColumn("latest", F.lead("lsn").over(w).isNull()).withColumn("prev", F.lag("c0").over(w))

        def counters():
            return F.count(F.lit(1)).alias("n"), F.sum(F.col("latest").cast("int")).alias("latest")

        def use(df) -> None:
            df.filter("latest").select("k", "c0").write.format("noop").mode("overwrite").save()

        def checkpointed() -> dict:
            kept = local_checkpoint(batch())
            seen = observed_counts(kept, *counters())
            use(kept)
            return seen

        def counted_checkpoint() -> dict:
            kept, seen = checkpoint_counted(batch(), *counters())
            use(kept)
            return seen

        def persisted() -> dict:
            obs = Observation(f"bench_{time.monotonic_ns()}")
            kept = batch().persist(StorageLevel.MEMORY_AND_DISK)
            try:
                kept.observe(obs, *counters()).write.format("noop").mode("overwrite").save()
                use(kept)
                return obs.get
            finally:
                kept.unpersist(blocking=True)

        ways = {
            "lazy checkpoint counted": counted_checkpoint,
            "checkpoint+count": checkpointed,
            "persist+observe": persisted,
        }
        times: dict[str, list[float]] = {name: [] for name in ways}
        for rep in range(args.repeat):
            for name, way in ways.items():
                t = time.perf_counter()
                with SparkJobs(spark, name) as jobs:
                    seen = way()
                s = time.perf_counter() - t
                times[name].append(s)
                print(f"repeat {rep + 1}: {name}: {s:.2f} s, {jobs.count} Spark jobs, counts {seen}", flush=True)
        for name, ts in times.items():
            warm = ts[1:] or ts
            print(f"{name}: warm median {statistics.median(warm):.2f} s (first {ts[0]:.2f} s)")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
