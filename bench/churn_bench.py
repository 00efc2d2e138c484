"""Format v3 under churn (issue #55): a series of update-heavy batches into one merge-on-read
table, format 2 (position delete files) and format 3 (deletion vectors) side by side, with the
memory of every batch.

    python bench/churn_bench.py --rows 2000000 --changes 200000 --batches 20 [--formats 2,3]
        [--compact-above N]

apache/iceberg#17241 reports a v3 MERGE whose executor memory grows without bound under a
high-churn stream of upserts, where the same v2 workload stays flat. This runs our ingest
(cdc_lakehouse.ingest.ingest_table, the production path) over `--batches` capture runs of the
same table, each `--changes` events (bench.workload.change_batch: 90% updates with recency skew
and TOAST-unchanged content, 8% inserts, 2% deletes), with no maintenance in between unless
`--compact-above N`: then the tables' compaction and expiry
(maintenance.maintain_table.maintain_targets) run after a batch that leaves more than N
position-delete records (the snapshot summary's total-position-deletes), timed on its own.

Per batch, in each format's own process (a classic Spark session, its JVM a child process):
seconds; the peak RSS of the process tree during the batch; the JVM heap's peak during the batch
(the sum of every heap pool's own peak, reset at the batch's start: an upper bound, the pools
peak at different times) and what it keeps after a full GC at its end (each batch therefore
starts after a full GC, which production does not do); persisted RDDs left over; the table's
data files, delete files and position-delete records; and whether the table's checksum (rows,
sums of id and version, total content length: bench.ingest_bench.table_checksum) equals the
expected state's, computed with DuckDB from the same inputs, batch after batch.
The figure the issue asks for: the 20th batch's peak against the first's (and the second's:
the first also warms the JIT up).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "plugins"), str(ROOT)]
from bench.ingest_bench import bench_table_config, load_base, table_checksum  # noqa: E402
from bench.measure import PeakRSS, machine, worker_result  # noqa: E402

WORK = Path(os.environ.get("CDC_BENCH_WORK", HERE / ".work"))
RUN_LSN = 20_000_000  # LSN space per batch, at least: 200k events in transactions of 20 span 10M


def run_id(k: int) -> str:
    return f"20260601T{k // 60:02d}{k % 60:02d}00Z"  # capture runs in order


def prepare(rows: int, changes: int, batches: int) -> dict:
    """The base table (bench.ingest_bench's), `batches` landed capture runs in one landing, and
    the expected checksum after each (cached)."""
    import duckdb
    import numpy as np

    from bench.ingest_bench import prepare as prepare_base
    from bench.workload import (
        BASE_LSN,
        change_batch,
        expected_checksum,
        final_state_sql,
        reduced_changes,
        write_landing,
    )

    base = prepare_base(rows, changes)["base"]  # the same 2M base as the ingest bench
    d = WORK / f"churn-r{rows}-c{changes}"
    meta = d / "meta.json"
    if meta.exists() and len(json.loads(meta.read_text())["expected"]) >= batches:
        return {"base": base, "dir": str(d), **json.loads(meta.read_text())}
    # Deletes come from the lowest ids, which no batch updates, one band per batch, so a deleted
    # row is never updated again (the source would need to insert it first).
    n_del = int(changes * 0.02)
    band = max(n_del * 2, 1)
    update_lo = batches * band + 1
    assert update_lo < rows // 2, f"--rows {rows} is too small for {batches} batches' deletes of {n_del}"
    # Each batch's LSNs above the previous one's (change_batch: 1000 per transaction of 20 events).
    run_lsn = max(RUN_LSN, (changes // 20 + 2) * 1000)
    state, expected, start = base, [], 500
    for k in range(batches):
        batch = change_batch(
            rows,
            changes,
            seed=100 + k,
            lsn_base=BASE_LSN + (k + 1) * run_lsn,
            first_new_id=rows + 1 + k * changes,
            update_lo=update_lo,
            delete_pool=np.arange(k * band + 1, (k + 1) * band + 1, dtype=np.int64),
            start_ts=f"2026-06-01T{k // 60:02d}:{k % 60:02d}:00",
        )
        manifest = write_landing(batch, d / "landing", "bench", run_id(k), start_lsn=start)
        start = manifest["end_lsn"]
        reduced = reduced_changes(batch, state)
        expected.append(expected_checksum(state, reduced))
        # The state after the batch: what the next batch's unchanged TOAST values come from.
        nxt = d / f"state-{k}.parquet"
        con = duckdb.connect()
        con.register("r", reduced)
        con.execute(f"COPY ({final_state_sql(state)}) TO '{nxt}' (FORMAT parquet)")
        con.close()
        if state != base:
            Path(state).unlink()
        state = str(nxt)
        print(f"  batch {k + 1}/{batches} landed: {batch.events} events, expected {expected[-1]}", flush=True)
    Path(state).unlink()
    info = {"batches": batches, "events": changes, "expected": expected}
    meta.write_text(json.dumps(info))
    return {"base": base, "dir": str(d), **info}


# --- one format, in its own process --------------------------------------------------------------


def _heap(spark, *, reset: bool = False, gc: bool = False) -> dict:
    """The JVM heap: every heap pool's peak usage since the last reset, and the heap in use (after
    a full GC when gc)."""
    jvm = spark._jvm
    mf = jvm.java.lang.management.ManagementFactory
    if gc:
        jvm.java.lang.System.gc()
    pools = [p for p in mf.getMemoryPoolMXBeans() if str(p.getType()) == "Heap memory"]
    peak = sum(p.getPeakUsage().getUsed() for p in pools)
    if reset:
        for p in pools:
            p.resetPeakUsage()
    return {"peak_mb": peak / 2**20, "used_mb": mf.getMemoryMXBean().getHeapMemoryUsage().getUsed() / 2**20}


def _files(spark, table: str) -> dict:
    """Live data and delete files and the rows they delete, from the current snapshot's summary."""
    from cdc_lakehouse.lake.commits import snapshot_summary

    s = snapshot_summary(spark, table)
    return {
        k.replace("total-", "").replace("-", "_"): int(s.get(k, 0))
        for k in ("total-data-files", "total-delete-files", "total-position-deletes", "total-records")
    }


