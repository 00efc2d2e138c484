"""landing.debezium.plan: The plan of a Debezium-fed table's ingest (driver): the pending sink files, their stats, the
frontier each shard's watermark may move to, the events staged as landing Parquet, and the
watermark that follows.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.landing.debezium.connect_types import EPOCH, DebeziumFormatError
from cdc_lakehouse.landing.debezium.records import (
    CutPoint,
    EventRow,
    FileStats,
    Shape,
    SinkFile,
    cut_point,
    file_events,
    file_stats,
    heartbeat_topic,
    place_from_json,
    place_to_json,
    shape_of,
    table_topic,
)
from cdc_lakehouse.landing.errors import NotBootstrapped
from cdc_lakehouse.landing.format import Heartbeat, Manifest
from cdc_lakehouse.landing.reader import LandingFS, Plan, spark_uri
from cdc_lakehouse.landing.writer import local_dir, make_private, mkdirs
from cdc_lakehouse.watermark import DebeziumState, HeldBy, Watermark

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

    from cdc_lakehouse.settings import LakeSettings


log = logging.getLogger(__name__)

# `.json.gz`: the sink's s3.compression.type=gzip (Avro files compress inside the container instead).
FILE_RE = re.compile(r"^(?P<topic>.+)\+(?P<partition>\d+)\+(?P<start>\d+)\.(?P<ext>json|json\.gz|avro)$")


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


def within_budget(files: list[SinkFile], stats: dict[str, FileStats], limit: int) -> list[SinkFile]:
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
        replace(f, floor=floors[topic], applied=place_from_json(applied.get(topic, {}).get(str(f.partition))))
        for topic, _ in shape.endpoints
        for f in pending_files(fs, base, topic, offsets.get(topic, {}), False)
    ]
    for prefix in sorted({src.prefix_for(g.conn_id) for g in cfg.source.shards}):
        topic = heartbeat_topic(prefix)
        files += pending_files(fs, base, topic, offsets.get(topic, {}), True)
    return files


def after_applied(chosen: list[SinkFile], stats: dict[str, FileStats]) -> list[SinkFile]:
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
        g = replace(f, applied=place_from_json(tops[k])) if k in tops else f
        tops[k] = following(place_to_json(g.applied), PlacesAfter.of(stats[g.name]))
        out.append(g)
    return out


@dataclass(frozen=True)
class PlacesAfter:
    """What a file (or its part before a cut) leaves of its partition's order: the highest place
    (as JSON keeps it: a list), and whether a new snapshot began in it (`file_stats`, `cut_point`)."""

    top: list[int] | None
    fresh: bool

    @classmethod
    def of(cls, stats: FileStats | CutPoint) -> PlacesAfter:
        return cls(stats["top"], stats["fresh"])


def following(applied: list[int] | None, after: PlacesAfter) -> list[int] | None:
    """The partition's highest place once a file leaving `after` is applied on top of `applied`:
    the file's own after a new snapshot."""
    if after.fresh or applied is None:
        return after.top
    return applied if after.top is None or applied >= after.top else after.top


def read_stats(spark: SparkSession, fs: LandingFS, shape: Shape, files: list[SinkFile]) -> dict[str, FileStats]:
    """file_stats of every listed object, by name; conversion errors stop the table here."""
    tables = [f for f in files if not f.heartbeat]
    stats = cast(list[FileStats], _json_rows(spark, tables, lambda f, d: file_stats(shape, f, d)) if tables else [])
    # Heartbeat topics start with '_', which Hadoop's input formats treat as hidden: read on the driver.
    stats += [file_stats(shape, f, read_bytes(fs, f.uri)) for f in files if f.heartbeat]
    errors = [e for s in stats if (e := s["error"])]
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
    files: list[SinkFile], picked: set[str], stats: dict[str, FileStats], last: list[Any] | None
) -> int | None:
    """The lowest position a partition may still deliver after this batch: its first event the
    batch does not take; else one above the highest it ever delivered (Debezium's position is the
    previous transaction's commit, shared by a whole transaction, so the next transaction's is
    higher: +1 covers the last one delivered). None when it never delivered anything."""
    with_events = [f for f in files if stats[f.name]["events"]]  # these have their lo and hi
    rest = [lo for f in with_events if f.name not in picked and (lo := stats[f.name]["lo"]) is not None]
    if rest:
        return min(rest)
    seen: list[int] = [hi for f in with_events if (hi := stats[f.name]["hi"]) is not None] + ([last[0]] if last else [])
    return max(seen) + 1 if seen else None


def frontiers(
    cfg: TableConfig,
    watermark: Watermark,
    files: list[SinkFile],
    chosen: list[SinkFile],
    stats: dict[str, FileStats],
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
    stats: dict[str, FileStats],
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
            hi, lo = s["hi"], s["lo"]  # set when the file has events
            if s["events"] and hi is not None and hi >= w:  # this file reaches the frontier: the rest waits
                crosses = lo is not None and lo < w
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


def cut_points(spark: SparkSession, shape: Shape, files: list[SinkFile], fronts: dict[str, Frontier]) -> list[CutPoint]:
    """cut_point of each file that crosses its shard's frontier (read again on the executors:
    only such files, at most one per partition)."""
    if not files:
        return []
    w = {t: fr.lsn for t, fr in fronts.items()}
    return cast(list[CutPoint], _json_rows(spark, files, lambda f, d: cut_point(shape, f, d, w[f.topic])))


def report(cfg: TableConfig, fronts: dict[str, Frontier], taken_stats: list[FileStats]) -> None:
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
    counted: dict[Literal["again", "late"], str] = {
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
    st = new.debezium = cast(DebeziumState, dict(new.debezium or {}))
    offsets, last, beats = st.setdefault("offsets", {}), st.setdefault("last", {}), st.setdefault("heartbeats", {})
    applied = st.setdefault("applied", {})
    for t in sorted(taken, key=lambda t: (t.file.topic, t.file.partition, t.file.start)):
        f, p = t.file, str(t.file.partition)
        po = offsets.setdefault(f.topic, {})
        po[p] = max(po.get(p, 0), t.end)
        if t.places is not None:
            pa = applied.setdefault(f.topic, {})
            top = following(pa.get(p), t.places)
            if top is None:
                pa.pop(p, None)
            else:
                pa[p] = top
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
        server_beat = beats.get(cfg.landing.prefix_for(g.conn_id))
        if server_beat and fr.delivered and not fr.held and not fr.left:
            pos.ts = _newest(pos.ts, server_beat)
        shown[shard] = HeldBy(partition=fr.holder, held=fr.held)
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
