"""One run of a derived tree (docs/derived-trees.md): current lake tables in, the tree table and
its unresolved nodes out.

    pin       the inputs' snapshots and watermarks: what this run reads, and its watermark. Both
              inputs at their endpoint's newest consistent point (lake.points: no source
              transaction that wrote both is read in half), or each at its current snapshot
              while they have none or with `read_at: current`
    plan      full (first run, `full`, a changed max_depth or set of inputs), incremental, or
              nothing; an input's previous snapshot expired is an error asking for `full`
    affected  nodes whose parent, existence or root attribute changed, nodes whose grants changed
              (the node a changed grant is on now, and the one it was on before), every unresolved
              node, and their descendants in the previous output. An input's changed keys come
              from lake.ranges, the rule the change feed and serving exports use: its changelog
              across ingest commits, else a diff of its two pinned snapshots
    resolve   pointer jumping over those nodes; their other ancestors come from the previous output
    grants    each grant holder's effective grants; other nodes take their nearest holder's
    commit    the unresolved table, then the output with the new watermark, each fenced on its old one
    hold      each input's pinned snapshot, held against expiry until the next run (lake.holds)

A crash between the two commits leaves the output's old watermark: the next run recomputes the
same nodes (and the newly unresolved ones again), so runs converge.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from pydantic import Field

from cdc_lakehouse.columns import SHARD_COL
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.derived.config import TreeConfig
from cdc_lakehouse.derived.tree import (
    ATTR,
    ID,
    PARENT,
    classify,
    detail,
    grant_sets,
    initial_state,
    jump,
    known_state,
    max_passes,
    other_shard_parents,
)
from cdc_lakehouse.identifiers import spark_ident
from cdc_lakehouse.lake.batches import BatchId, BatchStep, commit_once
from cdc_lakehouse.lake.commits import fenced_commit, sql_with_commit_properties
from cdc_lakehouse.lake.holds import hold, lag_error
from cdc_lakehouse.lake.points import latest_point, spark_history
from cdc_lakehouse.lake.ranges import KeyRange, changed_keys, key_range, live_rows, table_snapshots
from cdc_lakehouse.lake.snapshots import current_ancestors
from cdc_lakehouse.lake.tables import ensure_namespace, table_exists
from cdc_lakehouse.runtime.failpoints import crash_point
from cdc_lakehouse.runtime.phases import PhaseClock, SparkJobs, local_checkpoint
from cdc_lakehouse.settings import LakeSettings
from cdc_lakehouse.watermark import WATERMARK_PROP, StoredJson, Watermark, watermark_text_in

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)

TREE_WATERMARK_VERSION = 1


class InputPosition(StoredJson):
    """An input as a run pinned it: its snapshot and that snapshot's shard positions."""

    snapshot: int | None
    shards: dict[str, int] = Field(default_factory=dict)


class TreeWatermark(StoredJson):
    """A derived table's `cdc.watermark` (the same property as a replicated table's, another
    JSON): the inputs the run read and the depth it resolved to."""

    v: int = TREE_WATERMARK_VERSION
    max_depth: int | None = None
    inputs: dict[str, InputPosition] = Field(default_factory=dict)

    @classmethod
    def from_json(cls, text: str) -> TreeWatermark:
        return cls.model_validate_json(text)


def tree_watermark_in(snapshots: Iterable[Any]) -> TreeWatermark | None:
    """The newest tree watermark in a chain of snapshots (newest first); lake.commits fences on it."""
    text = watermark_text_in(snapshots)
    return None if text is None else TreeWatermark.from_json(text)


def read_tree_watermark(spark: SparkSession, table: str) -> TreeWatermark | None:
    """The derived table's watermark (current_ancestors refreshes the table first)."""
    return tree_watermark_in(current_ancestors(spark, table))


@dataclass(frozen=True)
class Pinned:
    """An input as this run reads it: its current snapshot and that snapshot's shard positions."""

    cfg: TableConfig
    table: str  # catalog-qualified current table
    snapshot: int | None
    shards: dict[str, int]

    def position(self) -> InputPosition:
        return InputPosition(snapshot=self.snapshot, shards=self.shards)


