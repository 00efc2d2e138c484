"""Column renames at the source as Iceberg renames: the lake column keeps its field id, so its
history (the changelog's older rows, time travel, the feed, exports) stays one column.

The capture records each DDL the source's event trigger wrote (source.ddl; manifest `ddl`) at
its position. A rename of `old` to `new` on shard s at LSN X means: s's events and schemas from
below X name the column `old`, from X on `new`. The first shard's rename renames the lake's
current and changelog tables (ALTER TABLE ... RENAME COLUMN, before the batch's data); from then
on every name from a shard below its own rename (X = infinity for a shard not renamed yet) is
read as the lake's: the events' before/after images and unchanged-TOAST lists, the manifests'
schemas and schema changes, and the shards' known columns in the watermark. A column added back
under the old name after the rename is a new column (its position is at or above X).

The renames seen so far are kept in the current table's `cdc.renamed-columns` property (JSON),
so a later batch, or a shard renamed hours later, maps the same way. Every step is idempotent: a
run killed after the lake's rename and before the property finds the rename again in the same
manifests (the watermark has not moved) and only sets the property.

Without the trigger (source.ddl: no privilege) no rename is known: the relation message shows a
drop plus an add, as before.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.identifiers import spark_ident
from cdc_lakehouse.lake.tables import sql_string, table_exists
from cdc_lakehouse.lake.watermark import Watermark
from cdc_lakehouse.landing.reader import Plan

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

log = logging.getLogger(__name__)

RENAMES_PROP = "cdc.renamed-columns"
NEVER = (1 << 63) - 1  # the position of a rename a shard has not made yet (a bigint)


class Rename(BaseModel):
    old: str
    new: str
    at: dict[str, int] = Field(default_factory=dict, description="shard -> LSN of the rename there")


class Renames(BaseModel):
    """The table's renames in the order they first happened."""

    renames: list[Rename] = Field(default_factory=list)

    @classmethod
    def from_json(cls, text: str | None) -> Renames:
        return cls(renames=[Rename.model_validate(r) for r in json.loads(text)]) if text else cls()

    def to_json(self) -> str:
        return json.dumps([r.model_dump() for r in self.renames], separators=(",", ":"), sort_keys=True)

    def add(self, old: str, new: str, shard: str, lsn: int) -> bool:
        """Record shard's rename at lsn; True when something new was learned."""
        for r in self.renames:
            if (r.old, r.new) == (old, new):
                if shard in r.at:
                    return False
                r.at[shard] = lsn
                return True
        self.renames.append(Rename(old=old, new=new, at={shard: lsn}))
        return True

    def lake_name(self, name: str, shard: str | None, lsn: int) -> str:
        """The lake's name of a column that shard named `name` at position lsn."""
        for r in self.renames:
            if name == r.old and lsn < r.at.get(shard or "", NEVER):
                name = r.new
        return name

    def column(self, name: Column, shard: Column, lsn: Column) -> Column:
        """lake_name as a Spark expression."""
        from pyspark.sql import functions as F

        for r in self.renames:
            at = F.create_map(*[x for s, n in sorted(r.at.items()) for x in (F.lit(s), F.lit(n))]) if r.at else None
            pos = F.coalesce(at[shard], F.lit(NEVER)) if at is not None else F.lit(NEVER)
            name = F.when((name == F.lit(r.old)) & (lsn < pos), F.lit(r.new)).otherwise(name)
        return name


def read_renames(spark: SparkSession, table: str) -> Renames:
    rows = spark.sql(f"SHOW TBLPROPERTIES {table} ({sql_string(RENAMES_PROP)})").collect()
    value = rows[0]["value"] if rows else None
    return Renames.from_json(value if value and not value.startswith("Table ") else None)


