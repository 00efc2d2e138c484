"""Column renames at the source as Iceberg renames: the lake column keeps its field id, so its
history (the changelog's older rows, time travel, the feed, exports) stays one column.

The capture records each DDL the source's event trigger wrote (source.ddl; manifest `ddl`) at
its position X = (commit LSN, LSN of the message): positions order within a transaction too.
A rename of `old` to `new` on shard s at X means: s's events and schemas from below X name the
column `old`, from X on `new`. The first shard's rename renames the lake's
current and changelog tables (ALTER TABLE ... RENAME COLUMN, before the batch's data); from then
on every name from a shard below its own rename (X = infinity for a shard not renamed yet) is
read as the lake's: the events' before/after images and unchanged-TOAST lists, the manifests'
schemas and schema changes, and the shards' known columns in the watermark. A column added back
under the old name after the rename is a new column (its position is at or above X).

The renames seen so far are kept in the current table's `cdc.renamed-columns` property (JSON),
so a later batch, or a shard renamed hours later, maps the same way; only a rename no earlier
batch recorded renames lake columns. Every step is idempotent: a
run killed after the lake's rename and before the property finds the rename again in the same
manifests (the watermark has not moved) and only sets the property.

Without the trigger (source.ddl: no privilege) no rename is known: the relation message shows a
drop plus an add, as before.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.identifiers import spark_ident
from cdc_lakehouse.ingest.errors import SchemaChangeError
from cdc_lakehouse.lake.tables import sql_string, table_exists, table_property
from cdc_lakehouse.landing.reader import Plan
from cdc_lakehouse.watermark import Watermark

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

log = logging.getLogger(__name__)

RENAMES_PROP = "cdc.renamed-columns"
NEVER = (1 << 63) - 1  # the position of a rename a shard has not made yet (a bigint)

# A position in the WAL that orders within a transaction too: (commit LSN, LSN of the message or
# change). A change before the DDL in the DDL's own transaction shares its commit LSN.
Position = tuple[int, int]


class Rename(BaseModel):
    old: str
    new: str
    at: dict[str, list[int]] = Field(default_factory=dict, description="shard -> [commit LSN, LSN] of the rename there")


class Renames(BaseModel):
    """The table's renames in the order they first happened."""

    renames: list[Rename] = Field(default_factory=list)

    @classmethod
    def from_json(cls, text: str | None) -> Renames:
        return cls(renames=[Rename.model_validate(r) for r in json.loads(text)]) if text else cls()

    def to_json(self) -> str:
        return json.dumps([r.model_dump() for r in self.renames], separators=(",", ":"), sort_keys=True)

    def add(self, old: str, new: str, shard: str, at: Position) -> Literal["new", "shard", None]:
        """Record shard's rename at `at`: "new" for a rename no shard made before, "shard" for one
        more shard making a known rename, None when it was known."""
        for r in self.renames:
            if (r.old, r.new) == (old, new):
                if shard in r.at:
                    return None
                r.at[shard] = list(at)
                return "shard"
        self.renames.append(Rename(old=old, new=new, at={shard: list(at)}))
        return "new"

    def lake_name(self, name: str, shard: str | None, at: Position) -> str:
        """The lake's name of a column that shard named `name` at position `at`."""
        for r in self.renames:
            x = r.at.get(shard or "")
            if name == r.old and (x is None or tuple(at) < (x[0], x[1])):
                name = r.new
        return name

    def column(self, name: Column, shard: Column, commit_lsn: Column, lsn: Column) -> Column:
        """lake_name as a Spark expression over an event's shard and (commit LSN, LSN)."""
        from pyspark.sql import functions as F

        for r in self.renames:
            before = F.lit(True)
            if r.at:
                xc = F.create_map(*[v for sh, x in sorted(r.at.items()) for v in (F.lit(sh), F.lit(x[0]))])[shard]
                xl = F.create_map(*[v for sh, x in sorted(r.at.items()) for v in (F.lit(sh), F.lit(x[1]))])[shard]
                before = xc.isNull() | (commit_lsn < xc) | ((commit_lsn == xc) & (lsn < xl))
            name = F.when((name == F.lit(r.old)) & before, F.lit(r.new)).otherwise(name)
        return name