@dataclass(frozen=True)
class DeriveResult:
    """What one run of a derived tree did. Figures a run does not produce are None (a noop run
    only pins; only an incremental run counts changed and affected nodes)."""

    mode: str  # full | incremental | noop
    spark_jobs: int | None  # None: not known (no Spark UI to count them on)
    seconds: float
    phases: dict[str, float]  # seconds per phase
    keys_from: dict[str, str] | None = None  # input name -> how its changed keys were found (lake.ranges)
    changed: int | None = None
    affected: int | None = None
    passes: int | None = None
    resolved: int | None = None
    unresolved: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """For the job's result line and the log: the figures the run produced."""
        always = ("mode", "spark_jobs", "seconds", "phases")
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None or f.name in always}


@dataclass
class TreeRun:
    """What the phases share."""

    dcfg: TreeConfig
    lake: LakeSettings
    nodes: Pinned
    grants: Pinned | None
    out: str
    unresolved: str
    previous: TreeWatermark | None  # the output's watermark before this run
    unresolved_previous: TreeWatermark | None  # the unresolved table's (ahead after a kill between the commits)
    mode: str = "full"
    ranges: dict[str, KeyRange] = field(default_factory=dict)  # input name -> its range since the previous run
    # What the run reports (DeriveResult), set by the phase that finds it:
    keys_from: dict[str, str] = field(default_factory=dict)  # input name -> how its changed keys were found
    changed: int | None = None  # changed nodes (incremental)
    affected_count: int | None = None  # nodes an incremental run recomputes (0: only the watermark moves)
    passes: int | None = None  # pointer-jumping passes
    resolved: int | None = None  # rows committed to the output
    unresolved_count: int | None = None  # and to the unresolved table

    @property
    def watermark(self) -> TreeWatermark:
        inputs = {p.cfg.name: p.position() for p in (self.nodes, self.grants) if p is not None}
        return TreeWatermark(v=TREE_WATERMARK_VERSION, max_depth=self.dcfg.max_depth, inputs=inputs)


def derive_tree(
    spark: SparkSession,
    lake: LakeSettings,
    dcfg: TreeConfig,
    tables: dict[str, TableConfig],
    *,
    full: bool = False,
) -> DeriveResult:
    """Bring the tree table up to its inputs' current snapshots; returns what the run did."""
    clock = PhaseClock()
    with SparkJobs(spark, f"derive {dcfg.name}") as jobs:
        with clock.phase("pin"):
            r = pin_run(spark, lake, dcfg, tables, full=full)
        if r.mode != "noop":
            nodes, grants, previous = read_inputs(spark, r)
            with clock.phase("affected"):
                # previous: the output before this run, which read_inputs reads for an incremental run only
                affected = affected_nodes(spark, r, nodes, previous) if previous is not None else None
            with clock.phase("resolve"):
                state = resolve(r, nodes, grants, affected, previous)
            with clock.phase("commit"):
                rows = output_rows(r, state, grants, previous, affected)
                commit(spark, r, rows, unresolved_rows(r, state, nodes), affected)
        hold_inputs(spark, r)
    result = DeriveResult(
        mode=r.mode,
        spark_jobs=jobs.count,
        seconds=round(clock.elapsed(), 1),
        phases=clock.rounded(),
        keys_from=r.keys_from or None,
        changed=r.changed,
        affected=r.affected_count,
        passes=r.passes,
        resolved=r.resolved,
        unresolved=r.unresolved_count,
    )
    log.info("derived %s: %s", dcfg.name, json.dumps(result.to_dict(), sort_keys=True))
    return result


# --- pin and plan ---------------------------------------------------------------------------------


def pin_input(spark: SparkSession, lake: LakeSettings, cfg: TableConfig) -> Pinned:
    """The current snapshot and the watermark it carries (its own or its nearest ancestor's)."""
    table = lake.qualified(cfg.current_table)
    if not table_exists(spark, table):
        raise RuntimeError(f"input table {table} of a derived table does not exist: bootstrap {cfg.name} first")
    spark.sql(f"REFRESH TABLE {table}")
    snapshot, shards = None, {}
    for snap in current_ancestors(spark, table):
        snapshot = snapshot if snapshot is not None else int(snap.snapshot_id)
        wm = snap.summary.get(WATERMARK_PROP)
        if wm is not None:
            shards = Watermark.from_json(wm).shard_lsns()
            break
    return Pinned(cfg, table, snapshot, shards)


