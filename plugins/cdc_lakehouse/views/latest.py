"""The latest-per-key view's query: the latest row per key over a table's changelog, without
deleted keys and without keys a later truncate removed. Built twice, kept in step: as a DataFrame
(published as a table, and read by tests) and as SQL text (an Iceberg view stores SQL).

Its columns are the current table's: the metadata columns of cdc_lakehouse.columns (CURRENT) around the
source columns, so the view and the current table line up column for column.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cdc_lakehouse.columns import (
    CURRENT,
    LSN_COL,
    OP_COL,
    SEQ_COL,
    SHARD_COL,
    UNAVAILABLE,
    UNAVAILABLE_COL,
    names_of,
)
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.identifiers import spark_ident
from cdc_lakehouse.lake.tables import source_columns_of
from cdc_lakehouse.settings import LakeSettings

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

# The view's metadata columns, before and after the source columns (the current table's).
_LEADING = names_of(CURRENT, leading=True)
_TRAILING = names_of(CURRENT, leading=False)


def _toast_columns(spark: SparkSession, changelog: str) -> list[str]:
    from pyspark.sql import functions as F

    return sorted(r[0] for r in spark.table(changelog).select(F.explode(UNAVAILABLE_COL)).distinct().collect())


def latest_rows(spark: SparkSession, lake: LakeSettings, cfg: TableConfig) -> DataFrame:
    """The latest row per key over the changelog, without deleted keys (Netflix's view).

    A changelog row lists in `_cdc_unavailable` the unchanged TOAST columns its event did not
    carry; where the ingest could not fill one from its own batch the value is NULL there, and
    here it comes from the key's latest earlier row that carried it."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    cl = lake.qualified(cfg.changelog_table)
    cur = lake.qualified(cfg.current_table)
    cols = [c for c, _ in source_columns_of(spark, cur, cfg)]
    events = spark.table(cl)
    toast = _toast_columns(spark, cl)
    trunc = (
        events.filter(F.col(OP_COL) == "t")
        .groupBy(SHARD_COL)
        .agg(F.max(F.struct(F.col(LSN_COL).alias("l"), F.col(SEQ_COL).alias("s"))).alias("_t"))
    )
    key = [SHARD_COL, *cfg.primary_key]
    ev = events.filter(F.col(OP_COL) != "t")
    if toast:
        upto = Window.partitionBy(*key).orderBy(LSN_COL, SEQ_COL).rowsBetween(Window.unboundedPreceding, 0)
        unav = F.coalesce(F.col(UNAVAILABLE_COL), F.array().cast(UNAVAILABLE.type))
        for c in toast:
            carried = (F.col(OP_COL) != "d") & ~(F.array_contains(unav, c) & F.col(c).isNull())
            ev = ev.withColumn(
                c, F.last(F.when(carried, F.struct(F.col(c).alias("v"))), ignorenulls=True).over(upto)["v"]
            )
    w = Window.partitionBy(*key).orderBy(F.col(LSN_COL).desc(), F.col(SEQ_COL).desc())
    latest = ev.withColumn("_rn", F.row_number().over(w)).filter("_rn = 1")
    latest = latest.join(F.broadcast(trunc), SHARD_COL, "left")
    after_trunc = (
        F.col("_t").isNull()
        | (F.col(LSN_COL) > F.col("_t.l"))
        | ((F.col(LSN_COL) == F.col("_t.l")) & (F.col(SEQ_COL) > F.col("_t.s")))
    )
    # Snapshot rows ('r') read as inserts, as in the current table.
    op = F.when(F.col(OP_COL) == "r", F.lit("c")).otherwise(F.col(OP_COL)).alias(OP_COL)
    return latest.filter((F.col(OP_COL) != "d") & after_trunc).select(
        *_LEADING, *cols, *[op if c == OP_COL else c for c in _TRAILING]
    )


def latest_sql(spark: SparkSession, lake: LakeSettings, cfg: TableConfig) -> str:
    """The same query as latest_rows, as SQL text (an Iceberg view stores SQL)."""
    cl = lake.qualified(cfg.changelog_table)
    cols = [c for c, _ in source_columns_of(spark, lake.qualified(cfg.current_table), cfg)]
    toast = set(_toast_columns(spark, cl))
    key = ", ".join(spark_ident(c) for c in [SHARD_COL, *cfg.primary_key])
    unav = f"coalesce({UNAVAILABLE_COL}, array())"
    sel = []
    for c in cols:
        q = spark_ident(c)
        if c in toast:
            carried = f"{OP_COL} <> 'd' AND NOT (array_contains({unav}, '{c}') AND {q} IS NULL)"
            sel.append(
                f"last(CASE WHEN {carried} THEN named_struct('v', {q}) END, true) OVER (PARTITION BY {key} "
                f"ORDER BY {LSN_COL}, {SEQ_COL} ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW).v AS {q}"
            )
        else:
            sel.append(q)
    lead, trail = ", ".join(_LEADING), ", ".join(_TRAILING)
    out = [f"e.{c}" for c in _LEADING] + [f"e.{spark_ident(c)}" for c in cols]
    out += [
        f"CASE WHEN e.{OP_COL} = 'r' THEN 'c' ELSE e.{OP_COL} END AS {OP_COL}" if c == OP_COL else f"e.{c}"
        for c in _TRAILING
    ]
    return (
        f"WITH t AS (SELECT {SHARD_COL}, max(named_struct('l', {LSN_COL}, 's', {SEQ_COL})) AS tr FROM {cl} "
        f"WHERE {OP_COL} = 't' GROUP BY {SHARD_COL}), "
        f"f AS (SELECT {lead}, {', '.join(sel)}, {trail} FROM {cl} "
        f"WHERE {OP_COL} <> 't'), "
        f"e AS (SELECT *, row_number() OVER (PARTITION BY {key} ORDER BY {LSN_COL} DESC, {SEQ_COL} DESC) AS rn FROM f) "
        f"SELECT {', '.join(out)} "
        f"FROM e LEFT JOIN t ON e.{SHARD_COL} = t.{SHARD_COL} WHERE e.rn = 1 AND e.{OP_COL} <> 'd' "
        f"AND (t.tr IS NULL OR e.{LSN_COL} > t.tr.l OR (e.{LSN_COL} = t.tr.l AND e.{SEQ_COL} > t.tr.s))"
    )