def run_format(fmt: int, prep: dict, rows: int, compact_above: int | None) -> list[dict]:
    from cdc_lakehouse.config import parse_table_config
    from cdc_lakehouse.ingest.ingest_table import ingest_table
    from cdc_lakehouse.lake.meta import ensure_meta_tables
    from cdc_lakehouse.maintenance.maintain_table import maintain_targets
    from cdc_lakehouse.maintenance.targets import table_targets
    from cdc_lakehouse.runtime.session import get_spark
    from cdc_lakehouse.settings import LakeSettings

    lake = LakeSettings.from_env().with_(
        warehouse=f"file://{WORK}/warehouse", landing_uri=f"file://{prep['dir']}/landing"
    )
    spark = get_spark("bench-churn", lake, classic=True, driver_memory=os.environ.get("CDC_BENCH_DRIVER_MEMORY", "8g"))
    ensure_meta_tables(spark, lake)
    config = bench_table_config(f"churn_v{fmt}_{rows}", "merge-on-read")
    config["lake"]["format_version"] = fmt
    cfg, errs = parse_table_config(config, "bench")
    assert not errs, errs
    table = lake.qualified(cfg.current_table)
    load_base(spark, lake, cfg, {"base": prep["base"]})
    _heap(spark, gc=True)  # the first batch starts as every later one does: after a full GC
    [(_, version)] = spark.sql(f"SHOW TBLPROPERTIES {table} ('format-version')").collect()
    assert version == str(fmt), f"{table}: format-version {version}, not {fmt}"
    out = []
    for k, want in enumerate(prep["expected"]):
        _heap(spark, reset=True)
        with PeakRSS(os.getpid(), interval=0.1) as mem:
            t = time.time()
            r = ingest_table(spark, lake, cfg, upto_run=run_id(k), ingest_run=f"churn-{k}")
            secs = time.time() - t
        heap = _heap(spark)
        retained = _heap(spark, gc=True)["used_mb"]
        # RDDs the driver still keeps after the ingest returned (its checkpoints, unless released).
        kept_rdds = spark.sparkContext._jsc.getPersistentRDDs().size()
        files = _files(spark, table)
        got = table_checksum(spark, table)
        row = {
            "batch": k + 1,
            "seconds": secs,
            "status": r.metrics.status,
            "spark_jobs": r.spark_jobs,
            "peak_rss_mb": mem.peak_mb,
            "heap_peak_mb": heap["peak_mb"],
            "heap_retained_mb": retained,
            "kept_rdds": kept_rdds,
            **files,
            "verified": got == want,
        }
        if compact_above is not None and files["position_deletes"] > compact_above:
            t = time.time()
            # The tables' compaction and expiry, as the maintenance DAG runs them (not its landing
            # retention: the bench's manifests are not a capture's).
            maintain_targets(spark, lake, cfg.name, table_targets(lake, cfg), f"churn-maint-{k}", datetime.now(UTC))
            row["maintenance_seconds"] = time.time() - t
            row["after_maintenance"] = _files(spark, table)
        out.append(row)
        print(
            f"  v{fmt} batch {k + 1}: {secs:.1f}s rss {mem.peak_mb:.0f} MB heap peak {heap['peak_mb']:.0f} MB "
            f"retained {retained:.0f} MB kept RDDs {kept_rdds} files {files} jobs {r.spark_jobs} verified={row['verified']}"
            + (f" maintenance {row['maintenance_seconds']:.1f}s" if "maintenance_seconds" in row else ""),
            flush=True,
        )
    spark.stop()
    return out