def pin_run(
    spark: SparkSession, lake: LakeSettings, dcfg: TreeConfig, tables: dict[str, TableConfig], *, full: bool
) -> TreeRun:
    grants = pin_input(spark, lake, tables[dcfg.grants.table]) if dcfg.grants else None
    out, unresolved = lake.qualified(dcfg.output_table), lake.qualified(dcfg.unresolved_table)
    nodes = pin_input(spark, lake, tables[dcfg.nodes.table])
    previous = read_tree_watermark(spark, out) if table_exists(spark, out) else None
    if grants is not None and dcfg.read_at == "point":
        nodes, grants = pin_at_point(spark, previous, nodes, grants)
    r = TreeRun(
        dcfg,
        lake,
        nodes,
        grants,
        out,
        unresolved,
        previous,
        read_tree_watermark(spark, unresolved) if table_exists(spark, unresolved) else None,
    )
    r.mode = plan_mode(r, full=full)
    if r.mode == "incremental":
        r.ranges = input_ranges(spark, r)
        gone = [f"{name}: {k.reason}" for name, k in r.ranges.items() if k.mode == "full"]
        if gone:
            log.info("derived %s: recomputing the whole tree (%s)", dcfg.name, "; ".join(gone))
            r.mode = "full"
    return r


def pin_at_point(spark: SparkSession, previous: TreeWatermark | None, *pins: Pinned) -> tuple[Pinned, ...]:
    """The inputs at the newest consistent point of their one endpoint; as pinned (current) when
    they are on several endpoints, have no point yet, or the point is behind what the previous
    run read (it read current snapshots before the inputs first met): the output never goes back."""
    endpoints = {g.endpoint_id for p in pins for g in p.cfg.source.shards}
    if len(endpoints) != 1 or any(p.cfg.landing.kind != "capture" for p in pins):
        log.info(
            "derived: inputs %s span endpoints %s: read at their current snapshots",
            [p.table for p in pins],
            sorted(endpoints),
        )
        return pins
    (endpoint,) = endpoints
    histories = {p.table: spark_history(spark, p.table, frozenset(s for _, _, s in p.cfg.shards())) for p in pins}
    point = latest_point(endpoint, histories.values())
    if point is None:
        log.info("derived: inputs %s have no consistent point yet: read at their current snapshots", list(histories))
        return pins
    out = []
    for p in pins:
        sid = point.snapshots[p.table]
        wm = histories[p.table].snaps[sid].watermark
        out.append(Pinned(p.cfg, p.table, sid, wm.shard_lsns() if wm is not None else {}))
    read = previous.inputs if previous is not None else {}
    behind = [
        p.table
        for p in out
        if p.cfg.name in read and any(n < read[p.cfg.name].shards.get(sh, 0) for sh, n in p.shards.items())
    ]
    if behind:
        log.info(
            "derived: consistent point %s is behind the last run's read of %s: read at current snapshots",
            point.lsn,
            behind,
        )
        return pins
    log.info("derived: inputs at consistent point %s of %s: %s", point.lsn, endpoint, point.snapshots)
    return tuple(out)


def input_ranges(spark: SparkSession, r: TreeRun) -> dict[str, KeyRange]:
    """Per input, how its keys changed from the snapshot the previous run pinned to this run's
    (lake.ranges.key_range); `full` when an input had no snapshot then or has none now. A pinned
    snapshot that is gone (the tree lagged past its hold, lake.holds) stops the run naming the fix,
    instead of a whole recomputation nobody asked for."""
    out = {}
    assert r.previous is not None, "an incremental run follows a previous one"
    for p in (r.nodes, r.grants):
        if p is None:
            continue
        lo = r.previous.inputs[p.cfg.name].snapshot
        if p.snapshot is None:
            out[p.cfg.name] = KeyRange(lo, -1, "full", f"{p.table} has no snapshot")
            continue
        snaps = table_snapshots(spark, p.table)[0]
        if lo is not None and lo not in snaps:
            fix = (
                f"trigger cdc_derived__{r.dcfg.name} with mode=full (recomputes the tree from the inputs' current rows)"
            )
            raise lag_error("derived", r.dcfg.name, p.table, lo, r.dcfg.max_lag_hours, fix)
        out[p.cfg.name] = key_range(snaps, lo, p.snapshot)
    return out


def hold_inputs(spark: SparkSession, r: TreeRun) -> None:
    """Hold each input's pinned snapshot (the output's watermark names it) for the next run; after
    the run's commit, so a run that failed or was fenced out leaves the previous run's holds."""
    for p in (r.nodes, r.grants):
        if p is not None and p.snapshot is not None:
            hold(spark, p.table, "derived", r.dcfg.name, p.snapshot, r.dcfg.max_lag_hours)


