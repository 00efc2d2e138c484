"""Source-side costs on a Notion-like block table in the local PostgreSQL:

    python bench/source_bench.py --blocks 1000000 [--what bootstrap,audit,capture] [--changes 200000]
                                 [--readers copy,jdbc,chunked] [--chunk-rows 50000]

  bootstrap  rows/s of cdc_lakehouse.bootstrap (snapshot -> reader -> Iceberg) against the practical
             limit, `COPY (SELECT <same columns>) TO STDOUT` of the same rows (as text) with the same
             number of connections per host; per reader (--readers copy,jdbc: both read the typed
             select list, copy through ADBC's binary COPY, jdbc through Spark's JDBC reader): the
             read alone, then the whole bootstrap. `chunked` in --readers runs the online chunked mode (bootstrap.mode: chunked,
             JDBC-free: driver COPY per chunk + MERGE) on a fresh table instead; for every mode a
             sampler on pg_stat_activity records the longest time one transaction, and one
             backend_xmin, was held open on the source while it ran
  column     a one-column backfill (bootstrap/column.py: `score` of every row, chunks of
             --chunk-rows between WAL markers, MERGEd under the LSN guard) beside a snapshot
             re-bootstrap (copy reader) of the same table, side by side in each repeat
  audit      time and peak memory (this process and its JVM) of the key-set audit of the table,
             full comparison and checksum-first
  capture    events/s of one capture run against pg_recvlogical draining the same changes
             through the same publication into /dev/null

The source lives in its own database (bench_src_<blocks>) and is kept between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "plugins"), str(ROOT)]
from bench.measure import PeakRSS, machine  # noqa: E402

SHARDS = ["s0", "s1", "s2", "s3"]
CONN_ID = "bench_source"  # + the size: slot names are per cluster, so each database gets its own


def _admin_dsn(db: str = "postgres") -> str:
    port = os.environ.get("CDC_LOCAL_PG_PORT", "55432")
    from cdc_lakehouse.settings import libpq_dsn

    return libpq_dsn(
        host="127.0.0.1", port=port, dbname=db, user="postgres", password=os.environ.get("CDC_LOCAL_PG_PASSWORD")
    )


def prepare_source(blocks: int):
    import psycopg2

    from devstack.workload import NotionWorkload

    global CONN_ID  # noqa: PLW0603
    CONN_ID = f"bench_source_{blocks}"

    db = f"bench_src_{blocks}"
    conn = psycopg2.connect(_admin_dsn())
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (db,))
        fresh = cur.fetchone() is None
        if fresh:
            cur.execute(f"CREATE DATABASE {db}")
    conn.close()
    dsn = _admin_dsn(db)
    pw = os.environ.get("CDC_LOCAL_PG_PASSWORD", "")
    os.environ[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = (
        f"postgresql://postgres:{pw}@127.0.0.1:{os.environ.get('CDC_LOCAL_PG_PORT', '55432')}/{db}"
    )
    wl = NotionWorkload(dsn, SHARDS, seed=11)
    if fresh:
        t = time.time()
        wl.create()
        wl.load(blocks_per_shard=blocks // len(SHARDS))
        print(f"source: {blocks} blocks in {len(SHARDS)} shards loaded in {time.time() - t:.0f}s", flush=True)
    else:
        wl.sync_ids()
    return db, dsn, wl


def table_config(name: str, **over):
    from cdc_lakehouse.config import parse_table_config

    data = {
        "name": name,
        "source": {"table": "block", "shards": [{"conn_id": CONN_ID, "schemas": SHARDS}]},
        "primary_key": ["id"],
        "lake": {"namespace": "bench"},
        **over,
    }
    cfg, errors = parse_table_config(data, "bench")
    assert not errors, errors
    return cfg


def copy_rate(dsn: str, columns, connections: int, pg_types: dict[str, str] | None = None) -> dict:
    """COPY of every shard with the bootstrap's select list, `connections` shards at a time."""
    import psycopg2
    from cdc_lakehouse.source.catalog import text_select_list

    sel = text_select_list(columns, pg_types)
    counts: dict[str, int] = {}

    class Sink:
        def __init__(self) -> None:
            self.n = 0

        def write(self, b) -> int:
            self.n += b.count(b"\n") if isinstance(b, bytes) else b.count("\n")
            return len(b)

    def one(schema: str) -> None:
        conn = psycopg2.connect(dsn)
        try:
            sink = Sink()
            with conn.cursor() as cur:
                cur.copy_expert(f"COPY (SELECT {sel} FROM {schema}.block) TO STDOUT", sink)
            counts[schema] = sink.n
        finally:
            conn.close()

    t = time.time()
    pending = list(SHARDS)
    while pending:
        batch, pending = pending[:connections], pending[connections:]
        threads = [threading.Thread(target=one, args=(s,)) for s in batch]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    secs = time.time() - t
    rows = sum(counts.values())
    return {"rows": rows, "seconds": secs, "rows_per_second": rows / secs}


