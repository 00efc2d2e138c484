"""The local stack's Spark Connect server, warmed before its first task: one real ingest of a
small synthetic batch (the bench's workload: bench/workload.py) into a scratch lake of its own,
a Hadoop catalog in the server's folder. It does what the shipped, generic warm-up
(cdc_lakehouse.runtime.warmup) does, and more: the ingest's own plans are compiled and its code
paths hot when the demo's first task arrives (docs/benchmarks-history.md, "Spark Connect: the first task
on a new server"). The bench's generator is why this lives in the local stack, not the package."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

log = logging.getLogger(__name__)

ROWS, CHANGES = 20_000, 4_000
CATALOG = "cdc_warm_lake"  # the scratch lake's catalog, in the warm-up's session only


def warm_local_server(url: str, workdir: Path) -> float:
    """The warm-up ingest on the server at `url`; returns its seconds. Nothing is left in workdir."""
    started = time.monotonic()
    scratch = Path(workdir) / "warm-ingest"
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        _one_ingest(url, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    seconds = time.monotonic() - started
    log.info("Spark Connect server %s warmed up with an ingest in %.1fs", url, seconds)
    return seconds


def _one_ingest(url: str, scratch: Path) -> None:
    import pyarrow.parquet as pq
    from cdc_lakehouse.config import parse_table_config
    from cdc_lakehouse.ingest.ingest_table import ingest_table
    from cdc_lakehouse.lake.meta import ensure_meta_tables
    from cdc_lakehouse.runtime.session import configure_session, connect_session, release_spark
    from cdc_lakehouse.settings import LakeSettings

    from bench.ingest_bench import bench_table_config, load_base
    from bench.workload import base_table, change_batch, write_landing

    scratch.mkdir(parents=True)
    pq.write_table(base_table(ROWS), scratch / "base.parquet")
    write_landing(change_batch(ROWS, CHANGES), scratch / "landing", "bench", "20260601T010000Z", start_lsn=500)
    # Its own settings, nothing from the environment: no catalog property of the user's lake.
    lake = LakeSettings(
        catalog_name=CATALOG,
        catalog_type="hadoop",
        warehouse=f"file://{scratch}/warehouse",
        landing_uri=f"file://{scratch}/landing",
    )
    cfg, errors = parse_table_config(bench_table_config("warm_ingest", "merge-on-read"), "warm-up")
    assert cfg is not None and not errors, errors
    spark = connect_session(url)
    try:
        configure_session(spark, lake)
        ensure_meta_tables(spark, lake)
        load_base(spark, lake, cfg, {"base": str(scratch / "base.parquet")})
        ingest_table(spark, lake, cfg, upto_run=None, ingest_run="warm-up")
    finally:
        release_spark(spark)
