"""Every writer of a current table is seen by every reader of ranges (lake.ranges: one rule).

One source (two shards of 30 blocks in trees), its block table followed by three readers: a
change-feed consumer that uses before-images (each delivered `_feed_before` must be exactly the
row the consumer holds, and after each read its state must equal the table at the range's
snapshot), a serving export to Redis (equal to the table, key for key) and a derived block tree
(equal to a tree computed in Python from the lake's inputs, and from the source). Each test lets
one writer other than the ingest change rows - an audit repair, a quarantine replay, an added
column's backfill, a re-bootstrap of a shard, a chunked bootstrap round, a stray writer (a manual
UPDATE) - and checks that the next incremental run of every reader reflects it.

The tests share the module's source and readers (setup is the expensive part): each leaves the
readers caught up with the table, so they run in any order or alone.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import psycopg2
import pytest
from cdc_lakehouse.audit.repair import repair_keys
from cdc_lakehouse.columns import META_PREFIX, SHARD_COL
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.derived.config import TreeConfig
from cdc_lakehouse.derived.derive_tree import derive_tree
from cdc_lakehouse.feed.models import BEFORE_COL, FEED_OP_COL, OP_DELETE, FeedOffset, FeedRange
from cdc_lakehouse.feed.read import live_rows, read_changes
from cdc_lakehouse.ingest.ingest_table import IngestResult
from cdc_lakehouse.ingest.replay import replay_quarantine
from cdc_lakehouse.lake.snapshots import read_watermark
from cdc_lakehouse.lake.tables import source_columns_of
from cdc_lakehouse.serving.config import ExportConfig
from cdc_lakehouse.serving.export import export
from cdc_lakehouse.serving.stores import store_uri_env

from devstack.workload import ID_STRIDE
from tests.helpers import landing_root
from tests.integration.conftest import Source
from tests.integration.test_derived_tree import assert_tree_is_reference, reference, tree_cfg, tree_of
from tests.integration.test_serving_export import assert_store_equals

B0, B1 = ID_STRIDE, 2 * ID_STRIDE  # ids of shards s0 and s1 are B + 1 ... B + 30 (one tree each)
VALUES = ["space_id", "parent_id", "type", "version", "is_archived"]  # exported: types never change here


def lenient(cfg: TableConfig, **update: Any) -> TableConfig:
    """The table's config with room for a quarantined event (a run's events are few)."""
    budget = cfg.ingest.error_budget.model_copy(update={"max_quarantined": 100, "max_fraction": 1.0})
    return cfg.model_copy(update={"ingest": cfg.ingest.model_copy(update={"error_budget": budget}), **update})


@dataclass
class World:
    s: Source
    cfg: TableConfig  # the block table's config (score narrowed until the replay test widens it)
    tree: TreeConfig
    export: ExportConfig
    offset: FeedOffset | None = None
    mirror: dict = field(default_factory=dict)  # the feed consumer's state: lake key -> row

    @property
    def spark(self):
        return self.s.spark

    @property
    def tables(self) -> dict[str, TableConfig]:
        return {self.cfg.name: self.cfg, self.s.perm.name: self.s.perm}

    @property
    def current(self) -> str:
        return self.s.lake.qualified(self.cfg.current_table)

    def shard(self, schema: str) -> str:
        return next(shard for _, sch, shard in self.cfg.shards() if sch == schema)


@pytest.fixture(scope="module")
def world(pg, source_uri, spark, lake, redis_server):
    unique = uuid.uuid4().hex[:8]
    s = Source(pg, spark, lake, unique, blocks=30)
    conn = f"ranges_{unique}"
    os.environ[store_uri_env(conn)] = redis_server.uri
    store = {"kind": "redis", "conn_id": conn, "namespace": f"ranges_{unique}", "buckets": 4}
    ecfg = ExportConfig.model_validate(
        {"name": f"ranges_{unique}", "source": {"table": s.block.name}, "store": store, "values": VALUES}
    )
    w = World(s, lenient(s.block, column_types={"score": "decimal(8,4)"}), tree_cfg(s, f"ranges_{unique}"), ecfg)
    s.capture()
    s.bootstrap(w.cfg)
    s.bootstrap(s.perm)
    assert follow(w, first=True) == {"feed": "full", "export": "full", "derived": "full"}
    yield w
    os.environ.pop(store_uri_env(conn), None)
    s.close()


# --- the readers ----------------------------------------------------------------------------------


def plain(row: dict | None) -> dict | None:
    """A row as the consumer keeps it: its source columns that are not NULL (a column added to the
    table since is NULL in a before-image read from an older snapshot, and absent from the row
    the consumer kept from then)."""
    if row is None:
        return None
    return {k: v for k, v in row.items() if v is not None and not k.startswith((META_PREFIX, "_feed_"))}


def feed_step(w: World) -> FeedRange:
    """One read with before-images: each before-image is what the consumer holds for the key, and
    the consumer's state then equals the table at the range's snapshot (a full recomputation)."""
    b = read_changes(w.spark, w.s.lake, w.cfg, "ranges", w.offset, with_before=True)
    if b.range.replaces_state:
        w.mirror.clear()
    for r in (row.asDict(recursive=True) for row in b.rows.collect()):
        key = (r[SHARD_COL], r["id"])
        assert plain(r[BEFORE_COL]) == w.mirror.get(key), (b.range, key, r[BEFORE_COL], w.mirror.get(key))
        if r[FEED_OP_COL] == OP_DELETE:
            w.mirror.pop(key, None)
        else:
            w.mirror[key] = plain(r)
    if b.range.mode != "noop":
        w.offset = b.range.offset
    at = live_rows(w.spark, w.s.lake, w.cfg, b.range.snapshot_id).collect()
    head = {(r[SHARD_COL], r["id"]): plain(r.asDict(recursive=True)) for r in at}
    wrong = {k: (w.mirror.get(k), head.get(k)) for k in set(w.mirror) | set(head) if w.mirror.get(k) != head.get(k)}
    assert not wrong, (b.range, f"{len(wrong)} keys differ (consumer, table), e.g. {list(wrong.items())[:2]}")
    return b.range


def lake_inputs(w: World) -> tuple[dict, dict]:
    """The tree's inputs as the lake holds them now (what a full recomputation reads)."""
    nodes: dict = {}
    grants: dict = {}
    for r in w.spark.table(w.current).select(SHARD_COL, "id", "parent_id", "space_id").collect():
        nodes.setdefault(r[0], {})[r[1]] = (r[2], r[3])
    perm = w.spark.table(w.s.lake.qualified(w.s.perm.current_table)).filter("NOT is_deleted")
    for r in perm.select(SHARD_COL, "block_id", "user_id", "role").collect():
        grants.setdefault((r[0], r[1]), {})[str(r[2])] = r[3]
    return nodes, grants


