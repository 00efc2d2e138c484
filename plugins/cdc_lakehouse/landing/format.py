"""The landing format: the layout, the event schemas and the manifest (docs/landing-format.md).

Layout under the landing URI (a local path or an s3:// prefix):

    <endpoint>/<table>/run=<run_id>/part-00000.parquet   events of one source table (all shards)
    <endpoint>/_manifests/<run_id>.json                  what the run wrote and where the slot stands

A run's files count only once its manifest exists; the manifest is written after the files
are durable and before the slot is confirmed.

Two event formats. Format 2 (TYPED_FORMAT, what the capture writes): `before` and `after` are
structs of the relation's columns, each typed with its lake type when the value entered
(landing.values); a value that does not fit its type is NULL there and kept as text, with its
column, in `before_raw` / `after_raw`. A file holds one schema version of one table; the manifest
lists each file's columns (ManifestFile.columns). Format 1 (TEXT_FORMAT: files written before
format 2, and the Debezium staging) carries every value as PostgreSQL text in maps; the ingest
still reads it (ingest.landed).

One event schema (EVENT_SCHEMA, format 1; typed_event_fields for format 2) is the definition: the
Arrow schemas the capture writes and the Spark schemas the ingest reads derive from it. The
manifest is JSON; `Manifest` is its typed model, and parse_manifest / dump_manifest keep files
byte-compatible (fields a file lacks stay absent, unknown ones are kept). Pure Python: pyarrow and
pyspark are imported only by the schema functions.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import TypedDict  # pydantic validates typing.TypedDict from Python 3.12 only

from cdc_lakehouse.source.slots import SlotReport
from cdc_lakehouse.watermark import ServerIdentity

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import types as T

MANIFEST_DIR = "_manifests"
TEXT_FORMAT = 1  # images as maps of PostgreSQL text
TYPED_FORMAT = 2  # images as structs typed where the values entered (issue #56)
FORMAT_VERSION = TYPED_FORMAT  # what the capture writes

# A column of a typed image: (name, lake type); the lake type is a Spark type name (source.catalog).
LandedColumn = tuple[str, str]


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


# --- format 2: typed images ----------------------------------------------------------------------

# The fields of a format-2 event, in file order: format 1's, with `before` and `after` typed
# structs (columns given per file) and the text of the values that did not fit beside them.
TYPED_EVENT_FIELDS = (
    "op",
    "before",
    "after",
    "unavailable",
    "before_raw",
    "after_raw",
    "source",
    "table_schema",
    "ts_ms",
    "run_id",
)
RAW_SUFFIX = "_raw"  # before_raw, after_raw: column -> PostgreSQL text of a value that did not fit

_SCALAR_ARROW = {
    "bigint": "int64",
    "int": "int32",
    "smallint": "int16",
    "tinyint": "int8",
    "boolean": "bool_",
    "float": "float32",
    "double": "float64",
    "string": "string",
    "date": "date32",
    "binary": "binary",
}
_DECIMAL_TYPE = re.compile(r"^decimal\((\d+),(\d+)\)$")


def arrow_type(lake_type: str) -> pa.DataType:
    """The Arrow type a typed image holds a column of this lake type in (Spark reads it back as
    that lake type)."""
    import pyarrow as pa

    t = lake_type.replace(" ", "")
    if t.startswith("array<") and t.endswith(">"):
        return pa.list_(arrow_type(t[6:-1]))
    if t == "timestamp":
        return pa.timestamp("us", tz="UTC")
    if t == "timestamp_ntz":
        return pa.timestamp("us")
    m = _DECIMAL_TYPE.match(t)
    if m:
        return pa.decimal128(int(m.group(1)), int(m.group(2)))
    if t in _SCALAR_ARROW:
        return getattr(pa, _SCALAR_ARROW[t])()
    raise ValueError(f"no landing type for lake type {lake_type!r}")


def spark_type(lake_type: str) -> T.DataType:
    """The Spark type of a lake type name (what source.catalog.lake_type and column_types give)."""
    from pyspark.sql import types as T

    t = lake_type.replace(" ", "")
    if t.startswith("array<") and t.endswith(">"):
        return T.ArrayType(spark_type(t[6:-1]))
    m = _DECIMAL_TYPE.match(t)
    if m:
        return T.DecimalType(int(m.group(1)), int(m.group(2)))
    scalars: dict[str, Callable[[], T.DataType]] = {
        "bigint": T.LongType,
        "int": T.IntegerType,
        "smallint": T.ShortType,
        "tinyint": T.ByteType,
        "boolean": T.BooleanType,
        "float": T.FloatType,
        "double": T.DoubleType,
        "string": T.StringType,
        "date": T.DateType,
        "timestamp": T.TimestampType,
        "timestamp_ntz": T.TimestampNTZType,
        "binary": T.BinaryType,
    }
    if t in scalars:
        return scalars[t]()
    raise ValueError(f"no Spark type for lake type {lake_type!r}")


def typed_arrow_schema(columns: Sequence[LandedColumn]) -> pa.Schema:
    """The Arrow schema of a format-2 file whose images have these columns."""
    import pyarrow as pa

    v1 = landing_arrow_schema()
    image = pa.struct([(n, arrow_type(t)) for n, t in columns])
    raw = pa.map_(pa.string(), pa.string())
    types = {"before": image, "after": image, "before_raw": raw, "after_raw": raw}
    return pa.schema([(f, types[f] if f in types else v1.field(f).type) for f in TYPED_EVENT_FIELDS])


def typed_spark_schema(columns: Sequence[LandedColumn]) -> T.StructType:
    """The Spark schema the ingest reads a format-2 file with (typed_arrow_schema, in Spark)."""
    from pyspark.sql import types as T

    v1 = landing_spark_schema()
    image = T.StructType([T.StructField(n, spark_type(t)) for n, t in columns])
    raw = T.MapType(T.StringType(), T.StringType())
    types = {"before": image, "after": image, "before_raw": raw, "after_raw": raw}
    return T.StructType([T.StructField(f, types[f] if f in types else v1[f].dataType) for f in TYPED_EVENT_FIELDS])


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
    columns: list[tuple[str, str]] | None = Field(
        None, description="format 2: the images' columns and lake types; absent for a text file (format 1)"
    )


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


class Streamed(_Part):
    """Transactions the server streamed before their commit (capture.streamed)."""

    committed: int = 0
    aborted: int = Field(0, description="streamed, then rolled back: nothing of them landed")
    subtransactions_aborted: int = Field(0, description="rolled back to a savepoint: left out")
    spooled_bytes: int = 0
    open_at_end: int = Field(0, description="still open at the run's bound: streamed again to the next run")


# A capture run that starts below its slot's confirmed position (a keepalive moved the slot past
# runs whose landing was never confirmed: capture.positions.start_position): from where, to where,
# and the attempts that were lost. Functional form: `from` is a keyword.
KeepaliveAdvance = TypedDict("KeepaliveAdvance", {"from": int, "to": int, "attempts": list[str]})


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
    slot_before: SlotReport | None = None
    slot_after: SlotReport | None = None
    source_identity: ServerIdentity | None = Field(None, description="IDENTIFY_SYSTEM of the server")
    published: list[str] | None = Field(None, description="tables in the publication at the end of the run")
    published_at_start: list[str] | None = None
    keepalive_advance: KeepaliveAdvance | None = None
    streamed: Streamed | None = None
    # Dicts, not a model: a marker is any JSON object under the project's message prefix, and one
    # of the wrong shape must not fail the run's manifest (the capture would retry it forever).
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
