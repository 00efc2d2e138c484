"""Consumed columns (opt-out schema evolution): a table that lists the columns it consumes keeps
running through any change to the others and stops only when a consumed column is dropped or
retyped incompatibly. `schema_actions`, the config checks and the publication's column list are
pure; the column list on a real publication is tested in tests/integration/test_consumed_columns.py."""

from __future__ import annotations

import pytest
from cdc_lakehouse.config import parse_table_config
from cdc_lakehouse.ingest.schema import schema_actions
from cdc_lakehouse.source.publication import column_list_for

from tests.conftest import make_config

# The lake table of a table consuming id, title and n (not k, not blob).
LAKE = [("id", "bigint"), ("title", "string"), ("n", "decimal(10,2)")]


def col(name, lake_type, pg_type="x"):
    return {"name": name, "type": pg_type, "lake_type": lake_type}


SOURCE = [
    col("id", "bigint"),
    col("title", "string"),
    col("n", "decimal(10,2)"),
    col("k", "int"),
    col("blob", "binary"),
]


def schema(*overrides, drop=()):
    by_name = {c["name"]: c for c in SOURCE}
    for o in overrides:
        by_name[o["name"]] = o
    return [c for n, c in by_name.items() if n not in drop]


INCLUDE = {"include": ["id", "title", "n"]}
EXCLUDE = {"exclude": ["k", "blob", "extra"]}  # "extra": a column the source adds later


def actions(sch, columns, lake=LAKE, **more):
    cfg = make_config("cc", ["s1"], columns=columns, **more)
    return schema_actions(cfg, lake, [sch], {"s1": sch})


@pytest.mark.parametrize("columns", [INCLUDE, EXCLUDE], ids=["include", "exclude"])
@pytest.mark.parametrize(
    "change",
    [
        schema(col("extra", "string")),  # added
        schema(drop=("k",)),  # dropped
        schema(col("k", "string", "text")),  # retyped int -> string: incompatible, were it consumed
        schema(col("k", None, "tsvector")),  # retyped to an unsupported type
        schema(col("extra", "string"), col("blob", "string"), drop=("k",)),  # all at once
    ],
    ids=["added", "dropped", "retyped", "unsupported", "all"],
)
def test_changes_to_unconsumed_columns_never_stop_the_table(columns, change):
    assert actions(change, columns) == ([], [])


def test_strict_tables_ignore_unconsumed_changes_too():
    assert actions(schema(col("extra", "string")), INCLUDE, schema_changes={"mode": "strict"}) == ([], [])


@pytest.mark.parametrize("columns", [INCLUDE, EXCLUDE], ids=["include", "exclude"])
def test_a_dropped_consumed_column_stops_the_table_with_the_choices(columns):
    ddl, errors = actions(schema(drop=("title",)), columns)
    assert ddl == [] and len(errors) == 1
    assert "'title' was dropped (shard s1)" in errors[0] and "keep_null" in errors[0] and "drop" in errors[0]


@pytest.mark.parametrize("columns", [INCLUDE, EXCLUDE], ids=["include", "exclude"])
def test_an_incompatible_retype_of_a_consumed_column_stops_the_table(columns):
    ddl, errors = actions(schema(col("n", "string", "text")), columns)
    assert ddl == [] and len(errors) == 1 and "'n' changed type from decimal(10,2) to string" in errors[0]


def test_a_widening_of_a_consumed_column_is_applied():
    assert actions(schema(col("n", "decimal(12,2)")), INCLUDE) == (["ALTER COLUMN `n` TYPE decimal(12,2)"], [])


def test_an_added_column_enters_only_when_consumed():
    # exclude: a new column is consumed (not excluded), so it is added; include: only if listed.
    assert actions(schema(col("extra", "string")), {"exclude": ["k", "blob"]}) == (["ADD COLUMN `extra` string"], [])
    assert actions(schema(col("extra", "string")), {"include": ["id", "title", "n", "extra"]}) == (
        ["ADD COLUMN `extra` string"],
        [],
    )


def test_a_lake_column_no_longer_consumed_is_decided_like_a_dropped_one():
    lake = [*LAKE, ("k", "int")]  # bootstrapped before k was excluded
    ddl, errors = actions(schema(), EXCLUDE, lake=lake)
    assert ddl == [] and len(errors) == 1 and "'k' is no longer consumed" in errors[0]
    assert actions(schema(), EXCLUDE, lake=lake, schema_changes={"dropped_columns": {"k": "drop"}}) == (
        ["DROP COLUMN `k`"],
        [],
    )


def _parse(columns, **more):
    data = {
        "name": "cc",
        "source": {"table": "t", "shards": [{"conn_id": "pg", "schemas": ["s1"]}]},
        "primary_key": ["id"],
        "columns": columns,
        **more,
    }
    return parse_table_config(data, "cc.yaml")


@pytest.mark.parametrize(
    ("columns", "more", "message"),
    [
        (
            {"include": ["title"]},
            {},
            "primary_key column(s) ['id'] are not consumed (columns); add them to columns.include",
        ),
        ({"exclude": ["id"]}, {}, "primary_key column(s) ['id'] are not consumed (columns); remove them from"),
        ({"exclude": ["t"]}, {"lake": {"sort_by": ["t"]}}, "lake.sort_by column(s) ['t'] are not consumed"),
        ({"include": ["id"], "exclude": ["x"]}, {}, "either columns.include or columns.exclude"),
        ({"include": []}, {}, "columns.include is empty"),
        ({"include": ["id", "bad name"]}, {}, "bad name"),
    ],
)
def test_config_errors_name_the_field_and_the_fix(columns, more, message):
    cfg, errors = _parse(columns, **more)
    assert cfg is None and len(errors) == 1 and message in errors[0].message, errors


def test_consumed_keeps_the_source_order():
    cfg, _ = _parse({"exclude": ["k"]})
    assert cfg.consumed(["id", "k", "title"]) == ["id", "title"]
    assert make_config("all", ["s1"]).columns.all


def test_publication_column_list_is_the_union_of_what_the_configs_consume():
    cols = ["id", "title", "n", "k", "blob"]
    a = make_config("a", ["s1"], columns={"include": ["id", "title"]})
    b = make_config("b", ["s1"], columns={"exclude": ["blob", "k", "n"]})
    c = make_config("c", ["s1"], columns={"include": ["id", "n"]})
    assert column_list_for([a, b], cols, ["id"], "d") == ["id", "title"]
    assert column_list_for([a, c], cols, ["id"], "d") == ["id", "title", "n"]
    # The replica identity is always in (PostgreSQL requires it); FULL or a config reading all: no list.
    assert column_list_for([a], cols, ["id", "k"], "i") == ["id", "title", "k"]
    assert column_list_for([a], cols, ["id"], "f") is None
    assert column_list_for([a, make_config("all", ["s1"])], cols, ["id"], "d") is None
    assert column_list_for([], cols, ["id"], "d") is None
