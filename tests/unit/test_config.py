"""Table config validation: typed objects, and errors that name the file, the field and the fix."""

from __future__ import annotations

import textwrap

import pytest
from cdc_lakehouse.columns import SHARD_COL
from cdc_lakehouse.config import load_table_config, load_table_configs, parse_table_config
from cdc_lakehouse.identifiers import IdentifierError, check_ident, pg_ident, spark_ident

BASE = {
    "name": "block",
    "source": {
        "table": "block",
        "shards": [
            {"conn_id": "pg_a", "schemas": ["s1", "s2"]},
            {"conn_id": "pg_b", "database": "notion", "schemas": ["s1"]},
        ],
    },
    "primary_key": ["id"],
}


def parse(**changes):
    data = {**BASE, **changes}
    return parse_table_config(data, "include/tables/block.yaml")


def test_defaults_and_derived_names():
    cfg, errors = parse()
    assert errors == []
    assert cfg.lake.write_mode == "merge-on-read"
    assert cfg.deletes == "hard"
    assert cfg.current_table == "cdc.block"
    assert cfg.changelog_table == "cdc.block__changelog"
    assert cfg.lake_key == [SHARD_COL, "id"]
    assert cfg.sort_by_columns == ["id"]
    assert [s for _, _, s in cfg.shards()] == ["s1", "s2", "notion.s1"]
    assert [g.endpoint_id for g in cfg.source.shards] == ["pg_a", "pg_b__notion"]


@pytest.mark.parametrize(
    ("changes", "field", "fragment"),
    [
        ({"lake": {"write_mode": "mor"}}, "lake.write_mode", "merge-on-read"),
        ({"primary_key": ["id; DROP TABLE x"]}, "primary_key", "not a valid identifier"),
        (
            {"source": {"table": "block", "shards": [{"conn_id": "pg_a", "schemas": ['s1"; drop']}]}},
            "source.shards.0.schemas",
            "not a valid identifier",
        ),
        ({"ingest": {"schedule": "every hour"}}, "ingest.schedule", "cron"),
        ({"lake": {"partition_by": ["id) --"]}}, "lake.partition_by", "bucket(N, col)"),
        ({"deletes": "sometimes"}, "deletes", "'hard' or 'soft'"),
        ({"primary_key": []}, "primary_key", "at least 1"),
        ({"lake": {"namespace": "Bad-Name"}}, "lake.namespace", "lower-case"),
        ({"tabel": "x"}, "tabel", "Extra inputs"),
        ({"primary_key": ["_cdc_shard"]}, "primary_key", "reserved prefix"),
        ({"column_types": {"amount": "decimal(20,4); x"}}, "column_types", "Spark type"),
        ({"maintenance": {"orphan_file_age_hours": 1}}, "maintenance.orphan_file_age_hours", "24"),
    ],
)
def test_bad_values_name_file_field_and_fix(changes, field, fragment):
    cfg, errors = parse(**changes)
    assert cfg is None
    assert errors, "expected an error"
    text = "\n".join(str(e) for e in errors)
    assert "include/tables/block.yaml" in text
    assert any(e.field.startswith(field) for e in errors), text
    assert fragment in text
    assert all(e.fix for e in errors)


def test_duplicate_shards_rejected():
    src = {"table": "block", "shards": [{"conn_id": "pg_a", "schemas": ["s1"]}, {"conn_id": "pg_b", "schemas": ["s1"]}]}
    cfg, errors = parse(source=src)
    assert cfg is None and "appears twice" in str(errors[0])


def test_one_broken_file_does_not_hide_the_others(tmp_path):
    (tmp_path / "good.yaml").write_text(
        textwrap.dedent("""
        name: good
        source: {table: t, shards: [{conn_id: c, schemas: [s]}]}
        primary_key: [id]
    """)
    )
    (tmp_path / "bad.yaml").write_text(
        "name: bad\nsource: {table: t, shards: [{conn_id: c, schemas: [s]}]}\n"
        "primary_key: [id]\nlake: {write_mode: sideways}\n"
    )
    (tmp_path / "broken.yaml").write_text("name: [unclosed\n")
    cs = load_table_configs(tmp_path)
    assert sorted(cs.tables) == ["good"]
    files = sorted({e.file.rsplit("/", 1)[-1] for e in cs.errors})
    assert files == ["bad.yaml", "broken.yaml"]
    assert any("lake.write_mode" in str(e) for e in cs.errors)
    assert any("not valid YAML" in str(e) for e in cs.errors)


