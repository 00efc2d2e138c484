"""ingest.reduce: typed events -> the lake's order (`_cdc_seq`, primary-key changes split in two)
and the latest event per key."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cdc_lakehouse.config import LSN_COL, OP_COL, SEQ_COL, SHARD_COL, TableConfig
from cdc_lakehouse.ingest.validate import BKEY, FILE, PKCHANGE, RAW, REASONS
from cdc_lakehouse.lake.columns import METADATA_NAMES, UNAVAILABLE, UNAVAILABLE_COL

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


def split_pk_changes(events: DataFrame, cfg: TableConfig) -> DataFrame:
    """Lake order `_cdc_seq` = 2*seq; a primary-key change becomes delete(old) at 2*seq and
    upsert(new) at 2*seq+1. `_fill_key_*` says whose prior state fills unavailable columns."""
    from pyspark.sql import functions as F

    pk = cfg.primary_key
    changed = F.lit(False)
    for k in pk:
        changed = changed | (F.col(BKEY + k).isNotNull() & ~F.col(BKEY + k).eqNullSafe(F.col(k)))
    ev = events.withColumn(PKCHANGE, (F.col(OP_COL) == "u") & changed)
    base = ev.withColumn(SEQ_COL, F.col("_seq_raw") * 2 + F.when(F.col(PKCHANGE), 1).otherwise(0))
    for k in pk:
        base = base.withColumn("_fill_key_" + k, F.when(F.col(PKCHANGE), F.col(BKEY + k)).otherwise(F.col(k)))
    deletes = ev.filter(F.col(PKCHANGE))
    source_cols = [c for c in events.columns if c not in _META_NON_SOURCE and not c.startswith(BKEY)]
    for c in source_cols:
        if c in pk:
            deletes = deletes.withColumn(c, F.col(BKEY + c))
        elif c != SHARD_COL:
            deletes = deletes.withColumn(c, F.lit(None).cast(events.schema[c].dataType))
    deletes = (
        deletes.withColumn(OP_COL, F.lit("d"))
        .withColumn(UNAVAILABLE_COL, F.lit(None).cast(UNAVAILABLE.type))
        .withColumn(SEQ_COL, F.col("_seq_raw") * 2)
        .withColumn(PKCHANGE, F.lit(False))
    )
    for k in pk:
        deletes = deletes.withColumn("_fill_key_" + k, F.col(k))
    return base.unionByName(deletes)


# Columns of a typed event that are not source columns: the metadata columns and the ingest's own.
_META_NON_SOURCE = METADATA_NAMES | {"_seq_raw", REASONS, RAW, FILE, PKCHANGE}


def latest_per_key(events: DataFrame, key: list[str]) -> DataFrame:
    """One event per key: the latest by (commit LSN, sequence)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    w = Window.partitionBy(*key).orderBy(F.col(LSN_COL).desc(), F.col(SEQ_COL).desc())
    return events.withColumn("_rn", F.row_number().over(w)).filter("_rn = 1").drop("_rn")
