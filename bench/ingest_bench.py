"""Apply cost of one batch of changes: our ingest vs the tools a team would pick instead.

    python bench/ingest_bench.py --rows 2000000 --changes 200000 [--engines ...] [--repeat 3]

Engines, each on the same base table and the same batch, each checked against the same
expected final state (computed by DuckDB from the inputs):
  ours-mor / ours-cow   cdc_lakehouse.ingest.ingest_table (validate, changelog, pre-combine, LSN-guarded MERGE)
                        of the batch landed typed, as the capture lands it (format 2)
  ours-text             ours-mor of the same batch landed as text (format 1, before issue #56)
  ours-mor-shuffle, ours-mor-colocated   ours-mor with ingest.merge_join forced (default auto)
                        on Spark + Iceberg, merge-on-read / copy-on-write
  spark-merge           a plain Spark MERGE of the pre-combined batch into the same Iceberg layout:
                        the cost of our guarantees is ours-mor / spark-merge
  pyiceberg             pyiceberg table.upsert + delete of the pre-combined batch
  delta                 delta-rs (deltalake) MERGE of the pre-combined batch
  rewrite               a full rewrite of the table with DuckDB (the periodic snapshot reload)
Each engine runs in its own process; its peak memory is the sampled RSS of its process tree.
Figures: seconds per repeat (the first includes JIT warm-up), median of the rest, write
amplification (bytes written / bytes of the changed rows). Results go to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "plugins"), str(ROOT)]
from bench.measure import (  # noqa: E402
    PeakRSS,
    files_holding_keys,
    last_execution_id,
    machine,
    scan_files,
    worker_result,
)

WORK = Path(os.environ.get("CDC_BENCH_WORK", HERE / ".work"))
ENGINES = ["ours-mor", "ours-cow", "spark-merge", "pyiceberg", "delta", "rewrite"]


def prepare(rows: int, changes: int, toast_share: float = 0.3, landing_format: int = 2) -> dict:
    """Base table and batch on disk (cached), with the expected checksum. toast_share: the share
    of updates that leave the content column out (an unchanged TOAST value); landing_format: 2,
    typed as the capture lands it now, or 1, the text landing of before issue #56."""
    import pyarrow.parquet as pq

    from bench.workload import base_table, change_batch, expected_checksum, reduced_changes, write_landing

    d = WORK / f"r{rows}"
    d.mkdir(parents=True, exist_ok=True)
    base = d / "base.parquet"
    if not base.exists():
        # In slices: NumPy's fixed-width strings for 20M rows would not fit in memory at once.
        chunk = 2_000_000
        tmp = base.with_suffix(".tmp")
        writer = None
        for start in range(1, rows + 1, chunk):
            t = base_table(min(chunk, rows - start + 1), start=start)
            writer = writer or pq.ParquetWriter(tmp, t.schema)
            writer.write_table(t, row_group_size=256_000)
        writer.close()
        tmp.rename(base)
    # v2: no update after a delete of the same key; v3: landing row groups of the capture's size.
    fmt = "v3" if landing_format == 1 else "v4-typed"
    bdir = d / (f"c{changes}-{fmt}" if toast_share == 0.3 else f"c{changes}-t{toast_share:g}-{fmt}")
    meta = bdir / "meta.json"
    if not meta.exists():
        batch = change_batch(rows, changes, toast_share=toast_share)
        write_landing(
            batch, bdir / "landing", "bench", "20260601T010000Z", start_lsn=500, landing_format=landing_format
        )
        reduced = reduced_changes(batch, str(base))
        pq.write_table(reduced, bdir / "reduced.parquet")
        info = {
            "events": batch.events,
            "updates": batch.updates,
            "inserts": batch.inserts,
            "deletes": batch.deletes,
            "toast_unchanged": batch.toast,
            "keys": reduced.num_rows,
            "expected": expected_checksum(str(base), reduced),
        }
        meta.write_text(json.dumps(info))
    return {"base": str(base), "dir": str(bdir), **json.loads(meta.read_text())}


# --- engines (run inside a worker process) ------------------------------------------------------


def bench_table_config(name: str, mode: str, merge_join: str = "auto") -> dict:
    """The table config of the bench table (as a YAML document would hold it)."""
    return {
        "name": name,
        "source": {"table": "block", "shards": [{"conn_id": "bench", "schemas": ["s0", "s1", "s2", "s3"]}]},
        "primary_key": ["id"],
        "lake": {"namespace": "bench", "write_mode": mode},
        "ingest": {"error_budget": {"max_quarantined": 0}, "merge_join": merge_join},
    }


