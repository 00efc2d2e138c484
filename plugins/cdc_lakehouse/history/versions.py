"""Changelog rows -> a history table's versions: the pure transforms (no reads, no writes).

A version is a state of a key that a source transaction left: one per key and transaction (a
transaction's intermediate states were never visible to another), and only where the state
changed (a transaction that leaves the row as it was, or a re-bootstrap's unchanged row, makes
none). Each version is valid from its transaction's commit to the commit of the next change of
the key (NULL: current).

In lake order (commit LSN, `_cdc_seq`) per key, starting from the key's open version (a seed):
1. `prepare`: the key each half of a key change links to (`_cdc_moved_from` / `_cdc_moved_to`;
   the upsert half of a key change is `_cdc_seq` 2n+1, beside the old key's delete at 2n); a
   link survives the transaction's later changes of the new key (`_links`).
2. `with_truncates`: a truncate (op t: a source TRUNCATE, or a re-bootstrap's marker at (P, -2))
   becomes a delete, at its position, of every key of its shard that is open or in the batch.
3. `versions`, in one pass of windows over each key's seed and events (one shuffle):
   - unchanged TOAST values: the ingest wrote the changelog with every value its batch could
     give, chains of key changes included (ingest.toast); a column the event did not carry
     (`_cdc_unavailable`) that is still NULL takes the key's latest earlier known value, back to
     its seed, never across a delete (after one the key is absent: a re-insert carries every
     value, and a key change's upsert half already has the old key's);
   - the last event of each transaction is the key's state after it;
   - the states that differ from the one before are versions, each valid until the next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cdc_lakehouse.columns import (
    COMMIT_TS_COL,
    IS_CURRENT_COL,
    LSN_COL,
    MOVED_FROM_COL,
    MOVED_TO_COL,
    OP_COL,
    SEQ_COL,
    SHARD_COL,
    UNAVAILABLE_COL,
    VALID_FROM_COL,
    VALID_FROM_LSN_COL,
    VALID_TO_COL,
    VALID_TO_LSN_COL,
)

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, WindowSpec

_PRESENT, _SEED, _POINT = "_h_present", "_h_seed", "_h_point"
CLOSED = "_h_closed"  # a row of versions(): an open version this batch closed
REPLACED = "_h_replaced"  # a row of versions(): an open version whose transaction came again
UNRESOLVED = "_h_unresolved"  # an event with an unchanged TOAST value no earlier state gave
# The version columns after the source's, in table order.
VERSION_COLUMNS = [OP_COL, VALID_FROM_LSN_COL, VALID_FROM_COL, VALID_TO_LSN_COL, VALID_TO_COL, IS_CURRENT_COL]
LINK_COLUMNS = [MOVED_FROM_COL, MOVED_TO_COL]


@dataclass(frozen=True)
class Shape:
    """The columns of one table's history: the lake key (shard first) and the source's other columns."""

    key: list[str]
    data: list[str]

    @property
    def pk(self) -> list[str]:
        return self.key[1:]

    @property
    def columns(self) -> list[str]:
        """The history table's columns, in order."""
        return [*self.key, *self.data, *VERSION_COLUMNS, *LINK_COLUMNS]


def key_json(cols: list[str], prefix: str = "") -> Column:
    """A key as JSON of its key columns ({"id": 5}): how a key change names the other key."""
    from pyspark.sql import functions as F

    return F.to_json(F.struct(*[F.col(prefix + c).alias(c) for c in cols]))


def prepare(rows: DataFrame, shape: Shape, broadcast: bool = True) -> DataFrame:
    """Changelog rows (one per position and key) with the key each half of a key change links
    to. broadcast: the key changes' halves are few enough to send to every task (not a bulk
    `UPDATE ... SET id = id + 1` of millions of rows), so the rows are not shuffled for them."""
    from pyspark.sql import functions as F

    seq = F.col(SEQ_COL)
    moved = (seq >= 0) & (seq % 2 == 1)  # the upsert half of a key change
    # The delete half of a key change is the row just before its upsert half (same transaction).
    old = rows.filter((seq >= 0) & (seq % 2 == 0) & (F.col(OP_COL) == "d")).select(
        SHARD_COL, LSN_COL, (seq + 1).alias(SEQ_COL), key_json(shape.pk).alias(MOVED_FROM_COL)
    )
    new = rows.filter(moved).select(
        SHARD_COL, LSN_COL, (seq - 1).alias(SEQ_COL), key_json(shape.pk).alias(MOVED_TO_COL)
    )
    if broadcast:
        old, new = F.broadcast(old), F.broadcast(new)
    at = [SHARD_COL, LSN_COL, SEQ_COL]
    return rows.join(old, at, "left").join(new, at, "left")