def test_duplicate_table_names(tmp_path):
    body = "source: {table: t, shards: [{conn_id: c, schemas: [s]}]}\nprimary_key: [id]\n"
    (tmp_path / "a.yaml").write_text("name: x\n" + body)
    (tmp_path / "b.yaml").write_text("name: x\n" + body)
    cs = load_table_configs(tmp_path)
    assert list(cs.tables) == ["x"]
    assert "already defined" in str(cs.errors[0])


def test_load_single_file_raises_with_every_problem(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text(
        "name: t\nsource: {table: t, shards: [{conn_id: c, schemas: [s]}]}\nprimary_key: [id]\n"
        "deletes: maybe\nlake: {format_version: 7}\n"
    )
    with pytest.raises(ValueError) as exc:
        load_table_config(p)
    assert "deletes" in str(exc.value) and "lake.format_version" in str(exc.value)


def test_shipped_table_configs_are_valid():
    from cdc_lakehouse.settings import PROJECT_ROOT

    cs = load_table_configs(PROJECT_ROOT / "include" / "tables")
    assert cs.errors == []
    assert {"block", "space", "permission"} <= set(cs.tables)


@pytest.mark.parametrize("bad", ["a b", "1abc", "x;y", 'q"q', "", "a" * 64, "é"])
def test_identifiers_reject_injection(bad):
    with pytest.raises(IdentifierError):
        check_ident(bad)
    with pytest.raises(IdentifierError):
        pg_ident(bad)


def test_quoting():
    assert pg_ident("Block_1") == '"Block_1"'
    assert spark_ident("id") == "`id`"


def test_one_endpoint_in_two_shard_groups_is_rejected():
    """Capture keys its work by endpoint: a second group of the same endpoint hid the first's schemas."""
    src = {"table": "block", "shards": [{"conn_id": "pg_a", "schemas": ["s1"]}, {"conn_id": "pg_a", "schemas": ["s2"]}]}
    cfg, errors = parse(source=src)
    assert cfg is None
    assert "both read endpoint 'pg_a'" in str(errors[0]) and "one group" in str(errors[0])


def test_two_configs_reading_one_source_shard_collide(tmp_path):
    body = "source: {table: t, shards: [{conn_id: c, schemas: [s1, s2]}]}\nprimary_key: [id]\n"
    (tmp_path / "a.yaml").write_text("name: a\n" + body)
    (tmp_path / "b.yaml").write_text(
        "name: b\nsource: {table: t, shards: [{conn_id: c, schemas: [s2]}]}\nprimary_key: [id]\n"
    )
    (tmp_path / "c.yaml").write_text(
        "name: c\nsource: {table: t, shards: [{conn_id: c, schemas: [s3]}]}\nprimary_key: [other]\n"
    )
    (tmp_path / "d.yaml").write_text(
        "name: d\nsource: {table: t, shards: [{conn_id: c, schemas: [s4]}]}\nprimary_key: [id]\n"
    )
    cs = load_table_configs(tmp_path)
    assert sorted(cs.tables) == ["a", "d"]
    text = "\n".join(str(e) for e in cs.errors)
    assert "source table s2.t on endpoint 'c' is already read by table 'a'" in text
    assert "another primary_key" in text
    # Configs that share a source table on disjoint shards are captured together: schemas unite.
    assert cs.endpoint_tables() == {"c": {"t": (["s1", "s2", "s4"], ["id"])}}


@pytest.mark.parametrize("partition_by", [["days(created_at)"], ["space_id"], []])
def test_colocated_merge_needs_a_partitioning_by_key_columns(partition_by):
    """Spark joins partition by partition only on the join key: anything else is refused by name
    when asked for, and auto falls back to the shuffled MERGE."""
    cfg, errors = parse(lake={"partition_by": partition_by}, ingest={"merge_join": "colocated"})
    assert cfg is None and "ingest.merge_join: colocated needs lake.partition_by" in str(errors[0])
    cfg, errors = parse(lake={"partition_by": partition_by})
    assert errors == [] and cfg.ingest.merge_join == "auto" and not cfg.colocatable


def test_default_partitioning_by_shard_is_colocatable():
    cfg, _ = parse()
    assert cfg.colocatable
    cfg, _ = parse(lake={"partition_by": ["_cdc_shard", "id"]}, ingest={"merge_join": "colocated"})
    assert cfg.colocatable
