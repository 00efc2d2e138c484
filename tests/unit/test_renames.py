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
    assert r.add("type", "kind", "s0", 100) and not r.add("type", "kind", "s0", 100)
    assert r.lake_name("type", "s0", 99) == "kind"  # before s0's rename: the old name
    assert r.lake_name("type", "s0", 100) == "type"  # after it: a new column of that name
    assert r.lake_name("type", "s1", 10**12) == "kind"  # s1 has not renamed yet
    assert r.add("type", "kind", "s1", 300)
    assert r.lake_name("type", "s1", 300) == "type" and r.lake_name("kind", "s1", 5) == "kind"
    assert Renames.from_json(r.to_json()) == r and Renames.from_json(None) == Renames()
    assert NEVER > 2**62


def test_a_chain_of_renames():
    r = Renames()
    r.add("a", "b", "s0", 100)
    r.add("b", "c", "s0", 200)
    assert [r.lake_name("a", "s0", 50), r.lake_name("b", "s0", 150), r.lake_name("c", "s0", 250)] == ["c"] * 3
