"""landing.writer: Parquet landing files of one capture run (Airflow worker): TableWriter buffers a
source table's events and writes them in the typed landing format (landing.format, format 2),
bounded in rows and bytes; file and directory modes and fsync helpers."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from cdc_lakehouse.landing.format import LandedColumn, ManifestFile, typed_arrow_schema
from cdc_lakehouse.landing.values import typed_column

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq

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
# group boundaries, so smaller groups let the ingest's read use every core: one 200k-event group
# took one task 3.8 s where ten groups take two tasks (bench/ingest_bench.py).
ROW_GROUP_ROWS = 20_000


@dataclass(frozen=True)
class ImageColumns:
    """A schema version of a source table as its images land: the relation's columns in order,
    each with the lake type its values are typed to (landing.values), and the relation's schema
    JSON (the event's `table_schema`). Events of one version share a file."""

    columns: tuple[LandedColumn, ...]
    schema_json: str


# A row image as the capture hands it over: the relation's values in column order (text or None;
# an unchanged TOAST value is None and its column listed as unavailable), or None for no image.
Image = list[str | None] | None


class _Version:
    """The buffered events and the open file of one ImageColumns."""

    def __init__(self, image: ImageColumns) -> None:
        self.image = image
        self.writer: pq.ParquetWriter | None = None
        self.file: ManifestFile | None = None  # the open file's entry
        self.file_rows = 0
        self.lists: dict[str, list[Any]] = {k: [] for k in TableWriter.LISTS}


class TableWriter:
    """Buffers events of one source table and writes them as Parquet row groups in the typed landing
    format (landing.format, format 2): one series of files per schema version of the table.

    Memory stays bounded by `batch_rows` and `batch_bytes` whatever the transaction size; files roll
    over at `file_rows` so Spark gets a few well-sized files per run. Run-level constants (host,
    endpoint, run id) are stored once per row group as dictionary-encoded columns. Values are
    typed per column at each flush (landing.values), not per event.
    """

    LISTS = ("op", "before", "after", "unavailable", "schema", "commit_lsn", "lsn", "xid", "seq", "commit_ts")

    def __init__(
        self,
        directory: Path,
        constants: dict[str, Any],
        batch_rows: int = ROW_GROUP_ROWS,
        file_rows: int = 2_000_000,
        batch_bytes: int = 64 * 1024**2,
        table: str = "",
    ):
        self.directory = directory
        self.constants = constants  # connector, endpoint, host, db, ts_ms, run_id
        self.table = table or directory.name
        self.batch_rows = batch_rows
        self.batch_bytes = batch_bytes
        self.file_rows = file_rows
        self._bytes = 0
        self._buffered = 0
        self.flushes = 0
        self.files: list[ManifestFile] = []
        self._versions: dict[ImageColumns, _Version] = {}
        self.rows = 0
        self.misfits = 0  # values kept as text: they did not fit their lake type
        self.min_commit_lsn: int | None = None
        self.max_commit_lsn: int | None = None
        self.shards: set[str] = set()

    def add(
        self,
        op: str,
        before: Image,
        after: Image,
        unavailable: list[str] | None,
        schema: str,
        image: ImageColumns,
        commit_lsn: int,
        lsn: int,
        xid: int,
        seq: int,
        commit_ts_us: int,
        size: int = 0,
    ) -> None:
        """size: the event's bytes as decoded (its message length), for the buffer's byte bound."""
        v = self._versions.get(image) or self._version(image)
        c = v.lists
        c["op"].append(op)
        c["before"].append(before)
        c["after"].append(after)
        c["unavailable"].append(unavailable)
        c["schema"].append(schema)
        c["commit_lsn"].append(commit_lsn)
        c["lsn"].append(lsn)
        c["xid"].append(xid)
        c["seq"].append(seq)
        c["commit_ts"].append(commit_ts_us)
        if self.min_commit_lsn is None or commit_lsn < self.min_commit_lsn:
            self.min_commit_lsn = commit_lsn
        if self.max_commit_lsn is None or commit_lsn > self.max_commit_lsn:
            self.max_commit_lsn = commit_lsn
        self.shards.add(schema)
        self.rows += 1
        self._buffered += 1
        self._bytes += size
        # Bounded in rows and in bytes: a few events with 1 GB TOAST values must not fill memory.
        if self._buffered >= self.batch_rows or self._bytes >= self.batch_bytes:
            self.flush()

    def _version(self, image: ImageColumns) -> _Version:
        self._versions[image] = v = _Version(image)
        return v

    def _table(self, v: _Version) -> pa.Table:
        import pyarrow as pa

        schema = typed_arrow_schema(v.image.columns)
        c = v.lists
        n = len(c["op"])
        k = self.constants

        def const(value: object, t: pa.DataType = pa.string()) -> pa.Array:
            return pa.array([value] * n, t)

        before, before_raw = self._image(v.image, c["before"], schema.field("before").type)
        after, after_raw = self._image(v.image, c["after"], schema.field("after").type)
        source = pa.StructArray.from_arrays(
            [
                const(k["connector"]),
                const(k["endpoint"]),
                const(k["host"]),
                const(k["db"]),
                pa.array(c["schema"], pa.string()),
                const(self.table),
                pa.array(c["commit_lsn"], pa.int64()),
                pa.array(c["lsn"], pa.int64()),
                pa.array(c["xid"], pa.int64()),
                pa.array(c["seq"], pa.int64()),
                pa.array(c["commit_ts"], pa.int64()).cast(pa.timestamp("us", tz="UTC")),
            ],
            fields=list(schema.field("source").type),
        )
        return pa.Table.from_arrays(
            [
                pa.array(c["op"], pa.string()),
                before,
                after,
                pa.array(c["unavailable"], schema.field("unavailable").type),
                before_raw,
                after_raw,
                source,
                const(v.image.schema_json),
                const(k["ts_ms"], pa.int64()),
                const(k["run_id"]),
            ],
            schema=schema,
        )

    def _image(self, image: ImageColumns, rows: list[Image], typ: pa.StructType) -> tuple[pa.Array, pa.Array]:
        """The images of a row group as a typed struct (columns typed in bulk), and the text of
        the values that did not fit, per row (null where every value fit)."""
        import pyarrow as pa

        n = len(rows)
        present = [r is not None for r in rows]
        blank = [None] * len(image.columns)
        # Rows to columns in one C-level transpose (a missing image is a row of NULLs).
        columns = list(zip(*[r if r is not None else blank for r in rows])) if n else [()] * len(image.columns)
        arrays: list[pa.Array] = []
        raw: list[list[tuple[str, str]] | None] = [None] * n
        for (name, lake_type), texts in zip(image.columns, columns, strict=True):
            arr, misfits = typed_column(texts, lake_type)
            arrays.append(arr)
            for row, text in misfits.items():
                raw[row] = [*(raw[row] or []), (name, text)]
            self.misfits += len(misfits)
        mask = pa.array([not p for p in present], pa.bool_())
        struct = pa.StructArray.from_arrays(arrays, fields=list(typ), mask=mask) if n else pa.array([], typ)
        return struct, pa.array(raw, pa.map_(pa.string(), pa.string()))

    def flush(self) -> None:
        import pyarrow as pa

        for v in self._versions.values():
            self._flush(v)
        self._buffered = 0
        self._bytes = 0
        # Hand freed Arrow buffers back to the OS each batch: the allocator otherwise keeps them,
        # and a large transaction would look like (and on a busy host act like) unbounded growth.
        pa.default_memory_pool().release_unused()

    def _flush(self, v: _Version) -> None:
        import pyarrow.parquet as pq

        n = len(v.lists["op"])
        if n == 0:
            return
        table = self._table(v)
        v.lists = {k: [] for k in self.LISTS}
        self.flushes += 1
        if v.writer is None or v.file is None:
            name = f"part-{len(self.files):05d}.parquet"
            v.writer = pq.ParquetWriter(self.directory / name, table.schema, compression="snappy")
            v.file = ManifestFile(name=name, rows=0, columns=list(v.image.columns))
            self.files.append(v.file)
        v.writer.write_table(table)
        del table
        v.file_rows += n
        v.file.rows += n
        if v.file_rows >= self.file_rows:
            self._close_file(v)

    def _close_file(self, v: _Version) -> None:
        if v.writer is not None and v.file is not None:
            v.writer.close()
            v.writer = None
            v.file.bytes = (self.directory / v.file.name).stat().st_size
            v.file, v.file_rows = None, 0

    def close(self) -> list[ManifestFile]:
        self.flush()
        for v in self._versions.values():
            self._close_file(v)
        return self.files
