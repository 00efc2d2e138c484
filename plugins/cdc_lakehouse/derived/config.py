"""Derived tables: one YAML file per output under include/derived/, validated into typed objects.

A derived table reads current lake tables (never the source) and writes an Iceberg table of its
own with its own watermark. The first kind is `tree`: per node of a parent-linked table, its
root, depth, ancestor path and effective permissions (docs/derived-trees.md).

Pure Python: DAG files reach it at parse time. Errors name the file, the field and the fix, as
the table configs' do (config.ConfigError); a derived file whose inputs are not configured tables
is an error, not a DAG that waits forever.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from cdc_lakehouse.config import (
    ConfigError,
    OutputMaintenanceConfig,
    TableConfig,
    _Model,
    validation_errors,
    yaml_files,
)
from cdc_lakehouse.identifiers import check_ident, check_lake_ident
from cdc_lakehouse.lake.holds import DEFAULT_MAX_LAG_HOURS


class TreeNodes(_Model):
    """The parent-linked table: `id` is its (single-column) primary key, `parent` names the parent's id."""

    table: str = Field(description="name of the table config holding the nodes (e.g. block)")
    id: str = "id"
    parent: str = "parent_id"
    root_attribute: str | None = Field(
        None, description="a column of the root node copied to every node (e.g. space_id: the workspace)"
    )

    @field_validator("id", "parent", "root_attribute")
    @classmethod
    def _col(cls, v: str | None) -> str | None:
        return None if v is None else check_ident(v, "column")


class TreeGrants(_Model):
    """Explicit grants: one row per (node, principal) with a grant value (e.g. permission)."""

    table: str = Field(description="name of the table config holding the grants")
    node: str = Field("block_id", description="column naming the node the grant is on")
    principal: str = Field("user_id", description="column naming who is granted")
    grant: str = Field("role", description="column holding what is granted")

    @field_validator("node", "principal", "grant")
    @classmethod
    def _col(cls, v: str) -> str:
        return check_ident(v, "column")


class DerivedLake(_Model):
    namespace: str = "derived"

    @field_validator("namespace")
    @classmethod
    def _ns(cls, v: str) -> str:
        return check_lake_ident(v, "lake namespace")


class TreeConfig(_Model):
    name: str = Field(description="the output's id: DAG id and lake table names derive from it")
    kind: Literal["tree"] = "tree"
    description: str = ""
    owner: str = "data-platform"
    tags: list[str] = Field(default_factory=list, description="extra Airflow tags of its DAG")
    nodes: TreeNodes
    grants: TreeGrants | None = None
    lake: DerivedLake = DerivedLake()
    # Notion's blocks go "from a few to dozens" deep; deeper chains are refused with a reason.
    max_depth: int = Field(128, ge=1, le=4096, description="deeper nodes are unresolved, not truncated")
    retries: int = Field(2, ge=0, le=10)
    # Its output and unresolved tables: compaction (deletes applied), expiry, orphans (cdc_maintenance__<name>).
    maintenance: OutputMaintenanceConfig = OutputMaintenanceConfig()
    max_lag_hours: int = Field(
        DEFAULT_MAX_LAG_HOURS,
        ge=1,
        le=24 * 366,
        description="how long its inputs keep the snapshots it read last (lake.holds); past it, an "
        "incremental run fails and asks for mode=full",
    )

    read_at: Literal["point", "current"] = Field(
        "point",
        description="point: both inputs at their endpoint's newest consistent point (lake.points), so no "
        "source transaction that wrote both is seen in half; each at its current snapshot while they "
        "have none (inputs on several endpoints, or not yet met after a bootstrap). current: always "
        "each input's current snapshot (fresher, without that promise)",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_lake_ident(v, "derived table name")

    @property
    def output_table(self) -> str:
        return f"{self.lake.namespace}.{self.name}"

    @property
    def unresolved_table(self) -> str:
        """Nodes that cannot be placed yet (cycle, missing parent, too deep), with the reason."""
        return f"{self.lake.namespace}.{self.name}__unresolved"

    @property
    def pool(self) -> str:
        """Its own one-slot Airflow pool: runs never overlap, and never wait on the inputs' writers."""
        return f"cdc_derived__{self.name}"

    @property
    def input_names(self) -> list[str]:
        return [self.nodes.table] + ([self.grants.table] if self.grants else [])


@dataclass
class DerivedSet:
    derived: dict[str, TreeConfig]
    errors: list[ConfigError]
    files: dict[str, str]


def _check_inputs(cfg: TreeConfig, tables: dict[str, TableConfig], file: str) -> list[ConfigError]:
    errors = []
    for where, name in [("nodes.table", cfg.nodes.table)] + (
        [("grants.table", cfg.grants.table)] if cfg.grants else []
    ):
        if name not in tables:
            errors.append(
                ConfigError(
                    file,
                    where,
                    f"{name!r} is not a configured table (known: {sorted(tables)})",
                    "name the `name` of a file in include/tables/, or add that table",
                )
            )
    node_cfg = tables.get(cfg.nodes.table)
    if node_cfg is not None and node_cfg.primary_key != [cfg.nodes.id]:
        errors.append(
            ConfigError(
                file,
                "nodes.id",
                f"table {node_cfg.name!r} has primary key {node_cfg.primary_key}, not [{cfg.nodes.id!r}]",
                "a tree's nodes need a single-column key: set nodes.id to it",
            )
        )
    return errors


def parse_derived_config(
    data: Any, file: str, tables: dict[str, TableConfig]
) -> tuple[TreeConfig | None, list[ConfigError]]:
    if not isinstance(data, dict):
        return None, [ConfigError(file, "<root>", "the file is not a YAML mapping", "write `name: ...` at top level")]
    try:
        cfg = TreeConfig.model_validate(data)
    except ValidationError as exc:
        return None, validation_errors(exc, file, reference="docs/derived-trees.md")
    errors = _check_inputs(cfg, tables, file)
    return (None, errors) if errors else (cfg, [])


def load_derived_configs(directory: str | Path, tables: dict[str, TableConfig]) -> DerivedSet:
    """Every *.yaml under directory (none if it does not exist); errors collected, never raised."""
    out = DerivedSet({}, [], {})
    for path, data in yaml_files(directory, out.errors):
        cfg, errs = parse_derived_config(data, path, tables)
        out.errors.extend(errs)
        if cfg is None:
            continue
        if cfg.name in out.derived or cfg.name in tables:
            other = out.files.get(cfg.name, "include/tables/")
            out.errors.append(
                ConfigError(path, "name", f"{cfg.name!r} is already defined in {other}", "use a unique name")
            )
            continue
        out.derived[cfg.name] = cfg
        out.files[cfg.name] = path
    return out
