"""Keeping a table's history (`<namespace>.<name>__history`, docs/history-tables.md) in step with
its changelog: after each ingest, the changelog rows appended since the history's last commit
become versions (history.versions) in one MERGE, whose commit carries the changelog snapshot it
read up to (`cdc.history`). That commit is fenced (lake.commits.fenced_commit): a rerun or a
second writer of the same rows publishes nothing twice, and a run killed before it leaves the
rows for the next.

Phases: plan (incremental from the history's changelog snapshot, full when there is none or it
is no longer an ancestor) -> read the new changelog rows -> drop late ones (the LSN guard) ->
seeds (the touched keys' open versions) -> fill unchanged TOAST values -> versions -> commit.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from cdc_lakehouse.columns import (
    COMMIT_TS_COL,
    HISTORY,
    IS_CURRENT_COL,
    LSN_COL,
    OP_COL,
    SEQ_COL,
    SHARD_COL,
    UNAVAILABLE_COL,
    VALID_FROM_LSN_COL,
    VALID_TO_LSN_COL,
    ddl_of,
)
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.history.versions import (
    CLOSED,
    REPLACED,
    UNRESOLVED,
    Shape,
    not_late,
    prepare,
    versions,
    with_truncates,
)
from cdc_lakehouse.identifiers import spark_ident
from cdc_lakehouse.ingest.toast import BROADCAST_ROWS
from cdc_lakehouse.lake.commits import fenced_commit, snapshot_summary, sql_with_commit_properties
from cdc_lakehouse.lake.snapshots import current_ancestors, current_snapshot, summary_of
from cdc_lakehouse.lake.tables import add_column, create_table_sql, partition_sql, source_columns_of, table_properties
from cdc_lakehouse.runtime.phases import PhaseClock, as_count, checkpoint_counted, local_checkpoint, releasing_kept
from cdc_lakehouse.settings import LakeSettings
from cdc_lakehouse.watermark import lsn_map

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)

HISTORY_PROP = "cdc.history"  # snapshot property of each history commit: HistoryPosition as JSON
Mode = Literal["incremental", "full", "noop"]


@dataclass(frozen=True)
class HistoryPosition:
    """What a history commit has read: the changelog up to `changelog_snapshot`, and per shard the
    highest commit LSN among those rows (a row below it arrived late: a chunked bootstrap's
    chunk, the ingest's backfill of a column added with a default, written at an older position)."""

    changelog_snapshot: int
    positions: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> HistoryPosition:
        d = json.loads(text)
        return cls(int(d["changelog_snapshot"]), {str(k): int(v) for k, v in d.get("positions", {}).items()})


def history_position_in(snapshots: Iterable[Any]) -> HistoryPosition | None:
    """The newest history position in a chain of snapshots (newest first)."""
    for s in snapshots:
        text = summary_of(s).get(HISTORY_PROP)
        if text:
            return HistoryPosition.from_json(text)
    return None


@dataclass
class HistoryResult:
    """One maintenance of a history table: what it read and wrote."""

    table: str
    mode: Mode
    reason: str
    changelog_rows: int = 0  # changelog rows read
    late: int = 0  # of those, dropped: before their key's newest version (the LSN guard)
    unresolved: int = 0  # unchanged TOAST values no earlier state gave: NULL in their version
    truncates: int = 0  # truncates among the rows (a source TRUNCATE, a re-bootstrap's marker)
    written: int = 0  # history rows written: new versions and closed ones
    changelog_snapshot: int | None = None
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase (PhaseClock)

    def to_dict(self) -> dict[str, object]:  # the job's result line (jobs.runner.StageResult)
        return asdict(self)


@dataclass(frozen=True)
class _Plan:
    mode: Mode
    reason: str
    head: int | None  # the changelog snapshot read up to
    at: HistoryPosition | None  # where the history stands


def maintain_history(spark: SparkSession, lake: LakeSettings, cfg: TableConfig, *, full: bool = False) -> HistoryResult:
    """Bring cfg's history table up to its changelog's current snapshot (full: rebuild it all)."""
    t0 = time.monotonic()
    hist, cl = lake.qualified(cfg.history_table), lake.qualified(cfg.changelog_table)
    shape = ensure_history_table(spark, lake, cfg)
    plan = _plan(spark, hist, cl, full)
    result = HistoryResult(cfg.history_table, plan.mode, plan.reason, changelog_snapshot=plan.head)
    if plan.mode == "noop" or plan.head is None:
        result.seconds = round(time.monotonic() - t0, 3)
        return result
    clock = PhaseClock()
    with releasing_kept():
        with clock.phase("read"):  # the new changelog rows and the open versions they touch
            rows, seeds, new_pos = _inputs(spark, hist, cl, cfg, shape, plan, result)
        with clock.phase("versions"):  # computed and kept: one shuffle of the seeds and events
            staged = _staged(_versions(rows, seeds, shape, result), shape, result, cfg.name)
        with clock.phase("commit"):
            published = _commit(spark, hist, shape, plan, new_pos, staged)
    # Not published: another run of the same rows was first (its commit's figure is not ours).
    result.written = int(snapshot_summary(spark, hist).get("added-records", 0)) if published else 0
    result.seconds, result.timings = round(time.monotonic() - t0, 3), clock.rounded()
    log.info("%s: history %s (%s): %s", cfg.name, plan.mode, plan.reason, result.to_dict())
    return result


def ensure_history_table(spark: SparkSession, lake: LakeSettings, cfg: TableConfig) -> Shape:
    """Create the history table, or add the changelog's new source columns to it; its Shape."""
    hist, cl = lake.qualified(cfg.history_table), lake.qualified(cfg.changelog_table)
    source = source_columns_of(spark, cl, cfg)
    meta = dict(ddl_of(HISTORY))
    cols = [(SHARD_COL, meta[SHARD_COL]), *source, *[(c, t) for c, t in meta.items() if c != SHARD_COL]]
    # Partitioned like the current table, then by _cdc_is_current: the open versions a run reads
    # and closes are one partition per shard, whatever the history's length.
    spark.sql(create_table_sql(hist, cols, partition_sql(cfg, also=[IS_CURRENT_COL]), table_properties(cfg)))
    have = {f.name for f in spark.table(hist).schema.fields}
    for name, typ in source:
        if name not in have:
            add_column(spark, hist, name, typ)
    return Shape(cfg.lake_key, [c for c, _ in source if c not in cfg.primary_key])


def _plan(spark: SparkSession, hist: str, cl: str, full: bool) -> _Plan:
    head = current_snapshot(spark, cl)
    at = history_position_in(current_ancestors(spark, hist))
    if head is None:
        return _Plan("noop", "the changelog has no snapshot", None, at)
    head_id = int(head.snapshot_id)
    if full:
        return _Plan("full", "asked for", head_id, at)
    if at is None:
        return _Plan("full", "the first run", head_id, at)
    if at.changelog_snapshot == head_id:
        return _Plan("noop", "the changelog has not moved", head_id, at)
    return _after(spark, cl, at, head_id)


def _after(spark: SparkSession, cl: str, at: HistoryPosition, head_id: int) -> _Plan:
    """From the history's changelog snapshot to the head: incremental when rows were appended."""
    since: list[str | None] = []  # the operations of the snapshots after the history's, newest first
    for snap in current_ancestors(spark, cl):
        if int(snap.snapshot_id) == at.changelog_snapshot:
            break
        since.append(snap.operation)
    else:  # expired (the history lagged past the changelog's retention) or rolled back
        return _Plan("full", f"changelog snapshot {at.changelog_snapshot} is no longer in its history", head_id, at)
    if "append" not in since:  # a compaction or a delete: no row to read
        return _Plan(
            "noop", f"no rows appended after {at.changelog_snapshot} ({', '.join(map(str, since))})", head_id, at
        )
    return _Plan("incremental", f"changelog snapshots after {at.changelog_snapshot}", head_id, at)


def _inputs(
    spark: SparkSession,
    hist: str,
    cl: str,
    cfg: TableConfig,
    shape: Shape,
    plan: _Plan,
    result: HistoryResult,
) -> tuple[DataFrame, DataFrame, HistoryPosition]:
    """The changelog rows to apply (late ones dropped), the open versions they start from, and
    the position the commit will carry."""
    from pyspark.sql import functions as F

    assert plan.head is not None
    floor = plan.at.positions if plan.at is not None and plan.mode == "incremental" else {}
    late = F.col(LSN_COL) < F.coalesce(lsn_map(floor)[F.col(SHARD_COL)], F.lit(-1))
    shards = [shard for _, _, shard in cfg.shards()]
    per_shard = [
        expr.alias(f"{name}{i}")
        for i, s in enumerate(shards)
        for name, expr in (
            ("top", F.max(F.when(F.col(SHARD_COL) == s, F.col(LSN_COL)))),
            ("restart", F.min(F.when((F.col(SHARD_COL) == s) & (F.col(OP_COL) == "t"), F.col(LSN_COL)))),
        )
    ]
    # One row per position and key: a snapshot's rows share theirs, (P, -1), and differ by key.
    raw = _conformed(_changelog_rows(spark, cl, plan), spark.table(hist), shape)
    rows, seen = checkpoint_counted(
        raw.dropDuplicates([*shape.key, LSN_COL, SEQ_COL]),
        F.count(F.lit(1)).alias("rows"),
        F.sum(late.cast("int")).alias("late"),
        F.sum((F.col(OP_COL) == "t").cast("int")).alias("truncates"),
        *per_shard,
    )
    result.changelog_rows, result.truncates = as_count(seen.get("rows")), as_count(seen.get("truncates"))
    positions = dict(floor)
    for i, shard in enumerate(shards):
        _check_order(cfg, shard, floor.get(shard), seen.get(f"restart{i}"))
        top = seen.get(f"top{i}")
        if top is not None:
            positions[shard] = max(positions.get(shard, -1), as_count(top))
    current = spark.table(hist).filter(F.col(IS_CURRENT_COL))
    if plan.mode == "full":  # a rebuild starts from nothing
        current = current.filter(F.lit(False))
    if as_count(seen.get("late")):
        last = (
            spark.table(hist)
            .join(rows.filter(late).select(*shape.key).distinct(), shape.key, "left_semi")
            .groupBy(*shape.key)
            .agg(F.max(F.coalesce(F.col(VALID_TO_LSN_COL), F.col(VALID_FROM_LSN_COL))).alias("_h_last"))
        )
        kept = local_checkpoint(not_late(rows, last, shape))
        result.late = result.changelog_rows - kept.count()
        rows = kept
    events = prepare(rows, shape, broadcast=result.changelog_rows <= BROADCAST_ROWS)
    return events, _seeds(current, rows, shape, result), HistoryPosition(plan.head, positions)


class HistoryOrderError(RuntimeError):
    """A shard's changelog restarted below the history's position: another source server."""


def _check_order(cfg: TableConfig, shard: str, floor: int | None, restart: Any) -> None:
    """A truncate marker below the shard's position: the shard was re-bootstrapped from a server
    whose LSNs are lower (a new primary, another host). Versions are ordered by LSN, which does not
    carry across servers, so this is refused rather than written out of order."""
    if floor is None or restart is None or as_count(restart) >= floor:
        return
    raise HistoryOrderError(
        f"{cfg.name}: history of shard {shard}: the changelog restarts at LSN {as_count(restart)}, below the "
        f"history's position {floor} (a re-bootstrap from another source server); its versions cannot be "
        f"ordered across servers yet (issue #55). The ingest committed; to go on, set history.enabled: false "
        f"for {cfg.name}, or drop {cfg.history_table} to start its history again from the changelog"
    )


def _conformed(raw: DataFrame, hist: DataFrame, shape: Shape) -> DataFrame:
    """The changelog rows' columns the history needs; a column the read snapshot's schema does
    not have yet (added to the table since its last append) is NULL."""
    from pyspark.sql import functions as F

    types = {f.name: f.dataType for f in hist.schema.fields}
    cols = [F.col(c) if c in raw.columns else F.lit(None).cast(types[c]).alias(c) for c in [*shape.key, *shape.data]]
    return raw.select(*cols, *_CHANGELOG_META)


def _changelog_rows(spark: SparkSession, cl: str, plan: _Plan) -> DataFrame:
    """The changelog at the plan's head (full), or the rows appended since the history's snapshot."""
    if plan.mode == "full":
        return spark.sql(f"SELECT * FROM {cl} VERSION AS OF {plan.head}")
    assert plan.at is not None
    # Appended rows only (Iceberg's incremental append scan: start exclusive, end inclusive);
    # a compaction's or an expiry's snapshots add no row.
    return (
        spark.read.format("iceberg")
        .option("start-snapshot-id", str(plan.at.changelog_snapshot))
        .option("end-snapshot-id", str(plan.head))
        .load(cl)
    )


def _seeds(current: DataFrame, rows: DataFrame, shape: Shape, result: HistoryResult) -> DataFrame:
    """The open versions of the keys the rows touch, and of every key of a truncated shard."""
    from pyspark.sql import functions as F

    keys = rows.filter(F.col(OP_COL) != "t").select(*shape.key).distinct()
    # The batch's keys against every open version: broadcast, the open versions are not shuffled.
    seeds = current.join(F.broadcast(keys) if result.changelog_rows <= BROADCAST_ROWS else keys, shape.key, "left_semi")
    if not result.truncates:  # read once, in the versions' shuffle: not kept
        return seeds
    truncated = rows.filter(F.col(OP_COL) == "t").select(SHARD_COL).distinct()
    seeds = seeds.unionByName(current.join(F.broadcast(truncated), SHARD_COL, "left_semi"))
    # Kept: the truncates' deletes read their keys too.
    return local_checkpoint(seeds.dropDuplicates([*shape.key, VALID_FROM_LSN_COL]))


_CHANGELOG_META = [OP_COL, LSN_COL, SEQ_COL, COMMIT_TS_COL, UNAVAILABLE_COL]


def _versions(rows: DataFrame, seeds: DataFrame, shape: Shape, result: HistoryResult) -> DataFrame:
    """The rows to write: truncates expanded, then versions (TOAST fill, one state per key and
    transaction, the change points)."""
    from pyspark.sql import functions as F

    names = sorted(
        r[0]
        for r in rows.select(F.explode(F.coalesce(F.col(UNAVAILABLE_COL), F.array())).alias("c")).distinct().collect()
        if r[0] in shape.data
    )
    events = with_truncates(rows, seeds, shape) if result.truncates else rows
    return versions(events, seeds, shape, names)


def _staged(out: DataFrame, shape: Shape, result: HistoryResult, name: str) -> DataFrame:
    """The MERGE's source, kept, and its unresolved TOAST values counted (one Spark job). A
    closed version is written again whole, and its open row deleted by key and valid_from (a
    CLOSE row): the MERGE then reads only those columns of the open versions, not their values,
    as an UPDATE of the same rows would."""
    from pyspark.sql import functions as F

    close = out.filter(F.col(CLOSED) | F.col(REPLACED)).select(*shape.key, VALID_FROM_LSN_COL, F.lit(True).alias(CLOSE))
    rows = out.filter(~F.col(REPLACED)).select(*shape.columns, UNRESOLVED, F.lit(False).alias(CLOSE))
    staged, seen = checkpoint_counted(
        rows.unionByName(close, allowMissingColumns=True), F.sum(F.col(UNRESOLVED).cast("int")).alias("unresolved")
    )
    result.unresolved = as_count(seen.get("unresolved"))
    if result.unresolved:
        log.warning(
            "%s: %d version(s) of the history lack an unchanged TOAST value no earlier state gave (NULL there); "
            "the current table held such events back",
            name,
            result.unresolved,
        )
    return staged


def _commit(
    spark: SparkSession, hist: str, shape: Shape, plan: _Plan, new_pos: HistoryPosition, staged: DataFrame
) -> bool:
    """One commit, fenced on the position the run started from, carrying the new one; False when
    another run had published that position."""
    from pyspark.sql import functions as F

    view = f"cdc_history_{uuid.uuid4().hex[:12]}"
    staged.createOrReplaceTempView(view)
    props = {HISTORY_PROP: new_pos.to_json()}
    cols = ", ".join(spark_ident(c) for c in shape.columns)
    vals = ", ".join(f"s.{spark_ident(c)}" for c in shape.columns)

    def write(target: str) -> None:
        if plan.mode == "full":  # every row replaced in one commit (a rebuild has no closed seeds)
            w = spark.table(view).filter(~F.col(CLOSE)).select(*shape.columns).writeTo(target)
            for k, v in props.items():
                w = w.option(f"snapshot-property.{k}", v)
            w.overwrite(F.lit(True))
            return
        on = " AND ".join(f"t.{spark_ident(k)} = s.{spark_ident(k)}" for k in [*shape.key, VALID_FROM_LSN_COL])
        sql = (
            f"MERGE INTO {target} t USING {view} s ON {on} AND t.{IS_CURRENT_COL} AND s.{CLOSE} "
            f"WHEN MATCHED THEN DELETE "
            f"WHEN NOT MATCHED AND NOT s.{CLOSE} THEN INSERT ({cols}) VALUES ({vals})"
        )
        sql_with_commit_properties(spark, sql, props)

    try:
        return fenced_commit(spark, hist, plan.at, new_pos, write, what=f"{hist} history", position=history_position_in)
    finally:
        spark.catalog.dropTempView(view)


CLOSE = "_h_close"  # a source row of the MERGE that deletes an open version (then written closed)
