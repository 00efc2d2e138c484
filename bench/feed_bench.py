"""The change feed (issue #19): reading the net changes of 1% changed keys against a full scan.

    python bench/feed_bench.py --rows 10000000 [--changed 0.01] [--repeat 3]   (make bench-feed)

The block-like table is built directly in a local Iceberg catalog (Hadoop catalog under
bench/.work/feed/), the way bootstrap and ingest leave it: the current table and its changelog
with the bootstrap's snapshot rows (op 'r', seq -1) and truncate markers (seq -2) at LSN 1000,
the `cdc.watermark` in the current table's commit; then one batch that changes `--changed` of
the keys (90% updates of `version`, 10% deletes), appended to the changelog at LSN 2000 and
MERGEd into the current table with the watermark moved to 3000 in the same commit. No PostgreSQL.

Timed (each `--repeat` times in one SparkSession, the first repeat reported apart, medians of
the rest; every read ends in Spark's `noop` sink, so all rows are produced and nothing written):
  feed           read_changes() from the offset at the bootstrap snapshot: changelog mode
  feed_diff      the same range through the feed's fallback (snapshot diff: both snapshots read
                 and hashed), what a rollback, a repair or a truncate in the range costs
  full_scan      every row of the table at the head snapshot (what a consumer without a feed reads)
The feed's result is checked: one row per changed key, the right number of upserts and deletes.
JSON in bench/results/feed-<rows>.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "plugins"), str(ROOT)]
from bench.measure import provenance  # noqa: E402

WORK = HERE / ".work" / "feed"
SHARDS = ["s0", "s1", "s2", "s3"]
COLS = [("id", "bigint"), ("space_id", "bigint"), ("type", "string"), ("version", "int"), ("content", "string")]
BASE_LSN, EVENT_LSN, HI_LSN = 1000, 2000, 3000


def table_cfg():
    from cdc_lakehouse.config import parse_table_config

    cfg, errs = parse_table_config(
        {
            "name": "block",
            "source": {"table": "block", "shards": [{"conn_id": "bench", "schemas": SHARDS}]},
            "primary_key": ["id"],
            "lake": {"namespace": "bench"},
        },
        "block.yaml",
    )
    assert not errs, errs
    return cfg


def _wm(lsn: int) -> str:
    from cdc_lakehouse.watermark import Watermark

    ts = datetime(2026, 6, 1, tzinfo=UTC).isoformat()
    return Watermark.from_dict({"v": 1, "shards": {f"bench.{s}": {"lsn": lsn, "ts": ts} for s in SHARDS}}).to_json()


def load(spark, lake, cfg, rows: int) -> None:
    """The bootstrap's two commits: changelog (snapshot rows + truncate markers), current table."""
    from cdc_lakehouse.columns import (
        COMMIT_TS_COL,
        INGESTED_COL,
        LSN_COL,
        LSN_EVENT_COL,
        OP_COL,
        RUN_COL,
        SEQ_COL,
        SHARD_COL,
    )
    from cdc_lakehouse.lake.tables import conform_to, create_lake_tables
    from pyspark.sql import functions as F

    create_lake_tables(spark, lake, cfg, COLS)
    cur, cl = lake.qualified(cfg.current_table), lake.qualified(cfg.changelog_table)
    t0 = F.lit(datetime(2026, 6, 1)).cast("timestamp")
    base = spark.range(rows).select(
        F.concat(F.lit("bench."), F.lit("s"), (F.col("id") % 4).cast("string")).alias(SHARD_COL),
        F.col("id"),
        (F.col("id") % 5000).alias("space_id"),
        F.element_at(F.array(*[F.lit(t) for t in ("text", "page", "to_do")]), (F.col("id") % 3 + 1).cast("int")).alias(
            "type"
        ),
        F.lit(1).alias("version"),
        F.concat(F.lit("line "), F.sha1(F.col("id").cast("string"))).alias("content"),
        F.lit("r").alias(OP_COL),
        F.lit(BASE_LSN).cast("bigint").alias(LSN_COL),
        F.lit(-1).cast("bigint").alias(SEQ_COL),
        t0.alias(COMMIT_TS_COL),
    )
    markers = spark.createDataFrame([(f"bench.{s}", BASE_LSN) for s in SHARDS], f"{SHARD_COL} string, {LSN_COL} bigint")
    markers = markers.select(
        "*", F.lit("t").alias(OP_COL), F.lit(-2).cast("bigint").alias(SEQ_COL), t0.alias(COMMIT_TS_COL)
    )
    events = markers.unionByName(base, allowMissingColumns=True).select(
        "*",
        F.col(LSN_COL).alias(LSN_EVENT_COL),
        F.lit("bootstrap").alias(RUN_COL),
        F.current_timestamp().alias(INGESTED_COL),
    )
    wm = _wm(BASE_LSN)
    conform_to(events, spark.table(cl).schema).writeTo(cl).option("distribution-mode", "none").option(
        "snapshot-property.cdc.watermark", wm
    ).append()
    conform_to(base, spark.table(cur).schema).writeTo(cur).option("snapshot-property.cdc.watermark", wm).append()


