"""The TOAST fill of a batch with a chain of key changes (issue #19): the graph step against the
pass-per-link fill it replaced.

    python bench/remap_bench.py --chain 1000 [--root table|batch] [--rows 100000] [--repeat 3] [--old-caps 32,none]

The batch: key 1 of a table of --rows rows (its large `content` only in the table) moves --chain
times (1 -> 10001 -> 10002 ...), one commit per move, each followed by an update of the new key
and of another key that leave `content` alone (unchanged TOAST). Both fills run on the same
events and the same Iceberg table in one Spark session, side by side; each repeat is timed and
checked (the chain's last key must get key 1's content, or count as unresolved).
  graph        cdc_lakehouse.ingest.toast.fill_with_stats (pointer jumping, ceil(log2(n)) passes)
  old-cap=C    the previous fill, copied below: one pass per link, at most C passes (32 in the
               code it replaced; "none" lifts the cap, which that code never did)
Results go to bench/results/remap-<chain>-<root>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "plugins"), str(ROOT)]
from bench.measure import provenance  # noqa: E402

WORK = Path(os.environ.get("CDC_BENCH_WORK", HERE / ".work")) / "remap"


# --- the pass-per-link fill as it was before issue #19 (ingest/toast.py), kept only here -----------


def old_fill(events, current, cfg, names, cap: int | None):
    from cdc_lakehouse.columns import LSN_COL, SEQ_COL, SHARD_COL
    from cdc_lakehouse.ingest import toast as T
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    key = [SHARD_COL, *cfg.primary_key]
    fkey = [SHARD_COL, *[f"_fill_key_{k}" for k in cfg.primary_key]]
    sub, rest = T._split_involved(events, key, fkey)
    sub = _old_generations(sub, key)
    earlier = Window.partitionBy(*key, "_unav_gen").orderBy(LSN_COL, SEQ_COL).rowsBetween(Window.unboundedPreceding, -1)
    f = (key, fkey, names, earlier)
    passes = [0]
    sub = _old_from_table(_old_propagate(sub, f, cap, passes), current, f, cap, passes)
    rest = rest.withColumn(T.NO_TABLE, F.lit(False))
    return rest.unionByName(sub.drop("_unav_gen").withColumnRenamed(T.WORK, T.UNAV_LEFT)), passes[0]


def _old_generations(sub, key):
    from cdc_lakehouse.columns import LSN_COL, OP_COL, SEQ_COL
    from cdc_lakehouse.ingest.toast import NO_TABLE
    from cdc_lakehouse.ingest.validate import PKCHANGE
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    order = Window.partitionBy(*key).orderBy(LSN_COL, SEQ_COL)
    before = order.rowsBetween(Window.unboundedPreceding, -1)
    sub = sub.withColumn("_unav_gen", F.coalesce(F.sum((F.col(OP_COL) == "d").cast("int")).over(before), F.lit(0)))
    gen_order = Window.partitionBy(*key, "_unav_gen").orderBy(LSN_COL, SEQ_COL)
    return sub.withColumn(
        NO_TABLE,
        (F.col("_unav_gen") > 0)
        | F.max(F.col(PKCHANGE).cast("int")).over(gen_order.rowsBetween(Window.unboundedPreceding, 0)).cast("boolean"),
    )


def _old_from_history(df, f):
    from cdc_lakehouse.columns import OP_COL
    from cdc_lakehouse.ingest.toast import WORK, _take
    from cdc_lakehouse.ingest.validate import PKCHANGE
    from pyspark.sql import functions as F

    _, _, names, earlier = f
    for c in names:
        src = F.when((F.col(OP_COL) != "d") & ~F.array_contains(WORK, c), F.struct(F.col(c).alias("v")))
        df = df.withColumn(f"_prev_{c}", F.last(src, ignorenulls=True).over(earlier))
    for c in names:
        take = F.array_contains(WORK, c) & ~F.col(PKCHANGE) & F.col(f"_prev_{c}").isNotNull()
        df = _take(df, c, take, F.col(f"_prev_{c}")["v"])
    return df


def _old_from_partner(df, f):
    from cdc_lakehouse.columns import LSN_COL, OP_COL, SEQ_COL
    from cdc_lakehouse.ingest.toast import WORK, _take
    from cdc_lakehouse.ingest.validate import PKCHANGE
    from pyspark.sql import functions as F

    key, fkey, names, _ = f
    partner = df.filter(F.col(OP_COL) == "d").select(
        *[F.col(a).alias(b) for a, b in zip(key, fkey)],
        F.col(LSN_COL),
        (F.col(SEQ_COL) + 1).alias(SEQ_COL),
        *[F.col(f"_prev_{c}").alias(f"_old_{c}") for c in names],
    )
    df = df.drop(*[f"_prev_{c}" for c in names]).join(partner, [*fkey, LSN_COL, SEQ_COL], "left")
    for c in names:
        take = F.array_contains(WORK, c) & F.col(PKCHANGE) & F.col(f"_old_{c}").isNotNull()
        df = _take(df, c, take, F.col(f"_old_{c}")["v"])
    return _old_from_history(df.drop(*[f"_old_{c}" for c in names]), f).drop(*[f"_prev_{c}" for c in names])


def _old_unresolved(df) -> int:
    from cdc_lakehouse.ingest.toast import WORK
    from cdc_lakehouse.ingest.validate import PKCHANGE
    from pyspark.sql import functions as F

    return df.filter(F.col(PKCHANGE) & (F.size(WORK) > 0)).count()


def _old_propagate(df, f, cap, passes):
    left = -1
    for _ in range(cap if cap is not None else 10**9):
        df = _old_from_partner(_old_from_history(df, f), f).localCheckpoint(eager=True)
        passes[0] += 1
        now = _old_unresolved(df)
        if now in (0, left):
            break
        left = now
    return df


def _old_from_table(sub, current, f, cap, passes):
    from cdc_lakehouse.columns import LSN_COL, SEQ_COL
    from cdc_lakehouse.ingest.toast import WORK, _take
    from cdc_lakehouse.ingest.validate import PKCHANGE
    from pyspark.sql import functions as F

    key, fkey, names, _ = f
    pk_missing = sub.filter(F.col(PKCHANGE) & (F.size(WORK) > 0)).select(*fkey).distinct().collect()
    if not pk_missing:
        return sub
    cond = None
    for r in pk_missing:
        c1 = F.lit(True)
        for a, b in zip(key, fkey):
            c1 = c1 & (F.col(a) == F.lit(r[b]))
        cond = c1 if cond is None else cond | c1
    base = current.filter(cond).select(
        *[F.col(a).alias(b) for a, b in zip(key, fkey)],
        *[F.struct(F.col(c).alias("v")).alias(f"_base_{c}") for c in names],
    )
    sub = sub.join(F.broadcast(base), fkey, "left").join(_old_roots(sub, f), [*fkey, LSN_COL, SEQ_COL], "left")
    for c in names:
        take = (
            F.array_contains(WORK, c)
            & F.col(PKCHANGE)
            & F.col(f"_base_{c}").isNotNull()
            & F.coalesce(F.col(f"_root_{c}"), F.lit(False))
        )
        sub = _take(sub, c, take, F.col(f"_base_{c}")["v"])
    sub = sub.drop(*[f"_root_{c}" for c in names])
    return _old_propagate(sub.drop(*[f"_base_{c}" for c in names]), f, cap, passes)


def _old_roots(sub, f):
    from cdc_lakehouse.columns import LSN_COL, OP_COL, SEQ_COL, UNAVAILABLE_COL
    from cdc_lakehouse.ingest.validate import PKCHANGE
    from pyspark.sql import functions as F

    key, fkey, names, earlier = f
    orig = F.coalesce(F.col(UNAVAILABLE_COL), F.array().cast("array<string>"))
    flags = sub
    for c in names:
        changed = (F.col(OP_COL) != "u") | F.col(PKCHANGE) | ~F.array_contains(orig, c)
        flags = flags.withColumn(f"_set_{c}", F.max(changed.cast("int")).over(earlier))
    return flags.filter(F.col(OP_COL) == "d").select(
        *[F.col(a).alias(b) for a, b in zip(key, fkey)],
        F.col(LSN_COL),
        (F.col(SEQ_COL) + 1).alias(SEQ_COL),
        *[(F.coalesce(F.col(f"_set_{c}"), F.lit(0)) == 0).alias(f"_root_{c}") for c in names],
    )


# --- the batch, the table, the runs ------------------------------------------------------------------


def chain_events(n: int, root: str) -> list[tuple]:
    """Key 1 moves n times, one commit per move; after each, updates of the new key and of key 2.
    root "batch": the batch first sets key 1's content (the chain's value is in the batch);
    "table": the value is only in the table."""
    ev, lsn, last = [], 1000, 1
    if root == "batch":
        ev.append(("s0", 1, lsn, 2, "u", False, 1, [], "big-1-" + "x" * 2000, 2))
    for i in range(n):
        new, lsn = 10_001 + i, lsn + 10
        ev.append(("s0", last, lsn, 2, "d", False, last, None, None, None))
        ev.append(("s0", new, lsn, 3, "u", True, last, ["content"], None, i + 2))
        ev.append(("s0", new, lsn, 4, "u", False, new, ["content"], None, i + 3))
        ev.append(("s0", 2, lsn, 6, "u", False, 2, ["content"], None, i + 2))
        last = new
    return ev


def setup(spark, rows: int):
    from cdc_lakehouse.columns import SHARD_COL
    from pyspark.sql import functions as F

    spark.sql("CREATE NAMESPACE IF NOT EXISTS lake.bench")
    spark.sql("DROP TABLE IF EXISTS lake.bench.remap_current")
    base = spark.range(1, rows + 1).select(
        F.lit("s0").alias(SHARD_COL),
        F.col("id"),
        F.concat(F.lit("big-"), F.col("id").cast("string"), F.lit("-"), F.repeat(F.lit("x"), 2000)).alias("content"),
        F.lit(1).alias("version"),
    )
    base.writeTo("lake.bench.remap_current").create()
    return spark.table("lake.bench.remap_current")


def run_once(spark, current, cfg, n: int, engine: str, root: str) -> dict:
    from cdc_lakehouse.ingest.toast import UNAV_LEFT, fill_with_stats
    from cdc_lakehouse.ingest.validate import PKCHANGE
    from pyspark.sql import functions as F

    from tests.unit.test_remap_graph import SCHEMA

    events = spark.createDataFrame(chain_events(n, root), SCHEMA).localCheckpoint(eager=True)
    t = time.monotonic()
    if engine == "graph":
        out, stats = fill_with_stats(events, current, cfg, ["content"])
        passes = stats.passes
    else:
        cap = engine.split("=", 1)[1]
        out, passes = old_fill(events, current, cfg, ["content"], None if cap == "none" else int(cap))
    out = out.localCheckpoint(eager=True)
    seconds = time.monotonic() - t
    unresolved = out.filter(F.col(PKCHANGE) & (F.size(UNAV_LEFT) > 0)).count()
    end = out.filter((F.col("id") == 10_000 + n) & (F.col("version") == n + 2)).first()
    intact = end is not None and not end[UNAV_LEFT] and end["content"] == "big-1-" + "x" * 2000
    return {"seconds": round(seconds, 2), "passes": passes, "unresolved_key_changes": unresolved, "intact": intact}


def _median(rs: list[dict]) -> float | None:
    ok = [r["seconds"] for r in rs if "seconds" in r]
    return statistics.median(ok[1:] or ok) if ok else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chain", type=int, default=1000)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--root", choices=["table", "batch"], default="table", help="where the chain's value is")
    p.add_argument("--old-caps", default="32,none", help="comma-separated caps of the old fill; none = no cap")
    args = p.parse_args()
    from cdc_lakehouse.runtime.session import get_spark
    from cdc_lakehouse.settings import LakeSettings

    from tests.conftest import make_config

    shutil.rmtree(WORK, ignore_errors=True)
    lake = LakeSettings(
        catalog_type="hadoop", catalog_name="lake", warehouse=f"file://{WORK}/wh", landing_uri=f"file://{WORK}/l"
    )
    spark = get_spark("bench-remap", lake, classic=True, extra={"spark.ui.enabled": "false"})
    current, cfg = setup(spark, args.rows), make_config("remap", ["s0"])
    engines = ["graph", *[f"old-cap={c.strip()}" for c in args.old_caps.split(",") if c.strip()]]
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for i in range(args.repeat):
        for e in engines:
            t = time.monotonic()
            try:
                r = run_once(spark, current, cfg, args.chain, e, args.root)
            except Exception as exc:  # a failing engine is a result too (the old fill's limits)
                r = {
                    "error": str(exc).strip().splitlines()[0][:200],
                    "seconds_to_error": round(time.monotonic() - t, 1),
                }
            runs[e].append(r)
            print(f"repeat {i + 1} {e}: {r}", flush=True)
    res = {
        "chain": args.chain,
        "root": args.root,
        "rows": args.rows,
        **provenance(spark.version),
        "runs": runs,
        # The first repeat includes JIT warm-up: the median is over the others when there are any.
        "median_s": {e: _median(rs) for e, rs in runs.items()},
    }
    print(json.dumps(res["median_s"]), flush=True)
    path = HERE / "results" / f"remap-{args.chain}-{args.root}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(res, indent=2) + "\n")
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
