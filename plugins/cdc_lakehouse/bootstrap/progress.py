"""Progress of a chunked bootstrap in cdc_meta.bootstrap_progress: one row per completed chunk;
the newest row of a (table, shard) is where a killed or paused bootstrap resumes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from cdc_lakehouse.lake.meta import ensure_meta_tables, meta_append
from cdc_lakehouse.lake.meta_rows import BootstrapChunk, RawRow
from cdc_lakehouse.lake.tables import table_exists
from cdc_lakehouse.settings import LakeSettings

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from cdc_lakehouse.bootstrap.chunks import ChunkRead

PROGRESS_TABLE = "bootstrap_progress"


@dataclass
class ShardProgress:
    """One shard's place in a chunked bootstrap: the last completed chunk and its last key."""

    table: str
    shard: str
    run_id: str
    chunk: int = -1  # the last completed chunk; -1: none yet
    last_key: list[str] | None = None  # as the source prints it: the next chunk starts above it
    rows_total: int = 0
    chunks_done: int = 0
    chunks_total: int = 0  # estimate: pg_class.reltuples / chunk_rows
    done: bool = False
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))

    def advance(self, chunk: ChunkRead, limit: int) -> None:
        self.chunk = chunk.no
        self.rows_total += chunk.rows.num_rows
        self.chunks_done += 1
        if chunk.last_key is not None:
            self.last_key = chunk.last_key
        # A short chunk is the shard's last: nothing above its key existed when it was read
        # (what is inserted there later comes through the stream).
        self.done = chunk.rows.num_rows < limit
        self.chunks_total = max(self.chunks_total, self.chunks_done)

    @classmethod
    def from_row(cls, row: RawRow) -> ShardProgress:
        started = row["started_at"]
        return cls(
            table=row["table_name"],
            shard=row["shard"],
            run_id=row["run_id"],
            chunk=int(row["chunk"]),
            last_key=json.loads(row["last_key"]) if row["last_key"] else None,
            rows_total=int(row["rows_total"]),
            chunks_done=int(row["chunks_done"]),
            chunks_total=int(row["chunks_total"] or 0),
            done=bool(row["done"]),
            started_at=started.replace(tzinfo=UTC) if started is not None else datetime.now(UTC),
        )


def _qualified(lake: LakeSettings) -> str:
    return lake.qualified(lake.meta_table(PROGRESS_TABLE))


def load_progress(spark: SparkSession, lake: LakeSettings, table: str) -> dict[str, ShardProgress]:
    """The newest progress row of each shard of `table` (creating the meta tables if needed)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    name = _qualified(lake)
    if not table_exists(spark, name):
        ensure_meta_tables(spark, lake)
    spark.sql(f"REFRESH TABLE {name}")
    w = Window.partitionBy("shard").orderBy(F.col("updated_at").desc(), F.col("chunk").desc())
    rows = (
        spark.table(name)
        .filter(F.col("table_name") == table)
        .withColumn("_n", F.row_number().over(w))
        .filter(F.col("_n") == 1)
        .drop("_n")
        .collect()
    )
    return {r["shard"]: ShardProgress.from_row(r.asDict()) for r in rows}


def progress_row(state: ShardProgress, chunk: ChunkRead) -> BootstrapChunk:
    """The progress row of `chunk`, taken right after state.advance(chunk)."""
    return BootstrapChunk(
        table_name=state.table,
        shard=state.shard,
        run_id=state.run_id,
        chunk=state.chunk,
        last_key=json.dumps(state.last_key) if state.last_key is not None else None,
        low_lsn=chunk.low,
        high_lsn=chunk.high,
        rows=chunk.rows.num_rows,
        rows_total=state.rows_total,
        chunks_done=state.chunks_done,
        chunks_total=state.chunks_total,
        done=state.done,
        xact_seconds=chunk.xact_seconds,
        started_at=state.started_at.astimezone(UTC).replace(tzinfo=None),
        updated_at=datetime.now(UTC).replace(tzinfo=None),
    )


def record_progress(spark: SparkSession, lake: LakeSettings, rows: list[BootstrapChunk]) -> None:
    """A round's progress rows, in one commit."""
    meta_append(spark, lake, PROGRESS_TABLE, rows)
