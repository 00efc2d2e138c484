"""lake.ranges: which keys of a current table changed between two of its snapshots, and whether
its changelog can say. One rule, in one place, for every reader of ranges: the change feed
(feed.plan, feed.read, feed.arrow), serving exports (serving.export) and derived trees (derived.derive_tree).

The changelog between the watermarks of snapshots lo and hi names every key that changed in
(lo, hi] only when all of this holds (`key_range`, mode `changelog`):
  - every snapshot in (lo, hi] is an ingest batch commit (`cdc.writer` = ingest, lake.writers) or
    a compaction (Iceberg operation `replace`, which changes no row);
  - lo is an ancestor of hi (the table was not rolled back in between);
  - no watermark in (lo, hi] lists a pending column backfill;
  - every shard of lo's watermark is in hi's, on the same endpoint and server, not moved back
    (positions of two servers never compare).
Anything else is mode `diff`: the changed keys are those whose live row differs between the two
snapshots. That covers every writer other than the ingest - an audit repair (its rows sit at the
watermark it restates), a quarantine replay (no watermark, no changelog rows), a column backfill,
a bootstrap or re-bootstrap, a chunked bootstrap round - and a commit naming no writer at all (a
manual UPDATE, a tool we do not know, a commit made before writers were named): identification
is positive, a writer is trusted only for what it promises. When lo no longer exists (expired),
the mode is `full`: there is nothing to compare with.

A `changelog` range can still turn out unusable when it is read: a truncate marker (op `t`) in it
means the truncated shard's vanished keys are in no changelog row, so `changed_keys` diffs then.

The rule is pure Python over `SnapshotInfo` (DAG files and the pyiceberg reader use it); the Spark
side (`table_snapshots`, `changed_keys`, `fingerprint_diff`) imports Spark lazily.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from cdc_lakehouse.columns import META_PREFIX, OP_COL
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.lake.writers import READ_UPTO_PROP, WRITER_PROP, names_its_changes
from cdc_lakehouse.runtime.phases import local_checkpoint
from cdc_lakehouse.settings import LakeSettings
from cdc_lakehouse.source.publication import identity_mismatch
from cdc_lakehouse.watermark import WATERMARK_PROP, Watermark

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

RangeMode = Literal["changelog", "diff", "full"]
COMPACTION = "replace"  # Iceberg's operation for rewrites that change no row


@dataclass(frozen=True)
class SnapshotInfo:
    """One snapshot of a table, as the range rule needs it (from lake.snapshots or pyiceberg)."""

    snapshot_id: int
    parent_id: int | None
    operation: str | None
    watermark: Watermark | None  # the parsed `cdc.watermark`, when the snapshot carries one
    writer: str | None = None  # `cdc.writer` (lake.writers), when the snapshot carries one
    read_upto: dict[str, int] | None = None  # `cdc.read-upto` (lake.writers), when it carries one

    @classmethod
    def of(cls, snapshot_id: int, parent_id: int | None, operation: str | None, summary: Any) -> SnapshotInfo:
        """From a snapshot summary (anything with `.get`: pyiceberg's Summary, a dict)."""
        get = summary.get if summary is not None else (lambda _k: None)
        wm, writer, upto = get(WATERMARK_PROP), get(WRITER_PROP), get(READ_UPTO_PROP)
        return cls(
            int(snapshot_id),
            None if parent_id is None else int(parent_id),
            None if operation is None else str(operation),
            None if wm is None else Watermark.from_json(str(wm)),
            None if writer is None else str(writer),
            None if upto is None else {str(k): int(v) for k, v in json.loads(str(upto)).items()},
        )

    @property
    def names_its_changes(self) -> bool:
        """The changelog names every key this commit changed: an ingest batch, or a compaction."""
        return self.operation == COMPACTION or names_its_changes(self.writer)

    def describe(self) -> str:
        return f"snapshot {self.snapshot_id} ({self.operation}, {WRITER_PROP}={self.writer or 'none'})"


def pyiceberg_snapshots(tbl: Any) -> tuple[dict[int, SnapshotInfo], int | None]:
    """A pyiceberg table's snapshots (id -> SnapshotInfo) and its current snapshot id."""
    snaps = {}
    for s in tbl.snapshots():
        summary = s.summary
        op = summary.operation.value if summary is not None else None
        snaps[s.snapshot_id] = SnapshotInfo.of(s.snapshot_id, s.parent_snapshot_id, op, summary)
    cur = tbl.current_snapshot()
    return snaps, None if cur is None else cur.snapshot_id


Snapshots = Mapping[int, SnapshotInfo]


@dataclass(frozen=True)
class KeyRange:
    """How the keys changed in (lo, hi] are found. lo_watermark and hi_watermark are the shard
    positions (shard -> exclusive LSN) of lo's and hi's watermarks (their own or their nearest
    ancestor's): what `changelog` mode reads between."""

    lo: int | None
    hi: int
    mode: RangeMode
    reason: str
    lo_watermark: dict[str, int] = field(default_factory=dict)
    hi_watermark: dict[str, int] = field(default_factory=dict)


# --- the rule (pure) -----------------------------------------------------------------------------


def effective_watermark(snaps: Snapshots, sid: int | None) -> Watermark | None:
    """The watermark of `sid`, or of its nearest ancestor that carries one."""
    while sid is not None and sid in snaps:
        if snaps[sid].watermark is not None:
            return snaps[sid].watermark
        sid = snaps[sid].parent_id
    return None


def between(snaps: Snapshots, lo: int, hi: int) -> list[SnapshotInfo] | None:
    """The snapshots in (lo, hi], oldest first; None when lo is not hi or an ancestor of it."""
    chain: list[SnapshotInfo] = []
    sid: int | None = hi
    while sid is not None and sid != lo:
        snap = snaps.get(sid)
        if snap is None:
            return None  # history cut before lo was reached
        chain.append(snap)
        sid = snap.parent_id
    return None if sid != lo else chain[::-1]


def is_ancestor(snaps: Snapshots, older: int, newer: int) -> bool:
    """Whether `older` is a strict ancestor of `newer`."""
    return older != newer and between(snaps, older, newer) is not None


def key_range(snaps: Snapshots, lo: int | None, hi: int) -> KeyRange:
    """The module's rule: how the keys changed from snapshot lo to snapshot hi are found."""
    if hi not in snaps:
        raise ValueError(f"snapshot {hi} is not among the table's snapshots")
    hi_wm = _positions(effective_watermark(snaps, hi))
    if lo is None or lo not in snaps:
        return KeyRange(lo, hi, "full", f"snapshot {lo} no longer exists (expired): every live row", {}, hi_wm)
    lo_wm = effective_watermark(snaps, lo)
    reason = _history_unusable(snaps, lo, hi) or _positions_unusable(lo, lo_wm, effective_watermark(snaps, hi))
    if reason:
        return KeyRange(lo, hi, "diff", reason, _positions(lo_wm), hi_wm)
    return KeyRange(lo, hi, "changelog", "ingest commits and compactions only", _positions(lo_wm), hi_wm)


def _positions(wm: Watermark | None) -> dict[str, int]:
    return {} if wm is None else wm.shard_lsns()


def _history_unusable(snaps: Snapshots, lo: int, hi: int) -> str | None:
    chain = between(snaps, lo, hi)
    if chain is None:
        return f"snapshot {lo} is not an ancestor of {hi} (the table was rolled back)"
    for snap in chain:
        if not snap.names_its_changes:
            return f"{snap.describe()} is not an ingest batch: the changelog may not name the rows it changed"
        if snap.watermark is not None and snap.watermark.backfill is not None:
            return f"snapshot {snap.snapshot_id} has a pending column backfill"
    return None


def _positions_unusable(lo: int, lo_wm: Watermark | None, hi_wm: Watermark | None) -> str | None:
    if lo_wm is None or hi_wm is None:
        return f"no watermark at or below snapshot {lo}"
    for shard, pos in lo_wm.shards.items():
        cur = hi_wm.shards.get(shard)
        if cur is None:
            return f"shard {shard} left the table"
        # Positions of two servers never compare (a moved or re-bootstrapped shard); a promoted
        # standby's timeline continues the old one up to its switch point (#52).
        if cur.endpoint != pos.endpoint or identity_mismatch(pos.source, cur.source, pos.lsn) is not None:
            return f"shard {shard} moved to another server or endpoint (a move, or a failover past its position)"
        if cur.lsn < pos.lsn:
            return f"shard {shard} moved back (a re-bootstrap)"
    return None


# --- Spark ---------------------------------------------------------------------------------------


def table_snapshots(spark: SparkSession, table: str) -> tuple[dict[int, SnapshotInfo], int | None]:
    """Every snapshot the table still has and the current one (Iceberg's metadata tables,
    lake.snapshots: one small query)."""
    from cdc_lakehouse.lake.snapshots import read_snapshots

    t = read_snapshots(spark, table)
    snaps = {}
    for s in t.by_id.values():
        info = SnapshotInfo.of(s.snapshot_id, s.parent_id, s.operation, s.summary)
        snaps[info.snapshot_id] = info
    return snaps, t.current_id


def live_rows(spark: SparkSession, table: str, cfg: TableConfig | None, snapshot_id: int | None) -> DataFrame:
    """A table's rows at a snapshot (None: its current one), soft-deleted rows left out: to every
    reader of ranges they are deletes."""
    from pyspark.sql import functions as F

    df = spark.sql(f"SELECT * FROM {table} VERSION AS OF {int(snapshot_id)}") if snapshot_id else spark.table(table)
    if cfg is not None and cfg.deletes == "soft" and cfg.soft_delete_columns.flag in df.columns:
        df = df.filter(~F.coalesce(F.col(cfg.soft_delete_columns.flag), F.lit(False)))
    return df


def changelog_keys(
    spark: SparkSession, lake: LakeSettings, cfg: TableConfig, lo: dict[str, int], hi: dict[str, int]
) -> DataFrame | None:
    """Lake keys of the changelog rows between the positions lo and hi (both halves of a key
    change), or None when those hold a truncate marker (op t: the vanished keys are in no row)."""
    from pyspark.sql import functions as F

    from cdc_lakehouse.lake.changelog import changes_between

    rows = local_checkpoint(changes_between(spark, lake, cfg, lo, hi).select(*cfg.lake_key, OP_COL))
    if not rows.filter(F.col(OP_COL) == "t").isEmpty():
        return None
    return rows.filter(F.col(cfg.lake_key[-1]).isNotNull()).select(*cfg.lake_key).distinct()


def fingerprint_diff(at_lo: DataFrame, at_hi: DataFrame, key: list[str], columns: list[str] | None = None) -> DataFrame:
    """Keys whose row differs between two frames, or that exist in only one. A row is its key and
    a hash of `columns` (default: every column but the `_cdc_*` ones, which change when a
    re-bootstrap or repair rewrites an unchanged row: no change to a reader)."""
    from pyspark.sql import functions as F

    def fingerprint(df: DataFrame, name: str) -> DataFrame:
        cols = columns if columns is not None else sorted(c for c in df.columns if not c.startswith(META_PREFIX))
        return df.select(*key, F.sha2(F.to_json(F.struct(*[F.col(c) for c in cols])), 256).alias(name))

    j = fingerprint(at_hi, "_now").join(fingerprint(at_lo, "_was"), key, "full_outer")
    return j.filter(~F.col("_now").eqNullSafe(F.col("_was"))).select(*key)


@dataclass
class ChangedKeys:
    """The lake keys (`cfg.lake_key`) that may have changed in a range, and how they were found."""

    keys: DataFrame
    found_by: Literal["changelog", "diff"]
    reason: str


def changed_keys(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    rng: KeyRange,
    at_lo: DataFrame | None = None,
    at_hi: DataFrame | None = None,
) -> ChangedKeys:
    """The keys of cfg's current table changed in a `changelog` or `diff` range: from the changelog
    between the two watermarks, or by comparing the live rows at lo and hi (`at_lo`/`at_hi`, read
    here when not given). Every key that changed is in the set; some unchanged ones may be too (a
    changelog row that set a column to its old value)."""
    if rng.mode == "full":
        raise ValueError(f"{cfg.current_table}: a full range ({rng.reason}) has no changed keys; read every row")
    if rng.mode == "changelog":
        keys = changelog_keys(spark, lake, cfg, rng.lo_watermark, rng.hi_watermark)
        if keys is not None:
            return ChangedKeys(keys, "changelog", rng.reason)
        reason = "a truncate or re-bootstrap marker in the range"
    else:
        reason = rng.reason
    table = lake.qualified(cfg.current_table)
    at_lo = at_lo if at_lo is not None else live_rows(spark, table, cfg, rng.lo)
    at_hi = at_hi if at_hi is not None else live_rows(spark, table, cfg, rng.hi)
    return ChangedKeys(fingerprint_diff(at_lo, at_hi, cfg.lake_key), "diff", reason)