def load_base(spark, lake, cfg, prep: dict) -> None:
    """(Re)creates cfg's current table with the base rows and an empty changelog, both at the
    watermark the bench batch starts from (synthetic endpoint "bench", LSN 500)."""
    from cdc_lakehouse.lake.tables import create_lake_tables

    from bench.workload import COLUMNS

    wm = {"v": 1, "shards": {s: {"lsn": 500, "ts": "2026-06-01T00:00:00+00:00"} for s in ["s0", "s1", "s2", "s3"]}}
    for t in (cfg.current_table, cfg.changelog_table):
        spark.sql(f"DROP TABLE IF EXISTS {lake.qualified(t)} PURGE")
    # Quarantined events outlive a dropped table (held-back keys would carry over between runs).
    spark.sql(f"DELETE FROM {lake.qualified(lake.meta_table('quarantine'))} WHERE table_name = '{cfg.name}'")
    create_lake_tables(spark, lake, cfg, [(n, lt) for n, _, lt in COLUMNS])
    base = spark.read.parquet(prep["base"])
    base.writeTo(lake.qualified(cfg.current_table)).option("snapshot-property.cdc.watermark", json.dumps(wm)).append()
    spark.createDataFrame([], spark.table(lake.qualified(cfg.changelog_table)).schema).writeTo(
        lake.qualified(cfg.changelog_table)
    ).option("snapshot-property.cdc.watermark", json.dumps(wm)).append()


def table_checksum(spark, table: str) -> dict:
    """What every engine's final table is checked on: rows, sums of id and version, content length."""
    r = spark.sql(f"SELECT count(*), sum(id), sum(version), sum(length(content)) FROM {table}").collect()[0]
    return {"rows": int(r[0]), "sum_id": int(r[1]), "sum_version": int(r[2]), "sum_content": int(r[3])}


def load_history(spark, lake, cfg, prep: dict) -> None:
    """(Re)creates cfg's history table as caught up with the base rows: each row's one open
    version, the commit carrying the changelog's snapshot that load_base made (issue #55)."""
    from cdc_lakehouse.history.maintain import HISTORY_PROP, HistoryPosition, ensure_history_table
    from cdc_lakehouse.lake.commits import current_snapshot_id
    from pyspark.sql import functions as F

    hist = lake.qualified(cfg.history_table)
    spark.sql(f"DROP TABLE IF EXISTS {hist} PURGE")
    shape = ensure_history_table(spark, lake, cfg)
    head = current_snapshot_id(spark, lake.qualified(cfg.changelog_table))
    assert head is not None
    opened = {
        "_cdc_op": F.lit("r"),
        "_cdc_valid_from_lsn": F.lit(500).cast("bigint"),
        "_cdc_valid_from": F.col("_cdc_commit_ts"),
        "_cdc_valid_to_lsn": F.lit(None).cast("bigint"),
        "_cdc_valid_to": F.lit(None).cast("timestamp"),
        "_cdc_is_current": F.lit(True),
        "_cdc_moved_from": F.lit(None).cast("string"),
        "_cdc_moved_to": F.lit(None).cast("string"),
    }
    rows = spark.read.parquet(prep["base"]).withColumns(opened).select(*shape.columns)
    pos = HistoryPosition(head, {s: 500 for s in ["s0", "s1", "s2", "s3"]})
    rows.writeTo(hist).option(f"snapshot-property.{HISTORY_PROP}", pos.to_json()).append()


