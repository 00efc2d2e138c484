"""lake.meta_rows: the rows of the cdc_meta tables as typed records whose fields generate the tables.

One record per table (ingest_runs has lake.ingest_metrics.IngestMetrics, which follows the same
rule): the fields made with `column(type)` are, in order, the table's columns (name and Spark
SQL type). lake.meta creates the tables from them, and readers get rows back as records
(from_row) instead of dicts indexed by column names spelled a second time.

Existing lakes keep their tables: a record's column order is the order of the tables created by
earlier releases, so a column is added at the end and never renamed or retyped
(ensure_meta_tables only adds columns). Every column is nullable in the table, so a column a row
does not have (added by a later release, or not read) is None in its record; the fields without a
default are the ones every writer sets.

Pure Python, no Spark or pyiceberg import: the alerts read these records in Airflow workers, and
DAG files import the alerts at parse time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar, Union, cast

from cdc_lakehouse.columns import COMMIT_LSN, RUN_ID, SHARD

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

SQL = "sql"  # the field metadata key holding the column's Spark SQL type (as in lake.ingest_metrics)

R = TypeVar("R")
# A row as read back, before it is a record: pyiceberg's to_pylist, Spark's Row.asDict.
RawRow = Mapping[str, Any]
# A row written to a cdc_meta table: its record (below; ingest_runs: IngestMetrics), or a row kept
# as a mapping (an ingest_runs row stored in a batch's state, ingest.records.BatchState).
MetaRow = Union["DataclassInstance", RawRow]  # noqa: UP007 - a string member: `|` would evaluate it


def row_values(row: MetaRow, names: Iterable[str]) -> tuple[Any, ...]:
    """The row's values of the columns `names`, in that order; a column it lacks is None."""
    if isinstance(row, Mapping):
        return tuple(row.get(c) for c in names)
    return tuple(getattr(row, c, None) for c in names)


def column(sql_type: str, *, required: bool = False) -> Any:
    """A field stored as a column of `sql_type`; None unless set, or set by every writer (required)."""
    return field(default=MISSING if required else None, metadata={SQL: sql_type})


def columns(record: type) -> list[tuple[str, str]]:
    """(name, Spark SQL type) of the record's columns, in table order."""
    return [(f.name, f.metadata[SQL]) for f in fields(record) if SQL in f.metadata]


def from_row(record: type[R], row: RawRow) -> R:
    """The record of a row read back (pyiceberg's to_pylist, Spark's Row.asDict). A column the row
    lacks is None; a key that is no column of the record is an error, as a misspelled column
    would otherwise read as null."""
    names = [c for c, _ in columns(record)]
    unknown = sorted(set(row) - set(names))
    if unknown:
        raise ValueError(f"{record.__name__}: {unknown} are not columns of its table (columns: {names})")
    return record(**{c: row.get(c) for c in names})


def as_records(record: type[R], rows: Iterable[R | RawRow]) -> list[R]:
    """Rows as records of `record`: records pass through, mappings go through from_row."""
    # cast: isinstance on a type[R] does not narrow the union; what is not an R is a RawRow.
    return [r if isinstance(r, record) else from_row(record, cast(RawRow, r)) for r in rows]


@dataclass(frozen=True, kw_only=True)
class QuarantinedEvent:
    """cdc_meta.quarantine: an event the ingest could not apply, with why and where it came from."""

    table_name: str = column("string", required=True)
    # The metadata columns the quarantine carries, under their names here (cdc_lakehouse.columns' `quarantine`).
    shard: str = column(SHARD.type, required=True)
    reason: str | None = column("string")
    raw: str | None = column("string")
    commit_lsn: int | None = column(COMMIT_LSN.type)
    seq: int | None = column("bigint")  # the source's seq (not _cdc_seq)
    landing_run: str | None = column(RUN_ID.type)
    landing_file: str | None = column("string")
    ingest_run: str | None = column("string")
    quarantined_at: datetime | None = column("timestamp")


@dataclass(frozen=True, kw_only=True)
class CaptureRun:
    """cdc_meta.capture_runs: one capture run of an endpoint (orchestration.tasks writes it with pyiceberg)."""

    endpoint: str = column("string", required=True)
    run_id: str = column("string", required=True)
    events: int | None = column("bigint")
    bytes: int | None = column("bigint")
    transactions: int | None = column("bigint")
    capped: bool | None = column("boolean")
    start_lsn: int | None = column("bigint")
    end_lsn: int | None = column("bigint")
    retained_wal_bytes: int | None = column("bigint")
    lag_bytes: int | None = column("bigint")
    seconds: float | None = column("double")
    started_at: datetime | None = column("timestamp")
    finished_at: datetime | None = column("timestamp")


