"""Online chunked bootstrap (bootstrap.mode: chunked), after Netflix's DBLog.

Per table:
  1. the endpoint's capture slot exists and the publication holds the table (prepare_endpoint),
     so from here on every change reaches the landing zone;
  2. a shard not yet in the table's watermark gets one at P0, the consistent point of a temporary
     slot created and dropped at once (the same handoff guarantee as the snapshot mode, but the
     snapshot is released immediately): the ingest applies every transaction committed at or after
     P0, and the chunks supply what committed before;
  3. per shard, chunks in key order (keyset pagination on the full key, bootstrap.chunks): a low
     watermark message L in the WAL, a wait until every transaction that may have committed below
     L is visible (source.markers.wait_until_visible), the chunk's read in one short transaction,
     a high watermark H.
     The work goes in rounds: each round reads the next chunk of every unfinished shard, shards in
     parallel with at most bootstrap.max_connections_per_host connections per server, and applies
     the round's chunks together (one changelog append and one MERGE per round, not per shard);
  4. the chunk is applied at position (L, -1) with the ingest's row-level LSN guard: every change
     after L carries a commit LSN above L, so the stream's version wins whether the ingest applied
     it before the chunk (its row is newer than L, the MERGE leaves it) or applies it later (its
     MERGE finds the chunk's row older). A hard delete applied before the chunk left no row to
     compare with, so keys the lake's changelog deleted after L are left out of the chunk; a
     truncate of the shard after L drops the shard's rows of the chunk (every row there now was inserted after it and
     comes from the stream). DBLog's rule (drop keys changed between L and H, apply at H) needs
     the stream to have reached H before a chunk is applied; "the stream wins after L" needs
     nothing from the capture, so chunk merges and hourly ingests commute. A chunk's commit
     never carries a watermark, so it never moves it;
  5. the round's progress rows (cdc_meta.bootstrap_progress, one per chunk) are appended in one
     commit; a killed or paused bootstrap resumes after the last recorded chunk of each shard;
  6. a round's two commits carry its marker (`cdc.chunk-round`: run and chunks) and are fenced on
     the marker the run last saw, at publish time (lake.commits.fenced_commit): a second
     bootstrap of the table that applied a round meanwhile makes this one fail, instead of both
     appending the same chunk's rows. One chunked bootstrap of a table at a time.

The L/H messages (pg_logical_emit_message, prefix `cdc_lakehouse`) are recorded by the capture in
its manifest (`bootstrap_markers`), so the order of chunks and stream is visible there too.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypedDict, cast

from cdc_lakehouse.bootstrap.bootstrap_table import _event_columns, _prepare_tables, _Snapshot, _Target
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
from cdc_lakehouse.bootstrap.progress import ShardProgress, load_progress, progress_row, record_progress
from cdc_lakehouse.bootstrap.result import ChunkedBootstrapResult
from cdc_lakehouse.bootstrap.snapshot import (
    BootstrapError,
    ShardSource,
    export_snapshot,
    preflight,
    prepare_endpoint,
    shards_by_endpoint,
    typed_rows,
)
from cdc_lakehouse.columns import COMMIT_TS_COL, LSN_COL, OP_COL, SEQ_COL, SHARD_COL
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.lake.commits import ConcurrentWriterError, fenced_commit
from cdc_lakehouse.lake.merge import KeyRange, range_kind, run_merge, within_keys
from cdc_lakehouse.lake.snapshots import current_ancestors, read_watermark
from cdc_lakehouse.lake.tables import changelog_columns, conform_to
from cdc_lakehouse.lake.writers import CHUNKED_BOOTSTRAP, READ_UPTO_PROP, WRITER_PROP
from cdc_lakehouse.runtime.failpoints import crash_point
from cdc_lakehouse.runtime.phases import local_checkpoint, releasing_kept
from cdc_lakehouse.runtime.session import session_conf
from cdc_lakehouse.settings import LakeSettings
from cdc_lakehouse.source.markers import ChunkMark
from cdc_lakehouse.watermark import ShardPosition, Watermark

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

log = logging.getLogger(__name__)


@dataclass
class ChunkedRun:
    """What one chunked bootstrap run did, per shard."""

    table: str
    run_id: str
    rows: dict[str, int] = field(default_factory=dict)  # rows read by this run, per shard
    chunks: dict[str, int] = field(default_factory=dict)  # chunks done by this run, per shard
    done: dict[str, bool] = field(default_factory=dict)
    resumed: dict[str, int] = field(default_factory=dict)  # shard -> chunk it resumed after
    longest_xact_seconds: float = 0.0
    paused: bool = False
    started: float = field(default_factory=time.monotonic)
    # Table -> the newest round marker (ROUND_PROP) it carried when this run last read or wrote it:
    # each round's commits are fenced on it (_apply_chunks).
    rounds: dict[str, RoundMarker | None] = field(default_factory=dict)

    def result(self) -> ChunkedBootstrapResult:
        elapsed = time.monotonic() - self.started
        total = sum(self.rows.values())
        return ChunkedBootstrapResult(
            table=self.table,
            run_id=self.run_id,
            rows=total,
            shards=dict(self.rows),
            chunks=dict(self.chunks),
            done=all(self.done.values()) and bool(self.done),
            resumed=dict(self.resumed),
            paused=self.paused,
            seconds=elapsed,
            rows_per_second=total / elapsed if elapsed else None,
            longest_xact_seconds=self.longest_xact_seconds,
        )


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
) -> ChunkedBootstrapResult:
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
        prepare_endpoint(endpoint_id, sources, cfg, (all_endpoint_tables or {}).get(endpoint_id), table_configs, lake)
        _start_positions(spark, cfg, target, endpoint_id, sources, run_id, progress)
    for table in (target.changelog, target.current):  # read with the progress this run resumes from
        spark.sql(f"REFRESH TABLE {table}")
        run.rounds[table] = round_marker_in(current_ancestors(spark, table))
    shards_left = [
        _Shard(
            s,
            chunk_query(
                s.schema, cfg.source.table, target.columns, pg_types, cfg.primary_key, cfg.bootstrap.chunk_rows
            ),
            _shard_state(cfg, s, progress.get(s.shard), run_id),
        )
        for sources in endpoints.values()
        for s in sources
    ]
    for sh in shards_left:
        run.rows[sh.source.shard], run.chunks[sh.source.shard] = 0, 0
        run.done[sh.source.shard] = False
        if sh.state.chunk >= 0:
            run.resumed[sh.source.shard] = sh.state.chunk
    columns_read = tuple(n for n, _ in target.columns)
    with _RoundReader(cfg, columns_read) as reader:
        while shards_left:
            reads = reader.read_round(shards_left)
            stop = _finish_round(spark, lake, cfg, target, reads, run, should_stop)
            shards_left = [sh for sh in shards_left if not sh.state.done]
            if stop and shards_left:
                run.paused = True
                log.info(
                    "bootstrap %s (chunked): paused; shards left %s", cfg.name, [sh.source.shard for sh in shards_left]
                )
                break
    result = run.result()
    log.info("bootstrap %s (chunked): %s", cfg.name, result.to_dict())
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
    wm = read_watermark(spark, target.current) or Watermark.empty()
    cwm = read_watermark(spark, target.changelog) or Watermark.empty()
    new = [s for s in sources if s.shard not in wm.shards]
    if not new:
        return
    conn, point, _snapshot, identity = export_snapshot(sources[0].endpoint, endpoint_id, run_id)
    conn.close()  # only its consistent point is needed: the snapshot is released here
    ts = datetime.now(UTC).isoformat()
    for s in new:
        pos = ShardPosition(
            lsn=point, ts=ts, endpoint=endpoint_id, source=identity, columns=[n for n, _ in target.columns]
        )
        wm.set_shard(s.shard, pos)
        if s.shard not in cwm.shards:
            cwm.set_shard(s.shard, pos)
        progress.pop(s.shard, None)  # progress of an earlier table of this name does not apply
    log.info("bootstrap %s (chunked): shards %s start at LSN %s", cfg.name, [s.shard for s in new], point)
    for table, w in ((target.changelog, cwm), (target.current, wm)):
        spark.createDataFrame([], spark.table(table).schema).writeTo(table).option(
            "snapshot-property.cdc.watermark", w.to_json()
        ).option(f"snapshot-property.{WRITER_PROP}", CHUNKED_BOOTSTRAP.name).append()


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


@dataclass
class _Shard:
    """One shard's part of a chunked run: where it reads from, its query and its progress."""

    source: ShardSource
    query: ChunkQuery
    state: ShardProgress
    upto: list[str] | None = None  # the shard's highest key when its first chunk of this run was read
    started: bool = False


