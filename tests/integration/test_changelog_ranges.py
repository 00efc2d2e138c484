"""Every changelog row lies in exactly one range between two consecutive watermarks, for both
inputs: our capture from a real PostgreSQL slot, and Debezium's S3-sink objects (one and two
partitions per topic). A watermark sits strictly above every event it covers: after each ingest
run the rows it appended lie between the watermark it started from (inclusive) and the one it
committed (exclusive); the ranges that `lake.changelog.changes_between` reads between consecutive
watermarks add up to the whole changelog, no row twice; and the current table equals the
changelog up to the watermark reduced to the newest row per key (the bootstrap's snapshot rows
sit at its watermark with seq < 0: the documented exception, read with the range that ends
there)."""

from __future__ import annotations

from collections import Counter

import pytest
from cdc_lakehouse.bootstrap.debezium import bootstrap_debezium
from cdc_lakehouse.columns import LSN_COL, OP_COL, SEQ_COL, SHARD_COL
from cdc_lakehouse.ingest.ingest_table import ingest_table
from cdc_lakehouse.lake.changelog import changes_between
from cdc_lakehouse.lake.snapshots import read_watermark

from tests.conftest import make_config
from tests.fixtures.debezium import json_line, object_path
from tests.integration.conftest import Source
from tests.integration.test_debezium import TOPIC, base, ev, key_only


class RangeWalk:
    """Follows one table through its ingest runs and checks the range rules after each."""

    def __init__(self, spark, lake, cfg, value: str):
        self.spark, self.lake, self.cfg, self.value = spark, lake, cfg, value
        self.cur = lake.qualified(cfg.current_table)
        self.marks = [self.position()]  # the watermark after the bootstrap, then after each run
        self.rows = Counter(self.changelog())

    def position(self) -> dict[str, int]:
        return read_watermark(self.spark, self.cur).shard_lsns()

    def key(self, r) -> tuple:
        return (r[SHARD_COL], r[LSN_COL], r[SEQ_COL], r[OP_COL], *[r[k] for k in self.cfg.primary_key], r[self.value])

    def changelog(self, df=None) -> list[tuple]:
        cl = self.lake.qualified(self.cfg.changelog_table)
        self.spark.sql(f"REFRESH TABLE {cl}")
        return [self.key(r) for r in (df if df is not None else self.spark.table(cl)).collect()]

    def between(self, lo: dict[str, int], hi: dict[str, int]) -> Counter:
        return Counter(self.changelog(changes_between(self.spark, self.lake, self.cfg, lo, hi)))

    def ingested(self, run: str) -> None:
        """Check the run that just committed (or moved nothing)."""
        lo, hi = self.marks[-1], self.position()
        rows = Counter(self.changelog())
        added = rows - self.rows
        assert sum(added.values()) == rows.total() - self.rows.total(), "a changelog row changed or vanished"
        for shard, lsn, seq, *_ in added:
            assert seq >= 0 and lo[shard] <= lsn < hi[shard], (run, (shard, lsn, seq), "outside", lo, hi)
        assert self.between(lo, hi) == added, (run, "the range of this run is not what it appended")
        assert self.table() == self.reduced(hi), (run, "the table is not the changelog up to the watermark")
        self.marks.append(hi)
        self.rows = rows

    def reduced(self, hi: dict[str, int]) -> dict[tuple, tuple]:
        """The changelog up to `hi` (as the reader bounds it), newest row per key, deletes dropped."""
        newest: dict[tuple, tuple] = {}
        for shard, lsn, seq, op, *rest in sorted(self.between({}, hi).elements(), key=lambda r: (r[1], r[2])):
            key, value = (shard, *rest[:-1]), rest[-1]
            if op == "d":
                newest.pop(key, None)
            elif op != "t" and None not in key:
                newest[key] = (lsn, seq, value)
        return newest

    def table(self) -> dict[tuple, tuple]:
        self.spark.sql(f"REFRESH TABLE {self.cur}")
        key = [SHARD_COL, *self.cfg.primary_key]
        return {
            tuple(r[k] for k in key): (r[LSN_COL], r[SEQ_COL], r[self.value])
            for r in self.spark.table(self.cur).collect()
        }

    def check_whole(self) -> None:
        """At the end: the ranges between consecutive watermarks cover the changelog, once each."""
        ranges = Counter(self.changelog(changes_between(self.spark, self.lake, self.cfg, {}, self.marks[0])))
        for lo, hi in zip(self.marks, self.marks[1:], strict=False):
            part = self.between(lo, hi)
            assert not (ranges & part), ("a row in two ranges", lo, hi, ranges & part)
            ranges += part
        assert ranges == Counter(self.changelog()), "rows in no range: " + str(Counter(self.changelog()) - ranges)


# --- our capture ------------------------------------------------------------------------------------


