"""The landing format: the layout, the event schema and the manifest (docs/landing-format.md).

Layout under the landing URI (a local path or an s3:// prefix):

    <endpoint>/<table>/run=<run_id>/part-00000.parquet   events of one source table (all shards)
    <endpoint>/_manifests/<run_id>.json                  what the run wrote and where the slot stands

A run's files count only once its manifest exists; the manifest is written after the files
are durable and before the slot is confirmed.

One event schema (EVENT_SCHEMA) is the definition: the Arrow schema the capture writes
(landing_arrow_schema) and the Spark schema the ingest reads (landing_spark_schema) both derive
from it. The manifest is JSON; `Manifest` is its typed model, and parse_manifest /
dump_manifest keep files byte-compatible (fields a file lacks stay absent, unknown ones are kept).
Pure Python: pyarrow and pyspark are imported only by the two schema functions.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import types as T

MANIFEST_DIR = "_manifests"
FORMAT_VERSION = 1


# --- the event ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class EventField:
    """A field of a landing event. `type` is one of TYPES; a struct lists its `fields`."""

    name: str
    type: str
    doc: str
    fields: tuple[EventField, ...] = ()


# The types a landing event uses (all fields nullable, as Parquet stores them).
TYPES = ("string", "int64", "timestamp", "map<string,string>", "list<string>", "struct")

SOURCE_SCHEMA: tuple[EventField, ...] = (
    EventField("connector", "string", "postgresql"),
    EventField("endpoint", "string", "the endpoint id"),
    EventField("host", "string", "host:port/database label"),
    EventField("db", "string", "the database"),
    EventField("schema", "string", "the shard (schema)"),
    EventField("table", "string", "the source table"),
    EventField("commit_lsn", "int64", "LSN of the transaction's commit; events apply in (commit_lsn, seq) order"),
    EventField("lsn", "int64", "LSN of the change itself"),
    EventField("xid", "int64", "transaction id"),
    EventField("seq", "int64", "position of the change within its transaction, from 1"),
    EventField("commit_ts", "timestamp", "commit time at the source (microseconds, UTC)"),
)

# Debezium's envelope. `before`/`after` hold PostgreSQL's text output of each column;
# `unavailable` lists columns whose unchanged TOASTed value the source did not send (never to be
# read as NULL); `table_schema` is the relation's columns as JSON.
EVENT_SCHEMA: tuple[EventField, ...] = (
    EventField("op", "string", "c insert, u update, d delete, t truncate"),
    EventField("before", "map<string,string>", "old row: the key columns or the full row; null for c"),
    EventField("after", "map<string,string>", "new row; null for d and t"),
    EventField("unavailable", "list<string>", "unchanged TOASTed columns the source did not send"),
    EventField("source", "struct", "where the change comes from", SOURCE_SCHEMA),
    EventField("table_schema", "string", "JSON list of the relation's columns (name, type, lake_type, key)"),
    EventField("ts_ms", "int64", "when the capture run started (ms since epoch)"),
    EventField("run_id", "string", "the capture run"),
)

LANDING_FIELDS = [f.name for f in EVENT_SCHEMA]
SOURCE_FIELDS = [f.name for f in SOURCE_SCHEMA]


def _arrow_type(f: EventField) -> pa.DataType:
    import pyarrow as pa

    if f.type == "struct":
        return pa.struct([(c.name, _arrow_type(c)) for c in f.fields])
    return {
        "string": pa.string,
        "int64": pa.int64,
        "timestamp": lambda: pa.timestamp("us", tz="UTC"),
        "map<string,string>": lambda: pa.map_(pa.string(), pa.string()),
        "list<string>": lambda: pa.list_(pa.string()),
    }[f.type]()


def landing_arrow_schema() -> pa.Schema:
    """The Arrow schema of a landing file (EVENT_SCHEMA)."""
    import pyarrow as pa

    return pa.schema([(f.name, _arrow_type(f)) for f in EVENT_SCHEMA])


def _spark_type(f: EventField) -> T.DataType:
    from pyspark.sql import types as T

    if f.type == "struct":
        return T.StructType([T.StructField(c.name, _spark_type(c)) for c in f.fields])
    makers: dict[str, Callable[[], T.DataType]] = {
        "string": T.StringType,
        "int64": T.LongType,
        "timestamp": T.TimestampType,
        "map<string,string>": lambda: T.MapType(T.StringType(), T.StringType()),
        "list<string>": lambda: T.ArrayType(T.StringType()),
    }
    return makers[f.type]()


def landing_spark_schema() -> T.StructType:
    """The Spark schema of a landing file (EVENT_SCHEMA), as the ingest, the audit and the
    freshness record read it."""
    from pyspark.sql.types import StructField, StructType

    return StructType([StructField(f.name, _spark_type(f)) for f in EVENT_SCHEMA])


# --- the layout --------------------------------------------------------------------------------


def run_dir(endpoint: str, table: str, run_id: str) -> str:
    return f"{endpoint}/{table}/run={run_id}"


def manifest_path(endpoint: str, run_id: str) -> str:
    return f"{endpoint}/{MANIFEST_DIR}/{run_id}.json"


def dump_json(obj: Any) -> str:
    """JSON as the landing zone stores it (manifests, attempts): compact, keys sorted."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)