def plan_mode(r: TreeRun, *, full: bool) -> str:
    prev = r.previous
    if full or prev is None or prev.max_depth != r.dcfg.max_depth:
        return "full"
    if set(prev.inputs) != set(r.watermark.inputs):
        return "full"  # an input was added or removed: nothing to diff against
    if prev.inputs == r.watermark.inputs:
        return "noop"
    return "incremental"


# --- read -----------------------------------------------------------------------------------------


def _at(spark: SparkSession, p: Pinned) -> DataFrame:
    """The input at its pinned snapshot, without soft-deleted rows."""
    return live_rows(spark, p.table, p.cfg, p.snapshot)


def read_inputs(spark: SparkSession, r: TreeRun) -> tuple[DataFrame, DataFrame | None, DataFrame | None]:
    """Nodes (shard, _n, _p, _a), grants (shard, _n, principal, grant) and the previous output in
    internal names (None on a full run)."""
    from pyspark.sql import functions as F

    n = r.dcfg.nodes
    attr = F.col(n.root_attribute) if n.root_attribute else F.lit(None).cast("string")
    nodes = _at(spark, r.nodes).select(
        SHARD_COL, F.col(n.id).alias(ID), F.col(n.parent).alias(PARENT), attr.alias(ATTR)
    )
    grants = None
    if r.grants is not None:
        g = r.dcfg.grants
        assert g is not None  # r.grants is pinned from it
        grants = _at(spark, r.grants).select(
            SHARD_COL,
            F.col(g.node).alias(ID),
            F.col(g.principal).cast("string").alias("principal"),
            F.col(g.grant).cast("string").alias("grant"),
        )
    previous = None
    if r.mode == "incremental":
        root = F.col(root_attr_column(r.dcfg)) if n.root_attribute else F.lit(None).cast("string")
        previous = spark.table(r.out).select(
            SHARD_COL,
            F.col(n.id).alias(ID),
            F.col(n.parent).alias(PARENT),
            "path",
            "grants",
            "grants_from",
            "grants_above",
            root.alias("root_attr"),
        )
    return nodes, grants, previous


def root_attr_column(dcfg: TreeConfig) -> str:
    return f"root_{dcfg.nodes.root_attribute}"


# --- affected -------------------------------------------------------------------------------------


def input_changes(spark: SparkSession, r: TreeRun, p: Pinned) -> DataFrame:
    """Lake keys of input p changed since the previous run: from its changelog, or by diffing the
    snapshot the previous run pinned with this run's (lake.ranges decides which)."""
    found = changed_keys(spark, r.lake, p.cfg, r.ranges[p.cfg.name], at_hi=_at(spark, p))
    r.keys_from[p.cfg.name] = found.found_by
    return found.keys


def changed_nodes(spark: SparkSession, r: TreeRun) -> DataFrame:
    """(shard, _n) of the nodes changed since the previous run (a node's lake key is shard and id)."""
    from pyspark.sql import functions as F

    return input_changes(spark, r, r.nodes).select(SHARD_COL, F.col(r.dcfg.nodes.id).alias(ID))


def changed_grant_nodes(spark: SparkSession, r: TreeRun) -> DataFrame:
    """(shard, _n) of the nodes whose grants changed: for each changed grant, the node it is on
    now and the node it was on at the previous run's pinned snapshot. A grants table keyed by a
    surrogate id is why both are read from the table: with the default replica identity a DELETE
    carries only the id, and an UPDATE moving a grant from X to Y only its new row, so neither the
    key nor the changelog names X; the grants table as of that snapshot does."""
    from pyspark.sql import functions as F

    p, g = r.grants, r.dcfg.grants
    assert p is not None and g is not None, "called only for a tree with grants"
    node = g.node
    keys = local_checkpoint(input_changes(spark, r, p))
    before = live_rows(spark, p.table, p.cfg, r.ranges[p.cfg.name].lo)
    on = [
        df.join(keys, p.cfg.lake_key, "left_semi").select(SHARD_COL, F.col(node).alias(ID))
        for df in (before, _at(spark, p))
    ]
    return on[0].unionByName(on[1])


