"""ingest.records: an ingest run's record (cdc_meta.ingest_runs) and freshness rows (cdc_meta.freshness).

A table's batch ends with these two commits, after its data commits. A group run (one Spark job
over many tables) collects them in `RunRecords` and commits each metadata table once for all of
its tables (issue #56: two commits and their Spark jobs per table were a large share of a small
table's cost). Either way each batch's rows are written once: the commit lists the batches it
holds (lake.batches BATCH_IDS_PROP), and a batch already listed is left out; the check and the
append are published as one step, so two runs recording a batch at once record it once. A group stopped
before its records are committed loses nothing: each table's next run finds its last batch
unrecorded and writes the record then (ingest.ingest_table.resume_batch).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import Field

from cdc_lakehouse.lake.batches import BATCH_IDS_PROP, BatchId, batches_since
from cdc_lakehouse.lake.commits import commit_unless_moved
from cdc_lakehouse.lake.freshness import FRESHNESS_TABLE, freshness_props
from cdc_lakehouse.lake.meta import META_TABLES, append_rows
from cdc_lakehouse.lake.meta_rows import ShardFreshness
from cdc_lakehouse.landing.format import Heartbeat, Manifest
from cdc_lakehouse.runtime.failpoints import crash_point
from cdc_lakehouse.settings import LakeSettings
from cdc_lakehouse.watermark import StoredJson

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

RUNS_TABLE = "ingest_runs"


class EndpointHeartbeats(StoredJson):
    """An endpoint's latest heartbeat per shard schema, in slot order (what freshness uses)."""

    endpoint: str
    heartbeats: dict[str, Heartbeat] = Field(default_factory=dict)


class BatchState(StoredJson):
    """Committed with the current table's commit (lake.batches.BATCH_STATE_PROP): what another run
    needs to write the batch's run record and freshness rows if this one stops right after that
    commit (ingest.ingest_table.resume_batch)."""

    run: dict[str, Any] = Field(description="the ingest_runs row without its watermark; started_at in ISO form")
    shard_commits: dict[str, dict[str, int]] = Field(default_factory=dict)
    heartbeats: list[EndpointHeartbeats] = Field(default_factory=list)
    merge_rows: int | None = Field(None, description="the rows the MERGE was given, when its summary counts none")

    @classmethod
    def of(cls, run: dict[str, Any], manifests: Iterable[Manifest]) -> BatchState:
        """The heartbeats kept per endpoint and schema, the latest in slot order."""
        beats: dict[str, dict[str, Heartbeat]] = {}
        for man in manifests:
            beats.setdefault(man.endpoint or "", {}).update(man.heartbeats)
        return cls(run=run, heartbeats=[EndpointHeartbeats(endpoint=ep, heartbeats=hb) for ep, hb in beats.items()])

    def to_json(self) -> str:
        # default=str: the run row's values that JSON has no type for, as before this model.
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True, default=str)

    def heartbeat_runs(self) -> list[Manifest]:
        """The heartbeats as the runs record_run reads them from (their ids and positions are not
        kept: only the heartbeats count there)."""
        return [Manifest(run_id="", end_lsn=0, endpoint=h.endpoint, heartbeats=h.heartbeats) for h in self.heartbeats]


@dataclass(frozen=True)
class TableRecords:
    """One table's batch as the metadata tables record it."""

    table_name: str
    batch: BatchId
    since_ms: int  # no commit before this time can carry the batch (lake.batches.committed)
    run: dict[str, Any]  # the cdc_meta.ingest_runs row (IngestMetrics.meta_row)
    freshness: list[ShardFreshness]  # its cdc_meta.freshness rows, one per shard


@dataclass
class RunRecords:
    """The records of a group run's tables, committed together by commit()."""

    pending: list[TableRecords] = field(default_factory=list)

    def add(self, records: TableRecords) -> None:
        self.pending.append(records)

    def commit(self, spark: SparkSession, lake: LakeSettings) -> int:
        """One commit per metadata table for every pending table; returns how many were recorded."""
        done, self.pending = self.pending, []
        write_records(spark, lake, done)
        return len(done)


def write_records(spark: SparkSession, lake: LakeSettings, records: list[TableRecords]) -> None:
    """The run records, then the freshness rows, each metadata table in one commit that lists the
    batches it holds; batches a commit of that table already holds are left out of it. The check
    and the append are one step (lake.commits.commit_unless_moved): a run that outlived its task
    and the next run recording the same batch at the same moment record it once (#51)."""
    if not records:
        return
    since = min(r.since_ms for r in records)
    for step, name, rows, props in (
        ("ingest_run_record", RUNS_TABLE, lambda rs: [r.run for r in rs], lambda rs: {}),
        ("ingest_freshness", FRESHNESS_TABLE, _freshness_rows, _freshness_props),
    ):
        table = lake.qualified(lake.meta_table(name))

        def unrecorded(snapshots: Iterable[Any], table: str = table) -> list[TableRecords] | None:
            done = batches_since(table, snapshots, since)
            return [r for r in records if done is not None and r.batch.value not in done] or None

        def append(
            target: str, todo: list[TableRecords], name: str = name, rows: Any = rows, props: Any = props
        ) -> None:
            ids = {BATCH_IDS_PROP: ",".join(r.batch.value for r in todo)}
            append_rows(spark, target, rows(todo), META_TABLES[name][0], {**props(todo), **ids})

        if commit_unless_moved(spark, table, unrecorded, append, what=f"{step} of {len(records)} table(s)"):
            crash_point(f"{step}_committed")


def _freshness_rows(records: list[TableRecords]) -> list[ShardFreshness]:
    return [f for r in records for f in r.freshness]


def _freshness_props(records: list[TableRecords]) -> dict[str, str]:
    return {k: v for r in records for k, v in freshness_props(r.table_name, r.freshness).items()}
