"""Reading a table's changelog between two watermarks: what the table gained from one lake
position to another. Layers built on a current table (derived trees, serving exports) use it to
find the keys they must recompute without diffing the table itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cdc_lakehouse.columns import LSN_COL, SEQ_COL, SHARD_COL
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.settings import LakeSettings
from cdc_lakehouse.watermark import lsn_map

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession


def changes_between(
    spark: SparkSession, lake: LakeSettings, cfg: TableConfig, lo: dict[str, int], hi: dict[str, int]
) -> DataFrame:
    """Changelog rows after the shard positions `lo` and up to `hi` (shard -> LSN). A watermark is
    exclusive, except for the snapshot rows and markers a bootstrap writes at its position
    (seq < 0): those are in the table at it."""
    from pyspark.sql import functions as F

    lo_map, hi_map = lsn_map(lo), lsn_map(hi)
    cl = spark.table(lake.qualified(cfg.changelog_table))
    lsn, snapshot_row = F.col(LSN_COL), F.col(SEQ_COL) < 0
    lo_s = F.coalesce(lo_map[F.col(SHARD_COL)], F.lit(-1))
    hi_s = F.coalesce(hi_map[F.col(SHARD_COL)], F.lit(-1))
    after_lo = (lsn > lo_s) | ((lsn == lo_s) & ~snapshot_row)
    upto_hi = (lsn < hi_s) | ((lsn == hi_s) & snapshot_row)
    return cl.filter(_coarse_bounds(lo, hi)).filter(after_lo & upto_hi)


def _coarse_bounds(lo: dict[str, int], hi: dict[str, int]) -> Column:
    """A looser filter than the exact one, made of plain column-literal comparisons only, which
    Iceberg evaluates against each file's column stats: the per-shard map lookups above cannot be
    pushed down, and without this every read scans the whole changelog (a bootstrap's snapshot
    files, at LSN = lo with seq < 0, are then skipped unopened). It never drops a row the exact
    filter keeps, so results are unchanged."""
    from pyspark.sql import functions as F

    if not hi:
        return F.lit(False)
    floor = min(lo.get(s, -1) for s in set(hi) | set(lo))
    ceil = max(hi.values())
    lsn, seq = F.col(LSN_COL), F.col(SEQ_COL)
    return ((lsn > floor) | ((lsn == floor) & (seq >= 0))) & ((lsn < ceil) | ((lsn == ceil) & (seq < 0)))