def structural(node_changes: DataFrame, nodes: DataFrame, previous: DataFrame) -> DataFrame:
    """Changed nodes whose place in the tree may differ: deleted, new (or unresolved before), moved,
    or a root whose root attribute changed. Most changes are updates of other columns: those
    change nothing in the tree and are not recomputed."""
    from pyspark.sql import functions as F

    keys = node_changes.select(SHARD_COL, ID).distinct()
    now = nodes.join(keys, [SHARD_COL, ID], "left_semi").withColumn("_now", F.lit(True))
    was = previous.select(SHARD_COL, ID, F.col(PARENT).alias("_pp"), "root_attr", F.lit(True).alias("_was"))
    j = keys.join(now, [SHARD_COL, ID], "left").join(was, [SHARD_COL, ID], "left")
    moved = ~F.col(PARENT).eqNullSafe(F.col("_pp"))
    new_root_attr = F.col(PARENT).isNull() & ~F.col(ATTR).cast("string").eqNullSafe(F.col("root_attr").cast("string"))
    return j.filter(F.col("_now").isNull() | F.col("_was").isNull() | moved | new_root_attr).select(SHARD_COL, ID)


def affected_nodes(spark: SparkSession, r: TreeRun, nodes: DataFrame, previous: DataFrame) -> DataFrame | None:
    """The nodes to recompute (shard, _n), checkpointed; None switches the run to full (no
    snapshot of the unresolved table matches the output's watermark)."""
    from pyspark.sql import functions as F

    seeds = structural(changed_nodes(spark, r), nodes, previous)
    if r.grants is not None:
        seeds = seeds.unionByName(changed_grant_nodes(spark, r))
    unresolved = unresolved_at_watermark(spark, r)
    if unresolved is None:
        log.info("derived %s: no unresolved snapshot matches the output's watermark; recomputing all", r.dcfg.name)
        r.mode = "full"
        return None
    seeds = seeds.unionByName(unresolved.select(SHARD_COL, F.col(r.dcfg.nodes.id).alias(ID)))
    seeds = local_checkpoint(seeds.filter(F.col(ID).isNotNull()).distinct())
    below = previous.select(SHARD_COL, ID, F.explode("path").alias("_anc"))
    descendants = below.join(seeds.select(SHARD_COL, F.col(ID).alias("_anc")), [SHARD_COL, "_anc"], "left_semi").select(
        SHARD_COL, ID
    )
    affected = local_checkpoint(seeds.unionByName(descendants).distinct())
    r.affected_count, r.changed = affected.count(), seeds.count()
    return affected


def unresolved_at_watermark(spark: SparkSession, r: TreeRun) -> DataFrame | None:
    """The unresolved table as it was committed with the output's current watermark. Not its
    current state: a run killed between its two commits has already removed from it the nodes
    it resolved, and only its output commit (which did not land) would have placed them."""
    if not table_exists(spark, r.unresolved):
        return None
    for snap in current_ancestors(spark, r.unresolved):
        wm = snap.summary.get(WATERMARK_PROP)
        if wm is not None and TreeWatermark.from_json(wm) == r.previous:
            return spark.sql(f"SELECT * FROM {r.unresolved} VERSION AS OF {int(snap.snapshot_id)}")
    return None


# --- resolve --------------------------------------------------------------------------------------


def resolve(
    r: TreeRun, nodes: DataFrame, grants: DataFrame | None, affected: DataFrame | None, previous: DataFrame | None
) -> DataFrame:
    """Resolver state of every node to recompute, classified (docs/derived-trees.md)."""
    from pyspark.sql import functions as F

    pending = nodes if affected is None else nodes.join(affected, [SHARD_COL, ID], "left_semi")
    holders = grants.select(SHARD_COL, ID).distinct() if grants is not None else nodes.limit(0).select(SHARD_COL, ID)
    state = local_checkpoint(initial_state(pending, holders))
    known = None
    if previous is not None and affected is not None:
        # Only the previous output's rows that are parents of recomputed nodes can be pointed at:
        # pointers only ever move to a parent of some pending node.
        parents = pending.select(SHARD_COL, F.col(PARENT).alias(ID)).distinct()
        unaffected = previous.join(affected, [SHARD_COL, ID], "left_anti").join(parents, [SHARD_COL, ID], "left_semi")
        known = local_checkpoint(known_state(unaffected))
    passes = 0
    while passes < max_passes(r.dcfg.max_depth) and not state.filter(~F.col("done")).isEmpty():
        lookup = state if known is None else state.unionByName(known, allowMissingColumns=True)
        state = local_checkpoint(jump(state, lookup, r.dcfg.max_depth))
        passes += 1
    r.passes = passes
    return local_checkpoint(classify(state, r.dcfg.max_depth))


