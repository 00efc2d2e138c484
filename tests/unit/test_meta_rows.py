"""The cdc_meta tables are generated from typed records (lake.meta_rows, lake.ingest_metrics): the
records must keep generating exactly the tables existing lakes have, their fields' Python types
must match their columns' types, and rows read back become records without inventing values."""

from __future__ import annotations

import types
import typing
from datetime import UTC, datetime

import pytest
from cdc_lakehouse.columns import QUARANTINE, columns_of
from cdc_lakehouse.lake.meta import META_RECORDS, META_TABLES
from cdc_lakehouse.lake.meta_rows import AuditResult, CaptureRun, as_records, columns, from_row

# The tables as existing lakes have them (the hand-written lists before the records generated
# them). Changing a line here breaks existing lakes: add columns at the end, never rename or retype.
EXISTING = {
    "quarantine": (
        "PARTITIONED BY (table_name)",
        "table_name string, shard string, reason string, raw string, commit_lsn bigint, seq bigint, "
        "landing_run string, landing_file string, ingest_run string, quarantined_at timestamp",
    ),
    "ingest_runs": (
        "PARTITIONED BY (table_name)",
        "table_name string, ingest_run string, interval_end string, landing_runs array<string>, "
        "events_read bigint, duplicates bigint, already_applied bigint, inserts bigint, updates bigint, "
        "deletes bigint, stale_skipped bigint, truncates bigint, quarantined bigint, "
        "changelog_rows bigint, data_files_added bigint, data_files_removed bigint, "
        "delete_files_added bigint, bytes_written bigint, bytes_removed bigint, changed_rows_bytes bigint, "
        "write_amplification double, lag_seconds_max double, lag_seconds_min double, "
        "freshness_seconds double, watermark string, write_mode string, apply_seconds double, "
        "total_seconds double, started_at timestamp, committed_at timestamp, status string, error string",
    ),
    "capture_runs": (
        "",
        "endpoint string, run_id string, events bigint, bytes bigint, transactions bigint, capped boolean, "
        "start_lsn bigint, end_lsn bigint, retained_wal_bytes bigint, lag_bytes bigint, seconds double, "
        "started_at timestamp, finished_at timestamp",
    ),
    "audit_results": (
        "PARTITIONED BY (table_name)",
        "table_name string, audit_run string, shard string, mode string, source_rows bigint, "
        "lake_rows bigint, missing bigint, extra bigint, different bigint, in_flight bigint, "
        "persistent bigint, buckets_compared bigint, buckets_differing bigint, sample_keys string, "
        "watermark_lsn bigint, repaired bigint, verdict string, seconds double, audited_at timestamp",
    ),
    "audit_mismatches": (
        "PARTITIONED BY (table_name)",
        "table_name string, shard string, key_json string, kind string, first_seen timestamp, "
        "last_seen timestamp, times_seen int, resolved boolean, last_audit_run string",
    ),
    "quality_results": (
        "PARTITIONED BY (table_name)",
        "table_name string, audit_run string, expectation string, success boolean, observed string, "
        "details string, checked_at timestamp",
    ),
    "freshness": (
        "PARTITIONED BY (table_name)",
        "table_name string, shard string, endpoint string, source_schema string, "
        "last_source_commit_lsn bigint, last_source_commit_ts timestamp, last_heartbeat_lsn bigint, "
        "last_heartbeat_ts timestamp, watermark_lsn bigint, fresh_to timestamp, lake_snapshot_id bigint, "
        "lake_committed_at timestamp, freshness_seconds double, ingest_run string, updated_at timestamp",
    ),
    "bootstrap_progress": (
        "PARTITIONED BY (table_name)",
        "table_name string, shard string, run_id string, chunk bigint, last_key string, low_lsn bigint, "
        "high_lsn bigint, rows bigint, rows_total bigint, chunks_done bigint, chunks_total bigint, "
        "done boolean, xact_seconds double, started_at timestamp, updated_at timestamp",
    ),
    "maintenance_runs": (
        "PARTITIONED BY (table_name)",
        "table_name string, run_id string, target string, phase string, data_files bigint, "
        "avg_file_bytes double, delete_files bigint, snapshots bigint, total_bytes bigint, records bigint, "
        "checksum string, seconds double, at timestamp",
    ),
    "consistent_points": (
        "",
        "endpoint string, lsn bigint, table_name string, snapshot_id bigint, run_id string, source string, "
        "recorded_at timestamp, ingest_run string",
    ),
}

# The Python type each Spark SQL column type is read back as (pyiceberg and Spark alike).
PYTHON_TYPE = {
    "string": str,
    "bigint": int,
    "int": int,
    "double": float,
    "boolean": bool,
    "timestamp": datetime,
    "array<string>": list[str],
}


def _cols(text: str) -> list[tuple[str, str]]:
    return [tuple(c.split(" ", 1)) for c in text.split(", ")]


@pytest.mark.parametrize("table", sorted(EXISTING))
def test_records_generate_exactly_the_existing_tables(table):
    part, cols = EXISTING[table]
    assert META_TABLES[table] == (_cols(cols), part)


def test_every_meta_table_has_a_record():
    assert sorted(META_TABLES) == sorted(EXISTING) == sorted(META_RECORDS)


@pytest.mark.parametrize("table", sorted(META_RECORDS))
def test_field_types_match_column_types(table):
    record = META_RECORDS[table][0]
    hints = typing.get_type_hints(record)
    for name, sql in columns(record):
        hint = hints[name]
        if isinstance(hint, types.UnionType):  # X | None: the column is nullable
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        assert hint == PYTHON_TYPE[sql], f"{record.__name__}.{name} is {hints[name]} but its column is {sql}"


def test_quarantine_carries_the_registry_columns_under_their_quarantine_names():
    cols = dict(META_TABLES["quarantine"][0])
    assert {c.quarantine: c.type for c in columns_of(QUARANTINE)} == {
        c.quarantine: cols.get(c.quarantine) for c in columns_of(QUARANTINE)
    }


def test_rows_read_back_become_records():
    at = datetime(2026, 3, 1, tzinfo=UTC)
    r = from_row(CaptureRun, {"endpoint": "pg_a", "run_id": "r1", "retained_wal_bytes": 7, "finished_at": at})
    assert (r.endpoint, r.run_id, r.retained_wal_bytes, r.finished_at) == ("pg_a", "r1", 7, at)
    assert r.events is None and r.capped is None  # not in the row: None, no default invented
    with pytest.raises(ValueError, match=r"CaptureRun: \['retained_wal_byte'\] are not columns"):
        from_row(CaptureRun, {"endpoint": "pg_a", "run_id": "r1", "retained_wal_byte": 7})
    (same, parsed) = as_records(AuditResult, [AuditResult(table_name="t", audit_run="a", shard="s0"), {"shard": "s1"}])
    assert same.table_name == "t" and parsed.shard == "s1" and parsed.verdict is None
