"""The landing zone: change events as Parquet files, grouped by endpoint, table and run.

Layout under the landing URI (a local path or an s3:// prefix):

    <endpoint>/<table>/run=<run_id>/part-00000.parquet   events of one source table (all shards)
    <endpoint>/_manifests/<run_id>.json                  what the run wrote and where the slot stands

A run's files count only once its manifest exists; the manifest is written after the files
are durable and before the slot is confirmed. Event schema: see LANDING_FIELDS and
docs/landing-format.md.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

MANIFEST_DIR = "_manifests"
FORMAT_VERSION = 1

# Field list of a landing event (Debezium envelope). `before`/`after` hold PostgreSQL's text
# output of each column; `unavailable` lists columns whose unchanged TOASTed value the source
# did not send (never to be read as NULL); `table_schema` is the relation's columns as JSON.
LANDING_FIELDS = [
    "op",
    "before",
    "after",
    "unavailable",
    "source",
    "table_schema",
    "ts_ms",
    "run_id",
]
SOURCE_FIELDS = [
    "connector",
    "endpoint",
    "host",
    "db",
    "schema",
    "table",
    "commit_lsn",
    "lsn",
    "xid",
    "seq",
    "commit_ts",
]


def landing_arrow_schema():
    import pyarrow as pa

    kv = pa.map_(pa.string(), pa.string())
    return pa.schema(
        [
            ("op", pa.string()),
            ("before", kv),
            ("after", kv),
            ("unavailable", pa.list_(pa.string())),
            (
                "source",
                pa.struct(
                    [
                        ("connector", pa.string()),
                        ("endpoint", pa.string()),
                        ("host", pa.string()),
                        ("db", pa.string()),
                        ("schema", pa.string()),
                        ("table", pa.string()),
                        ("commit_lsn", pa.int64()),
                        ("lsn", pa.int64()),
                        ("xid", pa.int64()),
                        ("seq", pa.int64()),
                        ("commit_ts", pa.timestamp("us", tz="UTC")),
                    ]
                ),
            ),
            ("table_schema", pa.string()),
            ("ts_ms", pa.int64()),
            ("run_id", pa.string()),
        ]
    )


def run_dir(endpoint: str, table: str, run_id: str) -> str:
    return f"{endpoint}/{table}/run={run_id}"


def manifest_path(endpoint: str, run_id: str) -> str:
    return f"{endpoint}/{MANIFEST_DIR}/{run_id}.json"


# --- stores ------------------------------------------------------------------------------------


class LandingUnavailable(RuntimeError):
    """The landing zone cannot be written: raised before a capture reads anything from its slot."""


class LocalLanding:
    """A landing zone on the local filesystem (the embedded default)."""

    def __init__(self, uri: str):
        u = urlsplit(uri)
        self.uri = uri.rstrip("/")
        self.root = Path(u.path if u.scheme == "file" else uri)
        self.root.mkdir(parents=True, exist_ok=True)

    def verify(self) -> None:
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise LandingUnavailable(
                f"landing zone {self.uri}: {self.root} is not writable by this user; fix its "
                "owner or mode, or point the lake connection's landing_uri elsewhere"
            )

    def staging_dir(self) -> Path:
        d = self.root / "_staging" / uuid.uuid4().hex
        _mkdirs(d, self.root)
        return d

    def publish_dir(self, staged: Path, rel: str) -> None:
        """Make the staged run directory visible under rel, durably (fsync files and dirs)."""
        for f in staged.iterdir():
            os.chmod(f, FILE_MODE)
            _fsync_file(f)
        target = self.root / rel
        _mkdirs(target.parent, self.root)
        if target.exists():  # leftovers of a crashed attempt that never got a manifest
            shutil.rmtree(target)
        os.replace(staged, target)
        _fsync_dir(target)
        _fsync_dir(target.parent)

    def discard(self, staged: Path) -> None:
        shutil.rmtree(staged, ignore_errors=True)

    def write_json(self, rel: str, obj: Any) -> None:
        path = self.root / rel
        _mkdirs(path.parent, self.root)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE), "w") as f:
            json.dump(obj, f, separators=(",", ":"), sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)

    def read_json(self, rel: str) -> Any:
        return json.loads((self.root / rel).read_text())

    def exists(self, rel: str) -> bool:
        return (self.root / rel).exists()

    def list_names(self, rel: str) -> list[str]:
        d = self.root / rel
        return sorted(p.name for p in d.iterdir()) if d.is_dir() else []

    def delete(self, rel: str) -> None:
        p = self.root / rel
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)

    def file_uri(self, rel: str) -> str:
        return f"file://{self.root / rel}"


class S3Landing:
    """A landing zone under an s3:// prefix, written through the Amazon provider's S3Hook."""

    def __init__(self, uri: str, aws_conn_id: str | None = "aws_default", hook: Any = None):
        u = urlsplit(uri)
        self.uri = uri.rstrip("/")
        self.bucket = u.netloc
        self.prefix = u.path.strip("/")
        if hook is None:
            from airflow.providers.amazon.aws.hooks.s3 import S3Hook

            hook = S3Hook(aws_conn_id=aws_conn_id)
        self.hook = hook
        self.aws_conn_id = aws_conn_id

    def verify(self) -> None:
        # check_for_bucket is False for a missing bucket and for one these keys may not see (403).
        if not self.hook.check_for_bucket(self.bucket):
            raise LandingUnavailable(
                f"landing zone {self.uri}: bucket {self.bucket!r} does not exist or the AWS connection "
                f"{self.aws_conn_id!r} cannot reach it; create the bucket, or fix the lake connection's "
                "landing_uri / landing_conn_id, or the AWS connection's keys, region and endpoint_url"
            )

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def staging_dir(self) -> Path:
        return Path(tempfile.mkdtemp(prefix="cdc-landing-"))

    def publish_dir(self, staged: Path, rel: str) -> None:
        # Objects become visible one by one; the manifest written afterwards is what commits them.
        for f in sorted(staged.iterdir()):
            self.hook.load_file(str(f), key=self._key(f"{rel}/{f.name}"), bucket_name=self.bucket, replace=True)
        shutil.rmtree(staged, ignore_errors=True)

    def discard(self, staged: Path) -> None:
        shutil.rmtree(staged, ignore_errors=True)

    def write_json(self, rel: str, obj: Any) -> None:
        self.hook.load_string(
            json.dumps(obj, separators=(",", ":"), sort_keys=True),
            key=self._key(rel),
            bucket_name=self.bucket,
            replace=True,
        )

    def read_json(self, rel: str) -> Any:
        return json.loads(self.hook.read_key(self._key(rel), bucket_name=self.bucket))

    def exists(self, rel: str) -> bool:
        return bool(self.hook.check_for_key(self._key(rel), bucket_name=self.bucket))

    def list_names(self, rel: str) -> list[str]:
        prefix = self._key(rel).rstrip("/") + "/"
        keys = self.hook.list_keys(bucket_name=self.bucket, prefix=prefix) or []
        return sorted({k[len(prefix) :].split("/")[0] for k in keys if k != prefix})

    def delete(self, rel: str) -> None:
        keys = self.hook.list_keys(bucket_name=self.bucket, prefix=self._key(rel)) or []
        if keys:
            self.hook.delete_objects(bucket=self.bucket, keys=keys)

    def file_uri(self, rel: str) -> str:
        return f"s3://{self.bucket}/{self._key(rel)}"


