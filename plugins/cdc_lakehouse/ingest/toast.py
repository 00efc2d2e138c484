"""Unchanged TOAST values: an UPDATE that leaves a large (TOASTed) column alone sends no value
for it (`_cdc_unavailable` lists such columns). They are filled from the batch where it can tell
the value; what it cannot is left to the MERGE (the table's value) or held back. Never NULL."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cdc_lakehouse.config import LSN_COL, OP_COL, SEQ_COL, SHARD_COL, TableConfig
from cdc_lakehouse.ingest.validate import PKCHANGE
from cdc_lakehouse.lake.columns import UNAVAILABLE_COL

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, WindowSpec


WORK = "_unav_work"
BROADCAST_ROWS = 2_000_000  # key sets up to this size are broadcast instead of shuffling the table


UNAV_LEFT = "_unav_left"  # columns still without a value after the batch: the MERGE takes the table's
NO_TABLE = "_unav_no_table"  # ... unless the key was deleted or re-created in the batch: then held back
GEN = "_unav_gen"


@dataclass(frozen=True)
class _Fill:
    key: list[str]  # shard + primary key
    fkey: list[str]  # whose earlier state fills an event: the old key for a key change (_fill_key_*)
    names: list[str]  # the batch's unchanged TOAST columns
    earlier: WindowSpec  # the key's earlier events within its generation (see _generations)


def fill_unavailable(events: DataFrame, current: DataFrame, cfg: TableConfig, names: list[str]) -> DataFrame:
    """Give unchanged TOAST columns their value from the batch itself: the key's latest earlier
    event that carried it, or for a primary-key change the old key's state. What the batch cannot
    provide stays listed in `_unav_left`; the MERGE then keeps the table's value, which costs no
    extra read. Nothing is ever filled with NULL."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    key = [SHARD_COL, *cfg.primary_key]
    fkey = [SHARD_COL, *[f"_fill_key_{k}" for k in cfg.primary_key]]
    sub, rest = _split_involved(events, key, fkey)
    sub = _generations(sub, key)
    earlier = Window.partitionBy(*key, GEN).orderBy(LSN_COL, SEQ_COL).rowsBetween(Window.unboundedPreceding, -1)
    f = _Fill(key, fkey, names, earlier)
    sub = _from_table(_propagate(sub, f), current, f)
    rest = rest.withColumn(NO_TABLE, F.lit(False))
    return rest.unionByName(sub.drop(GEN).withColumnRenamed(WORK, UNAV_LEFT))


def _split_involved(events: DataFrame, key: list[str], fkey: list[str]) -> tuple[DataFrame, DataFrame]:
    """The events of keys that need a fill or give one (old keys of key changes), with WORK the
    columns still to fill; and the others, which need nothing."""
    from pyspark.sql import functions as F

    need = events.filter(F.size(F.coalesce(F.col(UNAVAILABLE_COL), F.array())) > 0)
    involved = need.select(*key).unionByName(need.select(*[F.col(a).alias(b) for a, b in zip(fkey, key)])).distinct()
    involved = involved.localCheckpoint(eager=True)
    n_involved = involved.count()
    inv = F.broadcast(involved) if n_involved <= BROADCAST_ROWS else involved
    sub = events.join(inv, key, "left_semi").withColumn(
        WORK, F.coalesce(F.col(UNAVAILABLE_COL), F.array().cast("array<string>"))
    )
    rest = events.join(inv, key, "left_anti").withColumn(UNAV_LEFT, F.array().cast("array<string>"))
    return sub, rest