def run_ours(
    mode: str, prep: dict, rows: int, repeat: int, merge_join: str = "auto", history: bool = False
) -> list[dict]:
    from cdc_lakehouse.config import parse_table_config
    from cdc_lakehouse.ingest.ingest_table import ingest_table
    from cdc_lakehouse.lake.meta import ensure_meta_tables
    from cdc_lakehouse.runtime.session import get_spark
    from cdc_lakehouse.settings import LakeSettings

    lake = LakeSettings.from_env().with_(
        warehouse=f"file://{WORK}/warehouse", landing_uri=f"file://{prep['dir']}/landing"
    )
    spark = get_spark("bench-ingest", lake, classic=True, driver_memory=os.environ.get("CDC_BENCH_DRIVER_MEMORY", "8g"))
    ensure_meta_tables(spark, lake)
    name = f"blk_{mode.replace('-', '_')}_{rows}"
    config = bench_table_config(name, mode, merge_join)
    if history:
        config["history"] = {"enabled": True}
    cfg, errs = parse_table_config(config, "bench")
    assert not errs, errs
    out = []
    for i in range(repeat):
        load_base(spark, lake, cfg, prep)
        if history:
            load_history(spark, lake, cfg, prep)
        layout = files_holding_keys(spark, lake.qualified(cfg.current_table), f"{prep['dir']}/reduced.parquet")
        since = last_execution_id(spark)
        t = time.time()
        r = ingest_table(spark, lake, cfg, upto_run=None, ingest_run=f"bench-{i}")
        m = r.metrics
        history_secs = None
        if history:
            from cdc_lakehouse.history.maintain import maintain_history

            h0 = time.time()
            h = maintain_history(spark, lake, cfg)
            history_secs = time.time() - h0
            assert h.mode == "incremental" and h.late == 0 and h.unresolved == 0, h
            print(f"  history: {history_secs:.1f}s {h.to_dict()}", flush=True)
        secs = time.time() - t
        pruning = {**layout, **merge_scans(scan_files(spark, since))}
        got = table_checksum(spark, lake.qualified(cfg.current_table))
        ok = got == prep["expected"]
        out.append(
            {
                "pruning": pruning,
                "seconds": secs,
                "history_seconds": history_secs,
                "apply_seconds": m.apply_seconds,
                "write_amplification": m.write_amplification,
                "bytes_written": m.bytes_written,
                "changed_rows_bytes": m.changed_rows_bytes,
                "timings": m.timings,
                "spark_jobs": r.spark_jobs,
                "merge_join": m.merge_join,
                "verified": ok,
                "got": got,
            }
        )
        print(
            f"  {mode} repeat {i + 1}: {secs:.1f}s (merge {m.apply_seconds or 0:.1f}s) "
            f"WA {m.write_amplification or 0:.2f} Spark jobs {r.spark_jobs} join {m.merge_join} "
            f"phases {m.timings} verified={ok}",
            flush=True,
        )
        print(f"  {mode} repeat {i + 1} files: {pruning}", flush=True)
    spark.stop()
    return out


def run_spark_merge(prep: dict, rows: int, repeat: int) -> list[dict]:
    """The floor under ours: one Spark MERGE of the already pre-combined batch into the same Iceberg
    table (merge-on-read, partitioned by shard), in the same Spark setup. No validation,
    changelog, TOAST fill, LSN guard or watermark: ours / this is the price of those guarantees."""
    from cdc_lakehouse.runtime.phases import SparkJobs
    from cdc_lakehouse.runtime.session import get_spark
    from cdc_lakehouse.settings import LakeSettings

    lake = LakeSettings.from_env().with_(warehouse=f"file://{WORK}/warehouse")
    spark = get_spark(
        "bench-spark-merge", lake, classic=True, driver_memory=os.environ.get("CDC_BENCH_DRIVER_MEMORY", "8g")
    )
    table = lake.qualified(f"bench.plain_merge_{rows}")
    out = []
    for i in range(repeat):
        create_plain_table(spark, lake, table, prep)
        layout = files_holding_keys(spark, table, f"{prep['dir']}/reduced.parquet")
        since = last_execution_id(spark)
        t = time.time()
        with SparkJobs(spark, "plain merge") as jobs:
            plain_merge(spark, table, prep)
        secs = time.time() - t
        pruning = {**layout, **merge_scans(scan_files(spark, since))}
        got = table_checksum(spark, table)
        out.append(
            {
                "seconds": secs,
                "spark_jobs": jobs.count,
                "pruning": pruning,
                "verified": got == prep["expected"],
                "got": got,
            }
        )
        print(f"  spark-merge repeat {i + 1}: {secs:.1f}s Spark jobs {jobs.count} verified={got == prep['expected']}")
        print(f"  spark-merge repeat {i + 1} files: {pruning}", flush=True)
    spark.stop()
    return out


