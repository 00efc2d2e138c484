"""The single definitions: metadata columns, watermark and manifest models, session settings."""

from __future__ import annotations

import json

import pytest
from cdc_lakehouse.columns import CHANGELOG, CURRENT, LSN_COL, METADATA_COLUMNS, QUARANTINE, SHARD_COL, names_of
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.lake.tables import changelog_columns, current_table_columns
from cdc_lakehouse.landing.format import EVENT_SCHEMA, dump_json, dump_manifest, parse_manifest
from cdc_lakehouse.source.session import SESSION_OPTIONS, jdbc_init_statement
from cdc_lakehouse.watermark import Watermark

CFG = TableConfig.model_validate(
    {"name": "t", "source": {"table": "t", "shards": [{"conn_id": "c", "schemas": ["s0"]}]}, "primary_key": ["id"]}
)


def test_registry_drives_ddl():
    src = [("id", "bigint"), ("v", "string")]
    assert changelog_columns(src) == [
        ("_cdc_shard", "string"),
        *src,
        ("_cdc_op", "string"),
        ("_cdc_commit_lsn", "bigint"),
        ("_cdc_seq", "bigint"),
        ("_cdc_commit_ts", "timestamp"),
        ("_cdc_lsn", "bigint"),
        ("_cdc_xid", "bigint"),
        ("_cdc_unavailable", "array<string>"),
        ("_cdc_run_id", "string"),
        ("_cdc_ingested_at", "timestamp"),
    ]
    assert [c for c, _ in current_table_columns(CFG, src)] == [
        "_cdc_shard",
        "id",
        "v",
        "_cdc_op",
        "_cdc_commit_lsn",
        "_cdc_seq",
        "_cdc_commit_ts",
    ]
    assert (SHARD_COL, LSN_COL) == ("_cdc_shard", "_cdc_commit_lsn")
    assert names_of(QUARANTINE) == ["_cdc_shard", "_cdc_commit_lsn", "_cdc_run_id"]
    assert set(names_of(CURRENT)) <= set(names_of(CHANGELOG))
    assert all(c.name.startswith("_cdc_") and c.doc for c in METADATA_COLUMNS)


@pytest.mark.parametrize(
    "wm",
    [
        {"v": 1, "shards": {"s0": {"lsn": 7, "ts": "2026-01-01T00:00:00+00:00", "source": None}}, "runs": {"e": "r"}},
        {"v": 1, "shards": {"s0": {"lsn": 1, "columns": ["id"], "endpoint": "e"}}, "runs": {}, "backfill": [{"x": 1}]},
        {"shards": {}},
    ],
)
def test_watermark_round_trip(wm):
    text = json.dumps(wm, separators=(",", ":"), sort_keys=True)
    model = Watermark.from_json(text)
    assert model.to_json() == text
    assert model.to_dict() == wm
    assert Watermark.empty().to_dict() == {"v": 1, "shards": {}, "runs": {}}
    # Equal when the stored JSON is: a key left out differs from one set to its default.
    assert Watermark.from_json(text) == model
    assert Watermark.from_dict({"v": 1, "shards": {}}) != Watermark.empty()


def test_manifest_round_trip():
    m = {
        "format": 1,
        "run_id": "20260101T000000Z",
        "endpoint": "ep",
        "start_lsn": None,
        "end_lsn": 100,
        "capped": False,
        "tables": [
            {"table": "items", "dir": "ep/items/run=r", "files": [{"name": "p.parquet", "rows": 3, "bytes": 9}]}
        ],
        "heartbeats": {"s0": {"commit_lsn": 1, "end_lsn": 2, "commit_ts": "t", "xid": 3}},
        "schema_changes": [{"table": "s0.items", "at_commit_lsn": None, "columns": ["id"], "first_seen": True}],
        "published": ["s0.items"],
        "an_unknown_key": {"kept": True},
    }
    text = dump_json(m)
    model = parse_manifest(text)
    assert dump_manifest(model) == text
    assert json.loads(dump_manifest(model)) == m
    assert [(t, rel) for t, rel, _ in model.files()] == [("items", "ep/items/run=r/p.parquet")]


def test_event_schema_is_the_arrow_schema():
    from cdc_lakehouse.landing.format import landing_arrow_schema

    schema = landing_arrow_schema()
    assert schema.names == [f.name for f in EVENT_SCHEMA]
    assert str(schema.field("source").type.field("commit_ts").type) == "timestamp[us, tz=UTC]"


def test_session_settings_rendered_once():
    assert SESSION_OPTIONS == (
        "-c DateStyle=ISO -c TimeZone=UTC -c IntervalStyle=iso_8601 -c extra_float_digits=3 "
        "-c bytea_output=hex -c client_encoding=UTF8"
    )
    init = jdbc_init_statement("00000003-1")
    assert init.startswith("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ; SET TRANSACTION SNAPSHOT '00000003-1'; ")
    assert "SET TimeZone='UTC'" in init and "client_encoding" not in init