def _generations(sub: DataFrame, key: list[str]) -> DataFrame:
    """GEN: a value never crosses a delete of its key. Events after the key's n-th delete in the
    batch (a delete, or the delete half of a key change) form generation n and look back only
    within it; otherwise "move 1 -> 99, move 2 -> 1, update 1" would give key 1 the value 1 had
    before. NO_TABLE: the table's value of the key is the right base only while the key has not
    been deleted or (re)created by a key change earlier in the batch."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    order = Window.partitionBy(*key).orderBy(LSN_COL, SEQ_COL)
    before = order.rowsBetween(Window.unboundedPreceding, -1)
    sub = sub.withColumn(GEN, F.coalesce(F.sum((F.col(OP_COL) == "d").cast("int")).over(before), F.lit(0)))
    gen_order = Window.partitionBy(*key, GEN).orderBy(LSN_COL, SEQ_COL)
    return sub.withColumn(
        NO_TABLE,
        (F.col(GEN) > 0)
        | F.max(F.col(PKCHANGE).cast("int")).over(gen_order.rowsBetween(Window.unboundedPreceding, 0)).cast("boolean"),
    )


def _take(df: DataFrame, c: str, take: Column, value: Column) -> DataFrame:
    """Where `take`, column c gets `value` and is no longer to fill."""
    from pyspark.sql import functions as F

    df = df.withColumn(c, F.when(take, value).otherwise(F.col(c)))
    return df.withColumn(WORK, F.when(take, F.array_remove(WORK, c)).otherwise(F.col(WORK)))


def _from_history(df: DataFrame, f: _Fill) -> DataFrame:
    """The key's latest earlier event (in its generation) that carried the value; leaves the
    `_prev_*` columns for _from_partner."""
    from pyspark.sql import functions as F

    for c in f.names:
        src = F.when((F.col(OP_COL) != "d") & ~F.array_contains(WORK, c), F.struct(F.col(c).alias("v")))
        df = df.withColumn(f"_prev_{c}", F.last(src, ignorenulls=True).over(f.earlier))
    for c in f.names:
        take = F.array_contains(WORK, c) & ~F.col(PKCHANGE) & F.col(f"_prev_{c}").isNotNull()
        df = _take(df, c, take, F.col(f"_prev_{c}")["v"])
    return df


def _from_partner(df: DataFrame, f: _Fill) -> DataFrame:
    """Primary-key change: the new key starts from the old key's state just before the change,
    which is what its delete half (same commit, seq - 1) saw."""
    from pyspark.sql import functions as F

    partner = df.filter(F.col(OP_COL) == "d").select(
        *[F.col(a).alias(b) for a, b in zip(f.key, f.fkey)],
        F.col(LSN_COL),
        (F.col(SEQ_COL) + 1).alias(SEQ_COL),
        *[F.col(f"_prev_{c}").alias(f"_old_{c}") for c in f.names],
    )
    df = df.drop(*[f"_prev_{c}" for c in f.names]).join(partner, [*f.fkey, LSN_COL, SEQ_COL], "left")
    for c in f.names:
        take = F.array_contains(WORK, c) & F.col(PKCHANGE) & F.col(f"_old_{c}").isNotNull()
        df = _take(df, c, take, F.col(f"_old_{c}")["v"])
    # Later events of the new key inherit what the key change just received.
    return _from_history(df.drop(*[f"_old_{c}" for c in f.names]), f).drop(*[f"_prev_{c}" for c in f.names])


def _pk_unresolved(df: DataFrame) -> int:
    from pyspark.sql import functions as F

    return df.filter(F.col(PKCHANGE) & (F.size(WORK) > 0)).count()


def _propagate(df: DataFrame, f: _Fill) -> DataFrame:
    # A key changed twice in one batch (a -> b -> c) resolves one link per pass.
    left = -1
    for _ in range(32):
        df = _from_partner(_from_history(df, f), f).localCheckpoint(eager=True)
        now = _pk_unresolved(df)
        if now in (0, left):
            break
        left = now
    return df


def _from_table(sub: DataFrame, current: DataFrame, f: _Fill) -> DataFrame:
    """A key change whose old row is only in the table: read those few old keys (rare), then let
    the chain and the new key's later events in the batch inherit the value."""
    from pyspark.sql import functions as F

    pk_missing = sub.filter(F.col(PKCHANGE) & (F.size(WORK) > 0)).select(*f.fkey).distinct().collect()
    if not pk_missing:
        return sub
    cond = None
    for r in pk_missing:
        c1 = F.lit(True)
        for a, b in zip(f.key, f.fkey):
            c1 = c1 & (F.col(a) == F.lit(r[b]))
        cond = c1 if cond is None else cond | c1
    base = current.filter(cond).select(
        *[F.col(a).alias(b) for a, b in zip(f.key, f.fkey)],
        *[F.struct(F.col(c).alias("v")).alias(f"_base_{c}") for c in f.names],
    )
    sub = sub.join(F.broadcast(base), f.fkey, "left").join(_roots(sub, f), [*f.fkey, LSN_COL, SEQ_COL], "left")
    for c in f.names:
        take = (
            F.array_contains(WORK, c)
            & F.col(PKCHANGE)
            & F.col(f"_base_{c}").isNotNull()
            & F.coalesce(F.col(f"_root_{c}"), F.lit(False))
        )
        sub = _take(sub, c, take, F.col(f"_base_{c}")["v"])
    sub = sub.drop(*[f"_root_{c}" for c in f.names])
    return _propagate(sub.drop(*[f"_base_{c}" for c in f.names]), f)


def _roots(sub: DataFrame, f: _Fill) -> DataFrame:
    """Per key change and column, whether the table's value is still the old key's: no earlier
    event of the old key in this batch set the column (an insert, a delete, a key change into it,
    or an update carrying it)."""
    from pyspark.sql import functions as F

    orig = F.coalesce(F.col(UNAVAILABLE_COL), F.array().cast("array<string>"))
    flags = sub
    for c in f.names:
        changed = (F.col(OP_COL) != "u") | F.col(PKCHANGE) | ~F.array_contains(orig, c)
        flags = flags.withColumn(f"_set_{c}", F.max(changed.cast("int")).over(f.earlier))
    return flags.filter(F.col(OP_COL) == "d").select(
        *[F.col(a).alias(b) for a, b in zip(f.key, f.fkey)],
        F.col(LSN_COL),
        (F.col(SEQ_COL) + 1).alias(SEQ_COL),
        *[(F.coalesce(F.col(f"_set_{c}"), F.lit(0)) == 0).alias(f"_root_{c}") for c in f.names],
    )