# --- the manifest --------------------------------------------------------------------------------


class _Part(BaseModel):
    # Unknown keys are kept (another producer's, a later format's): a file read and written back
    # is unchanged. Fields a file lacks stay unset and are not written back.
    model_config = ConfigDict(extra="allow")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_unset=True)


class ManifestFile(_Part):
    name: str = Field(description="file name in the table's run directory")
    rows: int
    bytes: int | None = Field(None, description="size once closed; the ingest checks it")


class ManifestTable(_Part):
    table: str = Field(description="source table (all shards)")
    dir: str = Field(description="run directory, relative to the landing URI")
    files: list[ManifestFile] = Field(default_factory=list)
    events: int | None = None
    min_commit_lsn: int | None = None
    max_commit_lsn: int | None = None
    shards: list[str] = Field(default_factory=list, description="shard schemas with events")


class Heartbeat(_Part):
    """A shard's last heartbeat commit: a quiet shard is fresh up to it."""

    commit_lsn: int | None = None
    end_lsn: int | None = None
    commit_ts: str | None = None
    xid: int | None = None


class SchemaChange(_Part):
    table: str = Field(description="schema.table")
    at_commit_lsn: int | None = None
    at_lsn: int | None = Field(None, description="the relation message's position in its transaction")
    columns: list[str] | None = None
    added: list[str] = Field(default_factory=list)
    dropped: list[str] = Field(default_factory=list)
    retyped: list[Any] = Field(default_factory=list)
    first_seen: bool | None = None


class DdlChange(_Part):
    """One DDL of a captured table, from the source's event trigger (source.ddl), at its LSN."""

    table: str = Field(description="schema.table")
    lsn: int
    at_commit_lsn: int | None = None
    tag: str | None = None
    renamed: list[list[str]] = Field(default_factory=list, description="[old, new] pairs")
    added: list[str] = Field(default_factory=list)
    dropped: list[str] = Field(default_factory=list)
    retyped: list[Any] = Field(default_factory=list)
    defaults: list[Any] = Field(default_factory=list)


class Manifest(_Part):
    """`_manifests/<run_id>.json`: what a capture run wrote and where the slot stands."""

    format: int = FORMAT_VERSION
    run_id: str
    endpoint: str | None = None
    conn_id: str | None = None
    slot: str | None = None
    publication: str | None = None
    started_at: str | None = None
    finished_at: str | None = None
    start_lsn: int | None = Field(None, description="the run covers (start_lsn, end_lsn]")
    end_lsn: int = Field(description="the last commit included; the slot is confirmed to it")
    last_commit_lsn: int | None = None
    last_commit_ts: str | None = None
    capped: bool | None = Field(None, description="stopped at a bound and more changes remain")
    heartbeat_xid: int | None = None
    events: int | None = None
    bytes: int | None = None
    transactions: int | None = None
    tables: list[ManifestTable] = Field(default_factory=list)
    heartbeats: dict[str, Heartbeat] = Field(default_factory=dict, description="per shard schema")
    schemas: dict[str, Any] = Field(default_factory=dict, description="per table: the columns last seen")
    schema_changes: list[SchemaChange] = Field(default_factory=list)
    ddl: list[DdlChange] = Field(default_factory=list, description="DDL events (source.ddl), in WAL order")
    slot_before: dict[str, Any] | None = None
    slot_after: dict[str, Any] | None = None
    source_identity: dict[str, Any] | None = Field(None, description="IDENTIFY_SYSTEM of the server")
    published: list[str] | None = Field(None, description="tables in the publication at the end of the run")
    published_at_start: list[str] | None = None
    keepalive_advance: dict[str, Any] | None = None
    bootstrap_markers: list[dict[str, Any]] | None = Field(
        None, description="the chunked bootstraps' watermark messages the run read (bootstrap.chunked)"
    )

    def files(self, tables: set[str] | None = None) -> list[tuple[str, str, ManifestFile]]:
        """(source table, relative path, file) of the run's files."""
        return [
            (t.table, f"{t.dir}/{f.name}", f)
            for t in self.tables
            if tables is None or t.table in tables
            for f in t.files
        ]


def parse_manifest(data: dict[str, Any] | str | bytes) -> Manifest:
    """A manifest's JSON (text or the decoded dict) as a Manifest."""
    if isinstance(data, str | bytes):
        data = json.loads(data)
    return Manifest.model_validate(data)


def dump_manifest(manifest: Manifest) -> str:
    """The manifest file's text, exactly as the stores write it."""
    return dump_json(manifest.to_dict())
