"""The watermark: how far each shard's changes are in a lake table.

It is JSON in the `cdc.watermark` snapshot property, written in the same commit as the data
it describes:

    {"v": 1, "shards": {"<shard>": {"lsn": <int>, "ts": "<iso>", "endpoint": "<endpoint>",
                                    "source": {<server identity>}, "columns": [...]}},
     "runs": {"<endpoint>": "<run_id>"}}

`lsn` is exclusive: every source transaction of that shard whose commit LSN is below it is
in the table, and none at or above it. Bootstrap sets it to the snapshot's consistent
point; each ingest moves it to the end of the last capture run it applied. `endpoint` and
`source` say which endpoint and server the position belongs to (positions of two servers
never compare); `columns` are the shard's known source columns, `filled` the lake columns its
rows got from the source while the shard was quiet (ingest.backfill). `backfill` lists the added
columns whose older rows still wait for the source's value (ingest.backfill), `debezium` a
Debezium-fed table's Kafka offsets (landing.debezium); other keys are kept as they are.

lake.snapshots.read_watermark parses the JSON once into a `Watermark`; callers pass that model on.
It round-trips the JSON byte for byte (to_json), and two watermarks are equal when their JSON is.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import TypedDict  # pydantic validates typing.TypedDict from Python 3.12 only

if TYPE_CHECKING:
    from pyspark.sql import Column

WATERMARK_PROP = "cdc.watermark"
WATERMARK_VERSION = 1


class StoredJson(BaseModel):
    """A JSON value stored in a snapshot property. Unknown keys are kept and keys never set are
    left out, so a value read and written back is unchanged; equal when their JSON is (pydantic's
    own equality would also call a key set to its default equal to a missing one)."""

    model_config = ConfigDict(extra="allow")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_unset=True)

    def to_json(self) -> str:
        """As stored: compact, keys sorted."""
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StoredJson) or type(other) is not type(self):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable: never a dict key


class ServerIdentity(TypedDict, total=False):
    """Which server's LSNs a position is (source.publication.source_identity, from IDENTIFY_SYSTEM
    and TIMELINE_HISTORY): positions compare only within one identity (identity_mismatch)."""

    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc]

    system_identifier: str
    timeline: int
    database: str
    history: dict[str, int]  # an earlier timeline -> the LSN where the server left it


class ShardPosition(StoredJson):
    """One shard's position in a table."""

    lsn: int = Field(description="exclusive: every transaction committed below it is in the table")
    ts: str | None = Field(None, description="ISO time the position is fresh to")
    endpoint: str | None = Field(None, description="the endpoint whose slot the position belongs to")
    source: ServerIdentity | None = Field(None, description="the server identity (IDENTIFY_SYSTEM)")
    columns: list[str] | None = Field(None, description="the shard's known source columns")
    filled: list[str] | None = Field(
        None, description="lake columns the shard's rows got from its source while it sent no relation message"
    )


class PendingBackfill(StoredJson):
    """A schema change whose added columns the shard's rows from before it still need
    (ingest.backfill): the capture's schema change as landed (landing.format.SchemaChange; its other
    keys are kept as they are), with the endpoint it came through."""

    table: str | None = Field(None, description="schema.table of the shard (every entry the ingest writes has it)")
    endpoint: str | None = None
    at_commit_lsn: int | None = Field(None, description="commit LSN of the first transaction with the columns")
    added: list[str] = Field(default_factory=list, description="the columns to fill")

    def change_id(self) -> tuple[str | None, str | None, int | None]:
        """Which change this is, whatever else the entry says."""
        return (self.endpoint, self.table, self.at_commit_lsn)

    def shard_schema(self) -> tuple[str | None, str]:
        """(endpoint, source schema): which configured shard the change is of."""
        return (self.endpoint, (self.table or "").rpartition(".")[0])


class HeldBy(TypedDict):
    """Which partition holds a Debezium-fed shard at its frontier, and how many events wait above it."""

    partition: str
    held: int


