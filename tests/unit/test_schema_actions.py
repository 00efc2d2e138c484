"""Schema-change policy: which source schema changes become DDL and which stop the table.

`schema_actions` is pure: lake columns + the schemas the capture saw -> (DDL, errors).
"""

from __future__ import annotations

import pytest
from cdc_lakehouse.ingest.schema import schema_actions

from tests.conftest import make_config

LAKE = [("id", "bigint"), ("title", "string"), ("n", "decimal(10,2)"), ("k", "int")]


def col(name, lake_type, pg_type="x"):
    return {"name": name, "type": pg_type, "lake_type": lake_type}


BASE_SCHEMA = [col(n, t) for n, t in LAKE]


def schema(*overrides, drop=()):
    """The base source schema with columns replaced or appended (by name), some dropped."""
    by_name = {c["name"]: c for c in BASE_SCHEMA}
    for o in overrides:
        by_name[o["name"]] = o
    return [c for n, c in by_name.items() if n not in drop]


def actions(sch, *, latest=None, known=None, **cfg_overrides):
    cfg = make_config("sc", ["s1"], **cfg_overrides)
    return schema_actions(cfg, LAKE, [sch], {"s1": sch} if latest is None else latest, known=known)


def test_unchanged_schema_needs_nothing():
    assert actions(schema()) == ([], [])


def test_added_column_is_added_under_the_additive_policy():
    assert actions(schema(col("extra", "string"))) == (["ADD COLUMN `extra` string"], [])


def test_added_column_uses_the_configured_type_override():
    ddl, errors = actions(schema(col("amount", "decimal(38,18)")), column_types={"amount": "decimal(20,4)"})
    assert (ddl, errors) == (["ADD COLUMN `amount` decimal(20,4)"], [])


def test_column_added_in_several_schemas_is_added_once():
    cfg = make_config("sc", ["s1", "s2"])
    s = schema(col("extra", "bigint"))
    ddl, errors = schema_actions(cfg, LAKE, [s, list(reversed(s))], {"s1": s, "s2": s})
    assert (ddl, errors) == (["ADD COLUMN `extra` bigint"], [])


def test_added_column_stops_a_strict_table():
    ddl, errors = actions(schema(col("extra", "string", "text")), schema_changes={"mode": "strict"})
    assert ddl == []
    assert len(errors) == 1
    assert "'extra' (text) was added" in errors[0]
    assert "schema_changes.mode is strict" in errors[0]
    assert "include/tables/sc.yaml" in errors[0]


def test_added_column_of_unsupported_type_names_the_fix():
    ddl, errors = actions(schema(col("geo", None, "geometry")))
    assert ddl == []
    assert errors == [
        "sc: new source column 'geo' has unsupported type 'geometry'; "
        "set column_types: {geo: string} in include/tables/sc.yaml"
    ]


@pytest.mark.parametrize(
    ("name", "new_type"),
    [("k", "bigint"), ("n", "decimal(12,2)"), ("n", "decimal(38,2)")],
)
def test_safe_widening_is_altered_in_place(name, new_type):
    assert actions(schema(col(name, new_type))) == ([f"ALTER COLUMN `{name}` TYPE {new_type}"], [])


def test_widening_stops_a_strict_table():
    ddl, errors = actions(schema(col("k", "bigint")), schema_changes={"mode": "strict"})
    assert ddl == []
    assert len(errors) == 1
    assert "'k' changed type from int to bigint" in errors[0]


@pytest.mark.parametrize(
    ("name", "new_type"),
    [
        ("n", "decimal(12,3)"),  # another scale, even with more precision
        ("title", "bigint"),  # retype
        ("k", "string"),
    ],
)
def test_incompatible_retype_is_an_error_offering_both_choices(name, new_type):
    old = dict(LAKE)[name]
    ddl, errors = actions(schema(col(name, new_type, "pgtype")))
    assert ddl == []
    assert len(errors) == 1
    msg = errors[0]
    assert msg.startswith(f"sc: source column {name!r} changed type from {old} to {new_type} (pgtype)")
    assert f"set column_types: {{{name}: {old}}}" in msg
    assert "re-bootstrap" in msg


@pytest.mark.parametrize(("name", "new_type"), [("id", "int"), ("n", "decimal(8,2)")])
def test_a_source_type_narrower_than_the_lake_is_taken_as_it_is(name, new_type):
    """A shard still on the old type after another widened the lake column, or a source column
    narrowed: every value fits the lake's wider type, so nothing changes and nothing stops."""
    assert actions(schema(col(name, new_type))) == ([], [])


def test_type_pinned_by_column_types_is_not_a_change():
    assert actions(schema(col("k", "bigint")), column_types={"k": "int"}) == ([], [])