def read_alone(spark, cfg, columns, pg_types) -> dict:
    """The source read only (the rows in their lake types, with the misfit check; nothing written),
    under an exported snapshot, forced through every column by Spark's no-op sink."""
    from cdc_lakehouse.bootstrap.snapshot import export_snapshot, read_shards, shards_by_endpoint

    (endpoint_id, sources), *_ = shards_by_endpoint(cfg, None).items()
    conn, _, snapshot, _ = export_snapshot(sources[0].endpoint, endpoint_id, f"read{int(time.time())}")
    try:
        t = time.time()
        df = read_shards(spark, cfg, sources, snapshot, columns, pg_types)
        df.write.format("noop").mode("overwrite").save()
        secs = time.time() - t
    finally:
        conn.close()
    return {"seconds": secs}


class HeldOpen:
    """Samples pg_stat_activity of the source database every 20 ms: the longest age of a
    transaction (clock - xact_start) and the longest time one backend kept the same backend_xmin
    (what holds vacuum back), over every client backend but this sampler's."""

    def __init__(self, dsn: str):
        self.dsn, self.stop = dsn, threading.Event()
        self.longest_xact = self.longest_xmin = 0.0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=30)

    def _run(self) -> None:
        import psycopg2

        conn = psycopg2.connect(self.dsn)
        conn.autocommit = True
        seen: dict[tuple[int, str], float] = {}
        with conn.cursor() as cur:
            while not self.stop.is_set():
                cur.execute(
                    "SELECT pid, backend_xmin::text, extract(epoch FROM clock_timestamp() - xact_start) "
                    "FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
                    # Client backends only: after a large load, autovacuum's VACUUM/ANALYZE of the
                    # table held one transaction 168 s open during a 10M-row backfill run.
                    "AND backend_type = 'client backend'"
                )
                now = time.monotonic()
                for pid, xmin, age in cur.fetchall():
                    self.longest_xact = max(self.longest_xact, float(age or 0.0))
                    if xmin is not None:
                        first = seen.setdefault((pid, xmin), now)
                        self.longest_xmin = max(self.longest_xmin, now - first)
                time.sleep(0.02)
        conn.close()


def _one_bootstrap(spark, lake, cfg, run_id: str, dsn: str) -> dict:
    from cdc_lakehouse.bootstrap.bootstrap_table import bootstrap_table
    from cdc_lakehouse.bootstrap.result import SnapshotBootstrapResult

    if cfg.bootstrap.mode == "chunked":  # a fresh table each time: a second run would be a re-sync
        for t in (cfg.current_table, cfg.changelog_table):
            spark.sql(f"DROP TABLE IF EXISTS {lake.qualified(t)} PURGE")
    with PeakRSS() as mem, HeldOpen(dsn) as held:
        t = time.time()
        r = bootstrap_table(spark, lake, cfg, run_id=run_id)
        secs = time.time() - t
    snapshot = r if isinstance(r, SnapshotBootstrapResult) else None
    return {
        "rows": r.rows,
        "seconds": secs,
        "rows_per_second": r.rows / secs,
        "peak_rss_mb": mem.peak_mb,
        "read_and_changelog_seconds": snapshot.read_and_changelog_seconds if snapshot else None,
        "current_write_seconds": snapshot.current_write_seconds if snapshot else None,
        "chunks": None if snapshot else sum(r.chunks.values()) or None,
        "longest_xact_seconds": held.longest_xact,
        "longest_xmin_held_seconds": held.longest_xmin,
    }