def follow(w: World, *, first: bool = False, like_source: bool = True) -> dict[str, str]:
    """One run of each reader; each must equal a full recomputation (and the source). Returns how
    each found its keys: the feed's mode, the export's keys_from, the derived tree's for blocks."""
    for t in (w.current, w.s.lake.qualified(w.s.perm.current_table)):
        w.spark.sql(f"REFRESH TABLE {t}")
    fed = feed_step(w)
    ex = export(w.spark, w.s.lake, w.export, w.tables, {})
    assert ex.mode in (("full",) if first else ("incremental", "noop")), ex
    assert_store_equals(w.spark, w.export, w.current)
    der = derive_tree(w.spark, w.s.lake, w.tree, w.tables)
    assert der.mode in (("full",) if first else ("incremental", "noop")), der
    assert_tree_is_reference(w.s, w.tree, tree_of(*lake_inputs(w)))
    if like_source:
        assert_tree_is_reference(w.s, w.tree, reference(w.s))
    return {
        "feed": fed.mode,
        "export": ex.keys_from or ex.mode,
        "derived": (der.keys_from or {}).get(w.cfg.name, der.mode),
    }


# --- writers' setup -------------------------------------------------------------------------------


def ingest(w: World, *sql: str) -> IngestResult:
    w.s.execute(*sql)
    out = w.s.ingest(w.cfg, w.s.capture().manifest.run_id, run=f"i{w.s.runs}")
    assert out.metrics.status == "ok", out
    return out


def lose(w: World, *sql: str) -> None:
    """Source changes whose landing file is lost before the ingest (skipped on purpose): the lake
    misses them until a writer other than the ingest brings them."""
    w.s.execute(*sql)
    m = w.s.capture()
    entry = next(e for e in m.manifest.tables if e.table == "block")
    for f in entry.files:
        (landing_root(w.s.lake) / entry.dir / f.name).unlink()
    skip = w.cfg.model_copy(update={"ingest": w.cfg.ingest.model_copy(update={"missing_landing_files": "skip"})})
    assert w.s.ingest(skip, m.manifest.run_id, run=f"i{w.s.runs}").metrics.status == "ok_with_gaps"


def source_row(w: World, schema: str, block: int) -> tuple:
    conn = psycopg2.connect(w.s.dsn)
    with conn.cursor() as cur:
        cur.execute(f"SELECT parent_id, version FROM {schema}.block WHERE id = {block}")
        row = cur.fetchone()
    conn.close()
    return row


DIFFED = {"feed": "diff", "export": "snapshot_diff", "derived": "diff"}


# --- one test per writer ----------------------------------------------------------------------------


def test_an_audit_repair_reaches_every_reader(world):
    """The repair restates the watermark and writes its rows at it: a range ending at the repair
    must not take it for an ingest commit with an empty range."""
    w = world
    lose(
        w,
        f"UPDATE s0.block SET parent_id = {B0 + 2}, version = version + 10 WHERE id = {B0 + 20}",
        f"DELETE FROM s0.block WHERE id = {B0 + 30}",
    )
    keys = w.spark.createDataFrame(
        [(w.shard("s0"), B0 + 20), (w.shard("s0"), B0 + 30)], f"{SHARD_COL} string, id bigint"
    )
    lake_cols = source_columns_of(w.spark, w.current, w.cfg)
    wm = read_watermark(w.spark, w.current)
    assert repair_keys(w.spark, w.s.lake, w.cfg, keys, w.cfg.primary_key, lake_cols, wm, "ranges") == 2
    assert read_watermark(w.spark, w.current) == wm
    assert follow(w) == DIFFED
    # The next range starts at the repair: its rows (at the watermark) come again, unchanged.
    ingest(w, f"UPDATE s1.block SET version = version + 1 WHERE id = {B1 + 4}")
    assert follow(w)["feed"] == "changelog"


