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
rows got from the source while the shard was quiet (ingest.backfill). Other keys (the ingest's
pending `backfill`) are kept as they are.

Callers handle the watermark as a dict (read_watermark, watermark_json); `Watermark` is the
typed model of the same JSON, and round-trips it byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from cdc_lakehouse.lake.snapshots import current_ancestors

if TYPE_CHECKING:
    from pyspark.sql import Column, SparkSession

WATERMARK_PROP = "cdc.watermark"
WATERMARK_VERSION = 1


class ShardPosition(BaseModel):
    """One shard's position in a table."""

    model_config = ConfigDict(extra="allow")

    lsn: int = Field(description="exclusive: every transaction committed below it is in the table")
    ts: str | None = Field(None, description="ISO time the position is fresh to")
    endpoint: str | None = Field(None, description="the endpoint whose slot the position belongs to")
    source: dict[str, Any] | None = Field(None, description="the server identity (IDENTIFY_SYSTEM)")
    columns: list[str] | None = Field(None, description="the shard's known source columns")
    filled: list[str] | None = Field(
        None, description="lake columns the shard's rows got from its source while it sent no relation message"
    )


class Watermark(BaseModel):
    """The `cdc.watermark` JSON. Fields never set are left out of to_dict/to_json, so a
    watermark read and written back is unchanged; start a new one with Watermark.empty()."""

    model_config = ConfigDict(extra="allow")

    v: int = WATERMARK_VERSION
    shards: dict[str, ShardPosition] = Field(default_factory=dict)
    runs: dict[str, str] = Field(default_factory=dict, description="endpoint -> last capture run applied")

    @classmethod
    def empty(cls) -> Watermark:
        return cls(v=WATERMARK_VERSION, shards={}, runs={})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Watermark:
        return cls.model_validate(data)

    @classmethod
    def from_json(cls, text: str) -> Watermark:
        return cls.from_dict(json.loads(text))

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_unset=True)

    def to_json(self) -> str:
        return watermark_json(self.to_dict())

    def shard_lsns(self) -> dict[str, int]:
        return {shard: pos.lsn for shard, pos in self.shards.items()}


# --- watermarks --------------------------------------------------------------------------------


def read_watermark(spark: SparkSession, table: str) -> dict[str, Any] | None:
    """The newest `cdc.watermark` among the current snapshot and its ancestors."""
    # Iceberg's catalog caches loaded tables; another process (a killed run, maintenance) may have
    # committed since, and a stale watermark would re-apply events the table already has:
    # current_ancestors refreshes the table first (lake.snapshots).
    return watermark_in(current_ancestors(spark, table))


def watermark_in(snapshots: Iterable[Any]) -> dict[str, Any] | None:
    """The newest `cdc.watermark` in a chain of snapshots (newest first): a table's position as
    of its first snapshot (lake.commits fences commits on it)."""
    for snap in snapshots:
        wm = snap.summary.get(WATERMARK_PROP)
        if wm is not None:
            return json.loads(wm)
    return None


def read_watermark_model(spark: SparkSession, table: str) -> Watermark | None:
    """read_watermark, typed."""
    wm = read_watermark(spark, table)
    return None if wm is None else Watermark.from_dict(wm)


def watermark_json(wm: dict[str, Any] | Watermark) -> str:
    """The watermark as stored: compact, keys sorted."""
    if isinstance(wm, Watermark):
        wm = wm.to_dict()
    return json.dumps(wm, separators=(",", ":"), sort_keys=True)


def shard_lsn_map(wm: dict[str, Any] | Watermark) -> Column:
    """The watermark as a Spark map column, shard -> exclusive LSN (an empty map<string,bigint>
    when it has no shards): `shard_lsn_map(wm)[F.col(SHARD_COL)]` is a row's shard position."""
    from pyspark.sql import functions as F

    shards = wm.shard_lsns() if isinstance(wm, Watermark) else {s: v["lsn"] for s, v in wm.get("shards", {}).items()}
    pairs = []
    for shard, lsn in sorted(shards.items()):
        pairs += [F.lit(shard), F.lit(int(lsn))]
    return F.create_map(*pairs) if pairs else F.create_map().cast("map<string,bigint>")