def _reader_config(blocks: int, reader: str, chunk_rows: int):
    if reader == "chunked":
        return table_config(f"boot_{blocks}_chunked", bootstrap={"mode": "chunked", "chunk_rows": chunk_rows})
    return table_config(
        f"boot_{blocks}" + ("" if reader == "jdbc" else f"_{reader}"), bootstrap={"reader": reader, "mode": "snapshot"}
    )


def bench_bootstrap(
    spark, lake, dsn: str, blocks: int, repeat: int, readers: list[str], chunk_rows: int = 50_000
) -> dict:
    """COPY, then per reader (bootstrap.reader): the read alone and the whole bootstrap, side by side
    in each repeat."""
    from cdc_lakehouse.bootstrap.snapshot import preflight, shards_by_endpoint

    cfgs = {r: _reader_config(blocks, r, chunk_rows) for r in readers}
    cfg0 = next(iter(cfgs.values()))
    columns, pg_types = preflight(cfg0, shards_by_endpoint(cfg0, None))
    conns = cfg0.bootstrap.max_connections_per_host
    copies: list[dict] = []
    ours: dict[str, list[dict]] = {r: [] for r in readers}
    for i in range(repeat):
        copies.append(copy_rate(dsn, columns, conns, pg_types))
        rows = copies[-1]["rows"]
        print(
            f"  COPY ({conns} connections): {rows} rows in {copies[-1]['seconds']:.1f}s "
            f"= {copies[-1]['rows_per_second']:,.0f} rows/s",
            flush=True,
        )
        for reader, cfg in cfgs.items():
            # The chunked mode has no separate read: its chunks are read between MERGEs.
            read = read_alone(spark, cfg, columns, pg_types) if reader != "chunked" else None
            one = _one_bootstrap(spark, lake, cfg, f"bench{i}", dsn)
            if read:
                one.update(read_seconds=read["seconds"], read_rows_per_second=rows / read["seconds"])
            ours[reader].append(one)
            print(
                f"  [{reader}] read alone: "
                + (f"{read['seconds']:.1f}s = {rows / read['seconds']:,.0f} rows/s" if read else "-")
                + f"; bootstrap: {one['rows']} rows in {one['seconds']:.1f}s = {one['rows_per_second']:,.0f} rows/s"
                + (f" in {one['chunks']} chunks" if one["chunks"] else "")
                + f"; longest transaction on the source {one['longest_xact_seconds']:.2f}s, longest xmin held "
                f"{one['longest_xmin_held_seconds']:.2f}s; peak {one['peak_rss_mb']:.0f} MB",
                flush=True,
            )
    c = statistics.median(x["rows_per_second"] for x in copies)
    out: dict = {"copy": copies, "median_copy_rps": c, "connections_per_host": conns, "readers": {}}
    for reader, runs in ours.items():
        o = statistics.median(x["rows_per_second"] for x in runs)
        reads = [x["read_rows_per_second"] for x in runs if "read_rows_per_second" in x]
        rd = statistics.median(reads) if reads else None
        held = max(x["longest_xact_seconds"] for x in runs)
        out["readers"][reader] = {
            "bootstrap": runs,
            "median_bootstrap_rps": o,
            "ratio": o / c,
            "read_ratio": rd / c if rd else None,
            "longest_xact_seconds": held,
            "longest_xmin_held_seconds": max(x["longest_xmin_held_seconds"] for x in runs),
        }
        print(
            f"bootstrap {blocks} rows [{reader}]: median {o:,.0f} rows/s vs COPY {c:,.0f} rows/s = {o / c:.2f} of COPY "
            + (f"(read alone {rd / c:.2f} of COPY)" if rd else "")
            + f"; longest transaction held open {held:.2f}s",
            flush=True,
        )
    return out


def bench_audit(spark, lake, blocks: int, repeat: int) -> dict:
    from cdc_lakehouse.audit.audit_table import audit_table

    cfg = table_config(f"boot_{blocks}")
    out: dict[str, list] = {}
    for mode in ("full", "checksum"):
        out[mode] = []
        for i in range(repeat):
            with PeakRSS() as mem:
                t = time.time()
                r = audit_table(spark, lake, cfg, audit_run=f"bench-{mode}-{i}", mode=mode, repair=False)
                secs = time.time() - t
            out[mode].append({"seconds": secs, "peak_rss_mb": mem.peak_mb, "verdict": r.verdict, "timings": r.timings})
            print(
                f"  audit {mode} {blocks} keys: {secs:.1f}s, peak {mem.peak_mb:.0f} MB, {r.verdict} phases {r.timings}",
                flush=True,
            )
    return {
        m: {
            "runs": v,
            "median_seconds": statistics.median(x["seconds"] for x in v),
            "peak_rss_mb": max(x["peak_rss_mb"] for x in v),
        }
        for m, v in out.items()
    }