class _RoundReader:
    """Reads one chunk of each given shard per round, in threads: psycopg2 releases the GIL while
    it waits on the server, so shards on different connections overlap. A semaphore per server
    keeps to bootstrap.max_connections_per_host; every connection is opened for one chunk and
    closed after it, so nothing stays open (or holds an xmin) between chunks."""

    def __init__(self, cfg: TableConfig, columns: tuple[str, ...]):
        from concurrent.futures import ThreadPoolExecutor

        self.table, self.per_host, self.columns = cfg.source.table, cfg.bootstrap.max_connections_per_host, columns
        self.commit_wait = cfg.bootstrap.commit_wait_seconds
        self.pool: ThreadPoolExecutor | None = None
        self.slots: dict[tuple[tuple[str, int], ...], threading.BoundedSemaphore] = {}

    def __enter__(self) -> _RoundReader:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    def read_round(self, shards: list[_Shard]) -> list[tuple[_Shard, ChunkRead]]:
        from concurrent.futures import ThreadPoolExecutor

        for sh in shards:  # made here, not in the threads: setdefault there would race
            self.slots.setdefault(_server(sh), threading.BoundedSemaphore(self.per_host))
        if self.pool is None:  # enough threads to fill every server's cap at once
            self.pool = ThreadPoolExecutor(self.per_host * len(self.slots), thread_name_prefix="cdc-chunk")
        futures = [(sh, self.pool.submit(self._read, sh)) for sh in shards]
        return [(sh, f.result()) for sh, f in futures]  # in shard order; the first error is raised

    def _read(self, sh: _Shard) -> ChunkRead:
        import psycopg2

        from cdc_lakehouse.source.session import SESSION_OPTIONS

        with self.slots[_server(sh)]:
            conn = psycopg2.connect(
                sh.source.endpoint.dsn(), options=SESSION_OPTIONS, application_name=APPLICATION_NAME
            )
            conn.autocommit = True  # every statement its own transaction: nothing held between chunks
            try:
                if not sh.started:
                    _start_shard(conn, sh, self.table)
                st = sh.state
                marker = ChunkMark(table=st.table, shard=st.shard, chunk=st.chunk + 1, run_id=st.run_id)
                return read_chunk(
                    conn, sh.query, self.columns, st.last_key, marker, sh.upto, commit_wait=self.commit_wait
                )
            finally:
                conn.close()


