"""The tree derivation as DataFrame steps (docs/derived-trees.md): nodes with a parent link in,
per node its root, depth, ancestor path and effective grants out.

Pointer jumping: every node holds a pointer `ptr` and the ancestors `seg` strictly between itself
and `ptr`. A pass joins each pending node with the state of its pointer and takes that state's
segment and pointer: the span a node knows doubles per pass, so a chain of depth d resolves in
about log2(d) passes (a per-level loop would need d joins). A node is done when its pointer's
state is done: it reached a root, a node known from the previous run, or a parent that is missing.

Grants are not looked up per ancestor: the jumps carry `above`, the nearest ancestor holding an
explicit grant, so each node's effective grants are those of one node (itself if it holds any,
else `above`), and only holders' paths are expanded to compute grant sets.

Every function takes and returns DataFrames; nothing is collected to the driver.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from cdc_lakehouse.columns import SHARD_COL

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

# Internal names of the resolver's state (inputs are renamed to them, outputs back).
ID, PARENT, ATTR = "_n", "_p", "_a"
STATE = [SHARD_COL, ID, PARENT, ATTR, "holder", "ptr", "seg", "above", "done", "reason", "missing", "root_attr"]

# Why a node is unresolved. Each is retried every run: the data that resolves it may arrive later.
MISSING_PARENT = "missing_parent"
PARENT_IN_OTHER_SHARD = "parent_in_other_shard"
CYCLE = "cycle"
TOO_DEEP = "too_deep"


def max_passes(max_depth: int) -> int:
    """Passes after which every node within max_depth of a root or a known node is done: after
    k passes a pending node knows 2^k ancestors; two more for the last hop and the margin."""
    return math.ceil(math.log2(max(2, max_depth))) + 2


def initial_state(nodes: DataFrame, holders: DataFrame) -> DataFrame:
    """nodes (shard, _n, _p, _a) -> resolver state: roots are done, the rest point at their parent."""
    from pyspark.sql import functions as F

    h = holders.select(SHARD_COL, F.col(ID).alias("_h"), F.lit(True).alias("holder"))
    is_root = F.col(PARENT).isNull()
    return nodes.join(h, (nodes[SHARD_COL] == h[SHARD_COL]) & (nodes[ID] == h["_h"]), "left").select(
        nodes[SHARD_COL],
        nodes[ID],
        nodes[PARENT],
        nodes[ATTR],
        F.coalesce(F.col("holder"), F.lit(False)).alias("holder"),
        F.when(~is_root, F.col(PARENT)).alias("ptr"),
        F.array().cast(f"array<{nodes.schema[ID].dataType.simpleString()}>").alias("seg"),
        F.lit(None).cast(nodes.schema[ID].dataType).alias("above"),
        is_root.alias("done"),
        F.lit(None).cast("string").alias("reason"),
        F.lit(None).cast(nodes.schema[ID].dataType).alias("missing"),
        F.when(is_root, F.col(ATTR)).alias("root_attr"),
    )


def jump(state: DataFrame, lookup: DataFrame, max_depth: int) -> DataFrame:
    """One pass: each pending node takes its pointer's segment and pointer from `lookup` (states
    keyed by shard and node); a pointer with no state is a missing node. A node that already
    knows more than max_depth ancestors stops there (a cycle or a chain too deep): segments never
    grow past twice max_depth, whatever the data."""
    from pyspark.sql import functions as F

    done = state.filter(F.col("done"))
    pending = state.filter(~F.col("done")).alias("s")
    lk = lookup.select(
        F.col(SHARD_COL).alias("l_shard"),
        F.col(ID).alias("l_id"),
        *[
            F.col(c).alias(f"l_{c}")
            for c in ("holder", "ptr", "seg", "above", "done", "reason", "missing", "root_attr")
        ],
    )
    j = pending.join(lk, (F.col(f"s.{SHARD_COL}") == F.col("l_shard")) & (F.col("s.ptr") == F.col("l_id")), "left")
    found = F.col("l_id").isNotNull()
    nearest_holder = F.coalesce(F.col("above"), F.when(F.col("l_holder"), F.col("ptr")), F.col("l_above"))
    stepped = j.select(
        F.col(f"s.{SHARD_COL}").alias(SHARD_COL),
        F.col(ID),
        F.col(PARENT),
        F.col(ATTR),
        F.col("holder"),
        F.when(found, F.col("l_ptr")).alias("ptr"),
        F.when(found, F.concat("seg", F.array("ptr"), "l_seg")).otherwise(F.col("seg")).alias("seg"),
        F.when(found, nearest_holder).otherwise(F.col("above")).alias("above"),
        (~found | F.col("l_done")).alias("done"),
        F.when(found, F.col("l_reason")).otherwise(F.lit(MISSING_PARENT)).alias("reason"),
        F.when(found, F.col("l_missing")).otherwise(F.col("ptr")).alias("missing"),
        F.when(found, F.col("l_root_attr")).alias("root_attr"),
    )
    over = ~F.col("done") & (F.size("seg") > max_depth)
    stopped = stepped.withColumn("reason", F.when(over, _too_long()).otherwise(F.col("reason"))).withColumn(
        "done", F.col("done") | over
    )
    return done.unionByName(stopped)


def _too_long() -> Column:
    from pyspark.sql import functions as F

    repeated = F.array_contains("seg", F.col(ID)) | (F.size(F.array_distinct("seg")) < F.size("seg"))
    return F.when(repeated, F.lit(CYCLE)).otherwise(F.lit(TOO_DEEP))


def known_state(previous: DataFrame) -> DataFrame:
    """Resolver states of nodes resolved by an earlier run (rows of the output in internal names):
    done, with their full segment, so pending nodes below them finish in one pass."""
    from pyspark.sql import functions as F

    return previous.select(
        SHARD_COL,
        ID,
        PARENT,
        F.lit(None).cast(previous.schema["root_attr"].dataType).alias(ATTR),
        (F.col("grants_from") == F.col(ID)).alias("holder"),
        F.lit(None).cast(previous.schema[ID].dataType).alias("ptr"),
        F.reverse("path").alias("seg"),
        F.col("grants_above").alias("above"),
        F.lit(True).alias("done"),
        F.lit(None).cast("string").alias("reason"),
        F.lit(None).cast(previous.schema[ID].dataType).alias("missing"),
        F.col("root_attr"),
    )


def classify(state: DataFrame, max_depth: int) -> DataFrame:
    """Final reasons: still pending after the last pass means a cycle (a repeated ancestor) or a
    chain deeper than max_depth; a done node deeper than max_depth is too deep as well."""
    from pyspark.sql import functions as F

    reason = (
        F.when(F.col("reason").isNotNull(), F.col("reason"))
        .when(~F.col("done"), _too_long())
        .when(F.size("seg") > max_depth, F.lit(TOO_DEEP))
    )
    return state.withColumn("reason", reason)


def other_shard_parents(unresolved: DataFrame, all_nodes: DataFrame) -> DataFrame:
    """missing_parent where the missing node exists in another shard: a different outcome (the
    data breaks the sharding, it will not arrive in this shard)."""
    from pyspark.sql import functions as F

    missing = unresolved.filter(F.col("reason") == MISSING_PARENT).select(F.col("missing").alias("_m")).distinct()
    elsewhere = (
        all_nodes.join(F.broadcast(missing), all_nodes[ID] == missing["_m"])
        .groupBy("_m")
        .agg(F.min(SHARD_COL).alias("_other_shard"))
    )
    j = unresolved.join(elsewhere, unresolved["missing"] == elsewhere["_m"], "left")
    in_other = (F.col("reason") == MISSING_PARENT) & F.col("_other_shard").isNotNull()
    return j.withColumn("reason", F.when(in_other, F.lit(PARENT_IN_OTHER_SHARD)).otherwise(F.col("reason"))).drop("_m")


def detail(max_depth: int) -> Column:
    """A sentence per unresolved node naming the node that blocks it and what resolves it."""
    from pyspark.sql import functions as F

    missing = F.col("missing").cast("string")
    return (
        F.when(
            F.col("reason") == MISSING_PARENT,
            F.concat(F.lit("ancestor "), missing, F.lit(" is not in this shard yet; resolves when it arrives")),
        )
        .when(
            F.col("reason") == PARENT_IN_OTHER_SHARD,
            F.concat(
                F.lit("ancestor "), missing, F.lit(" is in shard "), F.col("_other_shard"), F.lit(", not this one")
            ),
        )
        .when(
            F.col("reason") == CYCLE, F.concat(F.lit("parent links loop through "), F.slice("seg", 1, 8).cast("string"))
        )
        .otherwise(F.lit(f"more than max_depth={max_depth} ancestors; raise max_depth if the data is right"))
    )


def grant_sets(resolved: DataFrame, grants: DataFrame) -> DataFrame:
    """(shard, holder id, grants) for every holder among `resolved`: walking from the holder up
    its path, the nearest explicit grant per principal wins (the holder's own first)."""
    from pyspark.sql import functions as F

    holders = resolved.filter(F.col("holder")).select(
        SHARD_COL, F.col(ID).alias("_holder"), F.posexplode(F.concat(F.array(ID), "seg")).alias("_dist", "_on")
    )
    g = grants.select(F.col(SHARD_COL).alias("_gs"), F.col(ID).alias("_gn"), F.col("principal"), F.col("grant")).alias(
        "g"
    )
    hits = holders.join(g, (holders[SHARD_COL] == F.col("_gs")) & (holders["_on"] == F.col("_gn")))
    nearest = hits.groupBy(SHARD_COL, "_holder", "principal").agg(
        F.min_by(F.struct("grant", F.col("_on").alias("granted_on")), F.col("_dist")).alias("_g")
    )
    entry = F.struct(F.col("principal"), F.col("_g.grant").alias("grant"), F.col("_g.granted_on").alias("granted_on"))
    return nearest.groupBy(SHARD_COL, "_holder").agg(F.array_sort(F.collect_list(entry)).alias("grants"))
