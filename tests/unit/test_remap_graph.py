"""Cascading key changes in one batch (issue #19): the TOAST fill resolves them as a graph.

A small model of PostgreSQL's logical-replication output produces the events (after the split of
key changes, as ingest.reduce makes them) and the source's final state; the fill runs on real
Spark, the reduced batch is applied the way the MERGE applies it, and the result must equal the
source: every unchanged TOAST value intact, nothing NULLed, nothing held back that was knowable."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest
from cdc_lakehouse.columns import LSN_COL, OP_COL, SEQ_COL, SHARD_COL, UNAVAILABLE_COL
from cdc_lakehouse.ingest.batch import DUP, LIVE, _per_key
from cdc_lakehouse.ingest.reduce import latest_per_key
from cdc_lakehouse.ingest.toast import NO_TABLE, UNAV_LEFT, fill_with_stats
from cdc_lakehouse.ingest.validate import PKCHANGE
from pyspark.sql import functions as F

from tests.conftest import make_config, session_seeds

SCHEMA = (
    f"{SHARD_COL} string, id bigint, {LSN_COL} bigint, {SEQ_COL} bigint, {OP_COL} string, "
    f"{PKCHANGE} boolean, _fill_key_id bigint, {UNAVAILABLE_COL} array<string>, content string, version int"
)


@dataclass
class Source:
    """A table with a TOASTed `content`: the rows, and the events a batch of statements produces."""

    rows: dict[int, dict]
    events: list[tuple] = field(default_factory=list)
    lsn: int = 100
    seq: int = 0

    def commit(self) -> None:
        self.lsn, self.seq = self.lsn + 10, 0

    def _emit(self, k: int, op: str, unav: list | None, content: str | None, version: int | None) -> None:
        """One event of its own (not a key change) at the next position of the transaction."""
        self.seq += 1
        self.events.append(("s0", k, self.lsn, 2 * self.seq, op, False, k, unav, content, version))

    def update(self, k: int, content: str | None = None) -> None:
        """UPDATE ... SET version = version + 1 [, content = ...]: content unchanged goes unsent."""
        r = self.rows[k]
        r["version"] += 1
        if content is not None:
            r["content"] = content
        unav = [] if content is not None else ["content"]
        self._emit(k, "u", unav, content, r["version"])

    def move(self, k: int, k2: int) -> None:
        """UPDATE ... SET id = k2 WHERE id = k: a delete of k and an insert of k2, content unsent."""
        assert k2 not in self.rows, f"{k2} exists: PostgreSQL would refuse the key change"
        r = self.rows[k2] = self.rows.pop(k)
        self.seq += 1
        self.events.append(("s0", k, self.lsn, 2 * self.seq, "d", False, k, None, None, None))
        self.events.append(("s0", k2, self.lsn, 2 * self.seq + 1, "u", True, k, ["content"], None, r["version"]))

    def redeliver(self) -> None:
        """At-least-once delivery: the newest event again, and the one before it when it sits at the
        position just before (a key change's two halves): exact duplicates, same positions."""
        last = self.events[-1]
        self.events.extend(e for e in self.events[-2:] if e[2:4] == last[2:4] or e[2:4] == (last[2], last[3] - 1))

    def delete(self, k: int) -> None:
        del self.rows[k]
        self._emit(k, "d", None, None, None)

    def insert(self, k: int, content: str) -> None:
        self.rows[k] = {"content": content, "version": 0}
        self._emit(k, "c", [], content, 0)


_POSITION = [SHARD_COL, "id", LSN_COL, SEQ_COL]


def start(n: int = 5) -> tuple[Source, dict[int, dict]]:
    rows = {k: {"content": f"big-{k}-" + "x" * 50, "version": 1} for k in range(1, n + 1)}
    return Source({k: dict(v) for k, v in rows.items()}), rows


def apply(spark, src: Source, table: dict[int, dict], fill: str = "graph") -> tuple[dict[int, dict], int | None, list]:
    """Fill, reduce and apply as the MERGE does: UNAV_LEFT columns keep the table's value unless
    NO_TABLE, in which case the event is held back (the key keeps its table row)."""
    cfg = make_config("remap", ["s0"])
    events = spark.createDataFrame(src.events, SCHEMA)
    current = spark.createDataFrame(
        [("s0", k, v["content"], v["version"]) for k, v in table.items()],
        f"{SHARD_COL} string, id bigint, content string, version int",
    )
    if fill == "graph":
        filled, passes = fill_with_stats(events.dropDuplicates(_POSITION), current, cfg, ["content"])
        passes = passes.passes
    else:
        # As ingest.ingest_table takes it: the fused plan's one pass, then the graph over its output.
        flagged = _per_key(events.withColumn(LIVE, F.lit(True)), cfg, ["content"])
        one_pass = flagged.filter(~F.col(DUP)).drop(UNAV_LEFT, NO_TABLE)
        filled, passes = fill_with_stats(one_pass, current, cfg, ["content"])[0], None
    out, held = {k: dict(v) for k, v in table.items()}, []
    for r in latest_per_key(filled, [SHARD_COL, "id"]).collect():
        if r[OP_COL] == "d":
            out.pop(r["id"], None)
        elif r[UNAV_LEFT] and (r[NO_TABLE] or r["id"] not in table):
            held.append(r["id"])
        else:
            base = table.get(r["id"], {})
            out[r["id"]] = {"content": base["content"] if r[UNAV_LEFT] else r["content"], "version": r["version"]}
    return out, passes, held


def chain(n: int) -> tuple[Source, dict[int, dict]]:
    """Key 1 moves n times (1 -> 1001 -> 1002 ...), each move followed by an update leaving the
    content alone, and updates of another key in between."""
    src, table = start()
    keys = [1, *range(1001, 1001 + n)]
    for a, b in zip(keys, keys[1:]):
        src.move(a, b)
        src.commit()
        src.update(b)
        src.update(2)
        src.commit()
    return src, table


@pytest.mark.parametrize("n", [1, 2, 100, 1000])
def test_chains_end_equal_to_the_source_in_log_passes(spark, n):
    src, table = chain(n)
    out, passes, held = apply(spark, src, table)
    assert held == []
    assert out == src.rows
    assert out[1000 + n]["content"] == table[1]["content"]
    assert passes <= math.ceil(math.log2(n)) + 1, passes


def test_a_value_set_inside_the_chain_follows_from_that_position_on(spark):
    src, table = start()
    src.move(1, 11)
    src.move(11, 12)
    src.commit()
    src.update(12, content="new-in-the-middle")
    src.update(12)
    src.move(12, 13)
    src.move(13, 14)
    src.commit()
    out, _, held = apply(spark, src, table)
    assert held == [] and out == src.rows and out[14]["content"] == "new-in-the-middle"


def test_swaps_and_cycles_through_a_temporary_key(spark):
    src, table = start(6)
    # swap 1 <-> 2
    src.move(1, 99)
    src.move(2, 1)
    src.move(99, 2)
    src.commit()
    # cycle 3 -> 4 -> 5 -> 3, twice round, with updates in between
    for _ in range(2):
        src.move(3, 98)
        src.update(98)
        src.move(5, 3)
        src.move(4, 5)
        src.move(98, 4)
        src.update(4)
        src.commit()
    src.update(1)
    out, _, held = apply(spark, src, table)
    assert held == [] and out == src.rows
    assert out[1]["content"] == table[2]["content"] and out[2]["content"] == table[1]["content"]
    assert out[3]["content"] == table[4]["content"]


def test_bulk_shift_of_every_key_by_one(spark):
    """UPDATE t SET id = id + 1 in one transaction (highest key first, as a unique key needs)."""
    src, table = start(200)
    for k in range(200, 0, -1):
        src.move(k, k + 1)
    src.commit()
    src.update(1 + 1)
    out, _, held = apply(spark, src, table)
    assert held == [] and out == src.rows
    assert all(out[k + 1]["content"] == table[k]["content"] for k in range(1, 201))


def test_a_value_never_crosses_a_delete_and_the_unknown_is_held_back(spark):
    src, table = start()
    src.move(1, 50)  # 50 takes 1's value
    src.delete(50)
    src.insert(50, "fresh")
    src.move(50, 51)  # 51 takes the fresh value, not 1's
    src.move(2, 60)
    src.commit()
    # A chain starting at a key neither the batch nor the table has: held back, never NULLed.
    src.rows[70] = {"content": "only-in-source", "version": 1}
    src.move(70, 71)
    src.move(71, 72)
    out, _, held = apply(spark, src, table)
    assert held == [72]
    src.rows.pop(72)
    assert out == src.rows and out[51]["content"] == "fresh" and out[60]["content"] == table[2]["content"]


def random_batch(seed: int, n_ops: int = 400) -> tuple[Source, dict[int, dict]]:
    """Updates (content sent or left alone), key changes into free keys, deletes, inserts and
    redeliveries over 30 keys in a space of 45, in commits of a few statements: chains, swaps
    through free keys, re-created keys and duplicates come up on their own."""
    rng = random.Random(seed)
    src, table = start(30)
    for i in range(n_ops):
        live, free = sorted(src.rows), sorted(set(range(1, 46)) - set(src.rows))
        op = rng.choices(["update", "set", "move", "delete", "insert", "again"], [40, 8, 25, 6, 6, 5])[0]
        if op == "update" and live:
            src.update(rng.choice(live))
        elif op == "set" and live:
            src.update(rng.choice(live), content=f"set-{i}")
        elif op == "move" and live and free:
            src.move(rng.choice(live), rng.choice(free))
        elif op == "delete" and live:
            src.delete(rng.choice(live))
        elif op == "insert" and free:
            src.insert(rng.choice(free), f"new-{i}")
        elif op == "again" and src.events:
            src.redeliver()
        if rng.random() < 0.3:
            src.commit()
    return src, table


@pytest.mark.parametrize("seed", [*session_seeds(2), 7])
def test_random_batches_one_pass_then_graph_and_graph_alone_equal_the_source(spark, seed):
    """The fill ingest.ingest_table takes when a key change lacks its value (the fused plan's one pass, then
    the graph over its output) and the graph alone over the raw batch both end where the source
    does. Every value here is knowable, so nothing may be held back."""
    print(f"seed {seed}")
    src, table = random_batch(seed)
    graph = apply(spark, src, table, fill="graph")
    composed = apply(spark, src, table, fill="one-pass+graph")
    assert graph[2] == [] and composed[2] == [], (seed, graph[2], composed[2])
    assert graph[0] == src.rows, seed
    assert composed[0] == src.rows, seed