def test_a_quarantine_replay_reaches_every_reader(world):
    """The replay commits rows below the watermark, without moving it and without changelog rows."""
    w = world
    # content set too: an event that left a TOASTed value unchanged cannot be replayed (ingest.replay)
    w.s.execute(f"UPDATE s0.block SET score = 123456.5, parent_id = {B0 + 3}, content = 'r' WHERE id = {B0 + 10}")
    assert w.s.ingest(w.cfg, w.s.capture().manifest.run_id, run=f"i{w.s.runs}").metrics.quarantined == 1
    w.cfg = lenient(w.s.block)  # the fix: the lake column widened to the source's numeric(12,4)
    ingest(w, f"UPDATE s1.block SET version = version + 1 WHERE id = {B1 + 5}")
    assert dict(source_columns_of(w.spark, w.current, w.cfg))["score"] == "decimal(12,4)"
    res = replay_quarantine(w.spark, w.s.lake, w.cfg, replay_run="ranges")
    assert (res.rows_changed, res.still_quarantined) == (1, 0), res
    # The feed reads up to complete snapshots only: the replay (no watermark) joins its next range.
    assert follow(w) == {**DIFFED, "feed": "changelog"}
    ingest(w, f"UPDATE s1.block SET version = version + 1 WHERE id = {B1 + 6}")
    assert follow(w)["feed"] == "diff"


def test_an_added_columns_backfill_reaches_every_reader(world):
    """ADD COLUMN ... DEFAULT: the ingest's backfill MERGE fills the rows that predate it."""
    w = world
    ingest(
        w,
        *[f"ALTER TABLE {schema}.block ADD COLUMN stars int DEFAULT 7" for schema in w.s.schemas],
        f"UPDATE s0.block SET version = version + 1 WHERE id = {B0 + 5}",
        f"UPDATE s1.block SET version = version + 1 WHERE id = {B1 + 5}",
    )
    assert {r[0] for r in w.spark.sql(f"SELECT DISTINCT stars FROM {w.current}").collect()} == {7}
    assert follow(w) == DIFFED
    assert all(v["stars"] == 7 for v in w.mirror.values())


def test_a_rebootstrap_of_one_shard_reaches_every_reader(world):
    w = world
    lose(
        w,
        f"UPDATE s0.block SET parent_id = {B0 + 4}, version = version + 10 WHERE id = {B0 + 15}",
        f"DELETE FROM s0.block WHERE id = {B0 + 29}",
    )
    w.s.bootstrap(w.cfg, shards=[w.shard("s0")])
    assert follow(w) == DIFFED


def test_a_chunked_bootstrap_round_reaches_every_reader(world):
    """A chunk is merged at its own low watermark, above the table's: in no changelog range yet."""
    w = world
    lose(w, f"UPDATE s1.block SET parent_id = {B1 + 2}, version = version + 10 WHERE id = {B1 + 20}")
    chunked = w.cfg.model_copy(
        update={"bootstrap": w.cfg.bootstrap.model_copy(update={"mode": "chunked", "chunk_rows": 1000})}
    )
    r = w.s.bootstrap(chunked, shards=[w.shard("s1")], should_stop=lambda _state: True)  # one round
    assert r.mode == "chunked" and r.chunks == {w.shard("s1"): 1}, r
    # The feed reads up to complete snapshots only: the chunk (no watermark) joins its next range.
    assert follow(w) == {**DIFFED, "feed": "changelog"}
    ingest(w, f"UPDATE s0.block SET version = version + 1 WHERE id = {B0 + 6}")
    assert follow(w)["feed"] == "diff"


def test_a_stray_writer_reaches_every_reader(world):
    """A manual UPDATE of the lake table names no writer: never trusted, always diffed."""
    w = world
    shard, block = w.shard("s1"), B1 + 12
    was = source_row(w, "s1", block)
    w.spark.sql(f"UPDATE {w.current} SET parent_id = {B1 + 3}, version = version + 100 WHERE id = {block}")
    ingest(w, f"UPDATE s0.block SET version = version + 1 WHERE id = {B0 + 7}")
    assert follow(w, like_source=False) == DIFFED
    assert w.mirror[(shard, block)]["version"] == was[1] + 100
    parent = "NULL" if was[0] is None else was[0]
    w.spark.sql(f"UPDATE {w.current} SET parent_id = {parent}, version = {was[1]} WHERE id = {block}")
    ingest(w, f"UPDATE s0.block SET version = version + 1 WHERE id = {B0 + 8}")
    assert follow(w) == DIFFED
