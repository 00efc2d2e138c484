"""From pgoutput messages to landing events: relations with their lake types, row values, schema diffs."""

from __future__ import annotations

import json
from typing import Any

from cdc_lakehouse.source.catalog import lake_type as source_lake_type
from cdc_lakehouse.source.catalog import schema_json as source_schema_json
from cdc_lakehouse.source.pgoutput import UNCHANGED, Relation, parse_pg_array
from cdc_lakehouse.source.slots import HEARTBEAT_TABLE


class Rel:
    """A relation as the slot describes it, with what the event builder needs precomputed."""

    __slots__ = ("rel", "key", "names", "key_idx", "array_idx", "schema_json", "columns", "heartbeat")

    def __init__(self, rel: Relation, type_lookup):
        self.rel = rel
        self.key = f"{rel.schema}.{rel.name}"
        self.names = rel.names
        self.heartbeat = rel.name == HEARTBEAT_TABLE
        self.columns: list[dict[str, Any]] = []
        self.array_idx: set[int] = set()
        for i, c in enumerate(rel.columns):
            fmt, typtype, base = type_lookup(c.type_oid, c.typmod)
            lt = source_lake_type(base, "b") if typtype == "d" else source_lake_type(fmt, typtype)
            if lt and lt.startswith("array<"):
                self.array_idx.add(i)
            self.columns.append({"name": c.name, "type": fmt, "lake_type": lt, "key": c.is_key})
        self.key_idx = [i for i, c in enumerate(rel.columns) if c.is_key]
        self.schema_json = source_schema_json(self.columns)


def row_pairs(rel: Rel, values: list) -> tuple[list, list | None]:
    """Values -> (after as (name, text) pairs, unavailable column names or None)."""
    names = rel.names
    # The common case (no arrays, no unchanged TOAST values) costs one zip per event.
    if not rel.array_idx and UNCHANGED not in values:
        return list(zip(names, values)), None
    out, unavailable = [], []
    for i, v in enumerate(values):
        if v is UNCHANGED:
            unavailable.append(names[i])
            continue
        if i in rel.array_idx and v is not None:
            try:
                text = json.dumps(parse_pg_array(v), separators=(",", ":"))
            except ValueError as exc:
                # Keep the raw text; the ingest quarantines it with this reason.
                text = "\x00unparseable-array:" + str(exc) + ":" + v
            out.append((names[i], text))
            continue
        out.append((names[i], v))
    return out, (unavailable or None)


def key_pairs(rel: Rel, values: list, only_key: bool) -> list:
    if only_key:
        return [(rel.names[i], values[i]) for i in rel.key_idx]
    return [(n, v) for n, v in zip(rel.names, values) if v is not UNCHANGED]


def schema_diff(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> dict[str, list] | None:
    before = {c["name"]: c["type"] for c in old}
    after = {c["name"]: c["type"] for c in new}
    added = [n for n in after if n not in before]
    dropped = [n for n in before if n not in after]
    retyped = [{"column": n, "from": before[n], "to": after[n]} for n in after if n in before and before[n] != after[n]]
    if added or dropped or retyped:
        return {"added": added, "dropped": dropped, "retyped": retyped}
    return None
