"""Source column renames (source.ddl, ingest.renames): the trigger's diff and the name mapping by
shard and position. Pure Python; the Spark expression is checked against lake_name in
tests/integration/test_schema_events.py."""

from __future__ import annotations

from cdc_lakehouse.ingest.renames import NEVER, Renames
from cdc_lakehouse.source.ddl import ddl_diff


def test_a_rename_keeps_the_attribute_number():
    before = {"1": {"name": "id", "type": "bigint"}, "2": {"name": "type", "type": "text", "default": None}}
    after = {"1": {"name": "id", "type": "bigint"}, "2": {"name": "kind", "type": "text", "default": None}}
    assert ddl_diff(before, after) == {
        "renamed": [["type", "kind"]],
        "added": [],
        "dropped": [],
        "retyped": [],
        "defaults": [],
    }


def test_add_drop_retype_and_default_in_one_diff():
    before = {"1": {"name": "id", "type": "integer"}, "2": {"name": "a", "type": "text"}}
    after = {
        "1": {"name": "id", "type": "bigint", "default": "0"},
        "3": {"name": "a", "type": "text"},  # dropped and added back: another attribute
    }
    d = ddl_diff(before, after)
    assert d["renamed"] == [] and d["added"] == ["a"] and d["dropped"] == ["a"]
    assert d["retyped"] == [{"column": "id", "from": "integer", "to": "bigint"}]
    assert d["defaults"] == [{"column": "id", "from": None, "to": "0"}]


def test_names_map_by_shard_and_position():
    r = Renames()
    assert r.add("type", "kind", "s0", (100, 90)) == "new" and r.add("type", "kind", "s0", (100, 90)) is None
    assert r.lake_name("type", "s0", (99, 5)) == "kind"  # before s0's rename: the old name
    assert r.lake_name("type", "s0", (100, 80)) == "kind"  # earlier in the rename's own transaction
    assert r.lake_name("type", "s0", (100, 95)) == "type"  # later in it: a new column of that name
    assert r.lake_name("type", "s0", (101, 0)) == "type"
    assert r.lake_name("type", "s1", (10**12, 0)) == "kind"  # s1 has not renamed yet
    assert r.add("type", "kind", "s1", (300, 290)) == "shard"
    assert r.lake_name("type", "s1", (300, 291)) == "type" and r.lake_name("kind", "s1", (5, 0)) == "kind"
    assert Renames.from_json(r.to_json()) == r and Renames.from_json(None) == Renames()
    assert NEVER == 2**63 - 1


def test_a_chain_of_renames():
    r = Renames()
    r.add("a", "b", "s0", (100, 100))
    r.add("b", "c", "s0", (200, 200))
    at = [(50, 0), (150, 0), (250, 0)]
    assert [r.lake_name(n, "s0", p) for n, p in zip(["a", "b", "c"], at, strict=True)] == ["c"] * 3


def test_a_renamed_key_or_layout_column_stops_the_table_with_the_fix():
    import pytest
    from cdc_lakehouse.ingest.errors import SchemaChangeError
    from cdc_lakehouse.ingest.renames import check_renamable

    from tests.conftest import make_config

    cfg = make_config("t", ["s0"], lake={"namespace": "t", "sort_by": ["space_id"]})
    check_renamable(cfg, "type")
    for col, where in (("id", "primary_key"), ("space_id", "lake.sort_by")):
        with pytest.raises(SchemaChangeError, match=where):
            check_renamable(cfg, col)
