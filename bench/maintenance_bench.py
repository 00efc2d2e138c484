"""Daily maintenance of one table: the snapshot-lineage check against full-scan checksums.

    python bench/maintenance_bench.py --rows 2000000 --changes 200000 [--repeat 2]

Per repeat, two identical tables are built the way the ingest bench builds its table
(bench/ingest_bench.py: the base rows, then one ingest of the batch, which leaves small data
files and position deletes), and `maintain_table` runs on each, side by side in one Spark
session:
  lineage    the default: only rewrites committed while it ran, proven from snapshot metadata
  checksum   maintenance.verify_content: true, a row checksum of both tables before and after
Figures: seconds and Spark jobs of the maintenance run, files before and after. Results go to
bench/results/.
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
from bench.ingest_bench import WORK, bench_table_config, load_base, prepare  # noqa: E402
from bench.measure import provenance  # noqa: E402

VARIANTS = {"lineage": False, "checksum": True}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--changes", type=int, default=200_000)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()

    from cdc_lakehouse.config import parse_table_config
    from cdc_lakehouse.ingest.ingest_table import ingest_table
    from cdc_lakehouse.lake.meta import ensure_meta_tables
    from cdc_lakehouse.maintenance.maintain_table import maintain_table
    from cdc_lakehouse.runtime.session import get_spark
    from cdc_lakehouse.settings import LakeSettings

    prep = prepare(args.rows, args.changes)
    lake = LakeSettings.from_env().with_(
        warehouse=f"file://{WORK}/warehouse", landing_uri=f"file://{prep['dir']}/landing"
    )
    spark = get_spark(
        "bench-maintenance", lake, classic=True, driver_memory=os.environ.get("CDC_BENCH_DRIVER_MEMORY", "8g")
    )
    ensure_meta_tables(spark, lake)
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for i in range(args.repeat):
        for variant, verify in VARIANTS.items():
            doc = bench_table_config(f"maint_{variant}_{args.rows}", "merge-on-read")
            doc["maintenance"] = {"verify_content": verify, "min_input_files": 2}
            cfg, errs = parse_table_config(doc, "bench")
            assert not errs, errs
            load_base(spark, lake, cfg, prep)
            ingest_table(spark, lake, cfg, upto_run=None, ingest_run=f"mb-{i}")
            t = time.time()
            r = maintain_table(spark, lake, cfg, run_id=f"mb-{variant}-{i}", consumers=[cfg])
            secs = time.time() - t
            cur = r.targets["current"]
            row = {
                "seconds": secs,
                "spark_jobs": r.spark_jobs,
                "current_files": [cur.before["data_files"], cur.after["data_files"]],
                "current_delete_files": [cur.before["delete_files"], cur.after["delete_files"]],
                "current_seconds": cur.seconds,
                "changelog_seconds": r.targets["changelog"].seconds,
            }
            results[variant].append(row)
            print(f"  {variant} repeat {i + 1}: {json.dumps(row)}", flush=True)
    summary = {
        v: {
            "median_seconds": statistics.median(x["seconds"] for x in rs),
            "spark_jobs": statistics.median(x["spark_jobs"] for x in rs),
        }
        for v, rs in results.items()
    }
    print(f"\n{'variant':<10}{'median s':>10}{'Spark jobs':>12}")
    for v, s in summary.items():
        print(f"{v:<10}{s['median_seconds']:>10.1f}{s['spark_jobs']:>12.0f}")
    out = HERE / "results" / f"maintenance-{args.rows}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({**provenance(spark.version), "results": results, "summary": summary}, indent=2))
    print(f"results: {out}")
    spark.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