# --- outputs --------------------------------------------------------------------------------------


def output_rows(
    r: TreeRun, state: DataFrame, grants: DataFrame | None, previous: DataFrame | None, affected: DataFrame | None
) -> DataFrame:
    """Resolved nodes in the output's columns."""
    from pyspark.sql import functions as F

    n = r.dcfg.nodes
    resolved = state.filter(F.col("reason").isNull())
    id_type = state.schema[ID].dataType.simpleString()
    entry = f"struct<principal:string,grant:string,granted_on:{id_type}>"
    rows = resolved.withColumn("grants_from", F.when(F.col("holder"), F.col(ID)).otherwise(F.col("above")))
    if grants is not None:
        sets = grant_sets(resolved, grants)
        if previous is not None and affected is not None:
            # Holders outside the affected set keep their grant sets: take those of the holders the
            # recomputed nodes point at (filters first: the previous output is the big side).
            needed = resolved.filter(~F.col("holder")).select(SHARD_COL, F.col("above").alias(ID)).distinct()
            kept = (
                previous.filter(F.col("grants_from") == F.col(ID))
                .join(needed, [SHARD_COL, ID], "left_semi")
                .join(affected, [SHARD_COL, ID], "left_anti")
            )
            sets = sets.unionByName(kept.select(SHARD_COL, F.col(ID).alias("_holder"), "grants"))
        rows = rows.join(
            sets.withColumnRenamed(SHARD_COL, "_gs"),
            (F.col(SHARD_COL) == F.col("_gs")) & (F.col("grants_from") == F.col("_holder")),
            "left",
        )
    else:
        rows = rows.withColumn("grants", F.lit(None))
    extra = [F.col("root_attr").alias(root_attr_column(r.dcfg))] if n.root_attribute else []
    return rows.select(
        SHARD_COL,
        F.col(ID).alias(n.id),
        F.col(PARENT).alias(n.parent),
        F.when(F.size("seg") > 0, F.element_at("seg", -1)).otherwise(F.col(ID)).alias("root_id"),
        *extra,
        F.size("seg").alias("depth"),
        F.reverse("seg").alias("path"),
        F.coalesce(F.col("grants"), F.array().cast(f"array<{entry}>")).cast(f"array<{entry}>").alias("grants"),
        F.col("grants_from"),
        F.col("above").alias("grants_above"),
        F.current_timestamp().alias("_derived_at"),
    )


def unresolved_rows(r: TreeRun, state: DataFrame, nodes: DataFrame) -> DataFrame:
    """Nodes that cannot be placed, with the reason and what would resolve them."""
    from pyspark.sql import functions as F

    n = r.dcfg.nodes
    bad = other_shard_parents(state.filter(F.col("reason").isNotNull()), nodes)
    return bad.select(
        SHARD_COL,
        F.col(ID).alias(n.id),
        F.col(PARENT).alias(n.parent),
        F.col("reason"),
        detail(r.dcfg.max_depth).alias("detail"),
        F.current_timestamp().alias("_derived_at"),
    )


# --- commit ---------------------------------------------------------------------------------------


def _ensure_table(spark: SparkSession, table: str, like: DataFrame) -> None:
    from pyspark.sql import functions as F

    if not table_exists(spark, table):
        w = spark.createDataFrame([], like.schema).writeTo(table).using("iceberg").partitionedBy(F.col(SHARD_COL))
        # Incremental runs replace scattered keys (a subtree is spread over the table): merge-on-read
        # writes delete files for them instead of rewriting every data file that holds one. A full
        # run rewrites the table, and with it the delete files.
        for k, v in {
            "format-version": "2",
            **{f"write.{op}.mode": "merge-on-read" for op in ("merge", "update", "delete")},
        }.items():
            w = w.tableProperty(k, v)
        w.create()