def _server(sh: _Shard) -> tuple[tuple[str, int], ...]:
    """The cap is per server: several databases (endpoints) on one host share it (a host list:
    the servers it names, of which the one that takes writes is read)."""
    return tuple(sorted(sh.source.endpoint.hosts))


def _start_shard(conn, sh: _Shard, table: str) -> None:
    """The shard's end now (every row above it was inserted after P0 and comes through the
    stream) and its estimated number of chunks."""
    with conn.cursor() as cur:
        rows = estimated_rows(cur, sh.source.schema, table)
    sh.state.chunks_total = max(sh.state.chunks_total, -(-rows // sh.query.limit))
    sh.upto = last_key(conn, sh.query)
    if sh.upto is None:  # an empty shard: one empty chunk records it as done
        sh.upto = sh.state.last_key
    sh.started = True


def _finish_round(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    target: _Target,
    reads: list[tuple[_Shard, ChunkRead]],
    run: ChunkedRun,
    should_stop: Callable[[ShardProgress], bool] | None,
) -> bool:
    """Apply the round's chunks in one commit pair, record their progress, log them; True when
    should_stop (asked once per chunk, as callers count chunks with it) asks to pause."""
    started = time.monotonic()
    with releasing_kept():  # a round's checkpoints go with it, not with the whole bootstrap
        _apply_chunks(spark, cfg, target, [c for _, c in reads], run)
    log.info(
        "bootstrap %s (chunked): round of %d chunk(s), %d rows, applied in %.2fs",
        cfg.name,
        len(reads),
        sum(c.rows.num_rows for _, c in reads),
        time.monotonic() - started,
    )
    for _, chunk in reads:
        crash_point(f"bootstrap_chunk_applied:{chunk.no}")
    rows = []
    for sh, chunk in reads:
        sh.state.advance(chunk, sh.query.limit)
        rows.append(progress_row(sh.state, chunk))
    record_progress(spark, lake, rows)
    stop = False
    for sh, chunk in reads:
        crash_point(f"bootstrap_chunk_recorded:{chunk.no}")
        shard = sh.source.shard
        run.rows[shard] += chunk.rows.num_rows
        run.chunks[shard] += 1
        run.done[shard] = sh.state.done
        run.longest_xact_seconds = max(run.longest_xact_seconds, chunk.xact_seconds)
        _log_chunk(cfg, sh.state, chunk, run)
        stop = (should_stop is not None and should_stop(sh.state)) or stop
    return stop


def _log_chunk(cfg: TableConfig, state: ShardProgress, chunk: ChunkRead, run: ChunkedRun) -> None:
    elapsed = time.monotonic() - run.started
    log.info(
        "bootstrap %s (chunked): shard %s chunk %s done (%s/%s chunks, %s rows in chunk, %s rows for the shard, "
        "%s rows/s, read transaction %.3fs, waited %.3fs for commits below L, L %s H %s)",
        cfg.name,
        state.shard,
        chunk.no,
        state.chunks_done,
        state.chunks_total or "?",
        chunk.rows.num_rows,
        state.rows_total,
        f"{sum(run.rows.values()) / elapsed:,.0f}" if elapsed else "?",
        chunk.xact_seconds,
        chunk.visible_wait_seconds,
        chunk.low,
        chunk.high,
    )


def _chunks_frame(spark: SparkSession, cfg: TableConfig, target: _Target, chunks: list[ChunkRead]) -> DataFrame:
    """The chunks' rows, typed with the ingest's casts, each at its own (L, -1) as op 'r'."""
    import pyarrow as pa
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType, StructField, StructType

    names = [n for n, _ in target.columns]
    table = pa.concat_tables(
        [
            c.rows.select(names).append_column(SHARD_COL, pa.array([c.shard] * c.rows.num_rows, pa.string()))
            for c in chunks
        ]
    )
    schema = StructType([StructField(c, StringType(), True) for c in [*names, SHARD_COL]])
    # Arrow carries the chunks into the JVM in one piece instead of a Python object per value.
    with session_conf(spark, {"spark.sql.execution.arrow.pyspark.enabled": "true"}):
        df = spark.createDataFrame(table.to_pandas(), schema)
    # A round holds one chunk per shard, so the shard names the chunk and its L.
    low = F.create_map(*[x for c in chunks for x in (F.lit(c.shard), F.lit(c.low).cast("bigint"))])
    return (
        typed_rows(df, cfg, target.columns)
        .withColumn(LSN_COL, low[F.col(SHARD_COL)])
        .withColumn(OP_COL, F.lit("r"))
        .withColumn(SEQ_COL, F.lit(-1).cast("bigint"))
    )


def _not_superseded(
    spark: SparkSession, cfg: TableConfig, target: _Target, rows: DataFrame, shards: list[str], lowest: int
) -> DataFrame:
    """The chunk rows the stream has not made obsolete in ways the LSN guard cannot see: a key
    the lake's changelog deleted after the row's L (a hard delete leaves no row to compare with),
    and every row of a shard truncated after its L (what is there now was inserted after it and
    comes from the stream). Updates and inserts after L need nothing: their rows are newer."""
    from pyspark.sql import functions as F

    spark.sql(f"REFRESH TABLE {target.changelog}")
    after = spark.table(target.changelog).filter(
        F.col(SHARD_COL).isin(shards) & F.col(OP_COL).isin("d", "t") & (F.col(LSN_COL) > F.lit(lowest))
    )
    truncs = after.filter(F.col(OP_COL) == "t").groupBy(SHARD_COL).agg(F.max(LSN_COL).alias("_trunc_lsn"))
    dels = after.filter(F.col(OP_COL) == "d").groupBy(SHARD_COL, *cfg.primary_key).agg(F.max(LSN_COL).alias("_del_lsn"))
    kept = (
        rows.join(F.broadcast(truncs), SHARD_COL, "left")
        .join(dels, [SHARD_COL, *cfg.primary_key], "left")
        .filter(
            (F.col("_trunc_lsn").isNull() | (F.col("_trunc_lsn") < F.col(LSN_COL)))
            & (F.col("_del_lsn").isNull() | (F.col("_del_lsn") < F.col(LSN_COL)))
        )
    )
    return kept.drop("_trunc_lsn", "_del_lsn")


# A round's commits carry {"run": <run id>, "chunks": {shard: chunk no}}: the position its
# commits are fenced on, as the ingest's are on the watermark.
ROUND_PROP = "cdc.chunk-round"


class RoundMarker(TypedDict):
    """A round's commits carry it (ROUND_PROP): which run applied which chunk of each shard."""

    run: str
    chunks: dict[str, int]  # shard -> the chunk applied


def round_marker_in(snapshots: Iterable[Any]) -> RoundMarker | None:
    """The newest round marker in a chain of snapshots (newest first)."""
    for snap in snapshots:
        raw = snap.summary.get(ROUND_PROP)
        if raw is not None:
            return cast(RoundMarker, json.loads(raw))
    return None


def _apply_chunks(
    spark: SparkSession, cfg: TableConfig, target: _Target, chunks: list[ChunkRead], run: ChunkedRun
) -> None:
    """Changelog 'r' events, then an LSN-guarded MERGE into the current table, for all of a
    round's chunks at once. Each commit is fenced on the newest round marker the run saw on its
    table (lake.commits.fenced_commit): a second bootstrap of the table that applied a round in
    between (a zombie, a manual run) makes this one fail before its round is visible, instead of
    both appending the chunk's rows. A commit that only lost the race with an ingest (no marker
    moved) is made again from the new snapshot, skip list included."""
    from pyspark.sql import functions as F

    chunks = [c for c in chunks if c.rows.num_rows]
    if not chunks:
        return
    frame = local_checkpoint(_chunks_frame(spark, cfg, target, chunks))
    within = round_key_range(cfg, frame)
    shards = sorted({c.shard for c in chunks})
    lowest = min(c.low for c in chunks)
    marker = RoundMarker(run=run.run_id, chunks={c.shard: c.no for c in chunks})
    props = {
        ROUND_PROP: json.dumps(marker, separators=(",", ":"), sort_keys=True),
        # The chunks' values were read up to their high markers (lake.points).
        READ_UPTO_PROP: json.dumps({c.shard: c.high for c in chunks}, sort_keys=True),
    }

    # An event whose row the stream superseded meanwhile is harmless in the changelog: the
    # stream's change of the key carries a higher LSN, so readers of the changelog see it as newer.
    snap = _Snapshot(run.run_id, datetime.now(UTC).replace(tzinfo=None), Watermark.empty(), Watermark.empty())
    rows = local_checkpoint(_not_superseded(spark, cfg, target, frame, shards, lowest))
    cl_cols = [c for c, _ in changelog_columns(target.columns)]

    def append(into: str) -> None:
        events = conform_to(_event_columns(rows, snap).select(*cl_cols), spark.table(target.changelog).schema)
        events.writeTo(into).option("distribution-mode", "none").option(
            f"snapshot-property.{ROUND_PROP}", props[ROUND_PROP]
        ).option(f"snapshot-property.{WRITER_PROP}", CHUNKED_BOOTSTRAP.name).append()

    def merge(into: str) -> None:  # the skip list again: an ingest that won the commit race may have deleted keys
        kept = _not_superseded(spark, cfg, target, frame, shards, lowest)
        _merge_current(spark, cfg, target, kept.withColumn(COMMIT_TS_COL, F.lit(snap.time)), into, props, within)

    what = f"{cfg.name} chunks " + ", ".join(f"{c.shard}#{c.no}" for c in chunks)
    for table, write in ((target.changelog, append), (target.current, merge)):
        fenced_commit(
            spark,
            table,
            run.rounds.get(table),
            marker,
            write,
            what=what,
            position=round_marker_in,
            conflict=functools.partial(_another_bootstrap, cfg, table, run.run_id),
        )
        run.rounds[table] = marker


def _another_bootstrap(cfg: TableConfig, table: str, run_id: str, now: RoundMarker | None) -> ConcurrentWriterError:
    other = now["run"] if now else None
    return ConcurrentWriterError(
        f"{cfg.name}: another chunked bootstrap (run {other}) applied chunks {now['chunks'] if now else None} to {table} "
        f"since this run ({run_id}) read it; nothing of this round was published. Run one bootstrap of a table "
        "at a time: let the other run finish (or stop it), then rerun; a run resumes after the last recorded chunk"
    )


def round_key_range(cfg: TableConfig, frame: DataFrame) -> str | None:
    """The key range of a round's rows, per shard (lake.merge.within_keys): its MERGE then reads
    only the table's files that may hold those keys. Chunks come in key order, so the rounds
    before wrote files below the range, and each round costs its own rows, not the table loaded so
    far (docs/benchmarks-history.md, "A chunked bootstrap's round"). Text keys come in the source's collation
    order, which Spark's byte order need not follow: their range is still exact for the round's
    rows, it only prunes less. None when no key column can be bounded."""
    from pyspark.sql import functions as F

    types = {k: frame.schema[k].dataType.simpleString() for k in cfg.primary_key}
    cols = [k for k in cfg.primary_key if range_kind(types[k])]
    if not cols:
        return None

    def carried(k: str, v: Column) -> Column:
        kind = range_kind(types[k])
        return F.unix_micros(v) if kind == "micros" else F.unix_date(v) if kind == "days" else v.cast("string")

    aggs = [
        carried(k, agg(F.col(k))).alias(f"_{n}{i}")
        for i, k in enumerate(cols)
        for agg, n in ((F.min, "lo"), (F.max, "hi"))
    ]
    ranges = {
        r[SHARD_COL]: [KeyRange(k, types[k], r[f"_lo{i}"], r[f"_hi{i}"]) for i, k in enumerate(cols)]
        for r in frame.groupBy(SHARD_COL).agg(*aggs).collect()
    }
    return within_keys(ranges)


def _merge_current(
    spark: SparkSession,
    cfg: TableConfig,
    target: _Target,
    rows: DataFrame,
    into: str,
    props: dict[str, str],
    within: str | None = None,
) -> None:
    """The ingest's MERGE (lake.merge.run_merge) with its row-level LSN guard into `into` (the
    current table's branch), its commit carrying props: a row the stream wrote later stays.
    Every chunk row is op 'r', so its delete clauses never fire. within: round_key_range."""

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
        # Rows merged at the chunk's own position, below or above the watermark (which does not
        # move): readers of ranges diff across this commit (lake.ranges), as its writer says.
        columns = [f.name for f in schema.fields if f.name not in flags]
        run_merge(spark, cfg, into, view, columns, {**props, **CHUNKED_BOOTSTRAP.props()}, within=within)
    finally:
        spark.catalog.dropTempView(view)
