"""Derived block trees (issue #17): our pointer-jumping build, full and incremental, against a
naive level-by-level join loop, on the same data in one run.

    python bench/tree_bench.py --blocks 1000000 [--naive-timeout 1200] [--no-rebuild]

The inputs are built directly in a local Iceberg catalog (Hadoop catalog under bench/.work/),
the way bootstrap and ingest leave them: `bench.block` and `bench.permission` current tables with
their `__changelog` tables, the snapshot rows at the bootstrap position (op 'r', seq -1, after a
truncate marker at seq -2) and the `cdc.watermark` in the current table's commit. No PostgreSQL.

Data (NumPy, cached under bench/.work/tree/): 4 shards of root pages whose sizes are lognormal
(median ~100 blocks, a tail to tens of thousands); each block gets a wanted depth 1 + Gamma(1.6,
5.5) (mean ~10), levels are made contiguous per tree, and a block's parent is a random block one
level up in its tree. About 20% of the blocks hold 1-3 explicit grants. The change batch touches
1% of the blocks: 90% updates of a non-tree column (version), 3% moves of a block (and its
subtree) under a block of another tree, 3% inserts (a tenth of them new roots), 1% deletes of
leaves, and grant changes (3%: granted, role changed, revoked), appended to the changelogs at
higher LSNs and merged into the current tables with the advanced watermark in the same commit,
as the ingest does.

Engines, one SparkSession, in this order, after a warm-up that runs every code path once on
20k blocks in another namespace (not measured: otherwise the first engine alone would carry the
JVM's class loading and JIT warm-up), and with the previous engine's cached blocks released:
  ours full          derive_tree(full=True) on the base data
  naive              per level one join of every node with the previous level (depth-many joins,
                     each level checkpointed), then every node's path exploded against the grants
                     (nearest per principal); written to an Iceberg table like ours. Its output is
                     compared with ours: rows whose root, root attribute, depth, path or grants
                     differ must be 0
  batch              the 1% change batch applied to the inputs (setup, timed, not an engine)
  ours incremental   derive_tree() in auto mode: must report mode incremental
  ours rebuild       derive_tree(full=True) into another table on the changed data (same input
                     as the incremental run); the incremental output must equal it (--no-rebuild
                     skips it)
Figures: seconds per engine and the ratios naive / ours full and full / incremental, Spark jobs,
passes (ours) and levels (naive), our phases, the commit and derived files measured (git HEAD and
their hashes). JSON in bench/results/tree-<blocks>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "plugins"), str(ROOT)]
from bench.measure import PeakRSS, machine  # noqa: E402

WORK = Path(os.environ.get("CDC_BENCH_WORK", HERE / ".work")) / "tree"
SHARDS = ["s0", "s1", "s2", "s3"]
ID_STRIDE = 1_000_000_000  # shard n owns ids [n * stride, (n + 1) * stride), as the dev workload
BASE_LSN = 1_000  # the bootstrap position of every shard
T0 = datetime(2026, 6, 1, 0, 0, tzinfo=UTC)  # bootstrap time
T1 = datetime(2026, 6, 2, 1, 0, tzinfo=UTC)  # the change batch's commits
NS = "bench"
BLOCK_COLS = [("id", "bigint"), ("space_id", "bigint"), ("parent_id", "bigint"), ("type", "string"), ("version", "int")]
PERM_COLS = [("block_id", "bigint"), ("user_id", "bigint"), ("role", "string")]
ROLES = np.array(["read", "comment", "edit", "full"])
TYPES = np.array(["text", "page", "heading", "to_do", "bulleted_list", "image"])
# Shape of the data; bump GEN_VERSION whenever any of it changes (the cache is keyed by it).
GEN_VERSION = 1
TREE_SIZE_MU, TREE_SIZE_SIGMA = 4.6, 1.3  # lognormal blocks per root page: median ~100
DEPTH_SHAPE, DEPTH_SCALE = 1.6, 5.5  # wanted depth 1 + Gamma(shape, scale)
PAGES_PER_SPACE = 8
GRANT_SHARE = 0.20
BATCH_SHARE = 0.01
BATCH_MIX = {"update": 0.90, "move": 0.03, "insert": 0.03, "delete": 0.01, "grant": 0.03}


# --- data -----------------------------------------------------------------------------------------


def tree_sizes(rng: np.random.Generator, n: int) -> np.ndarray:
    parts, total = [], 0
    while total < n:
        s = np.clip(np.round(rng.lognormal(TREE_SIZE_MU, TREE_SIZE_SIGMA, max(1000, n // 50))), 1, 200_000)
        parts.append(s.astype(np.int64))
        total += int(parts[-1].sum())
    sizes = np.concatenate(parts)
    cut = int(np.searchsorted(np.cumsum(sizes), n))
    sizes = sizes[: cut + 1].copy()
    sizes[-1] -= int(sizes.sum()) - n
    return sizes[sizes > 0]


def shard_tree(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """One shard's blocks in id order (row i has id base + 1 + i): tree, level, parent row (-1 =
    root). Every parent row is lower than its child's (parents are created first)."""
    sizes = tree_sizes(rng, n)
    tree = np.repeat(np.arange(len(sizes)), sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    want = 1 + np.floor(rng.gamma(DEPTH_SHAPE, DEPTH_SCALE, n)).astype(np.int64)
    want[starts] = 0
    order = np.lexsort((rng.random(n), want, tree))
    tree, want = tree[order], want[order]  # each tree keeps its rows, root first
    new_group = np.ones(n, bool)
    new_group[1:] = (want[1:] != want[:-1]) | (tree[1:] != tree[:-1])
    group = np.cumsum(new_group) - 1
    gstart = np.flatnonzero(new_group)
    gsize = np.diff(np.append(gstart, n))
    level = group - group[starts][tree]  # wanted depths made contiguous within the tree
    parent = np.full(n, -1, np.int64)
    below = level > 0
    up = group[below] - 1  # the same tree's group one level up
    parent[below] = gstart[up] + (rng.random(int(below.sum())) * gsize[up]).astype(np.int64)
    return {"tree": tree, "level": level, "parent": parent}


def _ids(base: int, rows: np.ndarray) -> np.ndarray:
    return base + 1 + rows


def _opt(values: np.ndarray, missing: np.ndarray):
    import pyarrow as pa

    return pa.array(values, mask=missing)


def generate(n: int, seed: int, d: Path) -> dict:
    """Base tables and the change batch as Parquet under d (kept: a rerun reads them back)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    meta = d / "meta.json"
    if meta.exists():
        info = json.loads(meta.read_text())
        if info.get("gen_version") == GEN_VERSION and info.get("seed") == seed:
            return info
    t = time.time()
    d.mkdir(parents=True, exist_ok=True)
    tables: dict[str, list] = {"block": [], "permission": [], "batch_block": [], "batch_permission": []}
    levels, trees, batch_counts = [], 0, {k: 0 for k in ("update", "move", "insert", "delete", "grant", "events")}
    hi_lsn = {}
    for k, shard in enumerate(SHARDS):
        rng = np.random.default_rng(seed * 100 + k)
        m = n // len(SHARDS) + (1 if k < n % len(SHARDS) else 0)
        base = k * ID_STRIDE
        s = shard_tree(rng, m)
        tree, level, parent = s["tree"], s["level"], s["parent"]
        trees += int(tree[-1]) + 1
        levels.append(level)
        ids = _ids(base, np.arange(m))
        space = base + 1 + tree // PAGES_PER_SPACE
        btype = np.where(level == 0, "page", TYPES[rng.integers(0, len(TYPES), m)])
        version = rng.integers(1, 6, m).astype(np.int32)
        tables["block"].append(
            pa.table(
                {
                    "_cdc_shard": pa.array([shard] * m, pa.string()),
                    "id": ids,
                    "space_id": space,
                    "parent_id": _opt(_ids(base, np.maximum(parent, 0)), parent < 0),
                    "type": btype,
                    "version": version,
                }
            )
        )
        # Grants: ~20% of the blocks, 1-3 distinct users each.
        holders = np.flatnonzero(rng.random(m) < GRANT_SHARE)
        per = rng.integers(1, 4, len(holders))
        g_rows = np.repeat(holders, per)
        g_no = np.arange(len(g_rows)) - np.repeat(np.cumsum(per) - per, per)
        users = np.repeat(rng.integers(1, 2000, len(holders)), per) + g_no * 51 + rng.integers(0, 51, len(g_rows))
        roles = ROLES[rng.choice(4, len(g_rows), p=[0.5, 0.2, 0.2, 0.1])]
        tables["permission"].append(
            pa.table(
                {
                    "_cdc_shard": pa.array([shard] * len(g_rows), pa.string()),
                    "block_id": _ids(base, g_rows),
                    "user_id": users,
                    "role": roles,
                }
            )
        )
        # The change batch: 1% of this shard's blocks, disjoint sets per kind. Moves and deletes
        # come from odd trees, move targets and new blocks' parents from even trees: no cycle, no
        # orphan, whatever the order of the events.
        c = max(1, round(m * BATCH_SHARE))
        want = {kind: round(c * share) for kind, share in BATCH_MIX.items()}
        odd = tree % 2 == 1
        leaf = np.bincount(parent[parent >= 0], minlength=m) == 0
        perm_rows = rng.permutation(m)
        moved = perm_rows[(odd & (level > 0))[perm_rows]][: want["move"]]
        taken = np.zeros(m, bool)
        taken[moved] = True
        deleted = perm_rows[(odd & leaf & ~taken)[perm_rows]][: want["delete"]]
        taken[deleted] = True
        updated = perm_rows[~taken[perm_rows]][: want["update"]]
        even = np.flatnonzero(~odd)
        targets = even[rng.integers(0, len(even), len(moved))]
        n_ins = want["insert"]
        ins_roots = rng.random(n_ins) < 0.1
        ins_parent = even[rng.integers(0, len(even), n_ins)]
        ins_ids = _ids(base, m + np.arange(n_ins))
        ev_id = np.concatenate([ids[updated], ids[moved], ins_ids, ids[deleted]])
        ev_op = np.concatenate(
            [np.full(len(updated) + len(moved), "u"), np.full(n_ins, "c"), np.full(len(deleted), "d")]
        )
        new_parent = np.concatenate([parent[updated], targets, np.where(ins_roots, -1, ins_parent)])
        is_del = np.concatenate([np.zeros(len(updated) + len(moved) + n_ins, bool), np.ones(len(deleted), bool)])
        ev_parent = np.concatenate([_ids(base, np.maximum(new_parent, 0)), np.zeros(len(deleted), np.int64)])
        ev_parent_null = np.concatenate([new_parent < 0, np.ones(len(deleted), bool)])
        ev_space = np.concatenate(
            [
                space[updated],
                space[moved],
                np.where(ins_roots, base + 1, space[ins_parent]),
                np.zeros(len(deleted), np.int64),
            ]
        )
        ev_type = np.concatenate([btype[updated], btype[moved], np.full(n_ins, "text"), np.full(len(deleted), "")])
        ev_version = np.concatenate(
            [version[updated] + 1, version[moved] + 1, np.ones(n_ins, np.int32), np.zeros(len(deleted), np.int32)]
        ).astype(np.int32)
        # Grant changes: a third granted (new users), a third role changes, a third revoked.
        n_g = want["grant"]
        g_new, g_upd = n_g // 3, n_g // 3
        g_del = n_g - g_new - g_upd
        pick = rng.permutation(len(g_rows))
        upd_g, del_g = pick[:g_upd], pick[g_upd : g_upd + g_del]
        new_on = even[rng.integers(0, len(even), g_new)]
        pg_block = np.concatenate([_ids(base, new_on), _ids(base, g_rows[upd_g]), _ids(base, g_rows[del_g])])
        pg_user = np.concatenate([10_000 + np.arange(g_new), users[upd_g], users[del_g]])
        roles_i = rng.integers(0, 4, len(g_rows))
        pg_role = np.concatenate(
            [ROLES[rng.integers(0, 4, g_new)], ROLES[(roles_i[upd_g] + 1) % 4], np.full(g_del, "")]
        )
        pg_op = np.concatenate([np.full(g_new, "c"), np.full(g_upd, "u"), np.full(g_del, "d")])
        # One transaction per event, the shard's events interleaved in a random commit order.
        lsn = BASE_LSN + 1 + rng.permutation(len(ev_id) + len(pg_op))
        hi_lsn[shard] = BASE_LSN + 1 + len(ev_id) + len(pg_op)
        tables["batch_block"].append(
            pa.table(
                {
                    "_cdc_shard": pa.array([shard] * len(ev_id), pa.string()),
                    "_cdc_op": ev_op,
                    "_cdc_commit_lsn": lsn[: len(ev_id)],
                    "id": ev_id,
                    "space_id": _opt(ev_space, is_del),
                    "parent_id": _opt(ev_parent, ev_parent_null),
                    "type": _opt(ev_type, is_del),
                    "version": _opt(ev_version, is_del),
                }
            )
        )
        tables["batch_permission"].append(
            pa.table(
                {
                    "_cdc_shard": pa.array([shard] * len(pg_op), pa.string()),
                    "_cdc_op": pg_op,
                    "_cdc_commit_lsn": lsn[len(ev_id) :],
                    "block_id": pg_block,
                    "user_id": pg_user,
                    "role": _opt(pg_role, pg_op == "d"),
                }
            )
        )
        for kind, count in (
            ("update", len(updated)),
            ("move", len(moved)),
            ("insert", n_ins),
            ("delete", len(deleted)),
            ("grant", n_g),
            ("events", len(ev_id) + n_g),
        ):
            batch_counts[kind] += count
    for name, parts in tables.items():
        pq.write_table(pa.concat_tables(parts), d / f"{name}.parquet", row_group_size=1_000_000)
    level = np.concatenate(levels)
    info = {
        "gen_version": GEN_VERSION,
        "seed": seed,
        "blocks": n,
        "trees": trees,
        "grant_rows": sum(t.num_rows for t in tables["permission"]),
        "grant_holders": int(sum(len(np.unique(t["block_id"].to_numpy())) for t in tables["permission"])),
        "depth": depth_summary(level),
        "batch": batch_counts,
        "hi_lsn": hi_lsn,
        "generate_seconds": round(time.time() - t, 1),
    }
    meta.write_text(json.dumps(info, indent=2))
    return info


def depth_summary(level: np.ndarray) -> dict:
    hist = np.bincount(level)
    return {
        "mean": round(float(level.mean()), 2),
        "p50": int(np.percentile(level, 50)),
        "p90": int(np.percentile(level, 90)),
        "p99": int(np.percentile(level, 99)),
        "max": int(level.max()),
        "histogram": [int(x) for x in hist],
    }


def histogram_line(hist: list[int], width: int = 10) -> str:
    """Blocks per depth band: `0-9: 41%  10-19: 38% ...`."""
    total = sum(hist)
    bands = [sum(hist[i : i + width]) for i in range(0, len(hist), width)]
    return "  ".join(f"{i * width}-{i * width + width - 1}: {100 * b / total:.1f}%" for i, b in enumerate(bands))


# --- the lake -------------------------------------------------------------------------------------


def configs(ns: str = NS):
    from cdc_lakehouse.config import parse_table_config
    from cdc_lakehouse.derived.config import TreeConfig

    def table(name: str, key: list[str]):
        cfg, errs = parse_table_config(
            {
                "name": name,
                "source": {"table": name, "shards": [{"conn_id": "bench", "schemas": SHARDS}]},
                "primary_key": key,
                "lake": {"namespace": ns},
            },
            f"{name}.yaml",
        )
        assert not errs, errs
        return cfg

    block, perm = table("block", ["id"]), table("permission", ["block_id", "user_id"])

    def tree(name: str) -> TreeConfig:
        return TreeConfig.model_validate(
            {
                "name": name,
                "nodes": {"table": "block", "id": "id", "parent": "parent_id", "root_attribute": "space_id"},
                "grants": {"table": "permission", "node": "block_id", "principal": "user_id", "grant": "role"},
                "lake": {"namespace": ns},
                "max_depth": 128,
            }
        )

    return block, perm, tree


def _wm(lsns: dict[str, int], ts: datetime) -> str:
    from cdc_lakehouse.watermark import Watermark

    shards = {s: {"lsn": lsn, "ts": ts.isoformat()} for s, lsn in lsns.items()}
    return Watermark.from_dict({"v": 1, "shards": shards}).to_json()


def load_inputs(spark, lake, cfgs: list, cols: list, files: list[Path]) -> None:
    """Current tables and changelogs as a bootstrap at BASE_LSN leaves them."""
    from cdc_lakehouse.columns import (
        COMMIT_TS_COL,
        INGESTED_COL,
        LSN_COL,
        LSN_EVENT_COL,
        OP_COL,
        RUN_COL,
        SEQ_COL,
        SHARD_COL,
    )
    from cdc_lakehouse.lake.tables import conform_to, create_lake_tables
    from pyspark.sql import functions as F

    wm = _wm(dict.fromkeys(SHARDS, BASE_LSN), T0)
    for cfg, columns, f in zip(cfgs, cols, files, strict=True):
        create_lake_tables(spark, lake, cfg, columns)
        cur, cl = lake.qualified(cfg.current_table), lake.qualified(cfg.changelog_table)
        snap = (
            spark.read.parquet(str(f))
            .withColumn(OP_COL, F.lit("r"))
            .withColumn(LSN_COL, F.lit(BASE_LSN).cast("bigint"))
            .withColumn(SEQ_COL, F.lit(-1).cast("bigint"))
            .withColumn(COMMIT_TS_COL, F.lit(T0.replace(tzinfo=None)))
        )
        markers = (
            spark.createDataFrame([(s, BASE_LSN) for s in SHARDS], f"{SHARD_COL} string, {LSN_COL} bigint")
            .withColumn(OP_COL, F.lit("t"))
            .withColumn(SEQ_COL, F.lit(-2).cast("bigint"))
            .withColumn(COMMIT_TS_COL, F.lit(T0.replace(tzinfo=None)))
        )
        events = (
            markers.unionByName(snap, allowMissingColumns=True)
            .withColumn(LSN_EVENT_COL, F.col(LSN_COL))
            .withColumn(RUN_COL, F.lit("bootstrap-bench"))
            .withColumn(INGESTED_COL, F.current_timestamp())
        )
        conform_to(events, spark.table(cl).schema).writeTo(cl).option("distribution-mode", "none").option(
            "snapshot-property.cdc.watermark", wm
        ).append()
        conform_to(snap, spark.table(cur).schema).writeTo(cur).option("snapshot-property.cdc.watermark", wm).append()


def apply_batch(spark, lake, cfgs: list, files: list[Path], hi_lsn: dict[str, int]) -> None:
    """The ingest's two commits per table: the events appended to the changelog, then one MERGE
    of them into the current table carrying the advanced watermark (one event per key here, so
    nothing to pre-combine)."""
    from cdc_lakehouse.columns import COMMIT_TS_COL, INGESTED_COL, LSN_EVENT_COL, RUN_COL, SEQ_COL, XID_COL
    from cdc_lakehouse.ingest.ingest_table import current_columns
    from cdc_lakehouse.lake.commits import sql_with_commit_properties
    from cdc_lakehouse.lake.merge import merge_sql
    from cdc_lakehouse.lake.tables import conform_to, source_columns_of
    from pyspark.sql import functions as F

    wm = _wm(hi_lsn, T1)
    for cfg, f in zip(cfgs, files, strict=True):
        cur, cl = lake.qualified(cfg.current_table), lake.qualified(cfg.changelog_table)
        ev = (
            spark.read.parquet(str(f))
            .withColumn(SEQ_COL, F.lit(0).cast("bigint"))
            .withColumn(COMMIT_TS_COL, F.lit(T1.replace(tzinfo=None)))
        )
        cl_rows = (
            ev.withColumn(LSN_EVENT_COL, F.col("_cdc_commit_lsn"))
            .withColumn(XID_COL, F.col("_cdc_commit_lsn"))
            .withColumn(RUN_COL, F.lit("20260602T010000Z"))
            .withColumn(INGESTED_COL, F.current_timestamp())
        )
        conform_to(cl_rows, spark.table(cl).schema).writeTo(cl).option("snapshot-property.cdc.watermark", wm).append()
        view = f"bench_batch_{cfg.name}"
        ev.createOrReplaceTempView(view)
        cols = current_columns(source_columns_of(spark, cur, cfg))
        sql_with_commit_properties(spark, merge_sql(cfg, cur, view, cols, []), {"cdc.watermark": wm})


# --- the naive peer -------------------------------------------------------------------------------


class Deadline:
    """Cancels a job group after `seconds` (the naive loop may not finish at 10M)."""

    def __init__(self, spark, group: str, seconds: float) -> None:
        self.fired = False
        self.started = time.monotonic()
        self.seconds = seconds

        def fire() -> None:
            self.fired = True
            spark.sparkContext.cancelJobGroup(group)

        self._t = threading.Timer(seconds, fire)
        self._t.daemon = True
        self._t.start()

    def over(self) -> bool:
        return self.fired or time.monotonic() - self.started > self.seconds

    def cancel(self) -> None:
        self._t.cancel()


def naive_tree(spark, lake, block_cfg, perm_cfg, out: str, max_depth: int, timeout: float) -> dict:
    """Level by level: level k+1 = every node joined with level k on its parent; then each node's
    own id and path exploded and joined with the grants, nearest grant per principal."""
    from cdc_lakehouse.columns import SHARD_COL
    from cdc_lakehouse.runtime.phases import PhaseClock, SparkJobs
    from pyspark.sql import functions as F

    clock = PhaseClock()
    sizes: list[int] = []
    result = {"levels": 0, "finished": False}
    with SparkJobs(spark, "naive tree") as jobs:
        deadline = Deadline(spark, jobs.group, timeout)
        try:
            with clock.phase("levels"):
                nodes = (
                    spark.table(lake.qualified(block_cfg.current_table))
                    .select(SHARD_COL, "id", "parent_id", "space_id")
                    .localCheckpoint(eager=True)
                )
                level = (
                    nodes.filter(F.col("parent_id").isNull())
                    .select(
                        SHARD_COL,
                        "id",
                        "parent_id",
                        F.col("id").alias("root_id"),
                        F.col("space_id").alias("root_space_id"),
                        F.lit(0).alias("depth"),
                        F.array().cast("array<bigint>").alias("path"),
                    )
                    .localCheckpoint(eager=True)
                )
                levels = [level]
                sizes.append(level.count())
                while sizes[-1] and len(sizes) <= max_depth:
                    if deadline.over():
                        raise TimeoutError
                    frontier = level.select(
                        SHARD_COL, F.col("id").alias("parent_id"), "root_id", "root_space_id", "depth", "path"
                    )
                    level = (
                        nodes.join(frontier, [SHARD_COL, "parent_id"])
                        .select(
                            SHARD_COL,
                            "id",
                            "parent_id",
                            "root_id",
                            "root_space_id",
                            (F.col("depth") + 1).alias("depth"),
                            F.concat("path", F.array("parent_id")).alias("path"),
                        )
                        .localCheckpoint(eager=True)
                    )
                    levels.append(level)
                    sizes.append(level.count())
                result["levels"] = len(sizes) - 1
            with clock.phase("grants_and_write"):
                placed = levels[0]
                for lv in levels[1:]:
                    placed = placed.unionByName(lv)
                grants = spark.table(lake.qualified(perm_cfg.current_table)).select(
                    SHARD_COL,
                    F.col("block_id").alias("_on"),
                    F.col("user_id").cast("string").alias("principal"),
                    F.col("role").alias("grant"),
                )
                up = placed.select(
                    SHARD_COL, "id", F.posexplode(F.concat(F.array("id"), F.reverse("path"))).alias("_dist", "_on")
                )
                nearest = (
                    up.join(grants, [SHARD_COL, "_on"])
                    .groupBy(SHARD_COL, "id", "principal")
                    .agg(F.min_by(F.struct("grant", F.col("_on").alias("granted_on")), F.col("_dist")).alias("_g"))
                )
                entry = F.struct(
                    "principal", F.col("_g.grant").alias("grant"), F.col("_g.granted_on").alias("granted_on")
                )
                sets = nearest.groupBy(SHARD_COL, "id").agg(F.array_sort(F.collect_list(entry)).alias("grants"))
                rows = placed.join(sets, [SHARD_COL, "id"], "left").select(
                    SHARD_COL,
                    "id",
                    "parent_id",
                    "root_id",
                    "root_space_id",
                    "depth",
                    "path",
                    F.coalesce(
                        "grants", F.array().cast("array<struct<principal:string,grant:string,granted_on:bigint>>")
                    ).alias("grants"),
                )
                rows.writeTo(out).using("iceberg").partitionedBy(F.col(SHARD_COL)).tableProperty(
                    "format-version", "2"
                ).create()
            result["finished"] = True
        except Exception as exc:  # noqa: BLE001 - a cancelled job group surfaces as a Py4J error
            if not (deadline.fired or isinstance(exc, TimeoutError)):
                raise
            result["levels"] = len(sizes) - 1
        finally:
            deadline.cancel()
    result.update(
        seconds=round(clock.elapsed(), 1),
        phases=clock.rounded(),
        spark_jobs=jobs.count,
        level_sizes=sizes,
        placed=sum(sizes),
    )
    return result


# --- checks ---------------------------------------------------------------------------------------


def _norm(spark, table: str):
    from cdc_lakehouse.columns import SHARD_COL
    from pyspark.sql import functions as F

    spark.sql(f"REFRESH TABLE {table}")
    g = F.transform("grants", lambda x: F.concat_ws("|", x["principal"], x["grant"], x["granted_on"].cast("string")))
    return spark.table(table).select(
        SHARD_COL,
        "id",
        F.struct("parent_id", "root_id", "root_space_id", "depth", "path").alias("place"),
        F.array_sort(g).alias("grants"),
    )


def differing(spark, a: str, b: str) -> dict:
    """Rows only in a, only in b, and in both with another place (parent, root, root attribute,
    depth, path) or other effective grants."""
    from cdc_lakehouse.columns import SHARD_COL
    from pyspark.sql import functions as F

    x, y = _norm(spark, a).alias("a"), _norm(spark, b).alias("b")
    j = x.join(y, [SHARD_COL, "id"], "full_outer")
    both = F.col("a.place").isNotNull() & F.col("b.place").isNotNull()
    r = j.agg(
        F.sum(F.col("b.place").isNull().cast("int")).alias("only_ours"),
        F.sum(F.col("a.place").isNull().cast("int")).alias("only_other"),
        F.sum((both & ~F.col("a.place").eqNullSafe(F.col("b.place"))).cast("int")).alias("place_differs"),
        F.sum((both & ~F.col("a.grants").eqNullSafe(F.col("b.grants"))).cast("int")).alias("grants_differ"),
    ).collect()[0]
    return {k: int(v or 0) for k, v in r.asDict().items()}


def differing_unresolved(spark, a: str, b: str) -> int:
    from cdc_lakehouse.columns import SHARD_COL

    for t in (a, b):
        spark.sql(f"REFRESH TABLE {t}")
    x = spark.table(a).select(SHARD_COL, "id", "reason")
    y = spark.table(b).select(SHARD_COL, "id", "reason")
    return x.exceptAll(y).count() + y.exceptAll(x).count()


# --- main -----------------------------------------------------------------------------------------


def ours(spark, lake, dcfg, tables, *, full: bool) -> dict:
    from cdc_lakehouse.derived.derive_tree import derive_tree

    _release(spark)
    before = _cpu_of_others()
    t = time.monotonic()
    m = derive_tree(spark, lake, dcfg, tables, full=full).to_dict()
    return {**m, "wall_seconds": round(time.monotonic() - t, 1), "other_cpu_seconds": _other_cpu(before)}


def _cpu_of_others() -> dict[int, float]:
    """CPU seconds so far of every process outside this one and its JVM."""
    import psutil

    mine = {os.getpid(), *(c.pid for c in psutil.Process().children(recursive=True))}
    out = {}
    for proc in psutil.process_iter(["pid", "cpu_times"]):
        ct = proc.info["cpu_times"]
        if proc.info["pid"] not in mine and ct is not None:
            out[proc.info["pid"]] = ct.user + ct.system
    return out


def _other_cpu(before: dict[int, float]) -> float:
    """CPU seconds other processes used since `before`: on 2 cores, anything near the engine's
    wall seconds means it shared the machine."""
    return round(sum(v - before.get(pid, 0.0) for pid, v in _cpu_of_others().items()), 1)


def _release(spark) -> None:
    """Let the previous engine's checkpointed blocks go before the next one starts (Spark frees
    them once the JVM collects the objects the Python DataFrames held)."""
    gc.collect()
    spark._jvm.System.gc()
    time.sleep(1)


def warm_up(spark, lake, blocks: int, seed: int) -> float:
    """Every code path once on small data in its own namespace, so that no engine's figure
    carries the JVM's class loading and JIT warm-up (the first engine would otherwise)."""
    t = time.monotonic()
    d = WORK / f"n{blocks}"
    info = generate(blocks, seed, d)
    block_cfg, perm_cfg, tree_cfg = configs("warmup")
    cfgs = [block_cfg, perm_cfg]
    tables = {"block": block_cfg, "permission": perm_cfg}
    load_inputs(spark, lake, cfgs, [BLOCK_COLS, PERM_COLS], [d / "block.parquet", d / "permission.parquet"])
    ours(spark, lake, tree_cfg("block_tree"), tables, full=True)
    naive_tree(spark, lake, block_cfg, perm_cfg, lake.qualified("warmup.block_tree_naive"), 128, 600)
    apply_batch(spark, lake, cfgs, [d / "batch_block.parquet", d / "batch_permission.parquet"], info["hi_lsn"])
    ours(spark, lake, tree_cfg("block_tree"), tables, full=False)
    return round(time.monotonic() - t, 1)


