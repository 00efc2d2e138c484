"""landing.debezium.records: The sink's files and their records, and one record -> one landing event row (runs on the
executors): the pure conversion.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, timedelta
from typing import TYPE_CHECKING, Any, TypedDict, cast

from cdc_lakehouse.config import LandingSource, TableConfig
from cdc_lakehouse.landing.debezium.connect_types import EPOCH, DebeziumFormatError, row_texts, table_columns
from cdc_lakehouse.source.catalog import schema_json

if TYPE_CHECKING:
    pass


# A landing event as a row in landing_spark_schema's field order (op, before, after, unavailable,
# source, table_schema, ts_ms, run_id), its `source` a tuple in the same way (commit_lsn at 6).
EventRow = tuple[Any, ...]


GZIP_MAGIC = b"\x1f\x8b"
# Snapshot ('r') events get a seq from their Kafka position: offset * SNAPSHOT_PARTITIONS + partition.
SNAPSHOT_PARTITIONS = 1024


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


def schema_field(schema: dict[str, Any], name: str) -> dict[str, Any] | None:
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
    value_schema = schema_field(schema, "after") or schema_field(schema, "before") or {}
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


def place_from_json(top: list[int] | None) -> Place | None:
    """A Place as the file stats and the watermark keep it (a JSON list), back."""
    return (top[0], top[1], top[2]) if top else None


def place_to_json(place: Place | None) -> list[int] | None:
    return list(place) if place else None


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


class FileStats(TypedDict):
    """What `file_stats` finds in one sink file; JSON from the executors to the planner."""

    name: str
    records: int  # offsets the file covers
    events: int  # landing events, copies of changes applied left out
    lo: int | None  # lowest and highest position of its events
    hi: int | None
    last: list[Any] | None  # [highest position, commit time of the latest event]
    late: int  # events placed at the shard's floor
    top: list[int] | None  # the highest place of a streamed change (place_to_json)
    fresh: bool  # a new snapshot began in it
    again: int  # copies of changes applied before
    heartbeat: int | None  # the latest heartbeat (ms)
    error: str | None  # a conversion error, as text


class CutPoint(TypedDict):
    """Where a file crosses its shard's frontier (`cut_point`)."""

    name: str
    at: int | None  # the offset of its first event at or above the frontier
    events: int  # events before it
    last: list[Any] | None
    held: int  # events from `at` on, held back
    top: list[int] | None
    fresh: bool


def file_stats(shape: Shape, sf: SinkFile, data: bytes) -> FileStats:
    """What the planner needs of a file: its record count (offsets it covers), its events' lowest
    and highest position (`lo`, `hi`), `last` (the highest position, the last event's commit
    time), how many were placed at the floor (`late`), the highest place of a streamed change
    (`top`), how many are copies of changes applied (`again`, left out of the rest), the latest
    heartbeat; a conversion error as text."""
    out = FileStats(
        name=sf.name,
        records=0,
        events=0,
        lo=None,
        hi=None,
        last=None,
        late=0,
        top=place_to_json(sf.applied),
        fresh=False,
        again=0,
        heartbeat=None,
        error=None,
    )
    try:
        if sf.heartbeat:
            for _schema, payload in records(data, shape.fmt, f"{shape.table_name}: {sf.uri}"):
                out["records"] += 1
                if payload is not None and payload.get("ts_ms") is not None:
                    out["heartbeat"] = max(out["heartbeat"] or 0, int(payload["ts_ms"]))
            return out
        out["records"] = sum(1 for _ in records(data, shape.fmt, f"{shape.table_name}: {sf.uri}"))
        for ev in _offset_events(shape, sf, data):
            out["top"], out["fresh"] = place_to_json(ev.top), out["fresh"] or ev.fresh
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


def cut_point(shape: Shape, sf: SinkFile, data: bytes, frontier: int) -> CutPoint:
    """Where a file crosses its shard's frontier: the offset of its first event at or above it
    (`at`, None when there is none), the events before it, the last one's position and the
    highest place and whether a new snapshot began (`top`, `fresh`, as `file_stats`), and how many
    events from it on are held back."""
    out = CutPoint(name=sf.name, at=None, events=0, last=None, held=0, top=place_to_json(sf.applied), fresh=False)
    for ev in _offset_events(shape, sf, data):
        if out["at"] is None and not ev.again and ev.row[4][6] >= frontier:
            out["at"] = ev.offset
        if out["at"] is not None:
            out["held"] += not ev.again
            continue
        out["top"], out["fresh"] = place_to_json(ev.top), out["fresh"] or ev.fresh
        if not ev.again:
            out["events"], out["last"] = out["events"] + 1, _last(out["last"], ev.row)
    return out
