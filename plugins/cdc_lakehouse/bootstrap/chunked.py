"""Online chunked bootstrap (bootstrap.mode: chunked), after Netflix's DBLog.

Per table:
  1. the endpoint's capture slot exists and the publication holds the table (prepare_endpoint),
     so from here on every change reaches the landing zone;
  2. a shard not yet in the table's watermark gets one at P0, the consistent point of a temporary
     slot created and dropped at once (the same handoff guarantee as the snapshot mode, but the
     snapshot is released immediately): the ingest applies every transaction committed at or after
     P0, and the chunks supply what committed before;
  3. per shard, chunks in key order (keyset pagination on the full key, bootstrap.chunks): a low
     watermark message L in the WAL, the chunk's read in one short transaction, a high watermark H;
  4. the chunk is applied at position (L, -1) with the ingest's row-level LSN guard: every change
     after L carries a commit LSN above L, so the stream's version wins whether the ingest applied
     it before the chunk (its row is newer than L, the MERGE leaves it) or applies it later (its
     MERGE finds the chunk's row older). A hard delete applied before the chunk left no row to
     compare with, so keys the lake's changelog deleted after L are left out of the chunk; a
     truncate after L drops the whole chunk (every row there now was inserted after it and
     comes from the stream). DBLog's rule (drop keys changed between L and H, apply at H) needs
     the stream to have reached H before a chunk is applied; "the stream wins after L" needs
     nothing from the capture, so chunk merges and hourly ingests commute. A chunk's commit
     never carries a watermark, so it never moves it;
  5. the chunk's progress row (cdc_meta.bootstrap_progress) is appended; a killed or paused
     bootstrap resumes after the last recorded chunk.

The L/H messages (pg_logical_emit_message, prefix `cdc_lakehouse`) are recorded by the capture in
its manifest (`bootstrap_markers`), so the order of chunks and stream is visible there too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from cdc_lakehouse.bootstrap.chunks import (
    APPLICATION_NAME,
    ChunkQuery,
    ChunkRead,
    chunk_query,
    estimated_rows,
    last_key,
    read_chunk,
    refuse_without_key,
)
from cdc_lakehouse.bootstrap.progress import ShardProgress, load_progress, record_progress
from cdc_lakehouse.bootstrap.run import _event_columns, _prepare_tables, _Snapshot, _Target
from cdc_lakehouse.bootstrap.snapshot import (
    BootstrapError,
    ShardSource,
    export_snapshot,
    preflight,
    prepare_endpoint,
    shards_by_endpoint,
    typed_rows,
)
from cdc_lakehouse.config import COMMIT_TS_COL, LSN_COL, OP_COL, SEQ_COL, SHARD_COL, TableConfig
from cdc_lakehouse.lake.commits import with_commit_retries
from cdc_lakehouse.lake.tables import changelog_columns, conform_to
from cdc_lakehouse.lake.watermark import read_watermark, watermark_json
from cdc_lakehouse.runtime.failpoints import crash_point
from cdc_lakehouse.settings import LakeSettings

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)


@dataclass
class ChunkedRun:
    """What one chunked bootstrap run did, shard by shard."""

    table: str
    run_id: str
    rows: dict[str, int] = field(default_factory=dict)  # rows read by this run, per shard
    chunks: dict[str, int] = field(default_factory=dict)  # chunks done by this run, per shard
    done: dict[str, bool] = field(default_factory=dict)
    resumed: dict[str, int] = field(default_factory=dict)  # shard -> chunk it resumed after
    longest_xact_seconds: float = 0.0
    paused: bool = False
    started: float = field(default_factory=time.monotonic)

    def to_dict(self) -> dict[str, Any]:
        elapsed = time.monotonic() - self.started
        total = sum(self.rows.values())
        return {
            "table": self.table,
            "run_id": self.run_id,
            "mode": "chunked",
            "rows": total,
            "shards": dict(self.rows),
            "chunks": dict(self.chunks),
            "done": all(self.done.values()) and bool(self.done),
            "resumed": dict(self.resumed),
            "paused": self.paused,
            "seconds": elapsed,
            "rows_per_second": total / elapsed if elapsed else None,
            "longest_xact_seconds": self.longest_xact_seconds,
        }


def chunked_bootstrap(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    *,
    run_id: str,
    shards: list[str] | None = None,
    all_endpoint_tables: dict[str, dict] | None = None,
    should_stop: Callable[[ShardProgress], bool] | None = None,
    table_configs: list[TableConfig] | None = None,
) -> dict[str, Any]:
    """Chunk cfg's shards (all, or `shards`) into its current table and changelog; resumes a run
    that was killed or paused. should_stop is asked after every chunk (pause from the DAG)."""
    endpoints = shards_by_endpoint(cfg, shards)
    if not endpoints:
        raise BootstrapError(f"{cfg.name}: no shards selected")
    _check_keys(cfg, endpoints)  # first: without a key the preflight's other findings are moot
    columns, pg_types = preflight(cfg, endpoints)
    # False: chunks MERGE into the table, so single shards need no shard partitioning.
    target = _prepare_tables(spark, lake, cfg, columns, False)
    progress = load_progress(spark, lake, cfg.name)
    run = ChunkedRun(cfg.name, run_id)
    for endpoint_id, sources in endpoints.items():
        prepare_endpoint(endpoint_id, sources, cfg, (all_endpoint_tables or {}).get(endpoint_id), table_configs)
        _start_positions(spark, cfg, target, endpoint_id, sources, run_id, progress)
    for sources in endpoints.values():
        for s in sources:
            q = chunk_query(
                s.schema, cfg.source.table, target.columns, pg_types, cfg.primary_key, cfg.bootstrap.chunk_rows
            )
            state = _shard_state(cfg, s, progress.get(s.shard), run_id)
            if not _run_shard(spark, lake, cfg, target, s, q, state, run, should_stop):
                run.paused = True
                break
        if run.paused:
            break
    result = run.to_dict()
    log.info("bootstrap %s (chunked): %s", cfg.name, result)
    return result


def choose_mode(cfg: TableConfig, shards: list[str] | None = None) -> str:
    """bootstrap.mode, with `auto` resolved by the shards' estimated rows (pg_class.reltuples)
    against bootstrap.auto_chunked_rows; a table with no usable key stays on the snapshot mode."""
    import psycopg2

    from cdc_lakehouse.bootstrap.chunks import has_usable_key

    mode = cfg.bootstrap.mode
    if mode != "auto":
        return mode
    total, keyed = 0, True
    for sources in shards_by_endpoint(cfg, shards).values():
        try:
            conn = psycopg2.connect(
                sources[0].endpoint.dsn(), connect_timeout=15, application_name="cdc_lakehouse bootstrap"
            )
        except psycopg2.OperationalError:
            return "snapshot"  # whose preflight reports the connection problem with its fix
        try:
            with conn.cursor() as cur:
                for s in sources:
                    total += estimated_rows(cur, s.schema, cfg.source.table)
                    keyed = keyed and has_usable_key(cur, s.schema, cfg.source.table, cfg.primary_key)
        except psycopg2.Error:
            return "snapshot"  # a missing table or privilege: the preflight names it and the fix
        finally:
            conn.close()
    chosen = "chunked" if keyed and total >= cfg.bootstrap.auto_chunked_rows else "snapshot"
    log.info(
        "bootstrap %s: mode auto -> %s (about %s rows, threshold %s%s)",
        cfg.name,
        chosen,
        total,
        cfg.bootstrap.auto_chunked_rows,
        "" if keyed else "; no usable key for chunks",
    )
    return chosen


def _check_keys(cfg: TableConfig, endpoints: dict[str, list[ShardSource]]) -> None:
    import psycopg2

    for sources in endpoints.values():
        conn = psycopg2.connect(sources[0].endpoint.dsn(), application_name="cdc_lakehouse bootstrap")
        try:
            with conn.cursor() as cur:
                for s in sources:
                    try:
                        refuse_without_key(cur, cfg.name, s.schema, cfg.source.table, cfg.primary_key)
                    except RuntimeError as exc:
                        raise BootstrapError(str(exc)) from None
        finally:
            conn.close()


def _start_positions(
    spark: SparkSession,
    cfg: TableConfig,
    target: _Target,
    endpoint_id: str,
    sources: list[ShardSource],
    run_id: str,
    progress: dict[str, ShardProgress],
) -> None:
    """Shards with no watermark yet get one at P0, committed (with no rows) before the first
    chunk; a shard already in the watermark keeps its position (a re-sync, or a resumed run)."""
    wm = read_watermark(spark, target.current) or {"v": 1, "shards": {}, "runs": {}}
    cwm = read_watermark(spark, target.changelog) or {"v": 1, "shards": {}, "runs": {}}
    new = [s for s in sources if s.shard not in wm["shards"]]
    if not new:
        return
    conn, point, _snapshot, identity = export_snapshot(sources[0].endpoint, endpoint_id, run_id)
    conn.close()  # only its consistent point is needed: the snapshot is released here
    ts = datetime.now(UTC).isoformat()
    for s in new:
        pos = {
            "lsn": point,
            "ts": ts,
            "endpoint": endpoint_id,
            "source": identity,
            "columns": [n for n, _ in target.columns],
        }
        wm["shards"][s.shard] = pos
        cwm["shards"].setdefault(s.shard, pos)
        progress.pop(s.shard, None)  # progress of an earlier table of this name does not apply
    log.info("bootstrap %s (chunked): shards %s start at LSN %s", cfg.name, [s.shard for s in new], point)
    spark.createDataFrame([], spark.table(target.changelog).schema).writeTo(target.changelog).option(
        "snapshot-property.cdc.watermark", watermark_json(cwm)
    ).append()
    spark.createDataFrame([], spark.table(target.current).schema).writeTo(target.current).option(
        "snapshot-property.cdc.watermark", watermark_json(wm)
    ).append()


def _shard_state(cfg: TableConfig, s: ShardSource, prev: ShardProgress | None, run_id: str) -> ShardProgress:
    """Resume an unfinished run of this shard, or start over (a finished one is a re-sync)."""
    if prev is not None and not prev.done:
        log.info(
            "bootstrap %s (chunked): shard %s resumes run %s after chunk %s (key %s, %s rows so far)",
            cfg.name,
            s.shard,
            prev.run_id,
            prev.chunk,
            prev.last_key,
            prev.rows_total,
        )
        return prev
    return ShardProgress(cfg.name, s.shard, run_id, chunk=-1, last_key=None, started_at=datetime.now(UTC))


def _run_shard(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    target: _Target,
    s: ShardSource,
    q: ChunkQuery,
    state: ShardProgress,
    run: ChunkedRun,
    should_stop: Callable[[ShardProgress], bool] | None,
) -> bool:
    """The shard's chunks until its end; False when paused (should_stop) before the end."""
    import psycopg2

    from cdc_lakehouse.source.session import SESSION_OPTIONS

    if state.chunk >= 0:
        run.resumed[s.shard] = state.chunk
    run.rows.setdefault(s.shard, 0)
    run.chunks.setdefault(s.shard, 0)
    conn = psycopg2.connect(s.endpoint.dsn(), options=SESSION_OPTIONS, application_name=APPLICATION_NAME)
    conn.autocommit = True  # every statement its own transaction: nothing held between chunks
    try:
        with conn.cursor() as cur:
            state.chunks_total = max(state.chunks_total, -(-estimated_rows(cur, s.schema, cfg.source.table) // q.limit))
        # The shard's end now: every row above it was inserted after P0 and comes through the stream.
        upto = last_key(conn, q)
        if upto is None:  # an empty shard: one empty chunk records it as done
            upto = state.last_key
        while True:
            marker = {"table": cfg.name, "shard": s.shard, "chunk": state.chunk + 1, "run_id": state.run_id}
            chunk = read_chunk(conn, q, tuple(n for n, _ in target.columns), state.last_key, marker, upto)
            _apply_chunk(spark, cfg, target, chunk, state.run_id)
            crash_point(f"bootstrap_chunk_applied:{chunk.no}")
            state.advance(chunk, q.limit)
            record_progress(spark, lake, state, chunk)
            crash_point(f"bootstrap_chunk_recorded:{chunk.no}")
            run.rows[s.shard] += chunk.rows.num_rows
            run.chunks[s.shard] += 1
            run.longest_xact_seconds = max(run.longest_xact_seconds, chunk.xact_seconds)
            _log_chunk(cfg, state, chunk, run)
            run.done[s.shard] = state.done
            # Asked after every chunk, the last included (callers count chunks with it).
            stop = should_stop is not None and should_stop(state)
            if state.done:
                return True
            if stop:
                log.info("bootstrap %s (chunked): paused after chunk %s of shard %s", cfg.name, state.chunk, s.shard)
                return False
    finally:
        conn.close()


def _log_chunk(cfg: TableConfig, state: ShardProgress, chunk: ChunkRead, run: ChunkedRun) -> None:
    elapsed = time.monotonic() - run.started
    log.info(
        "bootstrap %s (chunked): shard %s chunk %s done (%s/%s chunks, %s rows in chunk, %s rows for the shard, "
        "%s rows/s, read transaction %.3fs, L %s H %s)",
        cfg.name,
        state.shard,
        chunk.no,
        state.chunks_done,
        state.chunks_total or "?",
        chunk.rows.num_rows,
        state.rows_total,
        f"{sum(run.rows.values()) / elapsed:,.0f}" if elapsed else "?",
        chunk.xact_seconds,
        chunk.low,
        chunk.high,
    )


def _chunk_frame(spark: SparkSession, cfg: TableConfig, target: _Target, chunk: ChunkRead) -> DataFrame:
    """The chunk's rows, typed with the ingest's casts, at (L, -1) as op 'r'."""
    import pyarrow as pa
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType, StructField, StructType

    names = [n for n, _ in target.columns]
    table = chunk.rows.append_column(SHARD_COL, pa.array([chunk.shard] * chunk.rows.num_rows, pa.string()))
    schema = StructType([StructField(c, StringType(), True) for c in [*names, SHARD_COL]])
    # Arrow carries the chunk into the JVM in one piece instead of a Python object per value.
    prev = spark.conf.get("spark.sql.execution.arrow.pyspark.enabled", "false")
    spark.conf.set("spark.sql.execution.arrow.pyspark.enabled", "true")
    try:
        df = spark.createDataFrame(table.select([*names, SHARD_COL]).to_pandas(), schema)
    finally:
        spark.conf.set("spark.sql.execution.arrow.pyspark.enabled", prev)
    return (
        typed_rows(df, cfg, target.columns)
        .withColumn(OP_COL, F.lit("r"))
        .withColumn(LSN_COL, F.lit(chunk.low).cast("bigint"))
        .withColumn(SEQ_COL, F.lit(-1).cast("bigint"))
    )


def _deleted_after(spark: SparkSession, cfg: TableConfig, target: _Target, chunk: ChunkRead) -> tuple[DataFrame, bool]:
    """Keys of the shard that the lake's changelog deleted after L (the only stream changes the
    LSN guard cannot see: a hard delete leaves no row), and whether the shard was truncated
    after L. Updates and inserts after L need no list: their rows are newer than the chunk's."""
    from pyspark.sql import functions as F

    spark.sql(f"REFRESH TABLE {target.changelog}")
    after = spark.table(target.changelog).filter(
        (F.col(SHARD_COL) == chunk.shard) & (F.col(LSN_COL) > F.lit(chunk.low)) & F.col(OP_COL).isin("d", "t")
    )
    truncated = after.filter(F.col(OP_COL) == "t").limit(1).count() > 0
    keys = after.filter(F.col(OP_COL) == "d").select(*cfg.primary_key).distinct()
    return keys, truncated


def _apply_chunk(spark: SparkSession, cfg: TableConfig, target: _Target, chunk: ChunkRead, run_id: str) -> None:
    """Changelog 'r' events, then an LSN-guarded MERGE into the current table; retried from
    scratch (skip list included) when an ingest commits at the same time."""
    from pyspark.sql import functions as F

    if chunk.rows.num_rows == 0:
        return
    frame = _chunk_frame(spark, cfg, target, chunk)

    def attempt() -> None:
        skip, truncated = _deleted_after(spark, cfg, target, chunk)
        if truncated:
            log.info(
                "bootstrap %s: shard %s truncated after chunk %s's L: chunk dropped", cfg.name, chunk.shard, chunk.no
            )
            return
        rows = frame.join(skip, cfg.primary_key, "left_anti").localCheckpoint()
        snap = _Snapshot(run_id, datetime.now(UTC).replace(tzinfo=None), {}, {})
        cl_cols = [c for c, _ in changelog_columns(target.columns)]
        events = conform_to(_event_columns(rows, snap).select(*cl_cols), spark.table(target.changelog).schema)
        events.writeTo(target.changelog).option("distribution-mode", "none").append()
        _merge_current(spark, cfg, target, rows.withColumn(COMMIT_TS_COL, F.lit(snap.time)))

    with_commit_retries(attempt, what=f"{cfg.name} chunk {chunk.shard}#{chunk.no}")


def _merge_current(spark: SparkSession, cfg: TableConfig, target: _Target, rows: DataFrame) -> None:
    """The ingest's MERGE (ingest.merge.merge_sql) with its row-level LSN guard: a row the stream
    wrote later stays. Every chunk row is op 'r', so its delete clauses never fire."""

    from cdc_lakehouse.ingest.merge import merge_sql

    flags = set()
    if cfg.deletes == "soft":
        flags = {cfg.soft_delete_columns.flag, cfg.soft_delete_columns.timestamp}
    schema = spark.table(target.current).schema
    rows = conform_to(rows, schema)
    for c in flags:
        rows = rows.drop(c)
    view = f"cdc_chunk_{abs(hash((target.current, time.monotonic_ns())))}"
    rows.createOrReplaceTempView(view)
    try:
        spark.sql(merge_sql(cfg, target.current, view, [f.name for f in schema.fields if f.name not in flags], []))
    finally:
        spark.catalog.dropTempView(view)