def test_capture_batches_split_the_changelog_into_watermark_ranges(pg, source_uri, spark, lake, unique):
    s = Source(pg, spark, lake, unique, blocks=12)
    try:
        s.capture()
        s.bootstrap(s.block)
        walk = RangeWalk(spark, lake, s.block, "version")
        lo, hi = s.wl.first_id["s0"], s.wl.first_id["s1"]
        batches = [
            # Several transactions per batch, on both shards; the last one is what a watermark at
            # the last commit LSN would leave out.
            [f"UPDATE s0.block SET version = version + 1 WHERE id = {lo}",
             f"DELETE FROM s1.block WHERE id = {hi + 1}",
             f"UPDATE s1.block SET version = version + 5 WHERE id = {hi}"],
            [f"UPDATE s0.block SET version = version + 1 WHERE id IN ({lo}, {lo + 1})",
             f"INSERT INTO s1.block (id, space_id, type, created_at, updated_at) "
             f"SELECT {hi + 100}, space_id, 'text', now(), now() FROM s1.block WHERE id = {hi}"],
            [f"UPDATE s1.block SET version = version + 1 WHERE id = {hi + 100}"],
        ]  # fmt: skip
        for i, statements in enumerate(batches):
            s.execute(*statements)
            run = s.capture().manifest.run_id
            s.ingest(s.block, run, run=f"c{i}")
            walk.ingested(f"c{i}")
        walk.check_whole()
    finally:
        s.close()


# --- Debezium -----------------------------------------------------------------------------------------

# Transactions as Debezium sends them: (position the events carry = the previous commit, changes).
# The snapshot reads at LSN 1000; the first transaction after it has no last commit (each event
# then carries its own LSN); a transaction's events are spread over the partitions by key.
SNAPSHOT = [("r", i, base(i)) for i in (1, 2, 3, 4)]
T1 = (None, [("u", 1, base(1, note="t1")), ("u", 2, base(2, note="t1"))])
T2 = (1100, [("c", 5, base(5)), ("u", 3, base(3, note="t2")), ("d", 4, None)])
T3 = (1200, [("u", 1, base(1, note="t3")), ("u", 2, base(2, note="t3")), ("u", 5, base(5, note="t3"))])
T4 = (1300, [("u", 3, base(3, note="t4")), ("c", 6, base(6))])
T5 = (1400, [("d", 1, None)])
T6 = (1500, [("u", 6, base(6, note="t6")), ("u", 3, base(3, note="t6"))])  # both partitions move past T5


def events(tx, lsn0: int) -> list[tuple[int, dict]]:
    """(key, event) of a transaction, event LSNs from lsn0 on."""
    last, changes = tx
    out = []
    for n, (op, i, row) in enumerate(changes):
        out.append((i, ev(op, lsn0 + n, last, before=key_only(i) if op == "d" else None, after=row)))
    return out


class Sink:
    """The S3 sink: each flush writes, per partition, one object of what arrived since the last."""

    def __init__(self, root, partitions: int):
        self.root, self.partitions, self.next = root, partitions, dict.fromkeys(range(partitions), 0)

    def flush(self, keyed: list[tuple[int, dict]]) -> None:
        for p in range(self.partitions):
            mine = [e for i, e in keyed if i % self.partitions == p]
            if mine:
                path = object_path(self.root, TOPIC, p, self.next[p], "json")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("".join(json_line(e) + "\n" for e in mine))
                self.next[p] += len(mine)


@pytest.mark.parametrize("partitions", [1, 2])
def test_debezium_batches_split_the_changelog_into_watermark_ranges(spark, lake, tmp_root, unique, partitions):
    root = tmp_root / f"sink_{unique}_{partitions}"
    cfg = make_config(
        f"dbz_ranges_{unique}_{partitions}", ["s1"], table="orders",
        landing={"kind": "debezium_s3", "uri": f"file://{root}", "topic_prefix": "dbz", "partitions": partitions},
    )  # fmt: skip
    sink = Sink(root, partitions)
    snap = [(i, ev("r", 1000, None, after=row, snapshot="true")) for _, i, row in SNAPSHOT]
    sink.flush(snap + events(T1, 1010))
    bootstrap_debezium(spark, lake, cfg)
    walk = RangeWalk(spark, lake, cfg, "note")

    def ingest(run: str) -> None:
        ingest_table(spark, lake, cfg, upto_run=None, ingest_run=run)
        walk.ingested(run)

    ingest("d1")
    t2 = events(T2, 1110)
    sink.flush(t2[:2])  # the sink flushed T2 halfway: its delete of 4 comes with the next object
    ingest("d2")
    sink.flush(t2[2:] + events(T3, 1210))
    ingest("d3")
    sink.flush(events(T4, 1310) + events(T5, 1410))
    ingest("d4")
    sink.flush(events(T6, 1510))
    ingest("d5")
    ingest("d6")  # nothing new: nothing moves
    assert walk.marks[-1] == walk.marks[-2] == {"s1": 1501}
    walk.check_whole()
    want = {2: "t3", 3: "t6", 5: "t3", 6: "t6"}
    got = {k[1]: v[2] for k, v in walk.table().items()}
    assert got == want
    assert walk.rows.total() == len(snap) + sum(len(tx[1]) for tx in (T1, T2, T3, T4, T5, T6))  # each once