def change(spark, lake, cfg, share: float) -> dict[str, int]:
    """One ingest batch: `share` of the keys (by a hash of id), 90% updated and 10% deleted."""
    from cdc_lakehouse.columns import LSN_COL, LSN_EVENT_COL, OP_COL, RUN_COL, SEQ_COL
    from cdc_lakehouse.lake.commits import sql_with_commit_properties
    from cdc_lakehouse.lake.tables import conform_to
    from cdc_lakehouse.lake.writers import INGEST
    from pyspark.sql import functions as F

    cur, cl = lake.qualified(cfg.current_table), lake.qualified(cfg.changelog_table)
    buckets = 1_000_000
    h = F.pmod(F.xxhash64("id"), F.lit(buckets))
    picked = spark.table(cur).filter(h < int(share * buckets)).withColumn("_del", h < int(share * buckets / 10))
    ev = picked.select(
        *[c for c in spark.table(cur).columns if c not in ("version", OP_COL, LSN_COL, SEQ_COL)],
        (F.col("version") + 1).alias("version"),
        F.when(F.col("_del"), F.lit("d")).otherwise(F.lit("u")).alias(OP_COL),
        F.lit(EVENT_LSN).cast("bigint").alias(LSN_COL),
        F.lit(0).cast("bigint").alias(SEQ_COL),
        "_del",
    ).localCheckpoint(eager=True)
    cl_rows = ev.drop("_del").withColumn(LSN_EVENT_COL, F.col(LSN_COL)).withColumn(RUN_COL, F.lit("batch"))
    conform_to(cl_rows, spark.table(cl).schema).writeTo(cl).append()
    ev.createOrReplaceTempView("bench_feed_batch")
    sets = ", ".join(f"t.`{c}` = s.`{c}`" for c in spark.table(cur).columns)
    sql_with_commit_properties(
        spark,
        f"MERGE INTO {cur} t USING bench_feed_batch s ON t._cdc_shard = s._cdc_shard AND t.id = s.id "
        f"WHEN MATCHED AND s._del THEN DELETE WHEN MATCHED THEN UPDATE SET {sets}",
        {"cdc.watermark": _wm(HI_LSN), **INGEST.props()},  # as the ingest commits: lake.ranges trusts it
    )
    counts = ev.groupBy("_del").count().collect()
    return {("deletes" if r["_del"] else "updates"): r["count"] for r in counts}


def timed(fn) -> float:
    t = time.monotonic()
    fn()
    return time.monotonic() - t


def measure(spark, lake, cfg, since, head: int, repeat: int, expect: dict[str, int]) -> dict:
    from cdc_lakehouse.feed.models import FEED_OP_COL
    from cdc_lakehouse.feed.read import live_rows, net_rows, read_changes
    from cdc_lakehouse.lake.ranges import fingerprint_diff

    key = cfg.lake_key

    def feed() -> None:
        b = read_changes(spark, lake, cfg, "bench", since)
        assert b.range.mode == "changelog", b.range
        b.rows.write.format("noop").mode("overwrite").save()

    def feed_diff() -> None:
        lo, hi = live_rows(spark, lake, cfg, since.snapshot_id), live_rows(spark, lake, cfg, head)
        net_rows(fingerprint_diff(lo, hi, key), lo, hi, key, False).write.format("noop").mode("overwrite").save()

    def full_scan() -> None:
        live_rows(spark, lake, cfg, head).write.format("noop").mode("overwrite").save()

    got = read_changes(spark, lake, cfg, "bench", since).rows.groupBy(FEED_OP_COL).count().collect()
    got = {r[FEED_OP_COL]: r["count"] for r in got}
    assert got == {"upsert": expect["updates"], "delete": expect["deletes"]}, (got, expect)
    out = {}
    for name, fn in (("feed", feed), ("feed_diff", feed_diff), ("full_scan", full_scan)):
        runs = [timed(fn) for _ in range(repeat)]
        out[name] = {"first_s": round(runs[0], 2), "median_s": round(statistics.median(runs[1:] or runs), 2)}
        print(f"{name}: {json.dumps(out[name])}", flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--changed", type=float, default=0.01)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--driver-memory", default="6g")
    args = p.parse_args()
    from cdc_lakehouse.feed.models import FeedOffset
    from cdc_lakehouse.feed.read import plan
    from cdc_lakehouse.runtime.session import get_spark
    from cdc_lakehouse.settings import LakeSettings

    shutil.rmtree(WORK, ignore_errors=True)
    lake = LakeSettings(
        catalog_type="hadoop", catalog_name="lake", warehouse=f"file://{WORK}/wh", landing_uri=f"file://{WORK}/l"
    )
    spark = get_spark(
        "bench-feed", lake, classic=True, driver_memory=args.driver_memory, extra={"spark.ui.enabled": "false"}
    )
    cfg = table_cfg()
    t = time.monotonic()
    load(spark, lake, cfg, args.rows)
    first = plan(spark, lake, cfg, "bench", None)
    since = FeedOffset(
        consumer="bench", table=cfg.current_table, snapshot_id=first.snapshot_id, watermark=first.watermark
    )
    load_s = time.monotonic() - t
    expect = change(spark, lake, cfg, args.changed)
    head = plan(spark, lake, cfg, "bench", since).snapshot_id
    print(f"{args.rows:,} rows loaded in {load_s:.1f} s; batch {expect}", flush=True)
    res = {
        "rows": args.rows,
        "changed_share": args.changed,
        "batch": expect,
        **provenance(spark.version),
        "timings": measure(spark, lake, cfg, since, head, args.repeat, expect),
    }
    tm = res["timings"]
    res["full_scan_over_feed"] = round(tm["full_scan"]["median_s"] / tm["feed"]["median_s"], 2)
    print(f"full scan / feed: {res['full_scan_over_feed']}x", flush=True)
    path = HERE / "results" / f"feed-{args.rows}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(res, indent=2, default=str))
    spark.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
