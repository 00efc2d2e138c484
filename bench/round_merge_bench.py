"""One round of the chunked bootstrap at a given table size: its MERGE with and without the
round's key range (bootstrap.chunked.round_key_range), side by side.

    python bench/round_merge_bench.py --rows 10000000 --round-rows 200000 [--repeat 3]

The table (4 shards, key order, written once and kept in bench/.work) stands for what the earlier
rounds loaded; each MERGE applies the next round: `--round-rows` new keys above each shard's
highest, op 'r', through the chunked bootstrap's MERGE (lake.merge.merge_sql, LSN guard). Per
MERGE: seconds, and the data files its scan of the table kept and skipped (Iceberg's scan
metrics in the SQL UI, bench.measure.scan_files). Modes alternate within each repeat; every
MERGE adds its round, so the table grows by 2 x round-rows per repeat (said in the output).
Results go to bench/results/round-merge-*.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "plugins"), str(ROOT)]
from bench.ingest_bench import bench_table_config  # noqa: E402
from bench.measure import last_execution_id, machine, scan_files  # noqa: E402

WORK = Path(os.environ.get("CDC_BENCH_WORK", HERE / ".work"))
SHARDS = ["s0", "s1", "s2", "s3"]


def create_table(spark, table: str, rows: int) -> None:
    """`rows` rows over 4 shards, in key order within each shard (as rounds of chunks write them)."""
    from pyspark.sql import functions as F

    spark.sql(
        f"CREATE TABLE {table} (_cdc_shard string, id bigint, v string, _cdc_op string, _cdc_commit_lsn bigint, "
        "_cdc_seq bigint, _cdc_commit_ts timestamp) USING iceberg PARTITIONED BY (_cdc_shard) TBLPROPERTIES "
        "('format-version'='2', 'write.merge.mode'='merge-on-read', 'write.update.mode'='merge-on-read', "
        "'write.delete.mode'='merge-on-read', 'write.target-file-size-bytes'='33554432')"
    )
    per = rows // len(SHARDS)
    df = spark.range(rows).select(
        F.element_at(F.array(*[F.lit(s) for s in SHARDS]), (F.col("id") % len(SHARDS) + 1).cast("int")).alias(
            "_cdc_shard"
        ),
        (F.col("id") / len(SHARDS)).cast("bigint").alias("id"),
        F.repeat(F.lit("x"), 100).alias("v"),
        F.lit("r").alias("_cdc_op"),
        F.lit(100).cast("bigint").alias("_cdc_commit_lsn"),
        F.lit(-1).cast("bigint").alias("_cdc_seq"),
        F.current_timestamp().alias("_cdc_commit_ts"),
    )
    # Key ranges per file as the rounds leave them: one file holds one stretch of keys.
    df.repartitionByRange(max(rows // 200_000, 1), "_cdc_shard", "id").sortWithinPartitions("_cdc_shard", "id").writeTo(
        table
    ).append()
    print(f"created {table}: {rows} rows, {per} per shard")


def next_round(spark, table: str, round_rows: int):
    """round_rows new keys above each shard's highest key, as a round of chunks brings them."""
    from pyspark.sql import functions as F

    tops = {
        r["_cdc_shard"]: r["m"] for r in spark.table(table).groupBy("_cdc_shard").agg(F.max("id").alias("m")).collect()
    }
    per = round_rows // len(SHARDS)
    parts = [
        spark.range(tops[s] + 1, tops[s] + 1 + per).select(
            F.lit(s).alias("_cdc_shard"),
            F.col("id"),
            F.repeat(F.lit("y"), 100).alias("v"),
            F.lit("r").alias("_cdc_op"),
            F.lit(200).cast("bigint").alias("_cdc_commit_lsn"),
            F.lit(-1).cast("bigint").alias("_cdc_seq"),
            F.current_timestamp().alias("_cdc_commit_ts"),
        )
        for s in SHARDS
    ]
    frame = parts[0]
    for p in parts[1:]:
        frame = frame.unionByName(p)
    return frame.localCheckpoint()


def one_merge(spark, cfg, table: str, frame, ranged: bool) -> dict:
    from cdc_lakehouse.bootstrap.chunked import round_key_range
    from cdc_lakehouse.lake.merge import merge_sql

    started = time.monotonic()
    within = round_key_range(cfg, frame) if ranged else None  # its one small job counts in the time
    frame.createOrReplaceTempView("round_src")
    cols = ["_cdc_shard", "id", "v", "_cdc_op", "_cdc_commit_lsn", "_cdc_seq", "_cdc_commit_ts"]
    after = last_execution_id(spark)
    spark.sql(merge_sql(cfg, table, "round_src", cols, [], within))
    seconds = time.monotonic() - started
    scans = [s for s in scan_files(spark, after) if s.get("merge")]
    return {
        "mode": "range" if ranged else "whole table",
        "seconds": round(seconds, 2),
        "files_kept": sum(s.get("result_data_files", 0) for s in scans),
        "files_skipped": sum(s.get("skipped_data_files", 0) for s in scans),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--round-rows", type=int, default=200_000)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()

    from cdc_lakehouse.config import parse_table_config
    from cdc_lakehouse.runtime.session import get_spark
    from cdc_lakehouse.settings import LakeSettings

    lake = LakeSettings.from_env().with_(warehouse=f"file://{WORK}/warehouse")
    spark = get_spark(
        "bench-round-merge", lake, classic=True, driver_memory=os.environ.get("CDC_BENCH_DRIVER_MEMORY", "8g")
    )
    cfg, errs = parse_table_config(bench_table_config(f"round_merge_{args.rows}", "merge-on-read"), "bench")
    assert not errs, errs
    table = f"{lake.catalog_name}.bench.round_merge_{args.rows}"
    spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {lake.catalog_name}.bench")
    spark.sql(f"DROP TABLE IF EXISTS {table} PURGE")
    create_table(spark, table, args.rows)
    runs = []
    for i in range(args.repeat):
        for ranged in (i % 2 == 0, i % 2 != 0):
            r = one_merge(spark, cfg, table, next_round(spark, table, args.round_rows), ranged)
            r["repeat"] = i + 1
            print(json.dumps(r))
            runs.append(r)
    n = spark.table(table).count()
    expected = args.rows + 2 * args.repeat * (args.round_rows // len(SHARDS)) * len(SHARDS)
    assert n == expected, (n, expected)
    print(f"table after: {n} rows (checked)")
    for mode in ("whole table", "range"):
        xs = [r["seconds"] for r in runs if r["mode"] == mode]
        print(f"{mode:12s} median {statistics.median(xs):.2f} s over {xs}")
    out = HERE / "results" / f"round-merge-{args.rows}-{args.round_rows}.json"
    out.write_text(json.dumps({"machine": machine(), "args": vars(args), "runs": runs}, indent=2))
    spark.sql(f"DROP TABLE IF EXISTS {table} PURGE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