def bench_capture(dsn: str, wl, changes: int, repeat: int) -> dict:
    import psycopg2
    from cdc_lakehouse.capture.capture_run import capture_run
    from cdc_lakehouse.landing.stores import LocalLanding
    from cdc_lakehouse.source.catalog import EndpointTables
    from cdc_lakehouse.source.publication import PUBLICATION

    recv = shutil.which("pg_recvlogical") or next(
        iter(sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_recvlogical"))), None
    )
    work = HERE / ".work" / "capture"
    shutil.rmtree(work, ignore_errors=True)
    store = LocalLanding(f"file://{work}")
    ep = EndpointTables(
        f"{CONN_ID}_capture",
        CONN_ID,
        {"block": (SHARDS, ["id"]), "space": (SHARDS, ["id"]), "permission": (SHARDS, ["block_id", "user_id"])},
    )
    runs = []
    for i in range(repeat):
        capture_run(ep, dsn, store, f"warm{i}")  # the slot and publication exist, and nothing is pending
        conn = psycopg2.connect(dsn)
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = 'bench_recv'"
            )
            cur.execute("SELECT pg_create_logical_replication_slot('bench_recv', 'pgoutput')")
        counts = wl.step(changes, pk_changes=0)
        with conn.cursor() as cur:
            cur.execute("SELECT pg_current_wal_lsn()::text")
            end = cur.fetchone()[0]
        conn.close()
        with PeakRSS() as mem:
            t = time.time()
            m = capture_run(ep, dsn, store, f"run{i}").manifest
            ours = time.time() - t
        events = sum(f.rows for e in m.tables for f in e.files)
        r = None
        if recv:
            t = time.time()
            port = os.environ.get("CDC_LOCAL_PG_PORT", "55432")
            r = subprocess.run(
                [
                    str(recv),
                    "-h",
                    "127.0.0.1",
                    "-p",
                    port,
                    "-U",
                    "postgres",
                    "-d",
                    dsn.split("dbname=")[1].split(maxsplit=1)[0].strip("'"),  # libpq quotes it in the DSN
                    "--slot",
                    "bench_recv",
                    "--start",
                    "--endpos",
                    end,
                    "-o",
                    "proto_version=1",
                    "-o",
                    f"publication_names={PUBLICATION}",
                    "-f",
                    "/dev/null",
                    "--no-loop",
                ],
                env={**os.environ, "PGPASSWORD": os.environ.get("CDC_LOCAL_PG_PASSWORD", "")},
                capture_output=True,
                text=True,
                timeout=1800,
                check=False,
            )
            theirs = time.time() - t
        runs.append(
            {
                "events": events,
                "changes": dict(counts),
                "seconds": ours,
                "events_per_second": events / ours,
                "peak_rss_mb": mem.peak_mb,
                "pg_recvlogical_seconds": theirs if recv and r.returncode == 0 else None,
                "pg_recvlogical_error": None if not recv or r.returncode == 0 else r.stderr[-500:],
            }
        )
        print(
            f"  capture: {events} events in {ours:.1f}s = {events / ours:,.0f} events/s (peak {mem.peak_mb:.0f} MB)"
            + (
                f"; pg_recvlogical {theirs:.1f}s = {events / theirs:,.0f} events/s"
                if recv and r.returncode == 0
                else f"; pg_recvlogical failed: {r.stderr[-300:] if r else 'not found'}"
            ),
            flush=True,
        )
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("SELECT pg_drop_replication_slot('bench_recv')")
    conn.close()
    ours_eps = statistics.median(x["events_per_second"] for x in runs)
    theirs = [x["events"] / x["pg_recvlogical_seconds"] for x in runs if x["pg_recvlogical_seconds"]]
    return {
        "runs": runs,
        "median_events_per_second": ours_eps,
        "median_pg_recvlogical_events_per_second": statistics.median(theirs) if theirs else None,
    }