def merge_scans(scans: list[dict]) -> dict:
    """The data files the MERGE's scans of the target kept and skipped (bench.measure.scan_files)."""
    merges = [x for x in scans if x["merge"]]
    if not merges:  # zeros here would read as perfect pruning
        raise RuntimeError(f"no MERGE execution with Iceberg scan metrics among {scans}")
    if os.environ.get("CDC_BENCH_PLANS"):  # the MERGE's physical plans, for reading
        with open(os.environ["CDC_BENCH_PLANS"], "a") as f:
            f.writelines(f"--- execution {x['execution']}\n{x['plan']}\n" for x in merges)
    return {
        "merge_joins": sorted({j for x in merges for j in x["joins"]}),
        "merge_scanned_data_files": sum(x.get("result_data_files", 0) for x in merges),
        "merge_skipped_data_files": sum(x.get("skipped_data_files", 0) for x in merges),
    }


def _plain_columns(spark, prep: dict) -> list[str]:
    return [c for c in spark.read.parquet(prep["base"]).columns if not c.startswith("_cdc_") or c == "_cdc_shard"]


def create_plain_table(spark, lake, table: str, prep: dict) -> None:
    """The plain MERGE's target: the base rows in the same Iceberg layout as ours (merge-on-read,
    partitioned by shard, sorted by key), without our metadata columns."""
    base = spark.read.parquet(prep["base"])
    spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {lake.catalog_name}.bench")
    spark.sql(f"DROP TABLE IF EXISTS {table} PURGE")
    base.select(_plain_columns(spark, prep)).sortWithinPartitions("id").writeTo(table).partitionedBy(
        base["_cdc_shard"]
    ).tableProperty("format-version", "2").tableProperty("write.merge.mode", "merge-on-read").create()


def plain_merge(spark, table: str, prep: dict) -> None:
    """One Spark MERGE of the already pre-combined batch (one row per key, deletes marked)."""
    keep = _plain_columns(spark, prep)
    sets = ", ".join(f"t.{c} = s.{c}" for c in keep if c not in ("_cdc_shard", "id"))
    spark.read.parquet(f"{prep['dir']}/reduced.parquet").createOrReplaceTempView("batch")
    spark.sql(
        f"MERGE INTO {table} t USING batch s ON t._cdc_shard = s._cdc_shard AND t.id = s.id "
        f"WHEN MATCHED AND s.op = 'd' THEN DELETE WHEN MATCHED THEN UPDATE SET {sets} "
        f"WHEN NOT MATCHED AND s.op <> 'd' THEN INSERT ({', '.join(keep)}) "
        f"VALUES ({', '.join('s.' + c for c in keep)})"
    )


def _checksum_arrow(table) -> dict:
    import duckdb

    con = duckdb.connect()
    con.register("t", table)
    r = con.execute("SELECT count(*), sum(id), sum(version), sum(length(content)) FROM t").fetchone()
    return {"rows": int(r[0]), "sum_id": int(r[1]), "sum_version": int(r[2]), "sum_content": int(r[3])}


def _reduced_now(prep: dict):
    """Pre-combining the raw batch is part of every peer's work (they cannot take duplicate keys)."""
    import pyarrow.parquet as pq

    return pq.read_table(Path(prep["dir"]) / "reduced.parquet")


def _changed_bytes(base_bytes: int, rows: int, keys: int) -> int:
    return int(base_bytes / rows * keys)


def run_pyiceberg(prep: dict, rows: int, repeat: int) -> list[dict]:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.expressions import And, EqualTo, In, Or

    base = pq.read_table(prep["base"])
    keep = [c for c in base.column_names if not c.startswith("_cdc_") or c == "_cdc_shard"]
    base = base.select(keep)
    out = []
    for i in range(repeat):
        wh = WORK / f"pyiceberg-{rows}-{i}"
        shutil.rmtree(wh, ignore_errors=True)
        wh.mkdir(parents=True, exist_ok=True)
        cat = SqlCatalog("b", uri=f"sqlite:///{wh}/cat.db", warehouse=f"file://{wh}")
        cat.create_namespace_if_not_exists("b")
        tbl = cat.create_table("b.block", schema=base.schema)
        tbl.append(base)
        before_files = _dir_bytes(wh)
        t = time.time()
        red = _reduced_now(prep)
        ups = red.filter(pc.not_equal(red["op"], "d")).select(keep)
        dels = red.filter(pc.equal(red["op"], "d"))
        # A composite join key makes pyiceberg build a per-row Or(And(..)) filter that crashes the
        # interpreter (deep recursion); ids are unique across shards in this data, so join on id.
        tbl.upsert(ups.cast(base.schema), join_cols=["id"])
        if dels.num_rows:
            conds = []
            for s in set(dels["_cdc_shard"].to_pylist()):
                ids = dels.filter(pc.equal(dels["_cdc_shard"], s))["id"].to_pylist()
                conds.append(And(EqualTo("_cdc_shard", s), In("id", ids)))
            expr = conds[0]
            for c in conds[1:]:
                expr = Or(expr, c)
            tbl.delete(expr)
        secs = time.time() - t
        got = _checksum_arrow(cat.load_table("b.block").scan().to_arrow())
        written = _dir_bytes(wh) - before_files
        out.append(
            {
                "seconds": secs,
                "verified": got == prep["expected"],
                "got": got,
                "bytes_written": written,
                "write_amplification": written / _changed_bytes(os.path.getsize(prep["base"]), rows, prep["keys"]),
            }
        )
        print(f"  pyiceberg repeat {i + 1}: {secs:.1f}s verified={got == prep['expected']}", flush=True)
    return out