@dataclass(frozen=True, kw_only=True)
class AuditResult:
    """cdc_meta.audit_results: one shard's comparison with its source in one audit run."""

    table_name: str = column("string", required=True)
    audit_run: str = column("string", required=True)
    shard: str = column("string", required=True)
    mode: str | None = column("string")
    source_rows: int | None = column("bigint")
    lake_rows: int | None = column("bigint")
    missing: int | None = column("bigint")
    extra: int | None = column("bigint")
    different: int | None = column("bigint")
    in_flight: int | None = column("bigint")
    persistent: int | None = column("bigint")
    buckets_compared: int | None = column("bigint")
    buckets_differing: int | None = column("bigint")
    sample_keys: str | None = column("string")  # JSON list of sample keys
    watermark_lsn: int | None = column("bigint")
    repaired: int | None = column("bigint")
    verdict: str | None = column("string")  # ok | fail
    seconds: float | None = column("double")
    audited_at: datetime | None = column("timestamp")


@dataclass(frozen=True, kw_only=True)
class AuditMismatch:
    """cdc_meta.audit_mismatches: a key that differed from the source, tracked across audit runs."""

    table_name: str = column("string", required=True)
    shard: str = column("string", required=True)
    key_json: str | None = column("string")
    kind: str | None = column("string")
    first_seen: datetime | None = column("timestamp")
    last_seen: datetime | None = column("timestamp")
    times_seen: int | None = column("int")
    resolved: bool | None = column("boolean")
    last_audit_run: str | None = column("string")


@dataclass(frozen=True, kw_only=True)
class QualityResult:
    """cdc_meta.quality_results: one expectation of an audit run's quality checks."""

    table_name: str = column("string", required=True)
    audit_run: str = column("string", required=True)
    expectation: str | None = column("string")
    success: bool | None = column("boolean")
    observed: str | None = column("string")
    details: str | None = column("string")
    checked_at: datetime | None = column("timestamp")


@dataclass(kw_only=True)
class ShardFreshness:
    """cdc_meta.freshness: how fresh one shard of a table was after one ingest run (lake.freshness)."""

    table_name: str = column("string", required=True)
    shard: str = column("string", required=True)
    endpoint: str = column("string", required=True)
    source_schema: str = column("string", required=True)
    last_source_commit_lsn: int | None = column("bigint")
    last_source_commit_ts: datetime | None = column("timestamp")
    last_heartbeat_lsn: int | None = column("bigint")
    last_heartbeat_ts: datetime | None = column("timestamp")
    watermark_lsn: int | None = column("bigint")
    fresh_to: datetime | None = column("timestamp")
    lake_snapshot_id: int | None = column("bigint")
    lake_committed_at: datetime | None = column("timestamp")
    freshness_seconds: float | None = column("double")
    ingest_run: str = column("string", required=True)
    updated_at: datetime = column("timestamp", required=True)

    def stale_seconds(self, now: datetime) -> float | None:
        """How far behind the source the shard is at `now` (None: no position time known)."""
        return None if self.fresh_to is None else (now - self.fresh_to).total_seconds()


@dataclass(frozen=True, kw_only=True)
class BootstrapChunk:
    """cdc_meta.bootstrap_progress: one completed chunk of a chunked bootstrap (bootstrap.progress);
    the newest row of a (table, shard) is where a killed or paused bootstrap resumes."""

    table_name: str = column("string", required=True)
    shard: str = column("string", required=True)
    run_id: str = column("string", required=True)
    chunk: int | None = column("bigint")
    last_key: str | None = column("string")  # JSON list of the chunk's last key, as the source prints it
    low_lsn: int | None = column("bigint")
    high_lsn: int | None = column("bigint")
    rows: int | None = column("bigint")  # rows read in this chunk
    rows_total: int | None = column("bigint")  # rows read for the shard so far
    chunks_done: int | None = column("bigint")
    chunks_total: int | None = column("bigint")  # estimate (pg_class.reltuples / chunk_rows)
    done: bool | None = column("boolean")
    xact_seconds: float | None = column("double")  # how long the chunk's read transaction was open
    started_at: datetime | None = column("timestamp")
    updated_at: datetime | None = column("timestamp")


@dataclass(frozen=True, kw_only=True)
class PointTable:
    """cdc_meta.consistent_points: one table of one consistent point (lake.points): read every
    table of the endpoint's point (endpoint, lsn) at its snapshot_id."""

    endpoint: str = column("string", required=True)
    lsn: int = column("bigint", required=True)  # exclusive, as in the watermark
    table_name: str = column("string", required=True)  # catalog.namespace.name
    snapshot_id: int = column("bigint", required=True)
    run_id: str | None = column("string")  # the capture run that ended at lsn
    source: str | None = column("string")  # JSON of the server identity
    recorded_at: datetime | None = column("timestamp")
    ingest_run: str | None = column("string")


@dataclass(frozen=True, kw_only=True)
class MaintenanceStats:
    """cdc_meta.maintenance_runs: a table's figures before or after one maintenance of one target."""

    table_name: str = column("string", required=True)
    run_id: str = column("string", required=True)
    target: str | None = column("string")  # current | changelog | output | unresolved | feed_output
    phase: str | None = column("string")  # before | after
    data_files: int | None = column("bigint")
    avg_file_bytes: float | None = column("double")
    delete_files: int | None = column("bigint")
    snapshots: int | None = column("bigint")
    total_bytes: int | None = column("bigint")
    records: int | None = column("bigint")
    checksum: str | None = column("string")
    seconds: float | None = column("double")
    at: datetime | None = column("timestamp")