def bench_column(spark, lake, dsn: str, blocks: int, repeat: int, chunk_rows: int) -> dict:
    """The re-bootstrap and the one-column backfill of the same table, side by side per repeat."""
    from cdc_lakehouse.bootstrap.column import backfill_columns

    cfg = _reader_config(blocks, "copy", chunk_rows)
    cfg = cfg.model_copy(update={"bootstrap": cfg.bootstrap.model_copy(update={"chunk_rows": chunk_rows})})
    runs: list[dict] = []
    for i in range(repeat):
        boot = _one_bootstrap(spark, lake, cfg, f"col-boot{i}", dsn)
        with PeakRSS() as mem, HeldOpen(dsn) as held:
            t = time.time()
            r = backfill_columns(spark, lake, cfg, ["score"], run_id=f"col{i}-{time.time_ns()}")
            secs = time.time() - t
        runs.append(
            {
                "rebootstrap_seconds": boot["seconds"],
                "rebootstrap_longest_xact_seconds": boot["longest_xact_seconds"],
                "column_seconds": secs,
                "column_rows": r.rows_read,
                "column_chunks": r.chunks,
                "column_peak_rss_mb": mem.peak_mb,
                "column_longest_xact_seconds": held.longest_xact,
            }
        )
        print(
            f"  re-bootstrap {boot['rows']} rows {boot['seconds']:.1f}s (longest transaction "
            f"{boot['longest_xact_seconds']:.2f}s); one-column backfill {r.rows_read} rows in "
            f"{r.chunks} chunks {secs:.1f}s (longest transaction {held.longest_xact:.2f}s)",
            flush=True,
        )
    rb = statistics.median(x["rebootstrap_seconds"] for x in runs)
    col = statistics.median(x["column_seconds"] for x in runs)
    print(f"column backfill {blocks} rows: median {col:.1f}s vs re-bootstrap {rb:.1f}s = {col / rb:.2f}x", flush=True)
    return {"runs": runs, "median_rebootstrap_seconds": rb, "median_column_seconds": col, "ratio": col / rb}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--changes", type=int, default=200_000)
    p.add_argument("--what", default="bootstrap,audit,capture")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument(
        "--readers",
        default="copy,jdbc",
        help="bootstrap.reader values to run side by side; `chunked`: the chunked mode",
    )
    p.add_argument("--chunk-rows", type=int, default=50_000, help="bootstrap.chunk_rows of the chunked mode")
    args = p.parse_args()
    what = args.what.split(",")
    db, dsn, wl = prepare_source(args.blocks)
    results: dict = {"blocks": args.blocks, "database": db}
    if "capture" in what:
        print("capture:", flush=True)
        results["capture"] = bench_capture(dsn, wl, args.changes, args.repeat)
    if "bootstrap" in what or "audit" in what or "column" in what:
        from cdc_lakehouse.lake.meta import ensure_meta_tables
        from cdc_lakehouse.runtime.session import get_spark
        from cdc_lakehouse.settings import LakeSettings

        lake = LakeSettings.from_env().with_(
            warehouse=f"file://{HERE / '.work' / 'warehouse'}", landing_uri=f"file://{HERE / '.work' / 'landing'}"
        )
        spark = get_spark(
            "bench-source", lake, classic=True, driver_memory=os.environ.get("CDC_BENCH_DRIVER_MEMORY", "4g")
        )
        ensure_meta_tables(spark, lake)
        if "bootstrap" in what:
            print("bootstrap:", flush=True)
            results["bootstrap"] = bench_bootstrap(
                spark, lake, dsn, args.blocks, args.repeat, args.readers.split(","), args.chunk_rows
            )
        if "column" in what:
            print("column backfill:", flush=True)
            results["column"] = bench_column(spark, lake, dsn, args.blocks, args.repeat, args.chunk_rows)
        if "audit" in what:
            print("audit:", flush=True)
            results["audit"] = bench_audit(spark, lake, args.blocks, args.repeat)
        spark.stop()
    results["machine"] = machine()
    out = HERE / "results" / f"source-{args.blocks}.json"
    out.parent.mkdir(exist_ok=True)
    prev = json.loads(out.read_text()) if out.exists() else {}
    out.write_text(json.dumps({**prev, **results}, indent=2, default=str))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