def read_renames(spark: SparkSession, table: str) -> Renames:
    return Renames.from_json(table_property(spark, table, RENAMES_PROP))


def apply_renames(spark: SparkSession, cfg: TableConfig, cur: str, cl: str, plan: Plan, wm: Watermark) -> Renames:
    """The batch's renames on the lake tables, and the plan's names in the lake's (see the module)."""
    shard_map = cfg.shard_map()
    renames = read_renames(spark, cur)
    first_seen: list[Rename] = []
    learned = False
    for m in plan.manifests:
        for d in m.ddl:
            schema, _, table = d.table.rpartition(".")
            shard = shard_map.get((m.endpoint or "", schema))
            if table != cfg.source.table or shard is None:
                continue
            for old, new in d.renamed:
                what = renames.add(old, new, shard, (d.at_commit_lsn or d.lsn, d.lsn))
                learned |= what is not None
                if what == "new":
                    check_renamable(cfg, old)
                    first_seen.append(renames.renames[-1])
    # Only renames no earlier batch applied rename lake columns: a recorded one is done, and a
    # column added back under its old name since is another column. (A run killed before the
    # property was set finds its renames again here, and the lake has them already.)
    for table in (cur, cl):
        if first_seen and table_exists(spark, table):
            have = set(spark.table(table).columns)
            for r in first_seen:
                if r.old in have and r.new not in have:
                    log.warning("%s: source column %s renamed to %s: renaming it in %s", cfg.name, r.old, r.new, table)
                    spark.sql(f"ALTER TABLE {table} RENAME COLUMN {spark_ident(r.old)} TO {spark_ident(r.new)}")
                    have = (have - {r.old}) | {r.new}
    if learned:
        spark.sql(f"ALTER TABLE {cur} SET TBLPROPERTIES ({sql_string(RENAMES_PROP)} = {sql_string(renames.to_json())})")
    if renames.renames:
        map_plan(cfg, plan, renames, shard_map, wm)
    return renames


def check_renamable(cfg: TableConfig, column: str) -> None:
    """A column the table's config names (its key, layout or consumed columns) is not renamed
    under it: the table stops, naming the config to change first."""
    named = {
        "primary_key": cfg.primary_key,
        "lake.partition_by": cfg.lake.partition_by,
        "lake.sort_by": cfg.lake.sort_by or [],
        "columns.include": cfg.columns.include or [],
        "columns.exclude": cfg.columns.exclude,
    }
    where = [k for k, cols in named.items() if column in cols]
    if where:
        raise SchemaChangeError(
            f"{cfg.name}: source column {column!r} was renamed, and the table config names it in "
            f"{', '.join(where)}; change the config to the new name, then rerun (or re-bootstrap the table)"
        )


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
                    c["name"] = renames.lake_name(c["name"], shard, (m.end_lsn, NEVER))
        for ch in m.schema_changes:
            schema, _, table = ch.table.rpartition(".")
            if table != cfg.source.table:
                continue
            shard = shard_map.get((m.endpoint or "", schema))
            pos = (ch.at_commit_lsn, ch.at_lsn or 0) if ch.at_commit_lsn is not None else (m.end_lsn, NEVER)
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
                lsn = (at or {}).get(shard, pos.lsn)  # exclusive: everything below it is applied
                pos.columns = [renames.lake_name(c, shard, (lsn, 0)) for c in pos.columns]
    return out


def rename_fields(raw: DataFrame, renames: Renames, shard: Column) -> DataFrame:
    """The landing events' images and unchanged-TOAST lists in lake names."""
    from pyspark.sql import functions as F

    if not renames.renames:
        return raw
    commit, lsn = F.col("source.commit_lsn"), F.col("source.lsn")
    return (
        raw.withColumn("before", F.transform_keys("before", lambda k, _v: renames.column(k, shard, commit, lsn)))
        .withColumn("after", F.transform_keys("after", lambda k, _v: renames.column(k, shard, commit, lsn)))
        .withColumn("unavailable", F.transform("unavailable", lambda k: renames.column(k, shard, commit, lsn)))
    )
