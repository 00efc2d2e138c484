"""What a bootstrap returns: one typed result per mode (snapshot, chunked), both of which the job
turns into its result line with `to_dict()`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal, TypeAlias, TypedDict

from cdc_lakehouse.watermark import Watermark


class EndpointSnapshot(TypedDict):
    """One endpoint's part of a snapshot bootstrap: its shards were read at one consistent point."""

    consistent_point: int  # the LSN of the snapshot's replication slot
    shards: list[str]


@dataclass(frozen=True)
class SnapshotBootstrapResult:
    """What a snapshot bootstrap did (bootstrap.mode snapshot)."""

    table: str
    run_id: str
    shards: dict[str, int]  # rows of each shard bootstrapped
    rows: int
    endpoints: dict[str, EndpointSnapshot]
    read_and_changelog_seconds: float
    current_write_seconds: float
    seconds: float
    rows_per_second: float | None
    watermark: Watermark  # the current table's, as committed

    def to_dict(self) -> dict[str, Any]:
        """For the job's result line."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "watermark": self.watermark.to_dict()}


# A chunked bootstrap (bootstrap/chunked.py) reports otherwise: its result has mode "chunked".


@dataclass(frozen=True)
class ChunkedBootstrapResult:
    """What a chunked bootstrap run did (it may have paused: `done` says whether it finished)."""

    table: str
    run_id: str
    rows: int  # read by this run
    shards: dict[str, int]  # rows read by this run, per shard
    chunks: dict[str, int]  # chunks done by this run, per shard
    done: bool  # every shard finished
    resumed: dict[str, int]  # shard -> chunk it resumed after
    paused: bool
    seconds: float
    rows_per_second: float | None
    longest_xact_seconds: float
    mode: Literal["chunked"] = "chunked"

    def to_dict(self) -> dict[str, Any]:
        """For the job's result line."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


BootstrapResult: TypeAlias = SnapshotBootstrapResult | ChunkedBootstrapResult