def with_truncates(events: DataFrame, seeds: DataFrame, shape: Shape) -> DataFrame:
    """Each truncate (op t, no key) as a delete at its position of every key of its shard that
    has an open version or an event in the batch."""
    from pyspark.sql import functions as F

    truncs = events.filter(F.col(OP_COL) == "t").select(SHARD_COL, LSN_COL, SEQ_COL, COMMIT_TS_COL)
    rows = events.filter(F.col(OP_COL) != "t")
    keys = seeds.select(*shape.key).unionByName(rows.select(*shape.key)).distinct()
    deletes = truncs.join(keys, SHARD_COL).withColumn(OP_COL, F.lit("d"))
    return rows.unionByName(deletes, allowMissingColumns=True)


def versions(events: DataFrame, seeds: DataFrame, shape: Shape, names: list[str]) -> DataFrame:
    """The history rows to write, with three flags. A new version (closed when a later state of
    the batch replaced it); an open version a state of the batch closed, whole, with CLOSED (it
    replaces the open row of its key and `_cdc_valid_from_lsn`); an open version whose own
    transaction the batch carries again (a commit at a bootstrap's position), with REPLACED and
    its key and `_cdc_valid_from_lsn` only (its open row goes; the transaction's state is a new
    version); and UNRESOLVED (see _fill). `events`: prepared rows, no truncate left; `seeds`:
    the keys' open versions; `names`: the columns some event did not carry. Every window is over
    the key, so the seeds and events are shuffled once."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    # A seed sorts before its key's events (a late event was dropped before here).
    order = Window.partitionBy(*shape.key).orderBy(F.col(_SEED).desc(), LSN_COL, SEQ_COL)
    seq = _links(_fill(_monotonic_times(_sequence(events, seeds, shape), order), order, names), shape)
    # The last event of each transaction: the key's state after it.
    seq = seq.withColumn("_h_last", ~F.coalesce(F.lead(LSN_COL).over(order) == F.col(LSN_COL), F.lit(False)))
    replaced = seq.filter(F.col(_SEED) & ~F.col("_h_last")).select(
        F.lit(False).alias(CLOSED), F.lit(True).alias(REPLACED), *shape.key, F.col(LSN_COL).alias(VALID_FROM_LSN_COL)
    )
    states = seq.filter("_h_last")
    was = F.coalesce(F.lag(_PRESENT).over(order), F.lit(False))
    # A change point: a seed (the state before the batch), or a state whose presence or values
    # differ from the one before it (absent after absent is none).
    same = (was == F.col(_PRESENT)) & (~F.col(_PRESENT) | _same_values(shape.data, order))
    # A version's op: r for a snapshot row, else c where the key was absent before, u where not.
    op = F.when(F.col(_SEED) | (F.col(OP_COL) == "r"), F.col(OP_COL)).when(~was, F.lit("c")).otherwise(F.lit("u"))
    points = states.withColumns({_POINT: F.col(_SEED) | ~same, OP_COL: op}).filter(_POINT)
    # Each change point (a seed first) is valid until the next one of its key.
    points = points.withColumns(
        {
            VALID_TO_LSN_COL: F.lead(LSN_COL).over(order),
            VALID_TO_COL: F.lead(COMMIT_TS_COL).over(order),
            "_h_closed_by_move": F.lead(MOVED_TO_COL).over(order),
        }
    )
    live = points.filter(F.col(_PRESENT)).filter(~F.col(_SEED) | F.col(VALID_TO_LSN_COL).isNotNull())
    out = live.select(
        F.col(_SEED).alias(CLOSED),
        F.lit(False).alias(REPLACED),
        *shape.key,
        *shape.data,
        OP_COL,
        F.col(LSN_COL).alias(VALID_FROM_LSN_COL),
        F.col(COMMIT_TS_COL).alias(VALID_FROM_COL),
        VALID_TO_LSN_COL,
        VALID_TO_COL,
        F.col(VALID_TO_LSN_COL).isNull().alias(IS_CURRENT_COL),
        MOVED_FROM_COL,
        F.col("_h_closed_by_move").alias(MOVED_TO_COL),
        UNRESOLVED,
    )
    return out.unionByName(replaced, allowMissingColumns=True)


def _monotonic_times(seq: DataFrame, order: WindowSpec) -> DataFrame:
    """Commit times never go back along a key: an ingest backfill's or a chunk's row (seq < 0)
    carries the time the row had, not the time of the position it is applied at."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    upto = order.rowsBetween(Window.unboundedPreceding, 0)
    return seq.withColumn(COMMIT_TS_COL, F.max(COMMIT_TS_COL).over(upto))