def test_dropped_column_without_a_decision_stops_the_table():
    ddl, errors = actions(schema(drop=["title"]))
    assert ddl == []
    assert len(errors) == 1
    assert "source column 'title' was dropped (shard s1)" in errors[0]
    assert "{title: keep_null}" in errors[0]
    assert "{title: drop}" in errors[0]


def test_dropped_column_kept_as_null():
    s = schema(drop=["title"])
    assert actions(s, schema_changes={"dropped_columns": {"title": "keep_null"}}) == ([], [])


def test_dropped_column_dropped_once_for_many_shards():
    cfg = make_config("sc", ["s1", "s2"], schema_changes={"dropped_columns": {"title": "drop"}})
    s = schema(drop=["title"])
    assert schema_actions(cfg, LAKE, [s], {"s1": s, "s2": s}) == (["DROP COLUMN `title`"], [])


def test_dropped_primary_key_column_requires_a_re_bootstrap_whatever_the_policy():
    ddl, errors = actions(schema(drop=["id"]), schema_changes={"dropped_columns": {"id": "drop"}})
    assert ddl == []
    assert errors == [
        "sc: primary key column 'id' disappeared from the source (shard s1); re-bootstrap the table with the new key"
    ]


def test_shard_that_never_had_the_column_has_not_dropped_it():
    # s2 has not been written since `k` was added elsewhere: its latest schema still lacks it.
    old = schema(drop=["k"])
    latest = {"s1": schema(), "s2": old}
    cfg = make_config("sc", ["s1", "s2"])
    known = {"s1": {n for n, _ in LAKE}, "s2": {"id", "title", "n"}}
    assert schema_actions(cfg, LAKE, [schema(), old], latest, known=known) == ([], [])
    # ...but once the shard is known to have had it, its absence is a drop.
    known["s2"].add("k")
    _, errors = schema_actions(cfg, LAKE, [schema(), old], latest, known=known)
    assert len(errors) == 1
    assert "'k' was dropped (shard s2)" in errors[0]


def test_errors_are_sorted_and_deduplicated_and_name_the_given_file():
    cfg = make_config("sc", ["s1"])
    s = schema(col("k", "string"), col("title", "bigint"))
    ddl, errors = schema_actions(cfg, LAKE, [s, s], {"s1": s}, file_hint="tables/sc.yml")
    assert ddl == []
    assert len(errors) == 2
    assert errors == sorted(errors)
    assert all("tables/sc.yml" in e for e in errors)


def test_a_drop_decided_in_airflow_applies_and_the_yaml_wins_over_it():
    """#53: DropDecisions (recorded on the table by the ingest DAG's decide_dropped approval) decide
    a drop the YAML does not; an entry in the YAML's dropped_columns wins over them."""
    from cdc_lakehouse.ingest.schema import DropDecisions, UndecidedDrop

    s = schema(drop=["title"])
    cfg = make_config("sc", ["s1"])
    _, errors = schema_actions(cfg, LAKE, [s], {"s1": s})
    assert [(e.column, e.shard) for e in errors if isinstance(e, UndecidedDrop)] == [("title", "s1")]
    assert schema_actions(cfg, LAKE, [s], {"s1": s}, decided={"title": "drop"}) == (["DROP COLUMN `title`"], [])
    assert schema_actions(cfg, LAKE, [s], {"s1": s}, decided={"title": "keep_null"}) == ([], [])
    yaml_keeps = make_config("sc", ["s1"], schema_changes={"dropped_columns": {"title": "keep_null"}})
    assert schema_actions(yaml_keeps, LAKE, [s], {"s1": s}, decided={"title": "drop"}) == ([], [])

    pending = DropDecisions(decided={"old": "drop"}, pending={"title": ["s1", "s2"]})
    again = DropDecisions.from_json(pending.to_json())
    assert again == pending and DropDecisions.from_json(None) == DropDecisions()
    assert again.decide("keep_null") == DropDecisions(decided={"old": "drop", "title": "keep_null"})
    with pytest.raises(ValueError, match="keep_null"):
        again.decide("maybe")


def test_a_table_waiting_for_a_person_is_not_a_failed_table():
    """jobs.runner: a table that waits for a decision (DropDecisionNeeded) reports `waiting`, and
    the job does not fail for it; any other error is the table's failure."""
    from cdc_lakehouse.ingest.errors import DropDecisionNeeded
    from cdc_lakehouse.jobs.runner import run_tables

    def fn(spark, lake, cfg):
        if cfg.name == "waits":
            raise DropDecisionNeeded("waits: source column(s) title dropped ... decide_dropped", ["title"])
        raise RuntimeError("broken")

    cfgs = [make_config("waits", ["s1"]), make_config("broken", ["s1"])]
    results, failures = run_tables("ingest", None, None, cfgs, fn)
    assert results["waits"]["status"] == "waiting" and "decide_dropped" in results["waits"]["reason"]
    assert [name for name, _ in failures] == ["broken"] and results["broken"]["status"] == "failed"