def commit(spark: SparkSession, r: TreeRun, rows: DataFrame, unresolved: DataFrame, affected: DataFrame | None) -> None:
    """Unresolved first, then the output with the watermark: the output's commit is the run's.
    Both commits carry the watermark (unresolved_at_watermark finds the matching pair) and the
    batch id (lake.batches): a rerun of the same batch after a kill between them does not commit
    the unresolved table a second time. Each is fenced on the position its table had when this
    run pinned its inputs, checked when it is published (lake.commits.fenced_commit): a run that
    overlaps another (a zombie, a manual run) neither lands stale rows over newer ones nor
    commits a batch twice."""
    props = {WATERMARK_PROP: r.watermark.to_json()}
    ensure_namespace(spark, r.lake, r.dcfg.lake.namespace)
    for table, df in ((r.unresolved, unresolved), (r.out, rows)):
        _ensure_table(spark, table, df)
    rows = local_checkpoint(rows)
    unresolved = local_checkpoint(unresolved)
    r.resolved, r.unresolved_count = rows.count(), unresolved.count()
    previous = None if r.previous is None else r.previous.to_dict()
    batch = BatchId.of(f"derived:{r.out}", previous, r.watermark.to_dict())
    what = f"derived {r.dcfg.name}"

    def _fenced(name: str, table: str, previous: TreeWatermark | None, df: DataFrame) -> BatchStep:
        def step(p: dict[str, str]) -> None:
            write = lambda target: _replace(spark, r, target, df, affected, {**props, **p})  # noqa: E731
            fenced_commit(spark, table, previous, r.watermark, write, what=what, position=tree_watermark_in)

        return BatchStep(name, table, step, positioned=True)

    crash_point("derive_before_unresolved")
    commit_once(spark, batch, _fenced("derive_unresolved", r.unresolved, r.unresolved_previous, unresolved))
    crash_point("derive_after_unresolved")
    commit_once(spark, batch, _fenced("derive_output", r.out, r.previous, rows))


def _replace(
    spark: SparkSession, r: TreeRun, target: str, rows: DataFrame, affected: DataFrame | None, props: dict[str, str]
) -> None:
    """Full: the table becomes `rows`. Incremental: the affected keys' rows become `rows`.
    `target`: the branch of the table the fenced commit writes (lake.commits.fenced_commit)."""
    from pyspark.sql import functions as F

    if affected is None:
        w = rows.writeTo(target)
        for k, v in props.items():
            w = w.option(f"snapshot-property.{k}", v)
        w.overwrite(F.lit(True))
    elif r.affected_count:
        keys = [SHARD_COL, r.dcfg.nodes.id]
        sql_with_commit_properties(spark, merge_sql(target, _keyed(affected, rows, keys), keys, rows), props)
    stamp(spark, target, props)


def stamp(spark: SparkSession, target: str, props: dict[str, str]) -> None:
    """Make sure the head of `target` (`<table>.branch_<name>`) carries props: a write that
    changed nothing (no affected node, an empty table overwritten with nothing) commits no
    snapshot, and the watermark must still move. An empty append then."""
    table, _, branch = target.rpartition(".branch_")
    head = next(current_ancestors(spark, table, branch), None)
    if head is None or any(head.summary.get(k) != v for k, v in props.items()):
        w = spark.createDataFrame([], spark.table(table).schema).writeTo(target)
        for k, v in props.items():
            w = w.option(f"snapshot-property.{k}", v)
        w.append()


def _keyed(affected: DataFrame, rows: DataFrame, keys: list[str]) -> str:
    """A temp view: every affected key, with its new row where it has one (`_present`)."""
    from pyspark.sql import functions as F

    view = f"derived_src_{uuid.uuid4().hex[:10]}"
    a = affected.withColumnRenamed(ID, keys[1])
    a.join(rows.withColumn("_present", F.lit(True)), keys, "left").createOrReplaceTempView(view)
    return view


def merge_sql(target: str, view: str, keys: list[str], like: DataFrame) -> str:
    """Affected keys replace their rows: deleted where there is no new row, updated or inserted."""
    cols = [spark_ident(c) for c in like.columns]
    on = " AND ".join(f"t.{spark_ident(k)} = s.{spark_ident(k)}" for k in keys)
    update = ", ".join(f"t.{c} = s.{c}" for c in cols)
    return (
        f"MERGE INTO {target} t USING {view} s ON {on} "
        "WHEN MATCHED AND s._present IS NULL THEN DELETE "
        f"WHEN MATCHED THEN UPDATE SET {update} "
        f"WHEN NOT MATCHED AND s._present IS NOT NULL THEN INSERT ({', '.join(cols)}) "
        f"VALUES ({', '.join('s.' + c for c in cols)})"
    )
