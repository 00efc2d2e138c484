"""Derived table configs (include/derived/*.yaml): typed objects, and errors that name the file,
the field and the fix, as the table configs' do."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from cdc_lakehouse.config import load_table_configs, parse_table_config
from cdc_lakehouse.derived.config import load_derived_configs, parse_derived_config

ROOT = Path(__file__).resolve().parents[2]
FILE = "include/derived/tree.yaml"


def _table(name: str, key: list[str]):
    cfg, errors = parse_table_config(
        {
            "name": name,
            "source": {"table": name, "shards": [{"conn_id": "pg_a", "schemas": ["s1"]}]},
            "primary_key": key,
            "lake": {"namespace": "notion"},
        },
        f"include/tables/{name}.yaml",
    )
    assert not errors, errors
    return cfg


TABLES = {"block": _table("block", ["id"]), "permission": _table("permission", ["block_id", "user_id"])}
BASE = {
    "name": "block_tree",
    "nodes": {"table": "block", "root_attribute": "space_id"},
    "grants": {"table": "permission"},
}


def parse(**changes):
    return parse_derived_config({**BASE, **changes}, FILE, TABLES)


def _text(errors) -> str:
    return "\n".join(str(e) for e in errors)


def test_the_demo_tree_loads_against_the_demo_tables():
    cs = load_table_configs(ROOT / "include" / "tables")
    ds = load_derived_configs(ROOT / "include" / "derived", cs.tables)
    assert ds.errors == []
    cfg = ds.derived["block_tree"]
    assert ds.files["block_tree"].endswith("include/derived/block_tree.yaml")
    assert (cfg.nodes.table, cfg.nodes.id, cfg.nodes.parent, cfg.nodes.root_attribute) == (
        "block",
        "id",
        "parent_id",
        "space_id",
    )
    assert cfg.grants is not None
    assert (cfg.grants.table, cfg.grants.node, cfg.grants.principal, cfg.grants.grant) == (
        "permission",
        "block_id",
        "user_id",
        "role",
    )
    assert cfg.output_table == "derived.block_tree"
    assert cfg.unresolved_table == "derived.block_tree__unresolved"
    assert cfg.input_names == ["block", "permission"]
    assert cfg.pool == "cdc_derived__block_tree"
    assert "notion" in cfg.tags


def test_defaults():
    cfg, errors = parse(grants=None)
    assert errors == []
    assert cfg.kind == "tree" and cfg.grants is None and cfg.input_names == ["block"]
    assert cfg.lake.namespace == "derived" and cfg.max_depth == 128 and cfg.retries == 2
    assert (cfg.nodes.id, cfg.nodes.parent) == ("id", "parent_id")


@pytest.mark.parametrize(
    ("changes", "field", "fragment"),
    [
        ({"name": "Block-Tree"}, "name", "lower-case"),
        ({"nodes": {"table": "block", "parent": "parent_id; DROP TABLE x"}}, "nodes.parent", "not a valid identifier"),
        ({"grants": {"table": "permission", "principal": "user id"}}, "grants.principal", "not a valid identifier"),
        ({"lake": {"namespace": "Derived"}}, "lake.namespace", "lower-case"),
        ({"kind": "graph"}, "kind", "'tree'"),
        ({"max_depth": 0}, "max_depth", "greater than or equal to 1"),
    ],
)
def test_bad_values_name_file_field_and_fix(changes, field, fragment):
    cfg, errors = parse(**changes)
    assert cfg is None and errors
    text = _text(errors)
    assert FILE in text and fragment in text, text
    assert any(e.field == field for e in errors), text
    assert all(e.fix for e in errors)


def test_a_wrong_key_is_an_error_not_a_default():
    cfg, errors = parse(nodes={"table": "block", "parnet": "parent_id"})
    assert cfg is None
    (err,) = errors
    assert err.field == "nodes.parnet" and "Extra inputs" in err.message
    assert "spelling" in err.fix and "docs/derived-trees.md" in err.fix


@pytest.mark.parametrize(
    ("where", "changes"),
    [("nodes.table", {"nodes": {"table": "blocks"}}), ("grants.table", {"grants": {"table": "perm"}})],
)
def test_an_unknown_input_table_is_an_error(where, changes):
    cfg, errors = parse(**changes)
    assert cfg is None
    (err,) = errors
    assert err.field == where and err.file == FILE
    assert "is not a configured table" in err.message and "block" in err.message  # lists the known ones
    assert "include/tables/" in err.fix


def test_nodes_need_a_single_column_key():
    cfg, errors = parse(nodes={"table": "permission", "id": "block_id", "parent": "user_id"})
    assert cfg is None
    (err,) = errors
    assert err.field == "nodes.id" and "['block_id', 'user_id']" in err.message and "single-column" in err.fix


def _write(d: Path, name: str, body: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(textwrap.dedent(body))


def test_duplicate_names_are_errors_and_the_first_file_wins(tmp_path):
    body = """
        name: block_tree
        nodes: {table: block}
    """
    _write(tmp_path, "a.yaml", body)
    _write(tmp_path, "b.yaml", body)
    _write(tmp_path, "c.yaml", "name: block\nnodes: {table: block}\n")  # a table's name
    ds = load_derived_configs(tmp_path, TABLES)
    assert sorted(ds.derived) == ["block_tree"] and ds.files["block_tree"].endswith("a.yaml")
    text = _text(ds.errors)
    assert len(ds.errors) == 2, text
    assert "b.yaml: field 'name'" in text and "already defined in" in text and str(tmp_path / "a.yaml") in text
    assert "c.yaml: field 'name'" in text and "Fix: use a unique name" in text


def test_one_broken_file_does_not_hide_the_others(tmp_path):
    _write(tmp_path, "good.yaml", "name: good_tree\nnodes: {table: block}\n")
    _write(tmp_path, "syntax.yaml", "name: [unclosed\n")
    _write(tmp_path, "list.yaml", "- name: x\n")
    ds = load_derived_configs(tmp_path, TABLES)
    assert list(ds.derived) == ["good_tree"]
    by_file = {Path(e.file).name: e for e in ds.errors}
    assert set(by_file) == {"syntax.yaml", "list.yaml"}
    assert by_file["syntax.yaml"].field.startswith("line ") and "YAML" in by_file["syntax.yaml"].message
    assert by_file["list.yaml"].field == "<root>" and by_file["list.yaml"].fix


def test_a_missing_directory_means_no_derived_tables(tmp_path):
    ds = load_derived_configs(tmp_path / "absent", TABLES)
    assert (ds.derived, ds.errors, ds.files) == ({}, [], {})


def test_derived_dir_follows_its_variable_or_sits_next_to_the_tables(monkeypatch, tmp_path):
    from cdc_lakehouse.settings import derived_dir

    monkeypatch.delenv("CDC_DERIVED_DIR", raising=False)
    monkeypatch.delenv("CDC_TABLES_DIR", raising=False)
    assert derived_dir(tmp_path) == tmp_path / "include" / "derived"
    monkeypatch.setenv("CDC_TABLES_DIR", str(tmp_path / "conf" / "tables"))
    assert derived_dir() == tmp_path / "conf" / "derived"
    monkeypatch.setenv("CDC_DERIVED_DIR", str(tmp_path / "elsewhere"))
    assert derived_dir() == tmp_path / "elsewhere"


def test_the_derive_job_refuses_an_unknown_name_before_spark_starts(tmp_path, monkeypatch):
    from cdc_lakehouse.jobs.registry import run_job

    monkeypatch.delenv("CDC_SECRETS_FILE", raising=False)
    _write(tmp_path / "derived", "bad.yaml", "name: bad_tree\nnodes: {table: nope}\n")
    argv = ["--derived", "bad_tree", "--config-dir", str(ROOT / "include" / "tables")]
    with pytest.raises(SystemExit) as exc:
        run_job("derive", [*argv, "--derived-dir", str(tmp_path / "derived"), "--mode", "full"])
    text = str(exc.value)
    assert "['bad_tree'] not found or invalid" in text and "bad.yaml: field 'nodes.table'" in text
