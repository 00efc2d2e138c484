"""ingest.toast: split out of ingest.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cdc_lakehouse.config import LSN_COL, OP_COL, SEQ_COL, SHARD_COL, TableConfig
from cdc_lakehouse.ingest.validate import PKCHANGE
from cdc_lakehouse.lake.columns import UNAVAILABLE_COL

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


# --- TOAST ---------------------------------------------------------------------------------------

WORK = "_unav_work"
BROADCAST_ROWS = 2_000_000  # key sets up to this size are broadcast instead of shuffling the table


UNAV_LEFT = "_unav_left"  # columns still without a value after the batch: the MERGE takes the table's
NO_TABLE = "_unav_no_table"  # ... unless the key was deleted or re-created in the batch: then held back
GEN = "_unav_gen"


def fill_unavailable(events: DataFrame, current: DataFrame, cfg: TableConfig, names: list[str]) -> DataFrame:
    """Give unchanged TOAST columns their value from the batch itself: the key's latest earlier
    event that carried it, or for a primary-key change the old key's state. What the batch cannot
    provide stays listed in `_unav_left`; the MERGE then keeps the table's value, which costs no
    extra read. Nothing is ever filled with NULL."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    pk = cfg.primary_key
    key = [SHARD_COL, *pk]
    fkey = [SHARD_COL, *[f"_fill_key_{k}" for k in pk]]
    need = events.filter(F.size(F.coalesce(F.col(UNAVAILABLE_COL), F.array())) > 0)
    involved = need.select(*key).unionByName(need.select(*[F.col(a).alias(b) for a, b in zip(fkey, key)])).distinct()
    involved = involved.localCheckpoint(eager=True)
    n_involved = involved.count()
    inv = F.broadcast(involved) if n_involved <= BROADCAST_ROWS else involved
    sub = events.join(inv, key, "left_semi").withColumn(
        WORK, F.coalesce(F.col(UNAVAILABLE_COL), F.array().cast("array<string>"))
    )
    rest = events.join(inv, key, "left_anti").withColumn(UNAV_LEFT, F.array().cast("array<string>"))

    # A value never crosses a delete of its key: events after the key's n-th delete in the batch
    # (a delete, or the delete half of a key change) form generation n and look back only within it.
    # Otherwise "move 1 -> 99, move 2 -> 1, update 1" would give key 1 the value 1 had before.
    order = Window.partitionBy(*key).orderBy(LSN_COL, SEQ_COL)
    before = order.rowsBetween(Window.unboundedPreceding, -1)
    sub = sub.withColumn(GEN, F.coalesce(F.sum((F.col(OP_COL) == "d").cast("int")).over(before), F.lit(0)))
    gen_order = Window.partitionBy(*key, GEN).orderBy(LSN_COL, SEQ_COL)
    # The table's value of the key is the right base only while the key has not been deleted or
    # (re)created by a key change earlier in the batch.
    sub = sub.withColumn(
        NO_TABLE,
        (F.col(GEN) > 0)
        | F.max(F.col(PKCHANGE).cast("int")).over(gen_order.rowsBetween(Window.unboundedPreceding, 0)).cast("boolean"),
    )
    w = gen_order.rowsBetween(Window.unboundedPreceding, -1)

    def from_history(df: DataFrame) -> DataFrame:
        for c in names:
            src = F.when((F.col(OP_COL) != "d") & ~F.array_contains(WORK, c), F.struct(F.col(c).alias("v")))
            df = df.withColumn(f"_prev_{c}", F.last(src, ignorenulls=True).over(w))
        for c in names:
            take = F.array_contains(WORK, c) & ~F.col(PKCHANGE) & F.col(f"_prev_{c}").isNotNull()
            df = df.withColumn(c, F.when(take, F.col(f"_prev_{c}")["v"]).otherwise(F.col(c)))
            df = df.withColumn(WORK, F.when(take, F.array_remove(WORK, c)).otherwise(F.col(WORK)))
        return df

    def from_partner(df: DataFrame) -> DataFrame:
        # Primary-key change: the new key starts from the old key's state just before the change,
        # which is what its delete half (same commit, seq - 1) saw.
        partner = df.filter(F.col(OP_COL) == "d").select(
            *[F.col(a).alias(b) for a, b in zip(key, fkey)],
            F.col(LSN_COL),
            (F.col(SEQ_COL) + 1).alias(SEQ_COL),
            *[F.col(f"_prev_{c}").alias(f"_old_{c}") for c in names],
        )
        df = df.drop(*[f"_prev_{c}" for c in names]).join(partner, [*fkey, LSN_COL, SEQ_COL], "left")
        for c in names:
            take = F.array_contains(WORK, c) & F.col(PKCHANGE) & F.col(f"_old_{c}").isNotNull()
            df = df.withColumn(c, F.when(take, F.col(f"_old_{c}")["v"]).otherwise(F.col(c)))
            df = df.withColumn(WORK, F.when(take, F.array_remove(WORK, c)).otherwise(F.col(WORK)))
        # Later events of the new key inherit what the key change just received.
        return from_history(df.drop(*[f"_old_{c}" for c in names])).drop(*[f"_prev_{c}" for c in names])

    def pk_unresolved(df: DataFrame) -> int:
        return df.filter(F.col(PKCHANGE) & (F.size(WORK) > 0)).count()

    def propagate(df: DataFrame) -> DataFrame:
        # A key changed twice in one batch (a -> b -> c) resolves one link per pass.
        left = -1
        for _ in range(32):
            df = from_partner(from_history(df)).localCheckpoint(eager=True)
            now = pk_unresolved(df)
            if now in (0, left):
                break
            left = now
        return df

    sub = propagate(sub)
    # A key change whose old row is only in the table: read those few old keys (rare), then let
    # the chain and the new key's later events in the batch inherit the value.
    pk_missing = sub.filter(F.col(PKCHANGE) & (F.size(WORK) > 0)).select(*fkey).distinct().collect()
    if pk_missing:
        cond = None
        for r in pk_missing:
            c1 = F.lit(True)
            for a, b in zip(key, fkey):
                c1 = c1 & (F.col(a) == F.lit(r[b]))
            cond = c1 if cond is None else cond | c1
        base = current.filter(cond).select(
            *[F.col(a).alias(b) for a, b in zip(key, fkey)],
            *[F.struct(F.col(c).alias("v")).alias(f"_base_{c}") for c in names],
        )
        # The table's value is the old key's value only if no earlier event of the old key in this
        # batch set the column (an insert, a delete, a key change into it, or an update carrying it).
        orig = F.coalesce(F.col(UNAVAILABLE_COL), F.array().cast("array<string>"))
        flags = sub
        for c in names:
            changed = (F.col(OP_COL) != "u") | F.col(PKCHANGE) | ~F.array_contains(orig, c)
            flags = flags.withColumn(f"_set_{c}", F.max(changed.cast("int")).over(w))
        roots = flags.filter(F.col(OP_COL) == "d").select(
            *[F.col(a).alias(b) for a, b in zip(key, fkey)],
            F.col(LSN_COL),
            (F.col(SEQ_COL) + 1).alias(SEQ_COL),
            *[(F.coalesce(F.col(f"_set_{c}"), F.lit(0)) == 0).alias(f"_root_{c}") for c in names],
        )
        sub = sub.join(F.broadcast(base), fkey, "left").join(roots, [*fkey, LSN_COL, SEQ_COL], "left")
        for c in names:
            take = (
                F.array_contains(WORK, c)
                & F.col(PKCHANGE)
                & F.col(f"_base_{c}").isNotNull()
                & F.coalesce(F.col(f"_root_{c}"), F.lit(False))
            )
            sub = sub.withColumn(c, F.when(take, F.col(f"_base_{c}")["v"]).otherwise(F.col(c)))
            sub = sub.withColumn(WORK, F.when(take, F.array_remove(WORK, c)).otherwise(F.col(WORK)))
        sub = sub.drop(*[f"_root_{c}" for c in names])
        sub = propagate(sub.drop(*[f"_base_{c}" for c in names]))
    rest = rest.withColumn(NO_TABLE, F.lit(False))
    return rest.unionByName(sub.drop(GEN).withColumnRenamed(WORK, UNAV_LEFT))
