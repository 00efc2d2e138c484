"""ingest.reduce: typed events -> the lake's order (`_cdc_seq`, primary-key changes split in two)
and the latest event per key."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cdc_lakehouse.columns import LSN_COL, METADATA_NAMES, OP_COL, SEQ_COL, SHARD_COL, UNAVAILABLE, UNAVAILABLE_COL
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.ingest.validate import BKEY, FILE, PKCHANGE, RAW, REASONS

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame


# One row per event after split_pk_changes: a key change's delete of the old key is not one.
EVENT_ROW = "_event_row"
APPLIED = "_applied"  # an event below the table's watermark: already applied, only counted


def split_pk_changes(events: DataFrame, cfg: TableConfig, live: Column | None = None) -> DataFrame:
    """Lake order `_cdc_seq` = 2*seq; a primary-key change becomes delete(old) at 2*seq and
    upsert(new) at 2*seq+1 (EVENT_ROW marks the second, one row per event). `_fill_key_*` says whose prior state fills unavailable columns.
    With `live`, only rows where it holds are split (the others pass through with 2*seq).

    One row becomes two through explode rather than a union of two filtered copies, so the
    events are read once (a union would scan and validate the landing files twice)."""
    from pyspark.sql import functions as F

    pk = cfg.primary_key
    changed = F.lit(False)
    for k in pk:
        changed = changed | (F.col(BKEY + k).isNotNull() & ~F.col(BKEY + k).eqNullSafe(F.col(k)))
    is_change = (F.col(OP_COL) == "u") & changed
    if live is not None:
        is_change = is_change & live
    halves = F.when(is_change, F.array(F.lit(0), F.lit(1))).otherwise(F.array(F.lit(1)))
    ev = events.withColumn(PKCHANGE, is_change).withColumn("_half", F.explode(halves))
    old = F.col("_half") == 0  # the delete of the old key
    cols = {}
    for c in events.columns:
        if c in pk:
            cols[c] = F.when(old, F.col(BKEY + c)).otherwise(F.col(c))
        elif c not in _META_NON_SOURCE and not c.startswith(BKEY) and c != SHARD_COL:
            cols[c] = F.when(old, F.lit(None).cast(events.schema[c].dataType)).otherwise(F.col(c))
    cols[OP_COL] = F.when(old, F.lit("d")).otherwise(F.col(OP_COL))
    cols[UNAVAILABLE_COL] = F.when(old, F.lit(None).cast(UNAVAILABLE.type)).otherwise(F.col(UNAVAILABLE_COL))
    cols[SEQ_COL] = F.col("_seq_raw") * 2 + F.when(F.col(PKCHANGE) & ~old, 1).otherwise(0)
    for k in pk:
        cols["_fill_key_" + k] = F.when(F.col(PKCHANGE), F.col(BKEY + k)).otherwise(F.col(k))
    cols[PKCHANGE] = F.col(PKCHANGE) & ~old
    cols[EVENT_ROW] = ~old
    return ev.withColumns(cols).drop("_half")


# Columns of a typed event that are not source columns: the metadata columns and the ingest's own.
_META_NON_SOURCE = METADATA_NAMES | {"_seq_raw", REASONS, RAW, FILE, PKCHANGE, APPLIED}


def latest_per_key(events: DataFrame, key: list[str]) -> DataFrame:
    """One event per key: the latest by (commit LSN, sequence)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    w = Window.partitionBy(*key).orderBy(F.col(LSN_COL).desc(), F.col(SEQ_COL).desc())
    return events.withColumn("_rn", F.row_number().over(w)).filter("_rn = 1").drop("_rn")