class DebeziumState(TypedDict, total=False):
    """A Debezium-fed table's Kafka positions (landing.debezium.plan.advance writes every key; a
    bootstrap the first three). A dict as stored: keys never written stay out, others are kept."""

    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc]

    offsets: dict[str, dict[str, int]]  # topic -> partition -> the next offset to read
    last: dict[str, dict[str, list[Any]]]  # topic -> partition -> [highest position, its commit time]
    heartbeats: dict[str, str]  # topic prefix -> the newest heartbeat applied (ISO time)
    applied: dict[str, dict[str, list[int]]]  # topic -> partition -> the highest place applied
    frontier: dict[str, HeldBy]  # shard -> what holds it


class Watermark(StoredJson):
    """The `cdc.watermark` JSON. Fields never set are left out of to_dict/to_json, so a
    watermark read and written back is unchanged; start a new one with Watermark.empty().
    Change `shards` and `runs` through set_shard/set_run (an assignment marks them set)."""

    v: int = WATERMARK_VERSION
    shards: dict[str, ShardPosition] = Field(default_factory=dict)
    runs: dict[str, str] = Field(default_factory=dict, description="endpoint -> last capture run applied")
    backfill: list[PendingBackfill] | None = Field(
        None, description="schema changes whose added columns the rows before them still need (ingest.backfill)"
    )
    debezium: DebeziumState | None = Field(
        None, description="a Debezium-fed table's Kafka offsets and frontiers (landing.debezium)"
    )

    @classmethod
    def empty(cls) -> Watermark:
        return cls(v=WATERMARK_VERSION, shards={}, runs={})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Watermark:
        return cls.model_validate(data)

    @classmethod
    def from_json(cls, text: str) -> Watermark:
        return cls.from_dict(json.loads(text))

    def shard_lsns(self) -> dict[str, int]:
        return {shard: pos.lsn for shard, pos in self.shards.items()}

    def set_shard(self, shard: str, pos: ShardPosition) -> None:
        self.shards = {**self.shards, shard: pos}

    def set_run(self, endpoint: str, run_id: str) -> None:
        self.runs = {**self.runs, endpoint: run_id}

    def without_backfill(self) -> Watermark:
        """This watermark with no pending backfill (the key left out, as if never set)."""
        return Watermark.from_dict({k: v for k, v in self.to_dict().items() if k != "backfill"})


# --- watermarks --------------------------------------------------------------------------------


def watermark_in(snapshots: Iterable[Any]) -> Watermark | None:
    """The newest `cdc.watermark` in a chain of snapshots (newest first): a table's position as
    of its first snapshot (lake.commits fences commits on it)."""
    text = watermark_text_in(snapshots)
    return None if text is None else Watermark.from_json(text)


def watermark_text_in(snapshots: Iterable[Any]) -> str | None:
    """The newest `cdc.watermark` property in a chain of snapshots, as stored (a derived tree's
    watermark has a JSON of its own: derived.derive_tree.TreeWatermark)."""
    for snap in snapshots:
        wm: str | None = snap.summary.get(WATERMARK_PROP)
        if wm is not None:
            return wm
    return None


def shard_lsn_map(wm: Watermark | None) -> Column:
    """The watermark as a Spark map column, shard -> exclusive LSN (an empty map<string,bigint>
    when it has no shards, or no watermark): `shard_lsn_map(wm)[F.col(SHARD_COL)]` is a row's
    shard position."""
    return lsn_map({} if wm is None else wm.shard_lsns())


def lsn_map(lsns: dict[str, int]) -> Column:
    """Shard positions (shard -> LSN) as a Spark map column (an empty map<string,bigint> when none)."""
    from pyspark.sql import functions as F

    pairs = []
    for shard, lsn in sorted(lsns.items()):
        pairs += [F.lit(shard), F.lit(int(lsn))]
    return F.create_map(*pairs) if pairs else F.create_map().cast("map<string,bigint>")