def open_landing(uri: str, aws_conn_id: str | None = None):
    scheme = urlsplit(uri).scheme
    if scheme in ("", "file"):
        return LocalLanding(uri)
    if scheme in ("s3", "s3a"):
        return S3Landing(uri, aws_conn_id or "aws_default")
    raise ValueError(f"landing URI {uri!r}: use file:///path or s3://bucket/prefix")


# Landing files hold row images (deleted rows included) and manifests: readable by the owner and
# its group (the Spark user), never by everyone.
FILE_MODE = 0o640
DIR_MODE = 0o750


def _mkdirs(path: Path, root: Path) -> None:
    """mkdir -p with DIR_MODE for every directory created below root (umask aside)."""
    missing = []
    p = path
    while not p.exists() and p not in (root, p.parent):
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        os.chmod(d, DIR_MODE)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- writing events ----------------------------------------------------------------------------


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
        batch_rows: int = 20_000,
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
        self._writer = None
        self._file_rows = 0
        self._cols: dict[str, list] = {k: [] for k in self._LISTS}
        self.rows = 0
        self.min_commit_lsn: int | None = None
        self.max_commit_lsn: int | None = None
        self.shards: set[str] = set()

    def add(
        self,
        op: str,
        before,
        after,
        unavailable,
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

    def _table(self):
        import pyarrow as pa

        schema = landing_arrow_schema()
        c = self._cols
        n = len(c["op"])
        k = self.constants

        def const(v, t=pa.string()):
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
        if self._writer is None:
            name = f"part-{len(self.files):05d}.parquet"
            self._writer = pq.ParquetWriter(self.directory / name, table.schema, compression="snappy")
            self.files.append({"name": name, "rows": 0})
        self._writer.write_table(table)
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


def list_manifests(store, endpoint: str) -> list[dict[str, Any]]:
    """Every manifest of an endpoint, in capture order (by the slot position they start at)."""
    names = [n for n in store.list_names(f"{endpoint}/{MANIFEST_DIR}") if n.endswith(".json")]
    manifests = [store.read_json(f"{endpoint}/{MANIFEST_DIR}/{n}") for n in names]
    return sorted(manifests, key=lambda m: (m["end_lsn"], m["run_id"]))


def manifest_files(manifest: dict[str, Any], tables: Iterable[str] | None = None) -> list[tuple[str, str, dict]]:
    """(source table, relative path, file info) of a manifest's files."""
    out = []
    for entry in manifest.get("tables", []):
        if tables is not None and entry["table"] not in tables:
            continue
        for f in entry["files"]:
            out.append((entry["table"], f"{entry['dir']}/{f['name']}", f))
    return out