def code_version() -> dict:
    """What was measured: the commit, and the derived package's files (they may be uncommitted)."""
    import hashlib
    import subprocess

    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout
    files = sorted((ROOT / "plugins" / "cdc_lakehouse" / "derived").glob("*.py"))
    dirty = subprocess.run(
        ["git", "diff", "--quiet", "HEAD", "--", "plugins/cdc_lakehouse/derived"], cwd=ROOT, check=False
    ).returncode
    return {
        "git_head": head.strip(),
        "derived_uncommitted_changes": bool(dirty),
        "derived_sha1": {f.name: hashlib.sha1(f.read_bytes()).hexdigest()[:12] for f in files},
    }


def fmt_row(name: str, seconds, jobs, steps, extra: str = "") -> str:
    s = f"{seconds:>9.1f}" if isinstance(seconds, int | float) else f"{seconds:>9}"
    return f"{name:<34}{s}{jobs!s:>11}{steps!s:>15}  {extra}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--naive-timeout", type=float, default=1200, help="seconds before the naive loop is cancelled")
    p.add_argument("--no-rebuild", action="store_true", help="skip the full rebuild after the batch (and its check)")
    p.add_argument("--warmup-blocks", type=int, default=20_000, help="0: no warm-up")
    p.add_argument("--driver-memory", default=os.environ.get("CDC_BENCH_DRIVER_MEMORY", "10g"))
    args = p.parse_args()
    n = args.blocks
    d = WORK / f"n{n}"
    command = "python bench/tree_bench.py " + " ".join(sys.argv[1:])
    rss = PeakRSS(interval=0.5)
    rss.__enter__()

    info = generate(n, args.seed, d)
    dep = info["depth"]
    b = info["batch"]
    print(
        f"data: {n:,} blocks in {info['trees']:,} root pages over {len(SHARDS)} shards; {info['grant_rows']:,} "
        f"grants on {info['grant_holders']:,} blocks (generated in {info['generate_seconds']} s, cached in {d})\n"
        f"depth: mean {dep['mean']}, p50 {dep['p50']}, p90 {dep['p90']}, p99 {dep['p99']}, max {dep['max']}\n"
        f"  {histogram_line(dep['histogram'])}\n"
        f"batch: {b['events']:,} events = {b['update']:,} updates (version), {b['move']:,} moves, "
        f"{b['insert']:,} inserts, {b['delete']:,} deletes (blocks) + {b['grant']:,} grant changes",
        flush=True,
    )

    from cdc_lakehouse.runtime.session import get_spark
    from cdc_lakehouse.settings import LakeSettings

    warehouse = d / "warehouse"
    shutil.rmtree(warehouse, ignore_errors=True)
    lake = LakeSettings(
        catalog_type="hadoop", catalog_name="lake", warehouse=f"file://{warehouse}", landing_uri=f"file://{d}/landing"
    )
    spark = get_spark(
        "bench-tree", lake, classic=True, driver_memory=args.driver_memory, extra={"spark.ui.enabled": "false"}
    )
    block_cfg, perm_cfg, tree_cfg = configs()
    cfgs = [block_cfg, perm_cfg]
    tables = {"block": block_cfg, "permission": perm_cfg}
    dcfg = tree_cfg("block_tree")
    out = lake.qualified(dcfg.output_table)
    res: dict = {
        "blocks": n,
        "command": command,
        "code": code_version(),
        "data": info,
        "machine": machine(),
        "spark": spark.version,
        "driver_memory": args.driver_memory,
        "shuffle_partitions": spark.conf.get("spark.sql.shuffle.partitions"),
        "engines": {},
    }
    path = HERE / "results" / f"tree-{n}.json"
    path.parent.mkdir(exist_ok=True)

    def save() -> None:
        res["peak_rss_mb"] = round(rss.peak_mb)
        path.write_text(json.dumps(res, indent=2, default=str))

    if args.warmup_blocks:
        res["warmup_seconds"] = warm_up(spark, lake, args.warmup_blocks, args.seed)
        print(f"warm-up on {args.warmup_blocks:,} blocks (not measured): {res['warmup_seconds']} s", flush=True)
    t = time.monotonic()
    load_inputs(spark, lake, cfgs, [BLOCK_COLS, PERM_COLS], [d / "block.parquet", d / "permission.parquet"])
    res["load_seconds"] = round(time.monotonic() - t, 1)
    print(f"inputs written to the lake in {res['load_seconds']} s", flush=True)

    e = res["engines"]
    e["ours_full"] = ours(spark, lake, dcfg, tables, full=True)
    print(f"ours full: {json.dumps(e['ours_full'], sort_keys=True)}", flush=True)
    save()
    naive_out = lake.qualified(f"{NS}.block_tree_naive")
    _release(spark)
    before = _cpu_of_others()
    e["naive"] = naive_tree(spark, lake, block_cfg, perm_cfg, naive_out, dcfg.max_depth, args.naive_timeout)
    e["naive"]["other_cpu_seconds"] = _other_cpu(before)
    print(f"naive: {json.dumps({k: v for k, v in e['naive'].items() if k != 'level_sizes'})}", flush=True)
    if e["naive"]["finished"]:
        e["naive"]["vs_ours_full"] = differing(spark, out, naive_out)
        print(f"naive vs ours full: {e['naive']['vs_ours_full']}", flush=True)
    save()

    t = time.monotonic()
    apply_batch(spark, lake, cfgs, [d / "batch_block.parquet", d / "batch_permission.parquet"], info["hi_lsn"])
    res["batch_seconds"] = round(time.monotonic() - t, 1)
    print(f"batch applied to the inputs in {res['batch_seconds']} s", flush=True)

    e["ours_incremental"] = ours(spark, lake, dcfg, tables, full=False)
    print(f"ours incremental: {json.dumps(e['ours_incremental'], sort_keys=True)}", flush=True)
    save()
    if not args.no_rebuild:
        rcfg = tree_cfg("block_tree_rebuild")
        e["ours_rebuild"] = ours(spark, lake, rcfg, tables, full=True)
        print(f"ours full rebuild after the batch: {json.dumps(e['ours_rebuild'], sort_keys=True)}", flush=True)
        rebuilt = lake.qualified(rcfg.output_table)
        e["ours_incremental"]["vs_rebuild"] = {
            **differing(spark, out, rebuilt),
            "unresolved_differ": differing_unresolved(
                spark, lake.qualified(dcfg.unresolved_table), lake.qualified(rcfg.unresolved_table)
            ),
        }
        print(f"incremental vs rebuild: {e['ours_incremental']['vs_rebuild']}", flush=True)
    spark.stop()
    rss.__exit__(None, None, None)
    save()
    return report(res, args, dep, command, path)


