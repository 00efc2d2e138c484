"""The demo's summary of a derived tree: its unresolved nodes are counted by reason."""

from __future__ import annotations

from types import SimpleNamespace

import pyarrow as pa

from devstack.demo import _tree_lines, unresolved_text


class _Catalog:
    """pyiceberg's load_table(...).scan(...).to_arrow(), over given Arrow tables."""

    def __init__(self, tables: dict[str, pa.Table]):
        self.tables = tables

    def load_table(self, name: str):
        table = self.tables[name]
        return SimpleNamespace(scan=lambda selected_fields: SimpleNamespace(to_arrow=lambda: table))


def test_the_tree_summary_prints_unresolved_counts_by_reason():
    dcfg = SimpleNamespace(
        name="block_tree", output_table="out", unresolved_table="unres", nodes=SimpleNamespace(id="id")
    )
    grants = pa.list_(pa.struct([("principal", pa.int64()), ("grant", pa.string()), ("granted_on", pa.int64())]))
    out = pa.table(
        {
            "_cdc_shard": ["s0", "s0"],
            "id": [1, 2],
            "depth": [0, 1],
            "path": pa.array([[], [1]], pa.list_(pa.int64())),
            "grants": pa.array([[], []], grants),
        }
    )
    unresolved = pa.table({"reason": ["missing_parent", "cycle", "missing_parent"]})
    lines = _tree_lines(_Catalog({"out": out, "unres": unresolved}), dcfg)
    assert lines == ["derived block_tree: 2 nodes resolved, max depth 1; 3 unresolved: cycle 1, missing_parent 2"]
    assert unresolved_text({}) == "0 unresolved"
