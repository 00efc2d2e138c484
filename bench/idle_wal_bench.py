"""WAL a quiet database's slot keeps on a busy host (#52):

    python bench/idle_wal_bench.py [--intervals 12] [--interval-s 5] [--rows-per-interval 40000]

One PostgreSQL server of its own (the session's version: CDC_PG_VERSION, else the newest Debian
one) with two databases. `quiet` holds the published table, which nobody writes; `busy` takes
inserts all the time. Each "interval" (a compressed capture hour) writes --rows-per-interval rows
of about 500 bytes into `busy`, then runs one capture of `quiet`'s endpoint. Three slots of the
quiet database are sampled at the end of each interval, before and after the capture:

  ours        the capture's slot: each run writes a heartbeat into every shard, so its slot is
              confirmed to a commit of its own even when the tables are quiet
  recvlogical pg_recvlogical streaming the same publication the whole time, writing to /dev/null
              (what a generic client does: it confirms what the server's keepalives report)
  unread      a slot nothing reads (a consumer that stopped)

Retained WAL is pg_current_wal_lsn() - restart_lsn. Prints per interval and a summary (JSON on the
last line); the figure to compare with the WAL one interval writes is `ours` after each capture.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "plugins"), str(ROOT)]
from bench.measure import machine  # noqa: E402

ENDPOINT = "idle_quiet"


def retained(server, slot: str) -> int | None:
    rows = server.execute(
        f"SELECT (pg_current_wal_lsn() - restart_lsn)::bigint FROM pg_replication_slots WHERE slot_name = '{slot}'"
    )
    return int(rows[0][0]) if rows and rows[0][0] is not None else None


def wal_lsn(server) -> int:
    return int(server.execute("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint")[0][0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--intervals", type=int, default=12)
    ap.add_argument("--interval-s", type=float, default=5.0, help="seconds of writes into `busy` per interval")
    ap.add_argument("--rows-per-interval", type=int, default=40000)
    a = ap.parse_args()

    from cdc_lakehouse.capture.capture_run import capture_run
    from cdc_lakehouse.landing.stores import LocalLanding
    from cdc_lakehouse.source.catalog import EndpointTables
    from cdc_lakehouse.source.publication import PUBLICATION
    from cdc_lakehouse.source.slots import slot_name

    from devstack.localstack import LocalPostgres, free_port

    work = Path(tempfile.mkdtemp(prefix="idle-wal-"))
    work.chmod(0o755)
    server = LocalPostgres(work / "pg", free_port(), fast=True)
    server.start()
    recv = None
    try:
        for db in ("quiet", "busy"):
            server.ensure_database(db)
        server.execute("CREATE TABLE items (id bigint PRIMARY KEY, v text)", dbname="quiet")
        server.execute("INSERT INTO items SELECT g, 'x' FROM generate_series(1, 1000) g", dbname="quiet")
        server.execute("CREATE TABLE churn (id bigserial PRIMARY KEY, v text)", dbname="busy")
        ep = EndpointTables(ENDPOINT, "bench_idle", {"items": (["public"], ["id"])})
        store = LocalLanding(f"file://{work / 'landing'}")
        dsn = server.dsn("quiet")
        capture_run(ep, dsn, store, "r000")  # the slot and the publication
        ours = slot_name(ENDPOINT)
        server.execute("SELECT pg_create_logical_replication_slot('idle_unread', 'pgoutput')", dbname="quiet")
        server.execute("SELECT pg_create_logical_replication_slot('idle_recv', 'pgoutput')", dbname="quiet")
        tool = server.bindir / "pg_recvlogical"
        recv = subprocess.Popen(
            [str(tool), "-d", server.uri("quiet"), "--slot", "idle_recv", "--start", "-f", "/dev/null",
             "-o", "proto_version=1", "-o", f"publication_names={PUBLICATION}", "--status-interval", "1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        rows = []
        for i in range(1, a.intervals + 1):
            start_lsn, t0 = wal_lsn(server), time.monotonic()
            batches = 10
            for _ in range(batches):
                server.execute(
                    f"INSERT INTO churn (v) SELECT repeat(md5(g::text), 16) FROM generate_series(1, {a.rows_per_interval // batches}) g",
                    dbname="busy",
                )
                time.sleep(max(0.0, a.interval_s / batches - 0.05))
            written = wal_lsn(server) - start_lsn
            time.sleep(1.5)  # pg_recvlogical's status interval
            before = {s: retained(server, s) for s in (ours, "idle_recv", "idle_unread")}
            t = time.monotonic()
            capture_run(ep, dsn, store, f"r{i:03d}")
            capture_s = time.monotonic() - t
            after = retained(server, ours)
            row = {
                "interval": i,
                "wal_written": written,
                "ours_before": before[ours],
                "ours_after_capture": after,
                "recvlogical": before["idle_recv"],
                "unread": before["idle_unread"],
                "capture_s": round(capture_s, 2),
                "interval_s": round(time.monotonic() - t0, 1),
            }
            rows.append(row)
            print(
                f"interval {i:2d}: busy wrote {written / 2**20:7.1f} MiB; retained: ours {before[ours] / 2**20:7.1f} MiB "
                f"before the capture, {after / 2**20:6.2f} MiB after ({capture_s:.2f}s); "
                f"pg_recvlogical {before['idle_recv'] / 2**20:7.1f} MiB; unread {before['idle_unread'] / 2**20:8.1f} MiB",
                flush=True,
            )
        summary = {
            "bench": "idle_wal",
            "machine": machine(),
            "server_version": server.execute("SHOW server_version")[0][0],
            "intervals": a.intervals,
            "median_wal_written_per_interval": statistics.median(r["wal_written"] for r in rows),
            "max_ours_after_capture": max(r["ours_after_capture"] for r in rows),
            "max_ours_before_capture": max(r["ours_before"] for r in rows),
            "max_recvlogical": max(r["recvlogical"] for r in rows),
            "final_unread": rows[-1]["unread"],
            "rows": rows,
        }
        print(json.dumps(summary))
    finally:
        if recv is not None:
            recv.terminate()
            recv.wait(10)
        server.destroy()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
