"""The figures of one table's ingest run: the record of cdc_meta.ingest_runs.

One typed record instead of a dict whose keys were spelled in several places: the fields that
carry a column type are, in this order, the columns of cdc_meta.ingest_runs (lake.meta derives
the table from INGEST_RUN_COLUMNS), and callers get the record as a plain dict (`as_dict`).
It lives in the lake with the other cdc_meta records (lake.meta_rows) because lake.meta creates the
table from it; the ingest (ingest.ingest_table) fills it and the alerts read it. Imports nothing of the
package but runtime.phases.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import MISSING, dataclass, field, fields
from datetime import UTC, datetime
from typing import Any

from cdc_lakehouse.runtime.phases import PhaseClock

# The row counts Spark (4.1 on) hands the MERGE's write and Iceberg (1.11 on) records in its
# snapshot summary (BaseSparkWrite.setMergeSummaryProperties). Hard deletes only: a soft delete is
# an update there. Matched only: a truncate's deletes are the not-matched-by-source ones.
MERGE_COUNTS = {
    "inserts": "spark.merge-into.num-target-rows-inserted",
    "updates": "spark.merge-into.num-target-rows-matched-updated",
    "deletes": "spark.merge-into.num-target-rows-matched-deleted",
}


# IngestMetrics.status: the run's data landed, with landing gaps skipped, or another run of the
# same batch published it first (this run applied nothing).
OK, OK_WITH_GAPS, ALREADY_APPLIED = "ok", "ok_with_gaps", "already_applied"


def _col(sql_type: str, default: Any = MISSING, default_factory: Any = MISSING) -> Any:
    return field(default=default, default_factory=default_factory, metadata={"sql": sql_type})


@dataclass(kw_only=True)
class IngestMetrics:
    # Column order of cdc_meta.ingest_runs: tables created by earlier releases have it.
    table_name: str = _col("string")
    ingest_run: str = _col("string")
    interval_end: str | None = _col("string", None)
    landing_runs: list[str] = _col("array<string>", default_factory=list)
    events_read: int = _col("bigint", 0)
    duplicates: int = _col("bigint", 0)
    already_applied: int = _col("bigint", 0)
    inserts: int | None = _col("bigint", 0)  # None: not known (MERGE_COUNTS missing from the summary)
    updates: int | None = _col("bigint", 0)
    deletes: int | None = _col("bigint", 0)
    stale_skipped: int | None = _col("bigint", 0)  # batch rows the MERGE did not apply (table newer, no such key)
    truncates: int = _col("bigint", 0)
    quarantined: int = _col("bigint", 0)
    changelog_rows: int = _col("bigint", 0)
    data_files_added: int | None = _col("bigint", None)
    data_files_removed: int | None = _col("bigint", None)
    delete_files_added: int | None = _col("bigint", None)
    bytes_written: int | None = _col("bigint", None)
    bytes_removed: int | None = _col("bigint", None)
    changed_rows_bytes: int | None = _col("bigint", None)
    write_amplification: float | None = _col("double", None)
    lag_seconds_max: float | None = _col("double", None)
    lag_seconds_min: float | None = _col("double", None)
    freshness_seconds: float | None = _col("double", None)
    watermark: str | None = _col("string", None)
    write_mode: str = _col("string")
    apply_seconds: float | None = _col("double", None)
    total_seconds: float | None = _col("double", None)
    started_at: datetime = _col("timestamp", default_factory=lambda: datetime.now(UTC))
    committed_at: datetime | None = _col("timestamp", None)
    status: str = _col("string", "ok")
    error: str | None = _col("string", None)
    # Returned to callers, not stored in the meta table.
    backfilled: int | None = None
    merge_join: str | None = None  # shuffle | colocated (ingest.ingest_table.merge_source)
    timings: dict[str, float] = field(default_factory=dict)
    _clock: PhaseClock = field(default_factory=PhaseClock, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.timings = self._clock.seconds  # the clock fills the returned `timings` in place

    def timed(self, phase: str) -> AbstractContextManager[None]:
        """Seconds spent in `phase`, kept in `timings` (logged, and returned to the bench)."""
        return self._clock.phase(phase)

    def elapsed(self) -> float:
        return self._clock.elapsed()

    def set_counts(self, rows: int, inserts: int, updates: int, deletes: int, unchanged: int = 0) -> None:
        """What the MERGE did with the `rows` it was given; stale_skipped is the rest: rows the
        table held at a newer position, deletes of keys it lacks (unchanged: applied rows that
        are none of the three, such as a soft delete of a soft-deleted row)."""
        self.inserts, self.updates, self.deletes = inserts, updates, deletes
        self.stale_skipped = rows - inserts - updates - deletes - unchanged

    def merged_by_another_run(self) -> None:
        """Another run of the batch published its MERGE: no row of the current table is this
        run's (changelog_rows stays: the changelog append may still be this run's)."""
        self.status = ALREADY_APPLIED
        self.set_counts(0, 0, 0, 0)

    def take_merge_counts(self, summary: dict[str, str], rows: int) -> bool:
        """set_counts from the MERGE's snapshot summary (MERGE_COUNTS); False (counts left None)
        when the summary lacks them or they do not add up. A MERGE given no rows counts nothing
        (Spark then records no counts)."""
        if not rows:
            self.set_counts(0, 0, 0, 0)
            return True
        counts = [
            int(summary[MERGE_COUNTS[k]]) for k in ("inserts", "updates", "deletes") if MERGE_COUNTS[k] in summary
        ]
        # Spark's SQL metrics are accumulators: a stage run again (a lost executor, a fetch
        # failure, speculation) can count its rows twice. Unknown, rather than invented.
        if len(counts) < 3 or min(counts) < 0 or sum(counts) > rows:
            self.inserts = self.updates = self.deletes = self.stale_skipped = None
            return False
        self.set_counts(rows, *counts)
        return True

    def add_commit_stats(self, pre: dict[str, str], post: dict[str, str]) -> None:
        """Files and bytes of the MERGE's snapshot; write amplification against the bytes the
        changed rows take in the table before it (average row size times rows changed)."""

        def n(d: dict[str, str], k: str) -> int:
            return int(d.get(k, 0) or 0)

        self.data_files_added = n(post, "added-data-files")
        self.data_files_removed = n(post, "deleted-data-files")
        self.delete_files_added = n(post, "added-delete-files")
        self.bytes_written = n(post, "added-files-size")
        self.bytes_removed = n(post, "removed-files-size")
        records, size = n(pre, "total-records"), n(pre, "total-files-size")
        changed = (self.inserts or 0) + (self.updates or 0) + (self.deletes or 0)
        if records and changed:
            self.changed_rows_bytes = int(size / records * changed)
            self.write_amplification = self.bytes_written / self.changed_rows_bytes if self.changed_rows_bytes else None

    def set_lag(self, min_ts: datetime | None, max_ts: datetime | None) -> None:
        """Commit timestamps of the batch's oldest and newest events (naive UTC) -> lag now."""
        now = datetime.now(UTC)
        if min_ts is not None and max_ts is not None:
            self.lag_seconds_max = (now - min_ts.replace(tzinfo=UTC)).total_seconds()
            self.lag_seconds_min = (now - max_ts.replace(tzinfo=UTC)).total_seconds()

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}

    def meta_row(self) -> dict[str, Any]:
        return {c: getattr(self, c) for c, _ in INGEST_RUN_COLUMNS}

    def summary(self) -> str:
        wa = self.write_amplification
        return (
            f"ingest {self.table_name}: runs {self.landing_runs} events {self.events_read} "
            f"(applied before {self.already_applied}, duplicates {self.duplicates}) inserts "
            f"{self.inserts} updates {self.updates} deletes {self.deletes} stale "
            f"{self.stale_skipped} truncates {self.truncates} quarantined {self.quarantined}; "
            f"files +{self.data_files_added or 0}/-{self.data_files_removed or 0} deletes "
            f"+{self.delete_files_added or 0}, bytes written {self.bytes_written or 0}, write amplification "
            f"{'n/a' if wa is None else f'{wa:.2f}'}; apply {self.apply_seconds or 0:.1f}s total "
            f"{self.total_seconds or 0:.1f}s (merge join {self.merge_join or 'n/a'}); freshness "
            f"{self.freshness_seconds or 0:.0f}s; phases " + ", ".join(f"{k} {v:.1f}s" for k, v in self.timings.items())
        )


INGEST_RUN_COLUMNS: list[tuple[str, str]] = [
    (f.name, f.metadata["sql"]) for f in fields(IngestMetrics) if "sql" in f.metadata
]