def report(res: dict, args, dep: dict, command: str, path: Path) -> int:
    e, n = res["engines"], res["blocks"]
    full, inc, nv = e["ours_full"], e["ours_incremental"], e["naive"]
    rb = e.get("ours_rebuild")
    print(f"\n{n:,} blocks, depth mean {dep['mean']} / p99 {dep['p99']} / max {dep['max']}; {command}")
    print(f"{'engine':<34}{'seconds':>9}{'Spark jobs':>11}{'passes/levels':>15}  rows")
    print(
        fmt_row(
            "ours full (base data)",
            full["wall_seconds"],
            full["spark_jobs"],
            full["passes"],
            f"{full['resolved']:,} placed, {full['unresolved']:,} unresolved",
        )
    )
    naive_secs = nv["seconds"] if nv["finished"] else f">{nv['seconds']:.0f}"
    print(
        fmt_row(
            "naive level loop (base data)",
            naive_secs,
            nv["spark_jobs"],
            nv["levels"],
            f"{nv['placed']:,} placed" + ("" if nv["finished"] else f" (did not finish in {args.naive_timeout:.0f} s)"),
        )
    )
    print(
        fmt_row(
            "ours incremental (1% changed)",
            inc["wall_seconds"],
            inc["spark_jobs"],
            inc["passes"],
            f"mode {inc['mode']}, {inc.get('changed', 0):,} changed, {inc.get('affected', 0):,} affected",
        )
    )
    if rb:
        print(
            fmt_row(
                "ours full rebuild (after batch)",
                rb["wall_seconds"],
                rb["spark_jobs"],
                rb["passes"],
                f"{rb['resolved']:,} placed, {rb['unresolved']:,} unresolved",
            )
        )
    ratios = {}
    if nv["finished"]:
        ratios["naive / ours full"] = nv["seconds"] / full["wall_seconds"]
    else:
        ratios["naive / ours full (lower bound)"] = nv["seconds"] / full["wall_seconds"]
    ratios["ours full (base) / incremental"] = full["wall_seconds"] / inc["wall_seconds"]
    if rb:
        ratios["ours full rebuild / incremental"] = rb["wall_seconds"] / inc["wall_seconds"]
    res["ratios"] = {k: round(v, 2) for k, v in ratios.items()}
    path.write_text(json.dumps(res, indent=2, default=str))
    print("ratios: " + ", ".join(f"{k} = {v:.2f}x" for k, v in ratios.items()))
    print(f"phases (s): full {full['phases']}; incremental {inc['phases']}; naive {nv['phases']}")
    if nv["finished"]:
        print(f"check: naive vs ours full, rows differing: {nv['vs_ours_full']}")
    if rb:
        print(f"check: incremental vs full rebuild, rows differing: {inc['vs_rebuild']}")
    print(
        f"setup (not measured): warm-up {res.get('warmup_seconds', 0)} s, inputs written in {res['load_seconds']} s, "
        f"batch applied in {res['batch_seconds']} s"
    )
    print(f"peak RSS (Python + Spark JVM): {res['peak_rss_mb']:,} MB; driver memory {args.driver_memory}")
    others = {k: v.get("other_cpu_seconds") for k, v in e.items()}
    print(f"CPU seconds used by other processes during each engine (near 0: the machine was ours): {others}")
    print(f"code: {res['code']}")
    print(f"results: {path}")
    ok = inc["mode"] == "incremental"
    if nv["finished"]:
        ok &= not any(nv["vs_ours_full"].values())
    if rb:
        ok &= not any(inc["vs_rebuild"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
