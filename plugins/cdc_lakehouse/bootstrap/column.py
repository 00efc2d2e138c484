"""One-column backfill, online: the source's values of some columns for the rows the lake already
has, without a re-bootstrap and without a long transaction (the chunked bootstrap's machinery).

When a column becomes consumed (config `columns:`), gets a volatile default, is widened after
its values were quarantined, or needs a repair, the rows the stream has not rewritten since hold
the wrong value (NULL, most often). Per shard, in key order (keyset pagination, bootstrap.chunks):
a low watermark message L in the WAL, a wait until every commit below L is visible
(source.markers.wait_until_visible), the key and the columns of `chunk_rows` rows read in one
short transaction, a high watermark H; then one MERGE into the current table that sets only those
columns, and only on rows whose position is below L:

  - a row the ingest wrote at or after L came from an event after L, which carried the column
    (it was consumed before the backfill started): the stream's value stays;
  - a row below L gets the value read after L; a change committed between L and the read that the
    ingest has not applied yet arrives later with a higher position and sets the same column again
    (its event carries it), so the two commute as the chunked bootstrap's chunks and ingests do;
  - a key missing from the lake (inserted after L, not ingested yet) is not inserted: the stream
    brings it; a key deleted at the source is in no chunk, and the stream deletes it.

The row's position and every other column stay as they are; the changelog is not rewritten (it
keeps what was captured; the current table, the feed and exports see the filled values).
Progress is one row per chunk in cdc_meta.bootstrap_progress (table_name `<table>:columns:<c,...>`);
a killed or paused run resumes after the last recorded chunk of each shard. A finished backfill
of the same columns run again starts over (a repair).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from cdc_lakehouse.bootstrap import copy_read
from cdc_lakehouse.bootstrap.chunked import _check_keys
from cdc_lakehouse.bootstrap.chunks import (
    APPLICATION_NAME,
    KEY_TEXT_PREFIX,
    ChunkRead,
    chunk_query,
    estimated_rows,
    last_key,
    read_typed_chunk,
    typed,
)
from cdc_lakehouse.bootstrap.progress import ShardProgress, load_progress, progress_row, record_progress
from cdc_lakehouse.bootstrap.snapshot import BootstrapError, ShardSource, preflight, shards_by_endpoint
from cdc_lakehouse.bootstrap.typed_select import TypedSelect
from cdc_lakehouse.columns import LSN_COL, SHARD_COL
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.identifiers import spark_ident
from cdc_lakehouse.lake.commits import sql_with_commit_properties, with_commit_retries
from cdc_lakehouse.lake.tables import source_columns_of, sql_string
from cdc_lakehouse.lake.writers import COLUMN_BACKFILL, READ_UPTO_PROP
from cdc_lakehouse.settings import LakeSettings
from cdc_lakehouse.source.markers import ChunkMark

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)


@dataclass
class ColumnBackfillResult:
    table: str
    columns: list[str]
    run_id: str
    chunks: int = 0
    rows_read: int = 0
    seconds: float = 0.0
    paused: bool = False
    shards: dict[str, int] = field(default_factory=dict)  # shard -> rows read this run
    resumed: dict[str, int] = field(default_factory=dict)  # shard -> the chunk it resumed after

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Key types PostgreSQL and Spark order alike: a chunk's first and last keys bound it in both.
ORDERED_THE_SAME = frozenset({"smallint", "int", "bigint", "date", "timestamp", "timestamp_ntz"})


def progress_key(cfg: TableConfig, columns: list[str]) -> str:
    return f"{cfg.name}:columns:{','.join(sorted(columns))}"


def backfill_columns(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    columns: list[str],
    *,
    run_id: str,
    shards: list[str] | None = None,
    should_stop: Callable[[ShardProgress], bool] | None = None,
) -> ColumnBackfillResult:
    """Fill `columns` of cfg's current table from the source (all shards, or `shards`); resumes a
    run that was killed or paused. should_stop is asked after every chunk."""
    t0 = time.monotonic()
    endpoints = shards_by_endpoint(cfg, shards)
    if not endpoints:
        raise BootstrapError(f"{cfg.name}: no shards selected")
    _check_keys(cfg, endpoints)
    source_cols, pg_types = preflight(cfg, endpoints)
    cur = lake.qualified(cfg.current_table)
    read_cols = _columns_to_read(cfg, columns, dict(source_columns_of(spark, cur, cfg)), dict(source_cols))
    key = progress_key(cfg, columns)
    progress = load_progress(spark, lake, key)
    result = ColumnBackfillResult(cfg.name, sorted(columns), run_id)
    run = _Fill(spark, lake, cfg, cur, read_cols, pg_types, result)
    selected = [s for sources in endpoints.values() for s in sources]
    # Every selected shard finished: a new backfill (a repair) starts over. Otherwise the shards an
    # earlier run finished stay finished and the others resume, whatever run paused them.
    finished = all(s.shard in progress and progress[s.shard].done for s in selected)
    for s in selected:
        state = progress.get(s.shard)
        if state is None or (finished and state.run_id != run_id):
            state = ShardProgress(key, s.shard, run_id)
        elif state.chunk >= 0 and not state.done:
            result.resumed[s.shard] = state.chunk
        result.shards[s.shard] = 0
        if not state.done and run.shard(s, state, should_stop):
            result.paused = True
            break
    result.seconds = round(time.monotonic() - t0, 1)
    log.info("column backfill %s %s: %s", cfg.name, result.columns, result.to_dict())
    return result


@dataclass
class _Fill:
    """What every shard's fill shares."""

    spark: SparkSession
    lake: LakeSettings
    cfg: TableConfig
    cur: str
    read_cols: list[tuple[str, str]]
    pg_types: dict[str, str]
    result: ColumnBackfillResult

    def shard(self, s: ShardSource, state: ShardProgress, should_stop: Callable[[ShardProgress], bool] | None) -> bool:
        """Chunks of one shard to its end, each merged then recorded; True when told to stop."""
        import psycopg2

        cfg, r, limit = self.cfg, self.result, self.cfg.bootstrap.chunk_rows
        conn = psycopg2.connect(s.endpoint.dsn(), application_name=APPLICATION_NAME)
        conn.autocommit = True  # each marker and chunk read its own short transaction
        # The chunks' rows, typed, through ADBC (the snapshot bootstrap's reader); the markers and
        # the key bounds on psycopg2's connection.
        reader_conn = copy_read.connect(s.endpoint.dsn(), APPLICATION_NAME)
        reader = reader_conn.cursor()
        try:
            plain = chunk_query(s.schema, cfg.source.table, self.read_cols, self.pg_types, cfg.primary_key, limit)
            q, select = typed(plain, self.read_cols, self.pg_types)
            with conn.cursor() as c:
                state.chunks_total = max(state.chunks_total, estimated_rows(c, s.schema, cfg.source.table) // limit + 1)
            upto = last_key(conn, q)  # rows inserted later come through the stream
            while not state.done:
                marker = ChunkMark(
                    table=cfg.name, shard=s.shard, chunk=state.chunk + 1, run=r.run_id, columns=r.columns
                )
                chunk = read_typed_chunk(
                    conn, reader, q, select, state.last_key, marker, upto, commit_wait=cfg.bootstrap.commit_wait_seconds
                )
                merge_chunk(self.spark, cfg, self.cur, chunk, select, r.columns, r.run_id)
                state.advance(chunk, limit)
                record_progress(self.spark, self.lake, [progress_row(state, chunk)])
                r.chunks += 1
                r.rows_read += chunk.rows.num_rows
                r.shards[s.shard] += chunk.rows.num_rows
                log.info(
                    "column backfill %s %s: %s chunk %d (%d of ~%d), %d rows, read in %.2fs (transaction %.2fs)",
                    cfg.name, r.columns, s.shard, chunk.no, state.chunks_done, state.chunks_total,
                    chunk.rows.num_rows, chunk.read_seconds, chunk.xact_seconds,
                )  # fmt: skip
                if not state.done and should_stop is not None and should_stop(state):
                    return True
        finally:
            reader.close()
            reader_conn.close()
            conn.close()
        return False


def _columns_to_read(
    cfg: TableConfig, columns: list[str], lake_cols: dict[str, str], source_cols: dict[str, str]
) -> list[tuple[str, str]]:
    """The key and the columns to fill, with the lake's types; an unknown column stops the run."""
    if not columns:
        raise BootstrapError(f"{cfg.name}: no columns to backfill given")
    for c in columns:
        if c in cfg.primary_key:
            raise BootstrapError(f"{cfg.name}: column {c!r} is part of the primary key; re-bootstrap to change keys")
        if c not in lake_cols:
            raise BootstrapError(
                f"{cfg.name}: column {c!r} is not in the lake table; let an ingest add it first (it is added when "
                "the column is consumed and its first change arrives) or add it with ALTER TABLE, then backfill"
            )
        if c not in source_cols:
            raise BootstrapError(
                f"{cfg.name}: column {c!r} is not in the source table {cfg.source.table}; check its name"
            )
    return [(k, lake_cols[k]) for k in cfg.primary_key] + [(c, lake_cols[c]) for c in columns]


def _chunk_bounds(cfg: TableConfig, chunk: ChunkRead, types: dict[str, str]) -> str:
    """The chunk's shard and the range of its first key column, on the target alone: Iceberg
    reads only the files that can hold them (by partition and column bounds), not the table."""
    shard = f"t.{spark_ident(SHARD_COL)} = {sql_string(chunk.shard)}"
    first = cfg.primary_key[0]
    col, typ = f"t.{spark_ident(first)}", types[first]
    if not (typ in ORDERED_THE_SAME or typ.startswith("decimal")):
        return shard  # text sorts by the source's collation, which Spark's order need not match
    keys = chunk.rows.column(KEY_TEXT_PREFIX + first)  # as the source prints them
    lo, hi = keys[0].as_py(), keys[len(keys) - 1].as_py()
    return f"{shard} AND {col} >= CAST({sql_string(lo)} AS {typ}) AND {col} <= CAST({sql_string(hi)} AS {typ})"


def merge_chunk(
    spark: SparkSession,
    cfg: TableConfig,
    cur: str,
    chunk: ChunkRead,
    select: TypedSelect,
    columns: list[str],
    run_id: str,
) -> None:
    """Set `columns` from the chunk on the current table's rows of its keys that sit below L."""
    from cdc_lakehouse.bootstrap.copy_read import output_schema

    if not chunk.rows.num_rows:
        return
    delivered = select.spark_types(numeric_as_text=True)
    rows = chunk.rows.select([*[n for n, _ in delivered], SHARD_COL])
    # Arrow straight into Spark (no pandas); a value that does not fit stops the run here.
    typed = select.to_lake(spark.createDataFrame(rows, output_schema(tuple(delivered))), cfg.name, cfg.primary_key)
    view = f"cdc_colfill_{uuid.uuid4().hex[:12]}"
    typed.createOrReplaceTempView(view)
    on = " AND ".join(f"t.{spark_ident(c)} = s.{spark_ident(c)}" for c in [SHARD_COL, *cfg.primary_key])
    on += " AND " + _chunk_bounds(cfg, chunk, {c.name: c.lake_type for c in select.columns})
    sets = ", ".join(f"t.{spark_ident(c)} = s.{spark_ident(c)}" for c in columns)
    sql = f"MERGE INTO {cur} t USING {view} s ON {on} WHEN MATCHED AND t.{LSN_COL} < {int(chunk.low)} THEN UPDATE SET {sets}"
    props = {
        **COLUMN_BACKFILL.props(),
        "cdc.column-backfill": f"{run_id}:{chunk.shard}:{chunk.no}",
        # Values read up to H: positions of the shard below it are no consistent point (lake.points).
        READ_UPTO_PROP: json.dumps({chunk.shard: chunk.high}),
    }
    try:
        # An ingest committing meanwhile: the same chunk at the same L again is the same MERGE.
        with_commit_retries(lambda: sql_with_commit_properties(spark, sql, props), what=f"{cfg.name} column chunk")
    finally:
        spark.catalog.dropTempView(view)