# --- orchestration --------------------------------------------------------------------------------


def run_worker(fmt: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(Path(__file__)), "--worker", str(fmt), "--rows", str(args.rows)]
    cmd += ["--changes", str(args.changes), "--batches", str(args.batches)]
    if args.compact_above is not None:
        cmd += ["--compact-above", str(args.compact_above)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    result = worker_result(proc)
    return {"format": fmt, "batches": result} if result else {"format": fmt, "error": f"exit {proc.returncode}"}


def summary(r: dict) -> dict:
    """Per format: the first and last batch against each other (the first includes the JIT's
    warm-up, so the second is given too), and the median batch."""
    b = r["batches"]

    def ratio(key: str, base: int = 0) -> float:
        return b[-1][key] / b[min(base, len(b) - 1)][key]

    return {
        "first_s": b[0]["seconds"],
        "second_s": b[1]["seconds"] if len(b) > 1 else None,
        "last_s": b[-1]["seconds"],
        "median_s": statistics.median(x["seconds"] for x in b[1:] or b),
        "rss_first_mb": b[0]["peak_rss_mb"],
        "rss_last_mb": b[-1]["peak_rss_mb"],
        "rss_last_over_first": ratio("peak_rss_mb"),
        "heap_peak_last_over_first": ratio("heap_peak_mb"),
        "rss_last_over_second": ratio("peak_rss_mb", 1),
        "heap_peak_last_over_second": ratio("heap_peak_mb", 1),
        "heap_retained_first_mb": b[0]["heap_retained_mb"],
        "heap_retained_last_mb": b[-1]["heap_retained_mb"],
        "delete_files_last": b[-1]["delete_files"],
        "position_deletes_last": b[-1]["position_deletes"],
        "maintenance_runs": sum("maintenance_seconds" in x for x in b),
        "verified": all(x["verified"] and x["status"] == "ok" for x in b),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--changes", type=int, default=200_000)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--formats", default="2,3")
    p.add_argument("--compact-above", type=int, default=None, help="maintenance after a batch above N deleted rows")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    prep = prepare(args.rows, args.changes, args.batches)
    prep["expected"] = prep["expected"][: args.batches]
    if args.worker:
        print("RESULT " + json.dumps(run_format(args.worker, prep, args.rows, args.compact_above)), flush=True)
        return 0
    out = HERE / "results" / f"churn-{args.rows}-{args.changes}-{args.batches}.json"
    out.parent.mkdir(exist_ok=True)
    results = []
    for fmt in [int(f) for f in args.formats.split(",")]:
        print(f"format {fmt}:", flush=True)
        results.append(run_worker(fmt, args))
        if "batches" in results[-1]:
            results[-1]["summary"] = summary(results[-1])
        out.write_text(json.dumps({"args": vars(args), "results": results, "machine": machine()}, indent=2))
    print(
        f"\n{'format':<8}{'median s':>9}{'first s':>8}{'last s':>8}{'rss 1st':>9}{'rss last':>9}{'x':>6}"
        f"{'heap x':>7}{'kept 1st':>9}{'kept last':>10}{'deletes':>9}  verified"
    )
    for r in results:
        if "summary" not in r:
            print(f"v{r['format']:<7} {r.get('error')}")
            continue
        s = r["summary"]
        print(
            f"v{r['format']:<7}{s['median_s']:>9.2f}{s['first_s']:>8.2f}{s['last_s']:>8.2f}{s['rss_first_mb']:>9.0f}"
            f"{s['rss_last_mb']:>9.0f}{s['rss_last_over_first']:>6.2f}{s['heap_peak_last_over_first']:>7.2f}"
            f"{s['heap_retained_first_mb']:>9.0f}{s['heap_retained_last_mb']:>10.0f}{s['position_deletes_last']:>9}"
            f"  {s['verified']}"
        )
    print(f"\nresults: {out}")
    return 0 if all(r.get("summary", {}).get("verified") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
