"""From pgoutput messages to landing events: relations with their lake types and landing types, row
values, schema diffs."""

from __future__ import annotations

from cdc_lakehouse.landing.format import arrow_type
from cdc_lakehouse.landing.writer import ImageColumns
from cdc_lakehouse.source.catalog import SchemaColumn
from cdc_lakehouse.source.catalog import lake_type as source_lake_type
from cdc_lakehouse.source.catalog import schema_json as source_schema_json
from cdc_lakehouse.source.pgoutput import UNCHANGED, Relation
from cdc_lakehouse.source.slots import HEARTBEAT_TABLE


class Rel:
    """A relation as the slot describes it, with what the event builder needs precomputed: its
    columns (with their lake types) and how its images land (landing.writer.ImageColumns)."""

    __slots__ = ("rel", "key", "names", "key_idx", "schema_json", "columns", "heartbeat", "image")

    def __init__(self, rel: Relation, type_lookup, column_types: dict[str, str] | None = None):
        self.rel = rel
        self.key = f"{rel.schema}.{rel.name}"
        self.names = rel.names
        self.heartbeat = rel.name == HEARTBEAT_TABLE
        self.columns: list[SchemaColumn] = []
        for c in rel.columns:
            fmt, typtype, base = type_lookup(c.type_oid, c.typmod)
            lt = source_lake_type(base, "b") if typtype == "d" else source_lake_type(fmt, typtype)
            self.columns.append(SchemaColumn(name=c.name, type=fmt, lake_type=lt, key=c.is_key))
        self.key_idx = [i for i, c in enumerate(rel.columns) if c.is_key]
        self.schema_json = source_schema_json(self.columns)
        overrides = column_types or {}
        landed = tuple((c["name"], landing_type(c["lake_type"], overrides.get(c["name"]))) for c in self.columns)
        self.image = ImageColumns(landed, self.schema_json)


def landing_type(lake_type: str | None, override: str | None) -> str:
    """The type a column's values land as: the table config's column_types if it names one (so
    a column read as string keeps PostgreSQL's text), else the lake type of its PostgreSQL type;
    text when neither is a type the landing can hold (the ingest's column_types then decides)."""
    for t in (override, lake_type):
        if t:
            try:
                arrow_type(t)
            except ValueError:
                return "string"
            return t
    return "string"


def row_values(values: list) -> tuple[list, list[int] | None]:
    """A new row's values as the writer takes them: unchanged TOAST values (pgoutput's 'u') become
    None and their positions are returned (None when there are none: the common case costs one
    scan of the list)."""
    if UNCHANGED not in values:
        return values, None
    out = list(values)
    missing = [i for i, v in enumerate(values) if v is UNCHANGED]
    for i in missing:
        out[i] = None
    return out, missing


def old_values(rel: Rel, values: list, only_key: bool) -> list:
    """An old row (a delete's, or an update's when the key changed or REPLICA IDENTITY is FULL):
    only the key columns when only_key, never an unchanged TOAST marker."""
    if only_key:
        out: list = [None] * len(values)
        for i in rel.key_idx:
            out[i] = values[i]
        return out
    return [None if v is UNCHANGED else v for v in values]


def schema_diff(old: list[SchemaColumn], new: list[SchemaColumn]) -> dict[str, list] | None:
    before = {c["name"]: c["type"] for c in old}
    after = {c["name"]: c["type"] for c in new}
    added = [n for n in after if n not in before]
    dropped = [n for n in before if n not in after]
    retyped = [{"column": n, "from": before[n], "to": after[n]} for n in after if n in before and before[n] != after[n]]
    if added or dropped or retyped:
        return {"added": added, "dropped": dropped, "retyped": retyped}
    return None