def apply_renames(spark: SparkSession, cfg: TableConfig, cur: str, cl: str, plan: Plan, wm: Watermark) -> Renames:
    """The batch's renames on the lake tables, and the plan's names in the lake's (see the module)."""
    shard_map = cfg.shard_map()
    renames = read_renames(spark, cur)
    learned = False
    for m in plan.manifests:
        for d in m.ddl:
            schema, _, table = d.table.rpartition(".")
            shard = shard_map.get((m.endpoint or "", schema))
            if table != cfg.source.table or shard is None:
                continue
            for old, new in d.renamed:
                learned |= renames.add(old, new, shard, d.at_commit_lsn or d.lsn)
    if not renames.renames:
        return renames
    for table in (cur, cl):
        if not table_exists(spark, table):
            continue
        have = set(spark.table(table).columns)
        for r in renames.renames:
            if r.old in have and r.new not in have:
                log.warning("%s: source column %s renamed to %s: renaming it in %s", cfg.name, r.old, r.new, table)
                spark.sql(f"ALTER TABLE {table} RENAME COLUMN {spark_ident(r.old)} TO {spark_ident(r.new)}")
                have = (have - {r.old}) | {r.new}
    if learned:
        spark.sql(f"ALTER TABLE {cur} SET TBLPROPERTIES ({sql_string(RENAMES_PROP)} = {sql_string(renames.to_json())})")
    map_plan(cfg, plan, renames, shard_map, wm)
    return renames


def map_plan(
    cfg: TableConfig, plan: Plan, renames: Renames, shard_map: dict[tuple[str, str], str], wm: Watermark
) -> None:
    """The manifests' schemas and schema changes and the new watermark's known columns, in lake names."""
    for m in plan.manifests:
        for key, cols in m.schemas.items():
            schema, _, table = key.rpartition(".")
            if table == cfg.source.table:
                shard = shard_map.get((m.endpoint or "", schema))
                for c in cols:
                    c["name"] = renames.lake_name(c["name"], shard, m.end_lsn)
        for ch in m.schema_changes:
            schema, _, table = ch.table.rpartition(".")
            if table != cfg.source.table:
                continue
            shard = shard_map.get((m.endpoint or "", schema))
            pos = ch.at_commit_lsn if ch.at_commit_lsn is not None else m.end_lsn
            ch.columns = None if ch.columns is None else [renames.lake_name(c, shard, pos) for c in ch.columns]
            added = [renames.lake_name(c, shard, pos) for c in ch.added]
            dropped = [renames.lake_name(c, shard, pos) for c in ch.dropped]
            ch.added, ch.dropped = [c for c in added if c not in dropped], [c for c in dropped if c not in added]
    # Its known columns are still the batch's starting ones (columns_to_backfill updates them).
    plan.new_watermark = in_lake_names(plan.new_watermark, renames, wm.shard_lsns())


def in_lake_names(wm: Watermark, renames: Renames, at: dict[str, int] | None = None) -> Watermark:
    """A copy of wm whose shards' known columns have the lake's names, as of each shard's position
    (or `at`'s); the original stays as the table has it (the commit is fenced on it)."""
    out = wm.model_copy(deep=True)
    if renames.renames:
        for shard, pos in out.shards.items():
            if pos.columns is not None:
                lsn = (at or {}).get(shard, pos.lsn)
                pos.columns = [renames.lake_name(c, shard, lsn) for c in pos.columns]
    return out


def rename_fields(raw: DataFrame, renames: Renames, shard: Column) -> DataFrame:
    """The landing events' images and unchanged-TOAST lists in lake names."""
    from pyspark.sql import functions as F

    if not renames.renames:
        return raw
    lsn = F.col("source.commit_lsn")
    return (
        raw.withColumn("before", F.transform_keys("before", lambda k, _v: renames.column(k, shard, lsn)))
        .withColumn("after", F.transform_keys("after", lambda k, _v: renames.column(k, shard, lsn)))
        .withColumn("unavailable", F.transform("unavailable", lambda k: renames.column(k, shard, lsn)))
    )