def run_delta(prep: dict, rows: int, repeat: int) -> list[dict]:
    import pyarrow.parquet as pq
    from deltalake import DeltaTable, write_deltalake

    base = pq.read_table(prep["base"])
    keep = [c for c in base.column_names if not c.startswith("_cdc_") or c == "_cdc_shard"]
    base = base.select(keep)
    out = []
    for i in range(repeat):
        path = WORK / f"delta-{rows}-{i}"
        write_deltalake(str(path), base, partition_by=["_cdc_shard"], mode="overwrite")
        before = _dir_bytes(path)
        t = time.time()
        red = _reduced_now(prep)
        (
            DeltaTable(str(path))
            .merge(
                source=red, predicate="t._cdc_shard = s._cdc_shard AND t.id = s.id", source_alias="s", target_alias="t"
            )
            .when_matched_delete(predicate="s.op = 'd'")
            .when_matched_update(updates={c: f"s.{c}" for c in keep if c not in ("_cdc_shard", "id")})
            .when_not_matched_insert(updates={c: f"s.{c}" for c in keep}, predicate="s.op <> 'd'")
            .execute()
        )
        secs = time.time() - t
        got = _checksum_arrow(DeltaTable(str(path)).to_pyarrow_table())
        written = _dir_bytes(path) - before
        out.append(
            {
                "seconds": secs,
                "verified": got == prep["expected"],
                "got": got,
                "bytes_written": written,
                "write_amplification": written / _changed_bytes(os.path.getsize(prep["base"]), rows, prep["keys"]),
            }
        )
        print(f"  delta repeat {i + 1}: {secs:.1f}s verified={got == prep['expected']}", flush=True)
    return out


def run_rewrite(prep: dict, rows: int, repeat: int) -> list[dict]:
    import duckdb

    out = []
    for i in range(repeat):
        target = WORK / f"rewrite-{rows}-{i}.parquet"
        t = time.time()
        con = duckdb.connect()
        con.execute(f"SET threads = {os.cpu_count() or 2}")
        con.execute(f"""
            COPY (
              SELECT b.* EXCLUDE (_cdc_op, _cdc_commit_lsn, _cdc_seq, _cdc_commit_ts) FROM read_parquet('{prep["base"]}') b
              ANTI JOIN read_parquet('{prep["dir"]}/reduced.parquet') r USING (_cdc_shard, id)
              UNION ALL
              SELECT _cdc_shard, id, space_id, type, properties, content, updated_at, is_archived, version, score
              FROM read_parquet('{prep["dir"]}/reduced.parquet') WHERE op <> 'd'
            ) TO '{target}' (FORMAT parquet, COMPRESSION zstd)""")
        secs = time.time() - t
        r = con.execute(
            f"SELECT count(*), sum(id), sum(version), sum(length(content)) FROM read_parquet('{target}')"
        ).fetchone()
        got = {"rows": int(r[0]), "sum_id": int(r[1]), "sum_version": int(r[2]), "sum_content": int(r[3])}
        written = target.stat().st_size
        out.append(
            {
                "seconds": secs,
                "verified": got == prep["expected"],
                "got": got,
                "bytes_written": written,
                "write_amplification": written / _changed_bytes(os.path.getsize(prep["base"]), rows, prep["keys"]),
            }
        )
        print(f"  rewrite repeat {i + 1}: {secs:.1f}s verified={got == prep['expected']}", flush=True)
        target.unlink()
    return out


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