def _links(seq: DataFrame, shape: Shape) -> DataFrame:
    """A key change's link survives the transaction's later changes of the new key: each event
    carries the newest `_cdc_moved_from` of its key and transaction since the last delete."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    txn = Window.partitionBy(*shape.key, LSN_COL).orderBy(F.col(_SEED).desc(), SEQ_COL)
    mark = F.when(~F.col(_PRESENT), F.struct(F.lit(None).cast("string").alias("v"))).when(
        F.col(MOVED_FROM_COL).isNotNull(), F.struct(F.col(MOVED_FROM_COL).alias("v"))
    )
    carried = F.last(mark, ignorenulls=True).over(txn.rowsBetween(Window.unboundedPreceding, 0))
    return seq.withColumn(MOVED_FROM_COL, F.when(F.col(_PRESENT), carried["v"]))


def _sequence(events: DataFrame, seeds: DataFrame, shape: Shape) -> DataFrame:
    """Each key's seed (its open version) and events, as rows of one frame."""
    from pyspark.sql import functions as F

    seed_rows = seeds.select(
        *shape.key,
        *shape.data,
        F.col(OP_COL),
        F.col(VALID_FROM_LSN_COL).alias(LSN_COL),
        F.lit(None).cast("bigint").alias(SEQ_COL),
        F.col(VALID_FROM_COL).alias(COMMIT_TS_COL),
        F.lit(None).cast("array<string>").alias(UNAVAILABLE_COL),
        F.lit(True).alias(_SEED),
        F.col(MOVED_FROM_COL),
        F.lit(None).cast("string").alias(MOVED_TO_COL),
    )
    present = F.col(OP_COL) != "d"
    event_rows = events.select(
        *shape.key,
        *shape.data,
        OP_COL,
        LSN_COL,
        SEQ_COL,
        COMMIT_TS_COL,
        UNAVAILABLE_COL,
        F.lit(False).alias(_SEED),
        F.when(present, F.col(MOVED_FROM_COL)).alias(MOVED_FROM_COL),
        F.when(~present, F.col(MOVED_TO_COL)).alias(MOVED_TO_COL),
    )
    return seed_rows.unionByName(event_rows).withColumn(_PRESENT, F.col(OP_COL) != "d")


def _fill(seq: DataFrame, order: WindowSpec, names: list[str]) -> DataFrame:
    """Unchanged TOAST values: a column an event did not carry and that is still NULL (the batch
    did not give it) takes the latest earlier known value of its key, unless a delete came
    between. PostgreSQL never sends a NULL as an unchanged TOAST value, so such a column that
    stays NULL (no earlier state, or an earlier state that was itself missing it) is UNRESOLVED."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    before = order.rowsBetween(Window.unboundedPreceding, -1)
    unav = F.coalesce(F.col(UNAVAILABLE_COL), F.array().cast("array<string>"))
    cols, missing = {}, []
    for c in names:
        wanted = F.array_contains(unav, c) & F.col(c).isNull()
        # A delete's marker stops the search: the value before it is not the key's any more.
        known = F.when(~F.col(_PRESENT), F.struct(F.lit(None).alias("v"), F.lit(True).alias("gone"))).when(
            ~wanted, F.struct(F.col(c).alias("v"), F.lit(False).alias("gone"))
        )
        prev = F.last(known, ignorenulls=True).over(before)
        take = F.col(_PRESENT) & wanted & prev.isNotNull() & ~prev["gone"]
        cols[c] = F.when(take, prev["v"]).otherwise(F.col(c))
        missing.append(F.col(_PRESENT) & F.array_contains(unav, c) & F.col(c).isNull() & (~take | prev["v"].isNull()))
    flag = F.lit(False)
    for m in missing:
        flag = flag | m
    return seq.withColumns({**cols, UNRESOLVED: flag})


def _same_values(data: list[str], order: WindowSpec) -> Column:
    """Whether a state's source columns equal the previous state's of its key (NULL-safe)."""
    from pyspark.sql import functions as F

    same = F.lit(True)
    for c in data:
        same = same & F.col(c).eqNullSafe(F.lag(c).over(order))
    return same


def not_late(events: DataFrame, last: DataFrame, shape: Shape) -> DataFrame:
    """Drops events before their key's newest version position (`last`: key, `_h_last` LSN): the
    LSN guard of the current table's MERGE, which such an event (a quarantine replay of an old
    change) cannot change either. Truncates have no key: they are kept."""
    from pyspark.sql import functions as F

    keyed = events.filter(F.col(OP_COL) != "t").join(last, shape.key, "left")
    keyed = keyed.filter(F.col("_h_last").isNull() | (F.col(LSN_COL) >= F.col("_h_last"))).drop("_h_last")
    return keyed.unionByName(events.filter(F.col(OP_COL) == "t"))
