"""One transaction larger than memory, captured (#52):

    python bench/large_tx_bench.py [--gb 0.5 2] [--row-bytes 1000]

One PostgreSQL server of its own (the session's version: CDC_PG_VERSION, else the newest Debian
one). For each size, one INSERT of --gb GiB of rows (about --row-bytes each) in one transaction,
then the capture of it twice, each in a process of its own from the same WAL (two slots made
before the transaction):

  streamed  the server streams the transaction as it decodes it, past its
            logical_decoding_work_mem (64MB, the default); the capture spools it to its staging
            and lands it at the commit (capture.streamed)
  whole     the same capture with streaming off (CaptureLimits.streaming): the server spills the
            transaction to its own disk (pg_replslot) and sends it whole after its commit, what
            the capture's protocol 1 got before

Per capture: wall time, peak RSS of the capture process (ru_maxrss), events, what it spooled,
and the largest spill the server wrote for the slot (pg_stat_replication_slots). JSON on the last
line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "plugins"), str(ROOT)]
from bench.measure import machine  # noqa: E402

CAPTURE = """
import json, resource, sys, time
from cdc_lakehouse.capture.capture_run import CaptureLimits, capture_run
from cdc_lakehouse.landing.stores import LocalLanding
from cdc_lakehouse.source.catalog import EndpointTables
eid, dsn, root, run_id, streaming = sys.argv[1:6]
t = time.monotonic()
m = capture_run(EndpointTables(eid, "bench", {"items": (["public"], ["id"])}), dsn, LocalLanding("file://" + root),
                run_id, limits=CaptureLimits(streaming=streaming == "on")).manifest
print(json.dumps({"seconds": round(time.monotonic() - t, 1), "events": m.events,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                  "streamed": m.streamed.to_dict() if m.streamed else None}))
"""

MODES = {"streamed": "on", "whole": "off"}


def spill_watch(server, slot: str, stop: threading.Event, out: dict) -> None:
    """The slot's spill and stream byte counters (since the reset before the capture), every second."""
    while not stop.wait(1.0):
        try:
            rows = server.execute(
                f"SELECT spill_bytes, stream_bytes FROM pg_stat_replication_slots WHERE slot_name = '{slot}'"
            )
            if rows:
                out["spill_bytes"], out["stream_bytes"] = int(rows[0][0]), int(rows[0][1])
        except Exception:  # noqa: BLE001  a sample missed is a sample missed
            pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, nargs="+", default=[0.5, 2.0])
    ap.add_argument("--row-bytes", type=int, default=1000)
    a = ap.parse_args()

    from cdc_lakehouse.source.slots import slot_name

    from devstack.localstack import LocalPostgres, free_port

    work = Path(tempfile.mkdtemp(prefix="large-tx-"))
    work.chmod(0o755)
    server = LocalPostgres(work / "pg", free_port(), fast=True)
    server.start()
    script = work / "capture.py"
    script.write_text(CAPTURE)
    results = []
    try:
        server.ensure_database("src")
        dsn = server.dsn("src")
        server.execute("CREATE TABLE items (id bigint PRIMARY KEY, body text)", dbname="src")
        # Rows that do not compress: their WAL is about their size.
        server.execute("ALTER TABLE items ALTER COLUMN body SET STORAGE EXTERNAL", dbname="src")

        def capture(mode: str, run_id: str) -> dict:
            landing = work / f"landing-{mode}"
            out = subprocess.run(
                [sys.executable, str(script), f"bench_{mode}", dsn, str(landing), run_id, str(MODES[mode])],
                check=True,
                capture_output=True,
                text=True,
                env={"PYTHONPATH": str(ROOT / "plugins"), "PATH": "/usr/bin:/bin"},
            )
            return json.loads(out.stdout.strip().splitlines()[-1])

        for mode in MODES:
            capture(mode, "r0")  # each mode's slot, before the transaction
        for i, gb in enumerate(a.gb, start=1):
            rows = int(gb * 2**30 / a.row_bytes)
            reps = max(1, a.row_bytes // 32)
            server.execute("TRUNCATE items", dbname="src")
            for mode in MODES:  # the truncate, out of the way of the measured run
                capture(mode, f"t{i}")
            t = time.monotonic()
            server.execute(
                "INSERT INTO items SELECT g, string_agg(md5(g::text || r::text), '') "
                f"FROM generate_series(1, {rows}) g, generate_series(1, {reps}) r GROUP BY g",
                dbname="src",
            )
            insert_s = time.monotonic() - t
            print(f"{gb} GiB: {rows} rows inserted in one transaction in {insert_s:.1f}s", flush=True)
            for mode in MODES:
                server.execute(f"SELECT pg_stat_reset_replication_slot('{slot_name(f'bench_{mode}')}')", dbname="src")
                stop, spill = threading.Event(), {}
                watcher = threading.Thread(target=spill_watch, args=(server, slot_name(f"bench_{mode}"), stop, spill))
                watcher.start()
                try:
                    r = capture(mode, f"r{i}")
                finally:
                    stop.set()
                    watcher.join()
                r.update(mode=mode, gib=gb, rows=rows, insert_s=round(insert_s, 1), server=spill)
                assert r["events"] == rows, r
                results.append(r)
                print(
                    f"  {mode:8s} {r['seconds']:7.1f}s, peak RSS {r['peak_rss_mb']:5d} MB, {rows / r['seconds']:8.0f} "
                    f"events/s; server spill {spill.get('spill_bytes', 0) / 2**20:8.1f} MiB, streamed "
                    f"{spill.get('stream_bytes', 0) / 2**20:8.1f} MiB",
                    flush=True,
                )
            shutil.rmtree(work / "landing-streamed" / "ep", ignore_errors=True)
        print(
            json.dumps(
                {
                    "bench": "large_tx",
                    "machine": machine(),
                    "server_version": server.execute("SHOW server_version")[0][0],
                    "results": results,
                }
            )
        )
    finally:
        server.destroy()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
