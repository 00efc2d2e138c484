"""Serving exports: one YAML file per export under include/exports/, validated into ExportConfig.

An export copies a lake table (a table's current rows or its latest-per-key view, a derived
table, or any Iceberg table) into a key-value store's namespace (docs/serving-export.md).

Pure Python: DAG files read it at parse time. Errors name the file, the field and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from cdc_lakehouse.columns import SHARD_COL
from cdc_lakehouse.config import ConfigError, TableConfig, _Model, validation_errors, yaml_files
from cdc_lakehouse.derived.config import TreeConfig
from cdc_lakehouse.identifiers import check_ident, check_lake_ident
from cdc_lakehouse.lake.holds import DEFAULT_MAX_LAG_HOURS

REFERENCE = "docs/serving-export.md"


class ExportSource(_Model):
    """Exactly one of: `table` (a table config's current rows, or with `read: latest` its
    latest-per-key view), `derived` (a derived table) or `lake_table` (any `namespace.table`)."""

    table: str | None = None
    read: Literal["current", "latest"] = "current"
    derived: str | None = None
    lake_table: str | None = None

    @model_validator(mode="after")
    def _one(self) -> ExportSource:
        given = [k for k in ("table", "derived", "lake_table") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"name exactly one of table, derived, lake_table (given: {given or 'none'})")
        if self.lake_table:
            ns, _, name = self.lake_table.partition(".")
            check_lake_ident(ns, "lake namespace")
            check_lake_ident(name, "lake table")
        return self


class ExportStore(_Model):
    kind: Literal["redis", "dynamodb"] = "redis"
    conn_id: str = Field("cdc_redis", description="Airflow connection of the store (its URI is a secret)")
    namespace: str = Field(description="readers name this; versions live under it")
    buckets: int = Field(64, ge=1, le=65536, description="redis: hashes per version (HLEN counts, UNLINK drops)")
    table_prefix: str = Field("", description="dynamodb: prefix of the control and version tables")

    @field_validator("namespace")
    @classmethod
    def _ns(cls, v: str) -> str:
        return check_lake_ident(v, "store namespace")

    @field_validator("conn_id")
    @classmethod
    def _conn(cls, v: str) -> str:
        return check_ident(v, "connection id")


class ExportConfig(_Model):
    name: str = Field(description="the export's id: its DAG id and pool derive from it")
    description: str = ""
    owner: str = "data-platform"
    tags: list[str] = Field(default_factory=list)
    source: ExportSource
    key: list[str] | None = Field(None, description="key columns; default: the source's lake key")
    values: list[str] | None = Field(None, description="value columns; default: every column but the key and _cdc_*")
    encoding: Literal["avro"] = "avro"
    store: ExportStore
    schedule: str | None = Field(None, description="cron or preset; default: when the source table changes")
    keep_versions: int = Field(2, ge=1, le=100, description="complete versions kept, the current one included")
    validate_sample: int = Field(100, ge=0, le=100000, description="rows compared value by value after a full export")
    retries: int = Field(2, ge=0, le=10)
    max_lag_hours: int = Field(
        DEFAULT_MAX_LAG_HOURS,
        ge=1,
        le=24 * 366,
        description="how long the source keeps the exported and pending snapshots (lake.holds); past it, an "
        "incremental run fails and asks for mode=full",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_lake_ident(v, "export name")

    @field_validator("key", "values")
    @classmethod
    def _cols(cls, v: list[str] | None) -> list[str] | None:
        for c in v or []:
            check_ident(c, "column")
        return v

    @property
    def pool(self) -> str:
        return f"cdc_export__{self.name}"


@dataclass(frozen=True)
class ResolvedSource:
    """What the export reads: a catalog-less table name, its default key and the table it is keyed like."""

    table: str
    default_key: list[str] | None
    table_cfg: TableConfig | None = None  # set for table sources (soft deletes are filtered)


def resolve_source(
    ecfg: ExportConfig, tables: dict[str, TableConfig], derived: dict[str, TreeConfig]
) -> ResolvedSource:
    s = ecfg.source
    if s.table:
        cfg = tables[s.table]
        return ResolvedSource(cfg.current_table if s.read == "current" else cfg.latest_view, cfg.lake_key, cfg)
    if s.derived:
        d = derived[s.derived]
        return ResolvedSource(d.output_table, [SHARD_COL, d.nodes.id])
    assert s.lake_table is not None  # ExportSource names exactly one of table, derived, lake_table
    return ResolvedSource(s.lake_table, None)


@dataclass
class ExportSet:
    exports: dict[str, ExportConfig]
    errors: list[ConfigError]
    files: dict[str, str]


def _check_refs(
    e: ExportConfig, tables: dict[str, TableConfig], derived: dict[str, TreeConfig], file: str
) -> list[ConfigError]:
    errs = []
    if e.source.table and e.source.table not in tables:
        errs.append(ConfigError(file, "source.table", f"{e.source.table!r} is not a configured table", "name one"))
    if e.source.derived and e.source.derived not in derived:
        errs.append(ConfigError(file, "source.derived", f"{e.source.derived!r} is not a derived table", "name one"))
    if e.source.lake_table and not e.key:
        errs.append(ConfigError(file, "key", "a lake_table source has no default key", "list its key columns"))
    if e.source.table and e.source.read == "latest" and tables.get(e.source.table):
        if tables[e.source.table].maintenance.latest_view != "table":
            # An Iceberg view has no snapshots: nothing to export a position of, nor to diff.
            errs.append(
                ConfigError(
                    file,
                    "source.read",
                    "`latest` needs the latest view materialized as a table",
                    "set maintenance.latest_view: table in the table's config, or read: current",
                )
            )
    return errs


def parse_export_config(
    data: Any, file: str, tables: dict[str, TableConfig], derived: dict[str, TreeConfig]
) -> tuple[ExportConfig | None, list[ConfigError]]:
    if not isinstance(data, dict):
        return None, [ConfigError(file, "<root>", "the file is not a YAML mapping", "write `name: ...` at top level")]
    try:
        e = ExportConfig.model_validate(data)
    except ValidationError as exc:
        return None, validation_errors(exc, file, reference=REFERENCE)
    errs = _check_refs(e, tables, derived, file)
    return (None, errs) if errs else (e, [])


def load_export_configs(
    directory: str | Path, tables: dict[str, TableConfig], derived: dict[str, TreeConfig]
) -> ExportSet:
    """Every *.yaml under directory (none if it does not exist); errors collected, never raised."""
    out = ExportSet({}, [], {})
    namespaces: dict[tuple[str, str, str], str] = {}
    for path, data in yaml_files(directory, out.errors):
        e, errs = parse_export_config(data, path, tables, derived)
        out.errors.extend(errs)
        if e is None:
            continue
        target = (e.store.kind, e.store.conn_id, e.store.namespace)
        if e.name in out.exports or target in namespaces:
            other = out.files.get(e.name) or namespaces[target]
            out.errors.append(
                ConfigError(path, "name", f"name or store namespace already used in {other}", "make both unique")
            )
            continue
        out.exports[e.name], out.files[e.name], namespaces[target] = e, path, path
    return out
