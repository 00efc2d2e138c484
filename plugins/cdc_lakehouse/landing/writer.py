"""landing.writer: Parquet landing files of one capture run (Airflow worker): TableWriter buffers a
source table's events and writes them in the landing event schema (landing.format), bounded in
rows and bytes; file and directory modes and fsync helpers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from cdc_lakehouse.landing.format import landing_arrow_schema

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq

# A row image as the capture decodes it: (column, text or NULL) pairs, in the relation's order.
RowPairs = list[tuple[str, str | None]]

# Landing files hold row images (deleted rows included) and manifests: readable by the owner and
# its group (the Spark user), never by everyone.
FILE_MODE = 0o640
DIR_MODE = 0o750


def mkdirs(path: Path, root: Path) -> None:
    """mkdir -p with DIR_MODE for every directory created below root (umask aside)."""
    missing = []
    p = path
    while not p.exists() and p not in (root, p.parent):
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        os.chmod(d, DIR_MODE)


def local_dir(uri: str) -> Path | None:
    """The local directory of a landing URI (file:// or a plain path, as open_landing reads
    them); None for an object store, whose privacy is its bucket policy's."""
    u = urlsplit(uri)
    if u.scheme not in ("", "file"):
        return None
    return Path(u.path if u.scheme == "file" else uri)


def make_private(path: Path) -> None:
    """DIR_MODE and FILE_MODE on path and everything below it. For trees another writer made
    (Spark's Hadoop client sets 0644/0755 itself from its own umask setting, whatever this
    process's umask is)."""
    if not path.exists():
        return
    os.chmod(path, DIR_MODE if path.is_dir() else FILE_MODE)
    for dirpath, dirs, files in os.walk(path):
        for d in dirs:
            os.chmod(os.path.join(dirpath, d), DIR_MODE)
        for f in files:
            os.chmod(os.path.join(dirpath, f), FILE_MODE)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- writing events ----------------------------------------------------------------------------


# Events per Parquet row group (one flush). Spark splits a landing file between tasks only at row
# group boundaries, so smaller groups let the ingest's read and casts use every core: one
# 200k-event group took one task 3.8 s where ten groups take two tasks (bench/ingest_bench.py).
ROW_GROUP_ROWS = 20_000


class TableWriter:
    """Buffers events of one source table and writes them as Parquet row groups.

    Memory stays bounded by `batch_rows` whatever the transaction size; files roll over at
    `file_rows` so Spark gets a few well-sized files per run. Run-level constants (host,
    endpoint, run id) are stored once per row group as dictionary-encoded columns.
    """

    _LISTS = (
        "op",
        "before",
        "after",
        "unavailable",
        "schema",
        "table",
        "commit_lsn",
        "lsn",
        "xid",
        "seq",
        "commit_ts",
        "table_schema",
    )

    def __init__(
        self,
        directory: Path,
        constants: dict[str, Any],
        batch_rows: int = ROW_GROUP_ROWS,
        file_rows: int = 2_000_000,
        batch_bytes: int = 64 * 1024**2,
    ):
        self.directory = directory
        self.constants = constants  # connector, endpoint, host, db, ts_ms, run_id
        self.batch_rows = batch_rows
        self.batch_bytes = batch_bytes
        self._bytes = 0
        self.flushes = 0
        self.file_rows = file_rows
        self.files: list[dict[str, Any]] = []
        self._writer: pq.ParquetWriter | None = None
        self._file_rows = 0
        self._cols: dict[str, list[Any]] = {k: [] for k in self._LISTS}
        self.rows = 0
        self.min_commit_lsn: int | None = None
        self.max_commit_lsn: int | None = None
        self.shards: set[str] = set()

    def add(
        self,
        op: str,
        before: RowPairs | None,
        after: RowPairs | None,
        unavailable: list[str] | None,
        schema: str,
        table: str,
        commit_lsn: int,
        lsn: int,
        xid: int,
        seq: int,
        commit_ts_us: int,
        table_schema: str,
        size: int = 0,
    ) -> None:
        """size: the event's bytes as decoded (its message length), for the buffer's byte bound."""
        c = self._cols
        self._bytes += size
        c["op"].append(op)
        c["before"].append(before)
        c["after"].append(after)
        c["unavailable"].append(unavailable)
        c["schema"].append(schema)
        c["table"].append(table)
        c["commit_lsn"].append(commit_lsn)
        c["lsn"].append(lsn)
        c["xid"].append(xid)
        c["seq"].append(seq)
        c["commit_ts"].append(commit_ts_us)
        c["table_schema"].append(table_schema)
        if self.min_commit_lsn is None or commit_lsn < self.min_commit_lsn:
            self.min_commit_lsn = commit_lsn
        if self.max_commit_lsn is None or commit_lsn > self.max_commit_lsn:
            self.max_commit_lsn = commit_lsn
        self.shards.add(schema)
        self.rows += 1
        # Bounded in rows and in bytes: a few events with 1 GB TOAST values must not fill memory.
        if len(c["op"]) >= self.batch_rows or self._bytes >= self.batch_bytes:
            self.flush()

    def _table(self) -> pa.Table:
        import pyarrow as pa

        schema = landing_arrow_schema()
        c = self._cols
        n = len(c["op"])
        k = self.constants

        def const(v: object, t: pa.DataType = pa.string()) -> pa.Array:
            return pa.array([v] * n, t)

        source_type = schema.field("source").type
        source = pa.StructArray.from_arrays(
            [
                const(k["connector"]),
                const(k["endpoint"]),
                const(k["host"]),
                const(k["db"]),
                pa.array(c["schema"], pa.string()),
                pa.array(c["table"], pa.string()),
                pa.array(c["commit_lsn"], pa.int64()),
                pa.array(c["lsn"], pa.int64()),
                pa.array(c["xid"], pa.int64()),
                pa.array(c["seq"], pa.int64()),
                pa.array(c["commit_ts"], pa.int64()).cast(pa.timestamp("us", tz="UTC")),
            ],
            fields=list(source_type),
        )
        return pa.Table.from_arrays(
            [
                pa.array(c["op"], pa.string()),
                pa.array(c["before"], schema.field("before").type),
                pa.array(c["after"], schema.field("after").type),
                pa.array(c["unavailable"], schema.field("unavailable").type),
                source,
                pa.array(c["table_schema"], pa.string()),
                const(k["ts_ms"], pa.int64()),
                const(k["run_id"]),
            ],
            schema=schema,
        )

    def flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        n = len(self._cols["op"])
        if n == 0:
            return
        table = self._table()
        self._cols = {k: [] for k in self._LISTS}
        self._bytes = 0
        self.flushes += 1
        writer = self._writer
        if writer is None:
            name = f"part-{len(self.files):05d}.parquet"
            writer = self._writer = pq.ParquetWriter(self.directory / name, table.schema, compression="snappy")
            self.files.append({"name": name, "rows": 0})
        writer.write_table(table)
        del table
        # Hand freed Arrow buffers back to the OS each batch: the allocator otherwise keeps them,
        # and a large transaction would look like (and on a busy host act like) unbounded growth.
        pa.default_memory_pool().release_unused()
        self._file_rows += n
        self.files[-1]["rows"] += n
        if self._file_rows >= self.file_rows:
            self._close_file()

    def _close_file(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            self.files[-1]["bytes"] = (self.directory / self.files[-1]["name"]).stat().st_size
            self._file_rows = 0

    def close(self) -> list[dict[str, Any]]:
        self.flush()
        self._close_file()
        return self.files
