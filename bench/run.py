"""Every benchmark in one command (`make bench`), printing figures and writing bench/results/*.json.

    python bench/run.py                 the standard set (about 30-40 min on 2 cores)
    python bench/run.py --full          adds the large parts: grid and scale (about 1.5 h on 2 cores)
    python bench/run.py --only grid     one part: ingest, source, tables, grid, scale
    python bench/plots.py               PNG plots and markdown tables from bench/results/

Parts:
  ingest   bench/ingest_bench.py: 200k changes into 2M rows, ours (MoR, CoW) vs pyiceberg upsert,
           delta-rs merge and a DuckDB full rewrite, final state verified for each
  source   bench/source_bench.py: capture events/s vs pg_recvlogical, bootstrap rows/s vs COPY,
           audit time and peak memory (full, checksum-first) at 1M keys
  tables   bench/tables_bench.py: one hourly grouped ingest over 100 small tables
  grid     (--full) batch 10k/100k/1M into tables of 1M/10M rows, MoR and CoW vs delta-rs and a
           rewrite, plus the 200k batch into 20M rows against every peer
  scale    (--full) bootstrap and audit (full, checksum-first) at 10M keys
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(args: list[str]) -> int:
    print(f"\n$ python {' '.join(args)}", flush=True)
    t = time.time()
    rc = subprocess.call([sys.executable, *args])
    print(f"(exit {rc}, {time.time() - t:.0f}s)", flush=True)
    return rc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true")
    p.add_argument("--only", choices=["ingest", "source", "tables", "grid", "scale"])
    a = p.parse_args()
    plan: list[tuple[str, list[str]]] = [
        ("ingest", [str(HERE / "ingest_bench.py"), "--rows", "2000000", "--changes", "200000", "--repeat", "3"]),
        ("source", [str(HERE / "source_bench.py"), "--blocks", "1000000", "--changes", "200000"]),
        ("tables", [str(HERE / "tables_bench.py"), "--tables", "100"]),
    ]
    if a.full or a.only in ("grid", "scale"):
        for rows in (1_000_000, 10_000_000):
            for changes in (10_000, 100_000, 1_000_000):
                plan.append(
                    (
                        "grid",
                        [
                            str(HERE / "ingest_bench.py"),
                            "--rows",
                            str(rows),
                            "--changes",
                            str(changes),
                            "--repeat",
                            "2",
                            "--engines",
                            "ours-mor,ours-cow,delta,rewrite",
                        ],
                    )
                )
        # Table size at a fixed batch: the 2M point of the standard set, and 20M rows.
        plan.append(
            (
                "grid",
                [
                    str(HERE / "ingest_bench.py"),
                    "--rows",
                    "20000000",
                    "--changes",
                    "200000",
                    "--repeat",
                    "2",
                    "--engines",
                    "ours-mor,pyiceberg,delta,rewrite",
                ],
            )
        )
        plan.append(
            (
                "scale",
                [str(HERE / "source_bench.py"), "--blocks", "10000000", "--what", "bootstrap,audit", "--repeat", "1"],
            )
        )
    failed = [part for part, args in plan if (a.only in (None, part)) and run(args) != 0]
    if failed:
        print(f"failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
