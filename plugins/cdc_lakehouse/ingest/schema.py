"""Schema evolution: the events' schemas (from the capture's relation messages) against the lake
table. Additive changes become DDL run before the data; anything the table cannot take in place
stops the table with the choices spelled out."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NoReturn

from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.identifiers import spark_ident
from cdc_lakehouse.ingest.errors import DropDecisionNeeded
from cdc_lakehouse.lake.tables import add_column, alter_table, sql_string
from cdc_lakehouse.landing.reader import Plan
from cdc_lakehouse.source.catalog import SchemaColumn

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from cdc_lakehouse.watermark import Watermark

log = logging.getLogger(__name__)

WIDENINGS = {("int", "bigint"), ("float", "double")}

# Keep/drop choices made in Airflow's UI for source columns dropped with no
# schema_changes.dropped_columns entry (DropDecisions), a property of the current table.
DROP_DECISIONS_PROP = "cdc.dropped-columns"
DropChoice = Literal["keep_null", "drop"]
DROP_CHOICES: tuple[DropChoice, ...] = ("keep_null", "drop")


@dataclass
class DropDecisions:
    """The table's keep/drop decisions for dropped source columns, made in the ingest DAG's
    `decide_dropped` approval; the YAML's schema_changes.dropped_columns wins over them. `pending`:
    the columns an ingest found dropped and undecided, with the shards that dropped them."""

    decided: dict[str, DropChoice] = field(default_factory=dict)
    pending: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def from_json(cls, text: str | None) -> DropDecisions:
        data = json.loads(text) if text else {}
        return cls(dict(data.get("decided", {})), {c: list(s) for c, s in data.get("pending", {}).items()})

    def to_json(self) -> str:
        return json.dumps({"decided": self.decided, "pending": self.pending}, sort_keys=True)

    def decide(self, choice: str) -> DropDecisions:
        """Every pending column decided `choice` (an answer as the approval returns it, checked)."""
        if choice not in DROP_CHOICES:
            raise ValueError(f"a dropped column is kept (keep_null) or dropped (drop), not {choice!r}")
        return DropDecisions({**self.decided, **dict.fromkeys(self.pending, choice)}, {})


class UndecidedDrop(str):
    """An error of schema_actions: a lake column gone from a shard, with no decision."""

    column: str
    shard: str

    def __new__(cls, text: str, column: str, shard: str) -> UndecidedDrop:
        made = super().__new__(cls, text)
        made.column, made.shard = column, shard
        return made


# A relation's columns as the capture records them (source.catalog.schema_json).
SchemaJson = list[SchemaColumn]


def manifest_schemas(plan: Plan, cfg: TableConfig) -> tuple[list[SchemaJson], dict[str, SchemaJson]]:
    """The table's schemas as the capture saw them (relation messages), from the runs' manifests:
    every schema of the batch, and the latest per shard. No scan of the events is needed."""
    all_schemas: dict[str, SchemaJson] = {}
    latest: dict[str, SchemaJson] = {}
    for m in plan.manifests:
        for key, cols in m.schemas.items():
            schema, _, table = key.rpartition(".")
            if table != cfg.source.table:
                continue
            all_schemas.setdefault(json.dumps(cols, sort_keys=True), cols)
            latest[schema] = cols
    return list(all_schemas.values()), latest


def known_columns(cfg: TableConfig, wm: Watermark, plan: Plan | None) -> dict[str, set[str]]:
    """Per shard schema, the columns the shard is known to have had (its watermark), for
    schema_actions' drop check. With `plan`, a shard that announced no schema in the batch (no
    relation message: the manifests carry its schema over from earlier runs) has none: that
    schema may predate what the watermark knows (a re-bootstrap read the shard's newer columns),
    so it shows no drop. A drop is announced by the relation message of the shard's next change."""
    announced = {(c.endpoint, c.change.table.rpartition(".")[0]) for c in (plan.schema_changes if plan else [])}
    out = {}
    for group, schema, shard in cfg.shards():
        pos = wm.shards.get(shard)
        if pos is not None and pos.columns is not None:
            seen = plan is None or (group.endpoint_id, schema) in announced
            out[schema] = set(pos.columns) if seen else set()
    return out


def event_schemas(raw: DataFrame) -> tuple[list[SchemaJson], dict[str, SchemaJson]]:
    """All distinct event schemas, and the latest schema per source shard schema."""
    from pyspark.sql import functions as F

    rows = (
        raw.groupBy(F.col("source.schema").alias("s"))
        .agg(
            F.max_by("table_schema", F.struct("source.commit_lsn", "source.seq")).alias("latest"),
            F.collect_set("table_schema").alias("all"),
        )
        .collect()
    )
    all_schemas: dict[str, SchemaJson] = {}
    latest: dict[str, SchemaJson] = {}
    for r in rows:
        if r["latest"]:
            latest[r["s"]] = json.loads(r["latest"])
        for s in r["all"] or []:
            all_schemas.setdefault(s, json.loads(s))
    return list(all_schemas.values()), latest


def _dec(t: str) -> tuple[int, int] | None:
    m = re.match(r"^decimal\((\d+),\s*(\d+)\)$", t)
    return (int(m.group(1)), int(m.group(2))) if m else None


def schema_actions(
    cfg: TableConfig,
    lake_cols: list[tuple[str, str]],
    schemas: list[SchemaJson],
    latest: dict[str, SchemaJson],
    file_hint: str = "",
    known: dict[str, set[str]] | None = None,
    decided: Mapping[str, str] | None = None,
) -> tuple[list[str], list[str]]:
    """DDL to run before the data (additive changes) and the errors that stop the table.

    `known`: per shard schema, the columns the shard is known to have had (its watermark). A lake
    column missing from a shard's latest schema is dropped there only if the shard had it: a shard
    with no writes since a column was added elsewhere still shows its older schema. `decided`: the
    table's DropDecisions (the YAML's dropped_columns wins); a drop without either is an
    UndecidedDrop among the errors."""
    lake = dict(lake_cols)
    where = file_hint or f"include/tables/{cfg.name}.yaml"
    # Consumed columns (columns.include/exclude): changes to the others never reach the table.
    schemas = [consumed_schema(cfg, sch) for sch in schemas]
    latest = {k: consumed_schema(cfg, sch) for k, sch in latest.items()}
    ddl, errors, added = _new_and_changed(cfg, lake, schemas, where)
    for shard_schema, sch in latest.items():
        names = {c["name"] for c in sch}
        had = (known or {}).get(shard_schema)
        for name in lake:
            # A lake column the table stopped consuming is gone for it, as if dropped: decided the
            # same way (dropped_columns), never silently NULL.
            consumed = cfg.columns.consumes(name)
            if consumed and (name in names or name in added or (had is not None and name not in had)):
                continue
            stmt, error = _dropped(cfg, name, shard_schema, where, consumed, decided or {})
            if error:
                errors.append(error)
            elif stmt and stmt not in ddl:
                ddl.append(stmt)
    return ddl, sorted(set(errors))


def consumed_schema(cfg: TableConfig, sch: SchemaJson) -> SchemaJson:
    """A relation's columns (capture's schema JSON) that the table consumes."""
    return sch if cfg.columns.all else [c for c in sch if cfg.columns.consumes(c["name"])]


def _new_and_changed(
    cfg: TableConfig, lake: dict[str, str], schemas: list[SchemaJson], where: str
) -> tuple[list[str], list[str], set[str]]:
    """DDL and errors for columns new to the lake or of another type; `lake` takes the widenings.
    Also returns the names of the new columns."""
    ddl: list[str] = []
    errors: list[str] = []
    added: set[str] = set()
    for sch in schemas:
        for c in sch:
            name = c["name"]
            want = cfg.column_types.get(name) or c.get("lake_type")
            if name not in lake:
                if name in added:
                    continue
                added.add(name)
                if error := _added_error(cfg, c, want, where):
                    errors.append(error)
                else:
                    ddl.append(f"ADD COLUMN {spark_ident(name)} {want}")
            elif want and lake[name] != want:
                if _fits(want, lake[name]):
                    # The lake is wider already (another shard widened first, or column_types):
                    # this shard's values fit as they are. Shards widen at different times.
                    continue
                if _widens(cfg, lake[name], want):
                    ddl.append(f"ALTER COLUMN {spark_ident(name)} TYPE {want}")
                    lake[name] = want
                else:
                    errors.append(
                        f"{cfg.name}: source column {name!r} changed type from {lake[name]} to {want} ({c.get('type')}), "
                        "which the lake table cannot take in place. Choose: set column_types: "
                        f"{{{name}: {lake[name]}}} in {where} if the values still fit (values that do not are "
                        "quarantined), or re-bootstrap the table after setting the new type"
                    )
    return ddl, errors, added


def _added_error(cfg: TableConfig, c: SchemaColumn, want: str | None, where: str) -> str | None:
    name = c["name"]
    if not want:
        return (
            f"{cfg.name}: new source column {name!r} has unsupported type {c.get('type')!r}; "
            f"set column_types: {{{name}: string}} in {where}"
        )
    if cfg.schema_changes.mode == "strict":
        return (
            f"{cfg.name}: source column {name!r} ({c.get('type')}) was added and the table's "
            f"schema_changes.mode is strict; set it to additive in {where}, or re-bootstrap"
        )
    return None


def _fits(narrow: str, wide: str) -> bool:
    """Every value of `narrow` is one of `wide`, as Iceberg widens (int -> bigint, float ->
    double, a decimal of the same scale and more precision)."""
    nd, wd = _dec(narrow), _dec(wide)
    return (narrow, wide) in WIDENINGS or bool(nd and wd and wd[1] == nd[1] and wd[0] > nd[0])


def _widens(cfg: TableConfig, old: str, new: str) -> bool:
    """A type change Iceberg takes in place (`_fits`), and the table accepts additive changes."""
    return _fits(old, new) and cfg.schema_changes.mode == "additive"


def _dropped(
    cfg: TableConfig, name: str, shard_schema: str, where: str, consumed: bool, decided: Mapping[str, str]
) -> tuple[str | None, str | None]:
    """A lake column gone from a shard's schema (or no longer consumed): (DDL, None), (None, error)
    or (None, None) to keep it."""
    policy = cfg.schema_changes.dropped_columns.get(name) or decided.get(name)
    if name in cfg.primary_key:
        return None, (
            f"{cfg.name}: primary key column {name!r} disappeared from the source (shard "
            f"{shard_schema}); re-bootstrap the table with the new key"
        )
    if policy == "drop":
        return f"DROP COLUMN {spark_ident(name)}", None
    if policy == "keep_null":
        return None, None
    return None, UndecidedDrop(
        f"{cfg.name}: source column {name!r} "
        + (f"was dropped (shard {shard_schema})" if consumed else "is no longer consumed (columns in the config)")
        + " but the lake table keeps it, "
        f"so ingest stopped for this table. Choose in {where}: schema_changes.dropped_columns: "
        f"{{{name}: keep_null}} to keep it (NULL from now on), or {{{name}: drop}} to drop it from the "
        "current table (the changelog keeps its history); then rerun the failed task",
        name,
        shard_schema,
    )


def wait_for_drop_decision(
    spark: SparkSession, cfg: TableConfig, cur: str, decisions: DropDecisions, undecided: list[UndecidedDrop]
) -> NoReturn:
    """Record the undecided drops as pending on the current table, for the ingest DAG's
    decide_dropped approval to show, and stop the table's batch (DropDecisionNeeded)."""
    for drop in undecided:
        shards = decisions.pending.setdefault(drop.column, [])
        if drop.shard not in shards:
            shards.append(drop.shard)
    spark.sql(
        f"ALTER TABLE {cur} SET TBLPROPERTIES ({sql_string(DROP_DECISIONS_PROP)} = {sql_string(decisions.to_json())})"
    )
    columns = sorted(decisions.pending)
    raise DropDecisionNeeded(
        f"{cfg.name}: source column(s) {', '.join(columns)} dropped with no schema_changes.dropped_columns "
        "entry: the table waits for a keep/drop choice in its ingest DAG (task decide_dropped; or set the "
        "entry in the YAML and rerun). Nothing of this batch is applied.",
        columns,
    )


def apply_schema_actions(spark: SparkSession, cur: str, cl: str, ddl: list[str]) -> None:
    """Run the DDL on the current table, and what applies of it on the changelog: the changelog
    keeps dropped columns (their history), so a column added back may already be there."""
    for stmt in ddl:
        log.info("schema change applied to %s: %s", cur, stmt)
        alter_table(spark, cur, stmt)
        if stmt.startswith("ADD COLUMN "):
            name, typ = stmt.removeprefix("ADD COLUMN ").split(" ", 1)
            add_column(spark, cl, name.strip("`").replace("``", "`"), typ)
        elif not stmt.startswith("DROP"):
            alter_table(spark, cl, stmt)