# --- orchestration --------------------------------------------------------------------------------


def run_engine(engine: str, rows: int, changes: int, repeat: int, toast_share: float = 0.3) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__)),
        "--worker",
        engine,
        "--rows",
        str(rows),
        "--changes",
        str(changes),
        "--repeat",
        str(repeat),
        "--toast-share",
        str(toast_share),
    ]
    t = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    with PeakRSS(proc.pid, interval=0.2) as mem:
        result = worker_result(proc)
    if result is None:
        return {"engine": engine, "error": f"exit {proc.returncode}"}
    warm = [r["seconds"] for r in result[1:]] or [result[0]["seconds"]]
    return {
        "engine": engine,
        "repeats": result,
        "first_seconds": result[0]["seconds"],
        "median_seconds": statistics.median(warm),
        "peak_rss_mb": mem.peak_mb,
        "process_seconds": time.time() - t,
        "verified": all(r["verified"] for r in result),
        "write_amplification": statistics.median(
            [r["write_amplification"] for r in result if r.get("write_amplification") is not None] or [0]
        ),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--changes", type=int, default=200_000)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument(
        "--toast-share", type=float, default=0.3, help="share of updates without the content column (unchanged TOAST)"
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    prep = prepare(args.rows, args.changes, args.toast_share)
    if args.worker:
        # ours-text: the same batch landed as text (format 1, the capture's format before #56).
        text = lambda: prepare(args.rows, args.changes, args.toast_share, landing_format=1)  # noqa: E731
        fn = {
            "ours-mor": lambda: run_ours("merge-on-read", prep, args.rows, args.repeat),
            "ours-history": lambda: run_ours("merge-on-read", prep, args.rows, args.repeat, history=True),
            "ours-text": lambda: run_ours("merge-on-read", text(), args.rows, args.repeat),
            "ours-cow": lambda: run_ours("copy-on-write", prep, args.rows, args.repeat),
            "ours-mor-shuffle": lambda: run_ours("merge-on-read", prep, args.rows, args.repeat, "shuffle"),
            "ours-mor-colocated": lambda: run_ours("merge-on-read", prep, args.rows, args.repeat, "colocated"),
            "spark-merge": lambda: run_spark_merge(prep, args.rows, args.repeat),
            "pyiceberg": lambda: run_pyiceberg(prep, args.rows, args.repeat),
            "delta": lambda: run_delta(prep, args.rows, args.repeat),
            "rewrite": lambda: run_rewrite(prep, args.rows, args.repeat),
        }[args.worker]
        print("RESULT " + json.dumps(fn(), default=str), flush=True)
        return 0
    print(
        f"batch: {prep['events']} events ({prep['updates']} updates, {prep['inserts']} inserts, {prep['deletes']} "
        f"deletes, {prep['toast_unchanged']} with unchanged TOAST) over {prep['keys']} keys; table {args.rows} rows"
    )
    results = []
    tag = "" if args.toast_share == 0.3 else f"-t{args.toast_share:g}"
    out = HERE / "results" / f"ingest-{args.rows}-{args.changes}{tag}.json"
    out.parent.mkdir(exist_ok=True)
    for engine in args.engines.split(","):
        print(f"{engine}:", flush=True)
        results.append(run_engine(engine, args.rows, args.changes, args.repeat, args.toast_share))
        # Written after every engine: a long run stopped half-way keeps what it measured.
        out.write_text(
            json.dumps(
                {"rows": args.rows, "changes": args.changes, "batch": prep, "results": results, "machine": machine()},
                indent=2,
                default=str,
            )
        )
    ours = next((r for r in results if r["engine"] == "ours-mor" and "median_seconds" in r), None)
    print(f"\n{'engine':<11}{'median s':>10}{'first s':>9}{'x ours-mor':>11}{'WA':>8}{'peak MB':>9}  verified")
    for r in results:
        if "median_seconds" not in r:
            print(f"{r['engine']:<11} {r.get('error')}")
            continue
        ratio = r["median_seconds"] / ours["median_seconds"] if ours else float("nan")
        print(
            f"{r['engine']:<11}{r['median_seconds']:>10.2f}{r['first_seconds']:>9.2f}{ratio:>11.2f}"
            f"{r['write_amplification']:>8.2f}{r['peak_rss_mb']:>9.0f}  {r['verified']}"
        )
    print(f"\nresults: {out}")
    return 0 if all(r.get("verified") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
