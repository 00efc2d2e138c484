"""landing.debezium: Debezium's PostgreSQL connector, through Confluent's S3 sink, as a landing source
(docs/debezium.md).

The sink writes one object per topic partition and offset range:

    <uri>/<topics.dir>/<topic>/partition=<p>/<topic>+<p>+<startOffset>.<json|json.gz|avro>

with one record per Kafka record, in offset order (JsonFormat with schemas.enable=true: one
`{"schema": ..., "payload": ...}` per line; AvroFormat: an Avro container file). Table topics are
`<topic.prefix>.<schema>.<table>`, heartbeats `__debezium-heartbeat.<topic.prefix>`.

This module turns those files into exactly the landing events of our own capture
(landing.format.EVENT_SCHEMA), so validation, pre-combine, TOAST fill, MERGE and the watermark
are unchanged. The pure conversion (record -> event row) runs on the executors; the planner runs
on the driver, stages the batch's events as landing Parquet (read by the ingest like our capture's
files) and keeps, in the table's watermark under `debezium`, the next Kafka offset of every topic
partition (a rerun skips what is below it), each partition's last position and, per shard, the
partition that holds its frontier. A shard's watermark sits strictly above every event applied
and at or below every event not applied (`frontiers`), as our capture's does.

Pure Python at import time: pyspark and fastavro are imported inside the functions that need them.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import re
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from cdc_lakehouse.config import LandingSource, TableConfig
from cdc_lakehouse.landing.errors import NotBootstrapped
from cdc_lakehouse.landing.format import Heartbeat, Manifest
from cdc_lakehouse.landing.reader import LandingFS, Plan, spark_uri
from cdc_lakehouse.landing.writer import local_dir, make_private, mkdirs
from cdc_lakehouse.source.catalog import lake_type, schema_json

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

    from cdc_lakehouse.settings import LakeSettings
    from cdc_lakehouse.watermark import Watermark

# A landing event as a row in landing_spark_schema's field order (op, before, after, unavailable,
# source, table_schema, ts_ms, run_id), its `source` a tuple in the same way (commit_lsn at 6).
EventRow = tuple[Any, ...]

log = logging.getLogger(__name__)

# `.json.gz`: the sink's s3.compression.type=gzip (Avro files compress inside the container instead).
FILE_RE = re.compile(r"^(?P<topic>.+)\+(?P<partition>\d+)\+(?P<start>\d+)\.(?P<ext>json|json\.gz|avro)$")
GZIP_MAGIC = b"\x1f\x8b"
# Naive UTC: Debezium's timestamps without time zone count from here.
EPOCH = datetime(1970, 1, 1)  # noqa: DTZ001
# Snapshot ('r') events get a seq from their Kafka position: offset * SNAPSHOT_PARTITIONS + partition.
SNAPSHOT_PARTITIONS = 1024


class DebeziumFormatError(ValueError):
    """A record the conversion cannot turn into PostgreSQL text; the message names the fix."""


# --- the Connect schema of a column ----------------------------------------------------------------

# Connect schema (type, semantic name) -> PostgreSQL type, for the lake type (source.catalog.lake_type).
_PG_TYPES = {
    "int8": "smallint",
    "int16": "smallint",
    "int32": "integer",
    "int64": "bigint",
    "boolean": "boolean",
    "float": "real",  # JsonConverter's names for Connect's FLOAT32/FLOAT64
    "double": "double precision",
    "float32": "real",
    "float64": "double precision",
    "string": "text",
    "bytes": "bytea",
}
_PG_SEMANTIC = {
    "io.debezium.data.VariableScaleDecimal": "numeric",
    "io.debezium.time.Date": "date",
    "org.apache.kafka.connect.data.Date": "date",
    "io.debezium.time.Timestamp": "timestamp without time zone",
    "io.debezium.time.MicroTimestamp": "timestamp without time zone",
    "io.debezium.time.NanoTimestamp": "timestamp without time zone",
    "org.apache.kafka.connect.data.Timestamp": "timestamp without time zone",
    "io.debezium.time.ZonedTimestamp": "timestamp with time zone",
    "io.debezium.time.Time": "time without time zone",
    "io.debezium.time.MicroTime": "time without time zone",
    "io.debezium.time.NanoTime": "time without time zone",
    "org.apache.kafka.connect.data.Time": "time without time zone",
    "io.debezium.time.ZonedTime": "time with time zone",
    "io.debezium.data.Uuid": "uuid",
    "io.debezium.data.Json": "jsonb",
    "io.debezium.data.Xml": "xml",
    "io.debezium.data.Enum": "text",
    "io.debezium.data.Ltree": "text",
}
DECIMAL = "org.apache.kafka.connect.data.Decimal"
UNSUPPORTED_FIX = {
    "io.debezium.time.MicroDuration": "set interval.handling.mode=string on the connector is not enough either "
    "(ISO 8601 text); map the column out with column.exclude.list or cast it in a view",
    "io.debezium.data.Bits": "exclude the column (column.exclude.list) or store it as text",
}


def pg_type(col: dict[str, Any], where: str) -> str:
    """The PostgreSQL type behind a Connect field schema."""
    sem, typ = col.get("name"), col.get("type")
    if typ == "array":
        return pg_type(col["items"], where) + "[]"
    if sem == DECIMAL:
        params = col.get("parameters") or {}
        prec = params.get("connect.decimal.precision")
        return f"numeric({prec},{params.get('scale', 0)})" if prec else "numeric"
    if sem in _PG_SEMANTIC:
        return _PG_SEMANTIC[sem]
    if sem is None and typ in _PG_TYPES:
        return _PG_TYPES[typ]
    fix = UNSUPPORTED_FIX.get(sem or "", "exclude the column (column.exclude.list) or cast it to text at the source")
    raise DebeziumFormatError(f"{where}: Debezium type {sem or typ!r} is not supported. Fix: {fix}")


def table_columns(value_schema: dict[str, Any], key: list[str], where: str) -> list[dict[str, Any]]:
    """The row's columns as our events' table_schema lists them (name, type, lake_type, key)."""
    cols = []
    for f in value_schema.get("fields", []):
        params = f.get("parameters") or {}
        source_type = params.get("__debezium.source.column.type", "").upper()
        if f.get("type") in ("double", "float64") and source_type in ("NUMERIC", "DECIMAL", "MONEY"):
            raise DebeziumFormatError(
                f"{where}: column {f['field']!r} is {source_type} sent as a double (decimal.handling.mode=double), "
                "which loses digits. Fix: set decimal.handling.mode=precise or string on the connector"
            )
        pt = pg_type(f, f"{where}: column {f['field']!r}")
        cols.append({"name": f["field"], "type": pt, "lake_type": lake_type(pt), "key": f["field"] in key})
    return cols


# --- values -> PostgreSQL text ---------------------------------------------------------------------


def _unscaled(v: Any) -> int:
    raw = base64.b64decode(v) if isinstance(v, str) else bytes(v)
    return int.from_bytes(raw, "big", signed=True)


def decimal_text(v: Any, scale: int) -> str:
    """Connect Decimal (base64 or raw big-endian two's complement, or a Decimal) -> numeric text."""
    d = v if isinstance(v, Decimal) else Decimal(_unscaled(v)).scaleb(-scale)
    return f"{d:f}"


def ts_text(micros: int) -> str:
    """Microseconds since the epoch -> timestamp text as PostgreSQL prints it."""
    dt = EPOCH + timedelta(microseconds=micros)
    return _trim(dt.strftime("%Y-%m-%d %H:%M:%S.%f"))


def time_text(micros: int) -> str:
    day = datetime(2000, 1, 1)  # noqa: DTZ001 (only the time of day is printed)
    return _trim((day + timedelta(microseconds=micros)).strftime("%H:%M:%S.%f"))


def _trim(text: str) -> str:
    """PostgreSQL prints fractions without trailing zeros, and none when whole."""
    return text.rstrip("0").rstrip(".") if "." in text else text


def zoned_text(v: str) -> str:
    """ZonedTimestamp (ISO 8601, UTC from PostgreSQL) -> '2024-01-02 03:04:05.5+00'."""
    dt = datetime.fromisoformat(v.replace("Z", "+00:00")).astimezone(UTC)
    return _trim(dt.strftime("%Y-%m-%d %H:%M:%S.%f")) + "+00"


def float_text(v: float, single: bool) -> str:
    if math.isnan(v):
        return "NaN"
    if v in (float("inf"), float("-inf")):
        return "Infinity" if v > 0 else "-Infinity"
    if single:  # the shortest text that reads back as the same float4, as PostgreSQL prints it
        f4 = struct.unpack("f", struct.pack("f", v))[0]
        for p in range(1, 10):
            s = f"{v:.{p}g}"
            if struct.unpack("f", struct.pack("f", float(s)))[0] == f4:
                return s
    s = repr(float(v))
    return s[:-2] if s.endswith(".0") else s


_TIME_UNITS = {
    "io.debezium.time.Timestamp": 1000,
    "org.apache.kafka.connect.data.Timestamp": 1000,
    "io.debezium.time.MicroTimestamp": 1,
    "io.debezium.time.NanoTimestamp": -1000,
    "io.debezium.time.Time": 1000,
    "org.apache.kafka.connect.data.Time": 1000,
    "io.debezium.time.MicroTime": 1,
    "io.debezium.time.NanoTime": -1000,
}


def _micros(v: int, sem: str) -> int:
    unit = _TIME_UNITS[sem]
    return v * unit if unit > 0 else v // -unit


def to_text(col: dict[str, Any], v: Any) -> str | None:  # noqa: PLR0911 (one return per type)
    """A Debezium value -> the text PostgreSQL prints for it (what our capture lands)."""
    if v is None:
        return None
    sem, typ = col.get("name"), col.get("type")
    if typ == "array":
        return json.dumps([to_text(col["items"], x) for x in v], separators=(",", ":"))
    if sem == DECIMAL:
        return decimal_text(v, int((col.get("parameters") or {}).get("scale", 0)))
    if sem == "io.debezium.data.VariableScaleDecimal":
        return f"{v:f}" if isinstance(v, Decimal) else decimal_text(v["value"], int(v["scale"]))
    if sem in ("io.debezium.time.Date", "org.apache.kafka.connect.data.Date"):
        return (v if isinstance(v, date) else date(1970, 1, 1) + timedelta(days=v)).isoformat()
    if sem in _TIME_UNITS:
        return _temporal_text(v, sem)
    if sem == "io.debezium.time.ZonedTimestamp":
        return zoned_text(v)
    if sem == "io.debezium.time.ZonedTime":
        zoned: str = v
        return zoned[:-1] + "+00" if zoned.endswith("Z") else zoned
    if typ == "boolean":
        return "t" if v else "f"
    if typ in ("float", "double", "float32", "float64"):
        return float_text(v, typ in ("float", "float32"))
    if typ == "bytes":
        return "\\x" + (base64.b64decode(v) if isinstance(v, str) else bytes(v)).hex()
    return str(v)


def _temporal_text(v: Any, sem: str) -> str:
    if isinstance(v, datetime):  # Avro logical types, decoded by fastavro
        return ts_text(int((v.astimezone(UTC).replace(tzinfo=None) - EPOCH) / timedelta(microseconds=1)))
    if isinstance(v, time):
        return _trim(v.strftime("%H:%M:%S.%f"))
    micros = _micros(int(v), sem)
    return ts_text(micros) if "Timestamp" in sem else time_text(micros)


def is_unavailable(col: dict[str, Any], v: Any, placeholder: str) -> bool:
    """An unchanged TOASTed value Debezium did not have (unavailable.value.placeholder)."""
    if v is None:
        return False
    if isinstance(v, str):
        if col.get("type") == "bytes":
            return v == base64.b64encode(placeholder.encode()).decode()
        return v == placeholder
    if isinstance(v, bytes):
        return v == placeholder.encode()
    if isinstance(v, list) and len(v) == 1:
        return is_unavailable(col.get("items") or {}, v[0], placeholder)
    return False


def row_texts(
    schema: dict[str, Any], row: dict[str, Any] | None, placeholder: str
) -> tuple[dict[str, str | None] | None, list[str]]:
    """(column -> text, unavailable columns) of a before/after struct."""
    if row is None:
        return None, []
    out: dict[str, str | None] = {}
    unavailable: list[str] = []
    for f in schema.get("fields", []):
        name = f["field"]
        v = row.get(name)
        if is_unavailable(f, v, placeholder):
            unavailable.append(name)
            continue
        out[name] = to_text(f, v)
    return out, unavailable


# --- files and records -----------------------------------------------------------------------------


# Where a streamed change sits in its partition's order: (commit position, event LSN, 0 for a
# delete / 1 otherwise). Debezium writes a partition's changes in this order, and a copy it sends
# again after an unclean stop has the same place (`_offset_events`).
Place = tuple[int, int, int]


@dataclass(frozen=True)
class SinkFile:
    """One object of the S3 sink; records at offsets below `skip_below` are already applied, those
    from `stop_at` on are held back for a later batch (above the shard's frontier, `frontiers`).
    `floor` is the shard's watermark: an event whose position is below it is placed at it
    (`_offset_events`). `applied` is the place of the last streamed change of the partition applied
    before this file's first record (None: not known); a change at or below it is a copy Debezium
    sent again."""

    uri: str
    topic: str
    partition: int
    start: int
    skip_below: int = 0
    heartbeat: bool = False
    floor: int = 0
    stop_at: int | None = None
    applied: Place | None = None

    @property
    def name(self) -> str:
        return self.uri.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class Shape:
    """What the conversion (on the executors) needs to know about the table."""

    table_name: str  # the config's name, for messages
    table: str
    key: tuple[str, ...]
    placeholder: str
    fmt: str
    endpoints: tuple[tuple[str, str], ...]  # (topic, endpoint id)

    def endpoint(self, topic: str) -> str:
        return dict(self.endpoints)[topic]


def shape_of(cfg: TableConfig) -> Shape:
    src = cfg.landing
    return Shape(
        cfg.name, cfg.source.table, tuple(cfg.primary_key), src.unavailable_value, src.format,
        tuple((table_topic(src, g.conn_id, schema, cfg.source.table), g.endpoint_id) for g, schema, _ in cfg.shards()),
    )  # fmt: skip


def table_topic(src: LandingSource, conn_id: str, schema: str, table: str) -> str:
    return f"{src.prefix_for(conn_id)}.{schema}.{table}"


def heartbeat_topic(prefix: str) -> str:
    return f"__debezium-heartbeat.{prefix}"


def avro_to_connect(s: Any, names: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """An Avro schema as written by Confluent's AvroConverter -> the Connect schema JsonConverter
    writes (type, name, parameters, fields/items), so both formats share one conversion."""
    if isinstance(s, list):
        inner = [x for x in s if x != "null"]
        return {**avro_to_connect(inner[0], names), "optional": True}
    if isinstance(s, str):
        if s in names:
            return names[s]
        s = {"type": s}
    typ = s["type"]
    if isinstance(typ, dict | list):
        return avro_to_connect(typ, names)
    out: dict[str, Any] = {"name": s.get("connect.name"), "parameters": s.get("connect.parameters")}
    if typ == "record":
        out["type"] = "struct"
        out["name"] = s.get("connect.name") or s.get("name")
        out["fields"] = [{**avro_to_connect(f["type"], names), "field": f["name"]} for f in s["fields"]]
        full = f"{s['namespace']}.{s['name']}" if s.get("namespace") else s["name"]
        names[full] = names[s["name"]] = out
    elif typ == "array":
        out.update(type="array", items=avro_to_connect(s["items"], names))
    else:
        avro = {"int": "int32", "long": "int64"}
        out["type"] = s.get("connect.type") or avro.get(typ, typ)
    return out


def records(data: bytes, fmt: str, where: str) -> Iterator[tuple[dict[str, Any] | None, dict[str, Any] | None]]:
    """(value schema, payload) of every record of a sink file, in offset order; (None, None) for a
    tombstone (a null value)."""
    if fmt == "avro":
        import fastavro

        reader = fastavro.reader(io.BytesIO(data))
        schema = avro_to_connect(json.loads(reader.metadata["avro.schema"]), {})
        for rec in reader:
            # cast: the values of a record schema (a Debezium envelope) decode to dicts.
            yield (schema, cast(dict[str, Any], rec)) if rec is not None else (None, None)
        return
    if data[:2] == GZIP_MAGIC:
        import gzip

        data = gzip.decompress(data)
    for line in data.decode("utf-8").split("\n"):
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec is None or (isinstance(rec, dict) and rec.get("payload") is None and "schema" in rec):
            yield None, None
        elif not isinstance(rec, dict) or "payload" not in rec or "schema" not in rec:
            raise DebeziumFormatError(
                f"{where}: a record has no schema/payload envelope. Fix: set value.converter.schemas.enable=true "
                "on the S3 sink (JsonConverter with schemas), or landing.format: avro for Avro files"
            )
        else:
            yield rec["schema"], rec["payload"]


def _field(schema: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((f for f in schema.get("fields", []) if f.get("field") == name), None)


# --- one record -> one landing event -----------------------------------------------------------------


@dataclass
class FileState:
    """Per file: the table_schema JSON of each value schema seen (records repeat the schema)."""

    schemas: dict[str, str | None] = field(default_factory=dict)


def commit_position(src: dict[str, Any], op: str, offset: int, partition: int) -> tuple[int, int]:
    """(commit_lsn, seq) of an event: the order our ingest applies events in.

    Streamed changes: source.sequence is [last commit LSN, event LSN]; the last commit LSN is the
    same for every change of a transaction and grows with commit order, so it stands for the
    transaction's commit (the first transaction after a start has none: its event LSN). It is the
    commit of the transaction *before* this one (Debezium updates it at each COMMIT), so a
    watermark covers the transaction at position P only from P + 1 on (`frontiers`). seq is the
    event LSN (changes of a transaction in WAL order). Snapshot ('r') rows all carry the
    snapshot's LSN: they sort just before it, seq from their Kafka position."""
    lsn = int(src["lsn"])
    if op == "r" or src.get("snapshot") not in (None, "false", False):
        return lsn - 1, offset * SNAPSHOT_PARTITIONS + partition + 1
    seq = json.loads(src["sequence"]) if src.get("sequence") else []
    return (int(seq[0]) if seq and seq[0] is not None else lsn), lsn


def event_row(
    shape: Shape, sf: SinkFile, offset: int, schema: dict[str, Any], payload: dict[str, Any], st: FileState
) -> EventRow | None:
    """A Debezium change event -> a landing event row (landing_spark_schema order); None for
    records that are not row changes of the table."""
    op = payload.get("op")
    where = f"{shape.table_name}: {sf.uri} (offset {offset})"
    if op not in ("c", "u", "d", "r", "t"):
        raise DebeziumFormatError(f"{where}: unknown op {op!r}; is this a Debezium PostgreSQL topic?")
    src = payload["source"]
    if src.get("table") != shape.table:
        return None
    value_schema = _field(schema, "after") or _field(schema, "before") or {}
    skey = json.dumps(value_schema, sort_keys=True)
    if skey not in st.schemas:
        cols = table_columns(value_schema, list(shape.key), where) if value_schema.get("fields") else None
        st.schemas[skey] = schema_json(cols) if cols else None
    before, _ = row_texts(value_schema, payload.get("before"), shape.placeholder)
    after, unavailable = row_texts(value_schema, payload.get("after"), shape.placeholder)
    commit_lsn, seq = commit_position(src, op, offset, sf.partition)
    ts_us = src.get("ts_us") or src["ts_ms"] * 1000
    source = (
        "postgresql", shape.endpoint(sf.topic), src.get("name"), src.get("db"), src.get("schema"), src["table"],
        commit_lsn, int(src["lsn"]), src.get("txId"), seq, EPOCH.replace(tzinfo=UTC) + timedelta(microseconds=ts_us),
    )  # fmt: skip
    return (op, before, after, unavailable or None, source, st.schemas[skey], payload.get("ts_ms"), sf.name)


@dataclass(frozen=True)
class Event:
    """A change record of a sink file: its offset, its landing event row, whether it was placed
    at the floor (`late`), whether it is a copy of a change already applied (`again`: left out),
    the highest place of its partition after it (`top`), and whether it is a read of a new
    snapshot (`fresh`), which starts the partition's order again."""

    offset: int
    row: EventRow
    late: bool
    again: bool
    top: Place | None
    fresh: bool


def place_of(row: EventRow) -> Place | None:
    """A streamed change's place in its partition (snapshot reads have none: they all share the
    snapshot's LSN, and the connector reads them again only by taking a new snapshot)."""
    if row[0] == "r":
        return None
    return (row[4][6], row[4][7], 0 if row[0] == "d" else 1)


def _offset_events(shape: Shape, sf: SinkFile, data: bytes) -> Iterator[Event]:
    """The file's change records from `skip_below` up to `stop_at` (tombstones and records already
    applied by offset are left out).

    Debezium delivers at least once: after an unclean Kafka Connect stop it sends again, at new
    offsets, changes it had sent. A partition's streamed changes come in commit order (a
    transaction's in WAL order, a key change's delete before its create at one LSN), so a change
    at or below the place of one applied (`sf.applied`) or read before it in this file is such a
    copy: marked `again`, and applying it would bring an older value back above newer ones (#51).

    An event whose position is below the shard's watermark (`sf.floor`) and is not a copy is
    placed at it: the offsets say it was never applied, but the ingest drops events below the
    watermark as applied and a change-feed range closed at that watermark would never show it.
    That happens to the rest of a transaction the sink split across objects flushed at different
    times (the first part was applied and the watermark moved past its position) and to
    incremental-snapshot reads. At the watermark it sorts after everything applied before and
    before every later transaction (whose position is at least the watermark), so per key the
    order is kept.

    Snapshot reads have no place and are never copies. A read of a new snapshot (not an
    incremental one) starts the order again: after a new slot or a new server, positions may be
    lower than those applied before."""
    st = FileState()
    top = sf.applied
    for pos, (schema, payload) in enumerate(records(data, shape.fmt, f"{shape.table_name}: {sf.uri}")):
        offset = sf.start + pos
        if sf.stop_at is not None and offset >= sf.stop_at:
            return
        if offset < sf.skip_below or payload is None or sf.heartbeat:
            continue
        assert schema is not None  # only a tombstone has none, and it has no payload either
        row = event_row(shape, sf, offset, schema, payload, st)
        if row is None:
            continue
        place = place_of(row)
        fresh = place is None and payload["source"].get("snapshot") not in (None, "false", False, "incremental")
        again = place is not None and top is not None and place <= top
        if fresh:
            top = None
        elif place is not None and not again:
            top = place
        late = row[4][6] < sf.floor
        yield Event(offset, _at_floor(row, sf.floor) if late else row, late, again, top, fresh)


def _at_floor(row: EventRow, floor: int) -> EventRow:
    source = row[4]
    return (*row[:4], (*source[:6], floor, *source[7:]), *row[5:])


def file_events(shape: Shape, sf: SinkFile, data: bytes) -> Iterator[EventRow]:
    """The landing event rows of one sink file, from its `skip_below` offset up to `stop_at`."""
    for ev in _offset_events(shape, sf, data):
        if not ev.again:
            yield ev.row


def _last(last: list[Any] | None, row: EventRow) -> list[Any]:
    """[highest position, commit time of the latest event]: what the watermark keeps of a partition."""
    at = row[4][6]
    return [at if last is None else max(at, last[0]), row[4][10].isoformat()]


def file_stats(shape: Shape, sf: SinkFile, data: bytes) -> dict[str, Any]:
    """What the planner needs of a file: its record count (offsets it covers), its events' lowest
    and highest position (`lo`, `hi`), `last` (the highest position, the last event's commit
    time), how many were placed at the floor (`late`), the highest place of a streamed change
    (`top`), how many are copies of changes applied (`again`, left out of the rest), the latest
    heartbeat; a conversion error as text."""
    out: dict[str, Any] = {"name": sf.name, "records": 0, "events": 0, "lo": None, "hi": None, "last": None}
    out.update(late=0, top=_json_place(sf.applied), fresh=False, again=0, heartbeat=None, error=None)
    try:
        if sf.heartbeat:
            for _schema, payload in records(data, shape.fmt, f"{shape.table_name}: {sf.uri}"):
                out["records"] += 1
                if payload is not None and payload.get("ts_ms") is not None:
                    out["heartbeat"] = max(out["heartbeat"] or 0, int(payload["ts_ms"]))
            return out
        out["records"] = sum(1 for _ in records(data, shape.fmt, f"{shape.table_name}: {sf.uri}"))
        for ev in _offset_events(shape, sf, data):
            out["top"], out["fresh"] = _json_place(ev.top), out["fresh"] or ev.fresh
            if ev.again:
                out["again"] += 1
                continue
            at = ev.row[4][6]
            out["lo"] = at if out["lo"] is None else min(out["lo"], at)
            out["hi"] = at if out["hi"] is None else max(out["hi"], at)
            out["last"], out["events"] = _last(out["last"], ev.row), out["events"] + 1
            out["late"] += ev.late
    except (DebeziumFormatError, ValueError, KeyError, TypeError) as exc:
        out["error"] = f"{exc}" if isinstance(exc, DebeziumFormatError) else f"{shape.table_name}: {sf.uri}: {exc!r}"
    return out


def cut_point(shape: Shape, sf: SinkFile, data: bytes, frontier: int) -> dict[str, Any]:
    """Where a file crosses its shard's frontier: the offset of its first event at or above it
    (`at`, None when there is none), the events before it, the last one's position and the
    highest place and whether a new snapshot began (`top`, `fresh`, as `file_stats`), and how many
    events from it on are held back."""
    out: dict[str, Any] = {"name": sf.name, "at": None, "events": 0, "last": None, "held": 0}
    out.update(top=_json_place(sf.applied), fresh=False)
    for ev in _offset_events(shape, sf, data):
        if out["at"] is None and not ev.again and ev.row[4][6] >= frontier:
            out["at"] = ev.offset
        if out["at"] is not None:
            out["held"] += not ev.again
            continue
        out["top"], out["fresh"] = _json_place(ev.top), out["fresh"] or ev.fresh
        if not ev.again:
            out["events"], out["last"] = out["events"] + 1, _last(out["last"], ev.row)
    return out


# --- the plan (driver) -------------------------------------------------------------------------------


@dataclass
class DebeziumPlan(Plan):
    """A Plan of a Debezium-fed table: `files` is the staged landing Parquet of the batch,
    `sink_files` the sink objects it was converted from."""

    sink_files: list[SinkFile] = field(default_factory=list)


def pending_files(fs: LandingFS, base: str, topic: str, committed: dict[str, int], heartbeat: bool) -> list[SinkFile]:
    """The topic's objects not wholly below the committed offsets, per partition in offset order.
    A file ends where the next one of its partition starts, so only a partition's last file below
    the committed offset can straddle it; it is read from that offset on."""
    out = []
    for pdir in fs.list_names(f"{base}/{topic}"):
        if not pdir.startswith("partition="):
            continue
        found = []
        for name in fs.list_names(f"{base}/{topic}/{pdir}"):
            m = FILE_RE.match(name)
            if m and m["topic"] == topic and f"partition={m['partition']}" == pdir:
                found.append((int(m["start"]), int(m["partition"]), f"{base}/{topic}/{pdir}/{name}"))
        found.sort()
        for i, (start, p, uri) in enumerate(found):
            done = committed.get(str(p), 0)
            if i + 1 < len(found) and found[i + 1][0] <= done:
                continue  # the next file starts at or below the committed offset: this one is applied
            out.append(SinkFile(uri, topic, p, start, max(done, start), heartbeat))
    return out


def within_budget(files: list[SinkFile], stats: dict[str, dict[str, Any]], limit: int) -> list[SinkFile]:
    """The files of one batch: every heartbeat file, and of each topic partition a prefix in
    offset order, taken lowest position first across partitions until `limit` events (at least
    one file). The batch applies only what lies below its shard's frontier (`frontiers`), which
    the lowest position not taken bounds: taking in position order keeps that frontier moving
    during a backlog, and files at the lowest position are all taken (a transaction spread over
    several partitions or files), so a batch never takes only what it must then hold back."""
    queues: dict[tuple[str, int], list[SinkFile]] = {}
    for f in files:
        if not f.heartbeat:
            queues.setdefault((f.topic, f.partition), []).append(f)

    def head(q: list[SinkFile]) -> int:  # objects without events first: they cost nothing
        lo = stats[q[0].name].get("lo")
        return -1 if lo is None else lo

    chosen, total, lowest = [f for f in files if f.heartbeat], 0, None
    while any(queues.values()):
        q = min((q for q in queues.values() if q), key=head)
        if lowest is not None and total >= limit and head(q) > lowest:
            break
        f = q.pop(0)
        chosen.append(f)
        total += stats[f.name]["events"]
        if lowest is None and stats[f.name].get("lo") is not None:
            lowest = stats[f.name]["lo"]
    left = sum(len(q) for q in queues.values())
    if left:
        log.info(
            "debezium: %d event(s) in this batch (ingest.max_events_per_run %d); %d file(s) left for the next run",
            total,
            limit,
            left,
        )
    return chosen


def read_bytes(fs: LandingFS, uri: str) -> bytes:
    """A (small) file's bytes, read here (the driver, or the Spark Connect client)."""
    return fs.read_bytes(uri)


def _over_files(
    spark: SparkSession,
    files: list[SinkFile],
    fn: Callable[[SinkFile, bytes], Iterable[dict[str, Any]]],
    schema: StructType | str,
) -> DataFrame:
    """fn(SinkFile, bytes) -> records (dicts of `schema`'s fields) for every file, run on the
    executors: Spark's binaryFile source reads the objects, mapInArrow converts them. One Spark
    job for all of a batch's objects, and no object's bytes pass through this process (a Spark
    Connect client may be far from them)."""
    import pyarrow as pa

    from cdc_lakehouse.landing.format import landing_arrow_schema

    by_name = {f.name: f for f in files}
    raw = spark.read.format("binaryFile").load([f.uri for f in files]).select("path", "content")
    arrow = landing_arrow_schema() if not isinstance(schema, str) else None

    def run(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for b in batches:
            out: list[dict[str, Any]] = []
            for path, data in zip(b.column("path").to_pylist(), b.column("content").to_pylist()):
                out.extend(fn(by_name[path.rsplit("/", 1)[-1]], data))
            if out:
                yield pa.RecordBatch.from_pylist(out, schema=arrow)

    return raw.mapInArrow(run, schema)


def _json_rows(spark: SparkSession, files: list[SinkFile], fn: Callable[[SinkFile, bytes], object]) -> list[Any]:
    """fn(SinkFile, bytes) -> one JSON-able value per file, collected."""
    out = _over_files(spark, files, lambda f, d: [{"v": json.dumps(fn(f, d), default=str)}], "v string")
    return [json.loads(r["v"]) for r in out.collect()]


def event_record(row: EventRow) -> dict[str, Any]:
    """An event row (landing_spark_schema order) as the record Arrow builds a landing batch from."""
    from cdc_lakehouse.landing.format import LANDING_FIELDS, SOURCE_FIELDS

    rec = dict(zip(LANDING_FIELDS, row))
    rec["source"] = dict(zip(SOURCE_FIELDS, rec["source"]))
    return rec


def plan_debezium(spark: SparkSession, lake: LakeSettings, cfg: TableConfig, watermark: Watermark) -> DebeziumPlan:
    """The sink objects above the table's committed Kafka offsets, converted into landing events
    (Parquet in the landing format, under `<landing>/_debezium/<table>/`), and the watermark
    after them: each shard at its frontier, and only the events below it applied (`frontiers`).
    The rest of the ingest reads those files like our own capture's."""
    missing = [shard for _, _, shard in cfg.shards() if shard not in watermark.shards]
    if missing:
        raise NotBootstrapped(
            f"{cfg.name}: shard(s) {missing} have no watermark; run the bootstrap (cdc_bootstrap__{cfg.name}), "
            "which for a Debezium-fed table creates the tables and loads the connector's snapshot events"
        )
    shape = shape_of(cfg)
    files = listed_files(LandingFS(spark), cfg, shape, watermark)
    stats = read_stats(spark, LandingFS(spark), shape, files)
    chosen = after_applied(within_budget(files, stats, cfg.ingest.max_events_per_run), stats)
    fronts = frontiers(cfg, watermark, files, chosen, stats)
    taken, fronts = take_below(spark, shape, chosen, stats, fronts)
    report(cfg, fronts, [stats[t.file.name] for t in taken])
    new_wm = advance(cfg, watermark, taken, fronts)
    # Only files with events to apply are staged: a rerun re-lists each partition's last file (it
    # may have grown), and an empty batch goes the quiet-shard way (the watermark only).
    events = [t.file for t in taken if not t.file.heartbeat and t.events]
    staged = stage_events(spark, lake, cfg, events) if events else []
    # The batch's "runs": its sink objects (no slot position: end_lsn 0), then the heartbeats read.
    manifests = [Manifest(run_id=f.name, end_lsn=0) for f in events] + heartbeat_manifests(cfg, new_wm, chosen)
    return DebeziumPlan(manifests, staged, new_wm, sink_files=events)


def topic_shards(cfg: TableConfig) -> dict[str, str]:
    """Table topic -> the shard it feeds (one topic per server, schema and table)."""
    return {table_topic(cfg.landing, g.conn_id, schema, cfg.source.table): shard for g, schema, shard in cfg.shards()}


def listed_files(fs: LandingFS, cfg: TableConfig, shape: Shape, watermark: Watermark) -> list[SinkFile]:
    """Every object above the committed offsets: the table topics' (each with its shard's
    watermark as the floor of its events' positions) and the heartbeat topics'."""
    src = cfg.landing
    base = spark_uri(str(src.uri).rstrip("/")) + "/" + src.topics_dir
    offsets = (watermark.debezium or {}).get("offsets", {})
    floors = {topic: watermark.shards[shard].lsn for topic, shard in topic_shards(cfg).items()}
    applied = (watermark.debezium or {}).get("applied", {})
    files = [
        replace(f, floor=floors[topic], applied=_place(applied.get(topic, {}).get(str(f.partition))))
        for topic, _ in shape.endpoints
        for f in pending_files(fs, base, topic, offsets.get(topic, {}), False)
    ]
    for prefix in sorted({src.prefix_for(g.conn_id) for g in cfg.source.shards}):
        topic = heartbeat_topic(prefix)
        files += pending_files(fs, base, topic, offsets.get(topic, {}), True)
    return files


def after_applied(chosen: list[SinkFile], stats: dict[str, dict[str, Any]]) -> list[SinkFile]:
    """The chosen files, each knowing the place of the last change its partition applied before
    it: the watermark's, raised by the files of the batch before it (a copy of a change is sent
    after the change itself, possibly in a later object of the same batch)."""
    out: list[SinkFile] = []
    tops: dict[tuple[str, int], list[int] | None] = {}
    for f in chosen:  # per partition in offset order (within_budget)
        k = (f.topic, f.partition)
        if f.heartbeat:
            out.append(f)
            continue
        g = replace(f, applied=_place(tops[k])) if k in tops else f
        tops[k] = following(_json_place(g.applied), PlacesAfter.of(stats[g.name]))
        out.append(g)
    return out


@dataclass(frozen=True)
class PlacesAfter:
    """What a file (or its part before a cut) leaves of its partition's order: the highest place
    (as JSON keeps it: a list), and whether a new snapshot began in it (`file_stats`, `cut_point`)."""

    top: list[int] | None
    fresh: bool

    @classmethod
    def of(cls, stats: dict[str, Any]) -> PlacesAfter:
        return cls(stats["top"], stats["fresh"])


def following(applied: list[int] | None, after: PlacesAfter) -> list[int] | None:
    """The partition's highest place once a file leaving `after` is applied on top of `applied`:
    the file's own after a new snapshot."""
    if after.fresh or applied is None:
        return after.top
    return applied if after.top is None or applied >= after.top else after.top


def _place(top: list[int] | None) -> Place | None:
    return (top[0], top[1], top[2]) if top else None


def _json_place(place: Place | None) -> list[int] | None:
    return list(place) if place else None


def read_stats(spark: SparkSession, fs: LandingFS, shape: Shape, files: list[SinkFile]) -> dict[str, dict[str, Any]]:
    """file_stats of every listed object, by name; conversion errors stop the table here."""
    tables = [f for f in files if not f.heartbeat]
    stats = _json_rows(spark, tables, lambda f, d: file_stats(shape, f, d)) if tables else []
    # Heartbeat topics start with '_', which Hadoop's input formats treat as hidden: read on the driver.
    stats += [file_stats(shape, f, read_bytes(fs, f.uri)) for f in files if f.heartbeat]
    errors = [s["error"] for s in stats if s["error"]]
    if errors:
        raise DebeziumFormatError("\n".join(sorted(set(errors))))
    return {s["name"]: s for s in stats}


# --- the frontier: where a shard's watermark may go ---------------------------------------------------


@dataclass(frozen=True)
class Frontier:
    """Where a shard's watermark goes with this batch (`lsn`: every event below it applied, none
    at or above it), the partition that holds it there, and what waits: `held` events the batch
    read but holds back (at or above the frontier), `left` events of files the budget left out.
    `delivered` is False while a partition of the topic never delivered: the shard cannot move."""

    shard: str
    topic: str
    lsn: int
    holder: str
    delivered: bool
    held: int = 0
    left: int = 0


def partition_low(
    files: list[SinkFile], picked: set[str], stats: dict[str, dict[str, Any]], last: list[Any] | None
) -> int | None:
    """The lowest position a partition may still deliver after this batch: its first event the
    batch does not take; else one above the highest it ever delivered (Debezium's position is the
    previous transaction's commit, shared by a whole transaction, so the next transaction's is
    higher: +1 covers the last one delivered). None when it never delivered anything."""
    rest: list[int] = [stats[f.name]["lo"] for f in files if f.name not in picked and stats[f.name]["events"]]
    if rest:
        return min(rest)
    seen: list[int] = [stats[f.name]["hi"] for f in files if stats[f.name]["events"]] + ([last[0]] if last else [])
    return max(seen) + 1 if seen else None


def frontiers(
    cfg: TableConfig,
    watermark: Watermark,
    files: list[SinkFile],
    chosen: list[SinkFile],
    stats: dict[str, dict[str, Any]],
) -> dict[str, Frontier]:
    """Per table topic, its shard's frontier: the lowest `partition_low` of its partitions (within
    a partition events arrive in commit order; across partitions they do not, so a partition
    behind the others holds them back), never below the shard's watermark. The watermark then
    means exactly what it means for our capture: every transaction below it is in the table,
    none at or above it, and every changelog row lies in one range between two watermarks."""
    last = (watermark.debezium or {}).get("last", {})
    picked = {f.name for f in chosen}
    out = {}
    for topic, shard in topic_shards(cfg).items():
        mine = [f for f in files if f.topic == topic]
        parts = sorted(set(range(cfg.landing.partitions)) | {f.partition for f in mine})
        seen = last.get(topic, {})
        lows = {p: partition_low([f for f in mine if f.partition == p], picked, stats, seen.get(str(p))) for p in parts}
        left = sum(stats[f.name]["events"] for f in mine if f.name not in picked)
        out[topic] = frontier_of(shard, topic, watermark.shards[shard].lsn, lows, left)
    return out


def frontier_of(shard: str, topic: str, lsn: int, lows: dict[int, int | None], left: int) -> Frontier:
    never = [p for p, low in lows.items() if low is None]
    if never:
        return Frontier(shard, topic, lsn, f"{topic} partition {never[0]} (never delivered)", False, left=left)
    delivered = {p: low for p, low in lows.items() if low is not None}  # all of them, here
    p = min(delivered, key=lambda q: delivered[q])  # in partition order: a tie names the lowest partition
    return Frontier(shard, topic, max(lsn, delivered[p]), f"{topic} partition {p}", True, left=left)


@dataclass(frozen=True)
class Taken:
    """What a batch takes of one sink object: its records up to `end` (the partition's next
    offset), `events` of them, `last` [highest position, latest commit time], `top` the highest
    place of a change; for a heartbeat object its newest beat (ms)."""

    file: SinkFile
    end: int
    events: int = 0
    last: list[Any] | None = None
    heartbeat: int | None = None
    places: PlacesAfter | None = None


def take_below(
    spark: SparkSession,
    shape: Shape,
    chosen: list[SinkFile],
    stats: dict[str, dict[str, Any]],
    fronts: dict[str, Frontier],
) -> tuple[list[Taken], dict[str, Frontier]]:
    """The part of each chosen object below its shard's frontier, and the frontiers with the
    events held back counted. Per partition that is a prefix in offset order: the first event at
    or above the frontier and everything after it wait (the partition's committed offset stays
    at that event, so the next run reads it again); a file crossing the frontier is cut at it."""
    taken = [
        Taken(f, f.start + stats[f.name]["records"], heartbeat=stats[f.name]["heartbeat"])
        for f in chosen
        if f.heartbeat
    ]
    held: dict[str, int] = {}
    crossing = []
    by_part: dict[tuple[str, int], list[SinkFile]] = {}
    for f in chosen:
        if not f.heartbeat:
            by_part.setdefault((f.topic, f.partition), []).append(f)
    for (topic, _p), part in by_part.items():
        w = fronts[topic].lsn
        for i, f in enumerate(part):
            s = stats[f.name]
            if s["events"] and s["hi"] >= w:  # this file reaches the frontier: the rest of the partition waits
                crosses = s["lo"] < w
                crossing += [f] if crosses else []
                waiting = part[i + 1 :] if crosses else part[i:]
                held[topic] = held.get(topic, 0) + sum(stats[g.name]["events"] for g in waiting)
                break
            taken.append(Taken(f, f.start + s["records"], s["events"], s["last"], places=PlacesAfter.of(s)))
    for c in cut_points(spark, shape, crossing, fronts):
        f = next(f for f in crossing if f.name == c["name"])
        at = c["at"] if c["at"] is not None else f.start + stats[f.name]["records"]
        taken.append(Taken(replace(f, stop_at=at), at, c["events"], c["last"], places=PlacesAfter.of(c)))
        held[f.topic] = held.get(f.topic, 0) + c["held"]
    return taken, {t: replace(fr, held=held.get(t, 0)) for t, fr in fronts.items()}


def cut_points(
    spark: SparkSession, shape: Shape, files: list[SinkFile], fronts: dict[str, Frontier]
) -> list[dict[str, Any]]:
    """cut_point of each file that crosses its shard's frontier (read again on the executors:
    only such files, at most one per partition)."""
    if not files:
        return []
    w = {t: fr.lsn for t, fr in fronts.items()}
    return _json_rows(spark, files, lambda f, d: cut_point(shape, f, d, w[f.topic]))


def report(cfg: TableConfig, fronts: dict[str, Frontier], taken_stats: list[dict[str, Any]]) -> None:
    """Say what waits and why: events held back above a shard's frontier, and which partition
    holds it (the watermark's `debezium.frontier` keeps the same, so the run's metrics show it);
    events placed at the watermark (`_offset_events`)."""
    for fr in fronts.values():
        if fr.held:
            log.warning(
                "debezium %s: shard %s: %d event(s) held back at or above position %d, held there by %s: a partition "
                "behind the others may still deliver older transactions. Use one partition per table topic, or keep "
                "every partition flowing (docs/debezium.md, Positions)",
                cfg.name, fr.shard, fr.held, fr.lsn, fr.holder,
            )  # fmt: skip
    counted = {
        "again": "left out as copies of changes an earlier batch applied (Debezium sends changes again after an "
        "unclean Kafka Connect stop; docs/debezium.md, Redelivery)",
        "late": "below their shard's watermark (the rest of a transaction the sink split across objects flushed at "
        "different times, or incremental-snapshot reads) are applied at the watermark",
    }
    for what, says in counted.items():
        n = sum(s[what] for s in taken_stats)
        if n:
            log.warning("debezium %s: %d event(s) %s", cfg.name, n, says)


def stage_events(spark: SparkSession, lake: LakeSettings, cfg: TableConfig, events: list[SinkFile]) -> list[str]:
    """Write the events of `events` as landing Parquet; returns the directory. One staging
    directory per table, replaced by every plan: a batch that did not commit is planned again
    from the offsets in the watermark."""
    staging = f"{spark_uri(lake.landing_uri.rstrip('/'))}/_debezium/{cfg.name}"
    # The staged events are row images in the private landing zone. On a local landing zone the
    # parent is made 0750 before Spark writes (others cannot reach the files even for the moment
    # they have Hadoop's 0644), and the tree is made 0640/0750 after; a chmod walk, not a umask:
    # the JVM is another process, and Hadoop sets modes from its own cached setting.
    local = local_dir(lake.landing_uri)
    if local is not None:
        mkdirs(local / "_debezium", Path(local.resolve().anchor))
        make_private(local / "_debezium")  # also when made by an earlier release with 0755
    LandingFS(spark).delete(staging)
    read_debezium(spark, cfg, events).write.mode("overwrite").parquet(staging)
    if local is not None:
        make_private(local / "_debezium" / cfg.name)
    return [staging]


def heartbeat_manifests(cfg: TableConfig, new_wm: Watermark, files: list[SinkFile]) -> list[Manifest]:
    """The heartbeats read, as manifests of the heartbeat topics (endpoint, schema -> commit time:
    what the freshness record reads; Debezium's heartbeat carries no LSN, so end_lsn is 0)."""
    if not any(f.heartbeat for f in files):
        return []
    beats = (new_wm.debezium or {}).get("heartbeats", {})
    out = []
    for g in cfg.source.shards:
        beat = beats.get(cfg.landing.prefix_for(g.conn_id))
        if beat:
            hb = {s: Heartbeat(commit_lsn=None, commit_ts=beat) for s in g.schemas}
            run_id = heartbeat_topic(cfg.landing.prefix_for(g.conn_id))
            out.append(Manifest(run_id=run_id, end_lsn=0, endpoint=g.endpoint_id, heartbeats=hb))
    return out


def advance(cfg: TableConfig, watermark: Watermark, taken: list[Taken], fronts: dict[str, Frontier]) -> Watermark:
    """The watermark once `taken` is applied: every partition's next offset and last position,
    each shard at its frontier (with the newest commit time applied), `debezium.frontier` saying
    per shard which partition holds it and how many events wait above it. A heartbeat newer than
    a shard's time makes it that fresh, only when nothing of the shard waits."""
    new = watermark.model_copy(deep=True)
    st = new.debezium = dict(new.debezium or {})
    offsets, last, beats = st.setdefault("offsets", {}), st.setdefault("last", {}), st.setdefault("heartbeats", {})
    applied = st.setdefault("applied", {})
    for t in sorted(taken, key=lambda t: (t.file.topic, t.file.partition, t.file.start)):
        f, p = t.file, str(t.file.partition)
        po = offsets.setdefault(f.topic, {})
        po[p] = max(po.get(p, 0), t.end)
        if t.places is not None:
            pa = applied.setdefault(f.topic, {})
            pa[p] = following(pa.get(p), t.places)
            if pa[p] is None:
                del pa[p]
        prev = last.get(f.topic, {}).get(p)
        if t.last and (prev is None or t.last[0] >= prev[0]):
            last.setdefault(f.topic, {})[p] = t.last
        if t.heartbeat:
            prefix = f.topic[len(heartbeat_topic("")) :]
            beat = (EPOCH.replace(tzinfo=UTC) + timedelta(milliseconds=t.heartbeat)).isoformat()
            beats[prefix] = max(beats.get(prefix, beat), beat)
    shown = st.setdefault("frontier", {})
    for g, _schema, shard in cfg.shards():
        fr = next(fr for fr in fronts.values() if fr.shard == shard)
        pos = new.shards[shard]
        if fr.lsn > pos.lsn:
            pos.lsn, pos.ts = fr.lsn, _newest(pos.ts, *(ts for _, ts in last.get(fr.topic, {}).values()))
        beat = beats.get(cfg.landing.prefix_for(g.conn_id))
        if beat and fr.delivered and not fr.held and not fr.left:
            pos.ts = _newest(pos.ts, beat)
        shown[shard] = {"partition": fr.holder, "held": fr.held}
    return new


def _newest(*times: str | None) -> str | None:
    known = [t for t in times if t]
    return max(known, key=datetime.fromisoformat) if known else None


def read_debezium(spark: SparkSession, cfg: TableConfig, files: list[SinkFile]) -> DataFrame:
    """Sink objects as landing events (landing_spark_schema), converted on the executors."""
    from cdc_lakehouse.landing.format import landing_spark_schema

    shape = shape_of(cfg)
    schema = landing_spark_schema()
    events = _over_files(spark, files, lambda f, d: (event_record(r) for r in file_events(shape, f, d)), schema)
    return paired_key_changes(events)


def paired_key_changes(events: DataFrame) -> DataFrame:
    """An UPDATE that changes the primary key reaches Debezium's topic as a delete of the old key
    and a create of the new one, both at the UPDATE's WAL position (the old key is only in a
    Kafka header, which the S3 sink drops). The create's unchanged TOASTed columns are
    placeholders that no row of the new key can fill. Paired back into one update whose before
    image holds the old key, as our own capture reads it, the ingest moves the row and fills
    them from the old key's row (ingest.reduce.split_pk_changes).

    A pair is a delete and a create of one transaction at one event LSN: no two other changes
    share a WAL position. Both halves must be in the batch: with several partitions per topic
    they can land in different partitions and batches, and then stay a delete and a create."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    at = ["_k_ep", "_k_schema", "_k_table", "_k_lsn", "_k_xid"]
    keyed = events.withColumns(
        {
            "_k_ep": F.col("source.endpoint"),
            "_k_schema": F.col("source.schema"),
            "_k_table": F.col("source.table"),
            "_k_lsn": F.col("source.lsn"),
            "_k_xid": F.col("source.xid"),
        }
    )
    # One window, no self-join: the sink files' conversion (_over_files) is then evaluated once.
    w = Window.partitionBy(*at)
    halves, is_del = F.col("op").isin("c", "d"), F.col("op") == "d"
    pair = halves & (F.count(F.when(halves, 1)).over(w) == 2) & (F.count(F.when(is_del, 1)).over(w) == 1)
    old = F.first(F.when(is_del, F.col("before")), ignorenulls=True).over(w)
    keyed = keyed.withColumns({"_pair": pair, "_old": old}).filter(~(F.col("_pair") & is_del))
    moved = {"op": F.when(F.col("_pair"), F.lit("u")).otherwise(F.col("op"))}
    moved["before"] = F.when(F.col("_pair"), F.col("_old")).otherwise(F.col("before"))
    return keyed.withColumns(moved).select(*events.columns)


# --- bootstrap ---------------------------------------------------------------------------------------


def first_columns(spark: SparkSession, cfg: TableConfig) -> list[dict[str, Any]]:
    """The table's columns from the value schema of the first record of its topics (the snapshot's
    'r' events when the connector took one)."""
    src, shape = cfg.landing, shape_of(cfg)
    fs, base = LandingFS(spark), spark_uri(str(src.uri).rstrip("/")) + "/" + src.topics_dir
    firsts = []
    for topic, _ in shape.endpoints:
        files = pending_files(fs, base, topic, {}, False)
        firsts += sorted(files, key=lambda f: f.start)[:1]
    for f in sorted(firsts, key=lambda f: f.uri):
        for schema, payload in records(read_bytes(fs, f.uri), shape.fmt, f.uri):
            value_schema = schema and (_field(schema, "after") or _field(schema, "before"))
            if payload is not None and value_schema and value_schema.get("fields"):
                return table_columns(value_schema, cfg.primary_key, f"{cfg.name}: {f.uri}")
    raise NotBootstrapped(
        f"{cfg.name}: no Debezium record of the table under {src.uri}/{src.topics_dir} to take its columns from; "
        "start the connector (snapshot.mode=initial) and the S3 sink, then run the bootstrap again"
    )


def bootstrap_debezium(spark: SparkSession, lake: LakeSettings, cfg: TableConfig) -> Watermark:
    """Create the lake tables of a Debezium-fed table, with every shard at the start of its topics:
    the first ingest then loads the connector's snapshot ('r' events) and the changes after it.
    Returns the watermark the tables start at."""
    from cdc_lakehouse.lake.tables import create_lake_tables, table_exists
    from cdc_lakehouse.lake.writers import BOOTSTRAP, WRITER_PROP
    from cdc_lakehouse.watermark import ShardPosition, Watermark

    cur = lake.qualified(cfg.current_table)
    if table_exists(spark, cur):
        raise ValueError(f"{cfg.name}: lake table {cur} exists already; drop it first to bootstrap again")
    cols = first_columns(spark, cfg)
    bad = [c["name"] for c in cols if not (cfg.column_types.get(c["name"]) or c["lake_type"])]
    if bad:
        raise DebeziumFormatError(f"{cfg.name}: columns {bad} have no lake type; set column_types for them")
    create_lake_tables(spark, lake, cfg, [(c["name"], cfg.column_types.get(c["name"]) or c["lake_type"]) for c in cols])
    names = [c["name"] for c in cols]
    wm = Watermark(
        v=1,
        shards={shard: ShardPosition(lsn=0, endpoint=g.endpoint_id, columns=names) for g, _, shard in cfg.shards()},
        runs={},
        debezium={"offsets": {}, "last": {}, "heartbeats": {}},
    )
    empty = spark.createDataFrame([], spark.table(cur).schema)
    empty.writeTo(cur).option("snapshot-property.cdc.watermark", wm.to_json()).option(
        f"snapshot-property.{WRITER_PROP}", BOOTSTRAP.name
    ).append()
    return wm
