"""Typed models of the change feed: what crosses from the planner to the readers, the offset
stores and the consumers. Pure Python (pydantic), no Spark: DAG files import it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from cdc_lakehouse.identifiers import IdentifierError, check_lake_ident
from cdc_lakehouse.lake.ranges import SnapshotInfo  # noqa: F401 - the range rule's model, re-exported

FeedMode = Literal["noop", "changelog", "diff", "full"]
OP_UPSERT, OP_DELETE = "upsert", "delete"
FEED_OP_COL = "_feed_op"  # upsert | delete
BEFORE_COL = "_feed_before"  # the key's row at the consumer's offset (with_before=True), else absent


class FeedError(ValueError):
    """A feed read or offset commit that cannot go on; the message names table, consumer and fix."""


class OffsetConflictError(RuntimeError):
    """Another run of the same consumer committed an offset since this run read its own."""


class FeedOffset(BaseModel):
    """How far a consumer has read one table: a snapshot of the table's current table that
    carries a `cdc.watermark` (a complete position), and that watermark's shard positions."""

    model_config = ConfigDict(frozen=True)

    consumer: str = Field(description="the consumer's name, [a-z0-9_]")
    table: str = Field(description="the lake table read, namespace.name (a current table)")
    snapshot_id: int = Field(description="the snapshot read up to, inclusive")
    watermark: dict[str, int] = Field(default_factory=dict, description="shard -> exclusive LSN at that snapshot")

    def to_json(self) -> str:
        return json.dumps(self.model_dump(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> FeedOffset:
        return cls.model_validate_json(text)


def check_consumer_name(consumer: str) -> str:
    """Consumers name Iceberg snapshot properties and meta rows: the identifier rules apply."""
    try:
        return check_lake_ident(consumer, "feed consumer name")
    except IdentifierError as exc:
        raise FeedError(str(exc)) from None


@dataclass(frozen=True)
class FeedRange:
    """What one read covers: the changes after `since` up to and including snapshot `snapshot_id`.

    mode: noop (nothing new), changelog (keys from the changelog between the two watermarks),
    diff (keys whose rows differ between the two snapshots: a commit by any writer but the
    ingest, a rollback, a shard moved, a truncate; lake.ranges), full (no offset yet, a first read
    or a reset the consumer asked for: every live row, and the consumer replaces its state). An
    offset whose snapshot was expired is an error (lake.holds.ConsumerLagError), never a full range."""

    table: str
    consumer: str
    since: FeedOffset | None
    snapshot_id: int
    watermark: dict[str, int]
    mode: FeedMode
    reason: str = ""
    lo_watermark: dict[str, int] = field(default_factory=dict)

    @property
    def offset(self) -> FeedOffset:
        """The offset to commit once this range is applied."""
        return FeedOffset(
            consumer=self.consumer, table=self.table, snapshot_id=self.snapshot_id, watermark=self.watermark
        )

    @property
    def replaces_state(self) -> bool:
        return self.mode == "full"
