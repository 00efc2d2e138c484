"""Unchanged TOAST values: an UPDATE that leaves a large (TOASTed) column alone sends no value
for it (`_cdc_unavailable` lists such columns). They are filled from the batch where it can tell
the value; what it cannot is left to the MERGE (the table's value) or held back. Never NULL.

Key changes chained within one batch (a -> b -> c, swaps through a temporary key, cycles, a bulk
`UPDATE t SET id = id + 1`) are resolved as a graph (issue #19): every stretch of a key's life that
a key change starts points at the state of the old key at the position of that change; pointer
jumping doubles those pointers each pass, so a chain of n links needs ceil(log2(n)) passes, not n.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import reduce
from operator import and_
from typing import TYPE_CHECKING

from cdc_lakehouse.columns import LSN_COL, OP_COL, SEQ_COL, SHARD_COL, UNAVAILABLE_COL
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.ingest.validate import PKCHANGE
from cdc_lakehouse.runtime.phases import local_checkpoint

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, Row

log = logging.getLogger(__name__)

WORK = "_unav_work"
BROADCAST_ROWS = 2_000_000  # key sets up to this size are broadcast instead of shuffling the table


UNAV_LEFT = "_unav_left"  # columns still without a value after the batch: the MERGE takes the table's
NO_TABLE = "_unav_no_table"  # ... unless the key was deleted or re-created in the batch: then held back
SEG = "_unav_seg"
# Root keys up to this many are also pushed down to the table scan as literals (file pruning).
_PUSHDOWN_KEYS = 1000
# The remap graph, one row per (key change, column): the segment it fills (N), the segment it
# still points at (P), and once decided, where the value is (A, KIND: batch, table or none).
_COL, KIND = "_rg_col", "_rg_kind"


@dataclass(frozen=True)
class _Fill:
    key: list[str]  # shard + primary key
    fkey: list[str]  # whose earlier state fills an event: the old key for a key change (_fill_key_*)
    names: list[str]  # the batch's unchanged TOAST columns
    soft_flag: str | None  # with soft deletes, a flagged row of the table is no row of the source

    def ids(self, prefix: str) -> list[str]:
        return [f"{prefix}{i}" for i in range(len(self.key))]


@dataclass(frozen=True)
class RemapStats:
    """What the key-change graph took, logged with each multi-pass fill."""

    links: int  # key changes of involved keys in the batch
    passes: int  # pointer-jumping passes (ceil(log2(longest chain)) at most)
    unresolved: int  # key-change events still missing a value: left to quarantine (held back)


def fill_unavailable(events: DataFrame, current: DataFrame, cfg: TableConfig, names: list[str]) -> DataFrame:
    """Give unchanged TOAST columns their value from the batch itself: the key's latest earlier
    event that carried it, or for a primary-key change the old key's state (through any chain of
    key changes, or from the table at the chain's start). What the batch cannot provide stays
    listed in `_unav_left`; the MERGE then keeps the table's value, or, where the key was deleted
    or re-created in the batch (NO_TABLE), the event is held back. Nothing is filled with NULL."""
    return fill_with_stats(events, current, cfg, names)[0]


def fill_with_stats(
    events: DataFrame, current: DataFrame, cfg: TableConfig, names: list[str]
) -> tuple[DataFrame, RemapStats]:
    """fill_unavailable, and what its key-change graph took (also logged, as the record's `remap`)."""
    from pyspark.sql import functions as F

    key = [SHARD_COL, *cfg.primary_key]
    fkey = [SHARD_COL, *[f"_fill_key_{k}" for k in cfg.primary_key]]
    if not names:
        nothing = {UNAV_LEFT: F.array().cast("array<string>"), NO_TABLE: F.lit(False)}
        return events.withColumns(nothing), RemapStats(0, 0, 0)
    soft = cfg.soft_delete_columns.flag if cfg.deletes == "soft" else None
    f = _Fill(key, fkey, names, soft)
    sub, rest = _split_involved(events, key, fkey)
    sub = local_checkpoint(_segments(sub, f))
    graph, passes, links = _remap_graph(sub, f)
    sub = _from_starts(_from_history(sub, f), _start_values(graph, sub, current, f), f)
    sub = local_checkpoint(sub.drop(SEG, *[f"_prev_{c}" for c in names]))
    unresolved = sub.filter(F.col(PKCHANGE) & (F.size(WORK) > 0)).count()
    stats = RemapStats(links, passes, unresolved)
    log.info(
        "%s: %d key change(s) resolved as a graph in %d pass(es); %d key change(s) still without a value",
        cfg.name,
        links,
        passes,
        unresolved,
        extra={"remap": stats},
    )
    rest = rest.withColumn(NO_TABLE, F.lit(False))
    return rest.unionByName(sub.withColumnRenamed(WORK, UNAV_LEFT)), stats


def _split_involved(events: DataFrame, key: list[str], fkey: list[str]) -> tuple[DataFrame, DataFrame]:
    """The events of keys that need a fill or give one (old keys of key changes), with WORK the
    columns still to fill; and the others, which need nothing."""
    from pyspark.sql import functions as F

    need = events.filter(F.size(F.coalesce(F.col(UNAVAILABLE_COL), F.array())) > 0)
    involved = need.select(*key).unionByName(need.select(*[F.col(a).alias(b) for a, b in zip(fkey, key)])).distinct()
    involved = local_checkpoint(involved)
    n_involved = involved.count()
    inv = F.broadcast(involved) if n_involved <= BROADCAST_ROWS else involved
    sub = events.join(inv, key, "left_semi").withColumn(
        WORK, F.coalesce(F.col(UNAVAILABLE_COL), F.array().cast("array<string>"))
    )
    rest = events.join(inv, key, "left_anti").withColumn(UNAV_LEFT, F.array().cast("array<string>"))
    return sub, rest


def _segments(sub: DataFrame, f: _Fill) -> DataFrame:
    """SEG splits a key's events into stretches of one life: a new one starts after each delete
    (a value never crosses a delete of its key; otherwise "move 1 -> 99, move 2 -> 1, update 1"
    would give key 1 the value 1 had before) and at each key change into the key (its values come
    from the old key, not from this key's earlier events). Segment 0 continues the table's row;
    NO_TABLE: any other segment must not take the table's value of the key.
    `_prev_{c}`: the latest earlier event in the segment that carried column c."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    order = Window.partitionBy(*f.key).orderBy(LSN_COL, SEQ_COL)
    deletes = F.sum((F.col(OP_COL) == "d").cast("int")).over(order.rowsBetween(Window.unboundedPreceding, -1))
    moves = F.sum(F.coalesce(F.col(PKCHANGE), F.lit(False)).cast("int")).over(
        order.rowsBetween(Window.unboundedPreceding, 0)
    )
    sub = sub.withColumn(SEG, F.coalesce(deletes, F.lit(0)) + moves)
    earlier = Window.partitionBy(*f.key, SEG).orderBy(LSN_COL, SEQ_COL).rowsBetween(Window.unboundedPreceding, -1)
    prevs = {}
    for c in f.names:
        src = F.when((F.col(OP_COL) != "d") & ~F.array_contains(WORK, c), F.struct(F.col(c).alias("v")))
        prevs[f"_prev_{c}"] = F.last(src, ignorenulls=True).over(earlier)
    return sub.withColumns({**prevs, NO_TABLE: F.col(SEG) > 0})


def _take(df: DataFrame, c: str, take: Column, value: Column) -> DataFrame:
    """Where `take`, column c gets `value` and is no longer to fill."""
    from pyspark.sql import functions as F

    df = df.withColumn(c, F.when(take, value).otherwise(F.col(c)))
    return df.withColumn(WORK, F.when(take, F.array_remove(WORK, c)).otherwise(F.col(WORK)))


def _from_history(df: DataFrame, f: _Fill) -> DataFrame:
    """The latest earlier event of the segment that carried the value."""
    from pyspark.sql import functions as F

    for c in f.names:
        take = F.array_contains(WORK, c) & F.col(f"_prev_{c}").isNotNull()
        df = _take(df, c, take, F.col(f"_prev_{c}")["v"])
    return df


def _links(sub: DataFrame, f: _Fill) -> DataFrame:
    """The graph's first state. A key change (new key, segment N) at (lsn, seq) takes the old key's
    state just before it, which is what its delete half (same lsn, seq - 1) saw: that delete's
    `_prev_{c}` if its segment carried c (decided: batch); else, if that segment is the old key's
    segment 0, the table's row of the old key (decided: table); else the value of that segment's
    own key change: a pointer P to it (or none when no key change started it)."""
    from pyspark.sql import functions as F

    n, p, a = f.ids("_rg_n"), f.ids("_rg_p"), f.ids("_rg_a")
    moves = sub.filter(F.coalesce(F.col(PKCHANGE), F.lit(False))).select(
        *[F.col(k).alias(x) for k, x in zip(f.key, n)],
        F.col(SEG).alias("_rg_nseg"),
        *[F.col(k).alias(x) for k, x in zip(f.fkey, a)],
        F.col(LSN_COL).alias("_rg_alsn"),
        (F.col(SEQ_COL) - 1).alias("_rg_aseq"),
    )
    dels = sub.filter(F.col(OP_COL) == "d").select(
        *[F.col(k).alias(x) for k, x in zip(f.key, a)],
        F.col(LSN_COL).alias("_rg_alsn"),
        F.col(SEQ_COL).alias("_rg_aseq"),
        F.col(SEG).alias("_rg_dseg"),
        F.lit(True).alias("_rg_hit"),
        *[F.col(f"_prev_{c}").isNotNull().alias(f"_rg_has_{c}") for c in f.names],
    )
    j = moves.join(dels, [*a, "_rg_alsn", "_rg_aseq"], "left")
    per_col = []
    for c in f.names:
        kind = (
            F.when(F.col(f"_rg_has_{c}"), F.lit("batch"))
            .when(F.col("_rg_hit").isNull(), F.lit("none"))
            .when(F.col("_rg_dseg") == 0, F.lit("table"))
        )
        per_col.append(
            j.select(
                *n,
                "_rg_nseg",
                F.lit(c).alias(_COL),
                *[F.when(kind.isNull(), F.col(x)).alias(y) for x, y in zip(a, p)],
                F.when(kind.isNull(), F.col("_rg_dseg")).alias("_rg_pseg"),
                kind.alias(KIND),
                *a,
                "_rg_alsn",
                "_rg_aseq",
            )
        )
    out = per_col[0]
    for d in per_col[1:]:
        out = out.unionByName(d)
    return out


def _jump(g: DataFrame, f: _Fill, broadcast: bool) -> DataFrame:
    """One pointer-jumping pass: an undecided row takes the decision of the row it points at, or
    else that row's pointer, so the distance it has looked through doubles. A pointer to a
    segment no key change started (after a delete, no insert in the batch) decides none."""
    from pyspark.sql import functions as F

    n, p, a = f.ids("_rg_n"), f.ids("_rg_p"), f.ids("_rg_a")
    pn, aa = [*p, "_rg_pseg"], [*a, "_rg_alsn", "_rg_aseq"]
    y = g.select(
        *[F.col(x).alias(y) for x, y in zip([*n, "_rg_nseg"], pn)],
        _COL,
        F.col(KIND).alias("_y_kind"),
        F.lit(True).alias("_y_hit"),
        *[F.col(x).alias(f"_y{x}") for x in [*pn, *aa]],
    )
    j = g.join(F.broadcast(y) if broadcast else y, [*pn, _COL], "left")
    undecided = F.col(KIND).isNull()
    take = undecided & F.col("_y_kind").isNotNull()
    gone = undecided & F.col("_y_hit").isNull()
    follow = undecided & ~take & ~gone
    cols = {KIND: F.when(take, F.col("_y_kind")).when(gone, F.lit("none")).otherwise(F.col(KIND))}
    cols |= {x: F.when(take, F.col(f"_y{x}")).otherwise(F.col(x)) for x in aa}
    cols |= {x: F.when(follow, F.col(f"_y{x}")) for x in pn}
    return j.withColumns(cols).select(*g.columns)


def _remap_graph(sub: DataFrame, f: _Fill) -> tuple[DataFrame, int, int]:
    """Decide every (key change, column) by pointer jumping: (graph, passes, links). Pointers
    only go to segments that started earlier in (lsn, seq) order, so the graph has no cycle (even
    when the keys do, a -> b -> c -> a) and ceil(log2(longest chain)) passes decide it. Whatever
    is undecided after the bound counts as none (held back), never guessed."""
    from pyspark.sql import functions as F

    g = local_checkpoint(_links(sub, f))
    n_rows = g.count()
    links = n_rows // max(len(f.names), 1)
    bound = math.ceil(math.log2(links + 1)) + 1
    passes = 0
    while passes < bound and g.filter(F.col(KIND).isNull()).limit(1).count():
        g = local_checkpoint(_jump(g, f, n_rows <= BROADCAST_ROWS))
        passes += 1
    return g.withColumn(KIND, F.coalesce(F.col(KIND), F.lit("none"))), passes, links


def _table_values(graph: DataFrame, current: DataFrame, f: _Fill) -> DataFrame:
    """The table's row of each chain's first old key (A key columns, `_tv_{c}` structs)."""
    from pyspark.sql import functions as F

    a = f.ids("_rg_a")
    roots = local_checkpoint(graph.filter(F.col(KIND) == "table").select(*a).distinct())
    rows = current if f.soft_flag is None else current.filter(~F.coalesce(F.col(f.soft_flag), F.lit(False)))
    keys = roots.collect() if roots.count() <= _PUSHDOWN_KEYS else None
    if keys is not None:
        rows = rows.filter(_key_filter(keys, f))
    vals = rows.select(
        *[F.col(k).alias(x) for k, x in zip(f.key, a)],
        *[F.struct(F.col(c).alias("v")).alias(f"_tv_{c}") for c in f.names],
    )
    return vals.join(F.broadcast(roots), a, "left_semi")


def _key_filter(keys: list[Row], f: _Fill) -> Column:
    """Literal keys, so the scan can skip files whose key ranges miss them (the join stays exact):
    per shard an IN list for a one-column key, else one conjunction per key."""
    from pyspark.sql import functions as F

    a = f.ids("_rg_a")
    by_shard: dict[str, list[Row]] = {}
    for r in keys:
        by_shard.setdefault(r[a[0]], []).append(r)
    cond = F.lit(False)
    for shard, rs in by_shard.items():
        if len(f.key) == 2:
            one = F.col(f.key[1]).isin([r[a[1]] for r in rs])
        else:
            one = F.lit(False)
            for r in rs:
                one = one | reduce(and_, [F.col(k) == F.lit(r[x]) for k, x in zip(f.key[1:], a[1:])])
        cond = cond | ((F.col(f.key[0]) == F.lit(shard)) & one)
    return cond


def _start_values(graph: DataFrame, sub: DataFrame, current: DataFrame, f: _Fill) -> DataFrame:
    """Per segment a key change started (N columns): `_start_{c}`, the value its events inherit."""
    from pyspark.sql import functions as F

    n, a = [*f.ids("_rg_n"), "_rg_nseg"], f.ids("_rg_a")
    aa = [*a, "_rg_alsn", "_rg_aseq"]
    batch = sub.filter(F.col(OP_COL) == "d").select(
        *[F.col(k).alias(x) for k, x in zip(f.key, a)],
        F.col(LSN_COL).alias("_rg_alsn"),
        F.col(SEQ_COL).alias("_rg_aseq"),
        *[F.col(f"_prev_{c}").alias(f"_bv_{c}") for c in f.names],
    )
    table = _table_values(graph, current, f)
    starts = graph.select(*n).distinct()
    for c in f.names:
        g = graph.filter(F.col(_COL) == c)
        from_batch = g.filter(F.col(KIND) == "batch").join(batch, aa).select(*n, F.col(f"_bv_{c}").alias(f"_start_{c}"))
        from_table = g.filter(F.col(KIND) == "table").join(table, a).select(*n, F.col(f"_tv_{c}").alias(f"_start_{c}"))
        starts = starts.join(from_batch.unionByName(from_table), n, "left")
    return starts


def _from_starts(sub: DataFrame, starts: DataFrame, f: _Fill) -> DataFrame:
    """Events of a segment a key change started, still without a value: the segment's start."""
    from pyspark.sql import functions as F

    n = [*f.ids("_rg_n"), "_rg_nseg"]
    starts = starts.select(*[F.col(x).alias(k) for x, k in zip(n, [*f.key, SEG])], *[f"_start_{c}" for c in f.names])
    sub = sub.join(F.broadcast(starts), [*f.key, SEG], "left")
    for c in f.names:
        take = F.array_contains(WORK, c) & F.col(f"_start_{c}").isNotNull()
        sub = _take(sub, c, take, F.col(f"_start_{c}")["v"])
    return sub.drop(*[f"_start_{c}" for c in f.names])
