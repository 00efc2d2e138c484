"""Bootstrap of one table: its shards' consistent snapshots into the lake, handed to the change stream
at each endpoint's consistent point (the handoff is described in cdc_lakehouse.bootstrap.snapshot)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from cdc_lakehouse.bootstrap.result import BootstrapResult, EndpointSnapshot, SnapshotBootstrapResult
from cdc_lakehouse.bootstrap.snapshot import (
    BootstrapError,
    ShardSource,
    export_snapshot,
    preflight,
    prepare_endpoint,
    read_shards,
    shards_by_endpoint,
)
from cdc_lakehouse.columns import (
    COMMIT_TS_COL,
    INGESTED_COL,
    LSN_COL,
    LSN_EVENT_COL,
    OP_COL,
    RUN_COL,
    SEQ_COL,
    SHARD_COL,
    UNAVAILABLE_COL,
    XID_COL,
)
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.lake.snapshots import read_watermark
from cdc_lakehouse.lake.tables import (
    add_column,
    changelog_columns,
    conform_to,
    create_lake_tables,
    null_metadata,
    source_columns_of,
    table_exists,
)
from cdc_lakehouse.lake.writers import BOOTSTRAP, WRITER_PROP
from cdc_lakehouse.runtime.phases import PhaseClock
from cdc_lakehouse.settings import LakeSettings
from cdc_lakehouse.watermark import ShardPosition, Watermark

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


log = logging.getLogger(__name__)

# How the current table's rows reach the writers. Its sort order (WRITE ORDERED BY shard, key)
# would otherwise mean `range`: a sampling pass, then a range shuffle. `none`: each task sorts the
# changelog rows it reads back (one file split, in memory) by shard and key and writes them, with no
# shuffle; every file still holds one shard's rows in key order. 10M rows, typed copy reader
# (docs/bench-bootstrap-typed.md): current table 101.4 s with `hash` (a shuffle by shard, then four
# 2.5M-row sorts that spill) against 72.4 s. The files' key ranges are disjoint when the source's
# physical order follows the key (a serial key, as in the bench) and may overlap otherwise, which
# compaction (maintenance) sorts out.
CURRENT_DISTRIBUTION = "none"
# Both bulk writes (changelog and current table) encode with zstd level 1 instead of the tables'
# default level 3: the encode is CPU on the two cores the source's backends share, the files come
# out about 10% larger (124 against 112 MB per 2.5M rows), and compaction rewrites them at level 3.
BULK_WRITE_OPTIONS: dict[str, str] = {"compression-level": "1"}


@dataclass
class _Target:
    """The table's two lake tables and the source columns as the bootstrap writes them."""

    current: str
    changelog: str
    existed: bool
    columns: list[tuple[str, str]]


@dataclass
class _Snapshot:
    """One bootstrap's snapshot: its time, each endpoint's consistent point and the new watermarks."""

    run_id: str
    time: datetime  # naive UTC, as Spark's timestamp literals want it
    wm: Watermark
    cwm: Watermark
    per_endpoint: dict[str, EndpointSnapshot] = field(default_factory=dict)

    @property
    def run_tag(self) -> str:
        return f"bootstrap-{self.run_id}"

    def points(self) -> list[tuple[str, int]]:
        """(shard, consistent point) of every shard read."""
        return [(s, ep["consistent_point"]) for ep in self.per_endpoint.values() for s in ep["shards"]]


def bootstrap_table(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    *,
    run_id: str,
    shards: list[str] | None = None,
    all_endpoint_tables: dict[str, dict] | None = None,
    should_stop: Callable[[Any], bool] | None = None,
    table_configs: list[TableConfig] | None = None,
    snapshot_only: bool = False,
) -> BootstrapResult:
    """Snapshot cfg's shards (all, or `shards`) into its current table and changelog; or chunk
    them (bootstrap.mode, bootstrap/chunked.py; should_stop pauses that mode between chunks).
    snapshot_only: the snapshot mode whatever bootstrap.mode says (a recovery after a lost slot:
    a chunked run keeps the shards' positions and only upserts, so it would mend neither the
    gap nor the rows deleted in it)."""
    from cdc_lakehouse.bootstrap.chunked import choose_mode, chunked_bootstrap

    if not snapshot_only and choose_mode(cfg, shards) == "chunked":
        return chunked_bootstrap(
            spark,
            lake,
            cfg,
            run_id=run_id,
            shards=shards,
            all_endpoint_tables=all_endpoint_tables,
            should_stop=should_stop,
            table_configs=table_configs,
        )
    clock = PhaseClock()
    endpoints = shards_by_endpoint(cfg, shards)
    if not endpoints:
        raise BootstrapError(f"{cfg.name}: no shards selected")
    columns, pg_types = preflight(cfg, endpoints)
    partial = bool(shards and set(shards) != {s for _, _, s in cfg.shards()})
    target = _prepare_tables(spark, lake, cfg, columns, partial)
    snap = _new_snapshot(spark, target, run_id)
    # The exported snapshots live as long as their connections: the changelog write reads under them.
    with ExitStack() as stack:
        frames = _export_and_read(
            spark, stack, lake, cfg, endpoints, target, snap, pg_types, all_endpoint_tables, table_configs
        )
        with clock.phase("read_and_changelog"):
            _write_changelog(spark, cfg, target, snap, frames)
    with clock.phase("current_write"):
        _write_current(spark, cfg, target, snap, partial)
    return _result(spark, cfg, target, snap, clock)


def _prepare_tables(
    spark: SparkSession, lake: LakeSettings, cfg: TableConfig, columns: list[tuple[str, str]], partial: bool
) -> _Target:
    """Create the lake tables, or add the source's new columns to them; a retyped column stops here."""
    cur = lake.qualified(cfg.current_table)
    cl = lake.qualified(cfg.changelog_table)
    exists = table_exists(spark, cur)
    if partial and exists and SHARD_COL not in cfg.lake.partition_by:
        raise BootstrapError(
            f"{cfg.name}: re-bootstrapping single shards needs the table partitioned by {SHARD_COL} "
            "(lake.partition_by); re-bootstrap the whole table instead"
        )
    if not exists:
        create_lake_tables(spark, lake, cfg, columns)
        log.info("bootstrap %s: created %s and %s", cfg.name, cur, cl)
        return _Target(cur, cl, False, columns)
    lake_cols = dict(source_columns_of(spark, cur, cfg))
    for name, typ in columns:
        if name not in lake_cols:
            add_column(spark, cur, name, typ)
            add_column(spark, cl, name, typ)
        elif lake_cols[name] != typ:
            raise BootstrapError(
                f"{cfg.name}: column {name} is {lake_cols[name]} in the lake but {typ} at the "
                "source; drop the lake table to re-bootstrap with the new type, or set column_types"
            )
    # The lake's column order, which the existing tables (and their readers) already have.
    source = dict(columns)
    return _Target(cur, cl, True, [(n, t) for n, t in source_columns_of(spark, cur, cfg) if n in source])


def _new_snapshot(spark: SparkSession, target: _Target, run_id: str) -> _Snapshot:
    """Start from the tables' watermarks: shards not bootstrapped now keep their positions."""
    wm = (read_watermark(spark, target.current) if target.existed else None) or Watermark.empty()
    cwm = (read_watermark(spark, target.changelog) if target.existed else None) or Watermark.empty()
    return _Snapshot(run_id, datetime.now(UTC).replace(tzinfo=None), wm, cwm)


def _export_and_read(
    spark: SparkSession,
    stack: ExitStack,
    lake: LakeSettings,
    cfg: TableConfig,
    endpoints: dict[str, list[ShardSource]],
    target: _Target,
    snap: _Snapshot,
    pg_types: dict[str, str],
    all_endpoint_tables: dict[str, dict] | None,
    table_configs: list[TableConfig] | None = None,
) -> list[DataFrame]:
    """Per endpoint: slot and publication first, then an exported snapshot (its connection stays
    open on `stack`) and the shards' rows under it, with the watermark set to its point."""
    frames = []
    for endpoint_id, shard_sources in endpoints.items():
        prepare_endpoint(
            endpoint_id, shard_sources, cfg, (all_endpoint_tables or {}).get(endpoint_id), table_configs, lake
        )
        conn, point, snapshot, identity = export_snapshot(shard_sources[0].endpoint, endpoint_id, snap.run_id)
        stack.callback(conn.close)
        snap.per_endpoint[endpoint_id] = EndpointSnapshot(
            consistent_point=point, shards=[s.shard for s in shard_sources]
        )
        log.info("bootstrap %s: endpoint %s snapshot %s at LSN %s", cfg.name, endpoint_id, snapshot, point)
        frames.append(read_shards(spark, cfg, shard_sources, snapshot, target.columns, pg_types))
        for s in shard_sources:
            # The position and the server it belongs to: positions of another identity never compare.
            pos = ShardPosition(
                lsn=point,
                ts=snap.time.replace(tzinfo=UTC).isoformat(),
                endpoint=endpoint_id,
                source=identity,
                columns=[n for n, _ in target.columns],
            )
            snap.wm.set_shard(s.shard, pos)
            snap.cwm.set_shard(s.shard, pos)
    return frames


def _event_columns(df: DataFrame, snap: _Snapshot) -> DataFrame:
    """The changelog columns every bootstrap event has alike."""
    from pyspark.sql import functions as F

    return (
        df.withColumn(COMMIT_TS_COL, F.lit(snap.time))
        .withColumn(LSN_EVENT_COL, F.col(LSN_COL))
        .withColumn(XID_COL, null_metadata(XID_COL))
        .withColumn(UNAVAILABLE_COL, null_metadata(UNAVAILABLE_COL))
        .withColumn(RUN_COL, F.lit(snap.run_tag))
        .withColumn(INGESTED_COL, F.current_timestamp())
    )


def _write_changelog(
    spark: SparkSession, cfg: TableConfig, target: _Target, snap: _Snapshot, frames: list[DataFrame]
) -> None:
    """The snapshot rows as changelog events: op 'r' at (P, -1), after a truncate marker at (P, -2)
    that makes the latest-per-key view forget keys that vanished while the shard was not replicated."""
    from functools import reduce

    from pyspark.sql import functions as F

    typed = reduce(lambda a, b: a.unionByName(b), frames)
    lsn_map = F.create_map(*[x for shard, point in snap.points() for x in (F.lit(shard), F.lit(point))])
    rows = _event_columns(
        typed.withColumn(OP_COL, F.lit("r"))
        .withColumn(LSN_COL, lsn_map[F.col(SHARD_COL)])
        .withColumn(SEQ_COL, F.lit(-1).cast("bigint")),
        snap,
    )
    markers = spark.createDataFrame(snap.points(), f"{SHARD_COL} string, {LSN_COL} bigint")
    for name, typ in target.columns:
        markers = markers.withColumn(name, F.lit(None).cast(typ))
    markers = _event_columns(markers.withColumn(OP_COL, F.lit("t")).withColumn(SEQ_COL, F.lit(-2).cast("bigint")), snap)
    cl_cols = [c for c, _ in changelog_columns(target.columns)]
    events = conform_to(
        markers.select(*cl_cols).unionByName(rows.select(*cl_cols)), spark.table(target.changelog).schema
    )
    # 1) changelog (one read of the source), 2) current table from those rows, atomically per shard.
    # No shuffle before the changelog write: every snapshot row goes to one day partition,
    # and the JDBC tasks write as they read (10M rows: 207 s -> 183 s without the shuffle).
    events.writeTo(target.changelog).options(**BULK_WRITE_OPTIONS).option("distribution-mode", "none").option(
        "snapshot-property.cdc.watermark", snap.cwm.to_json()
    ).option("snapshot-property.cdc.bootstrap", snap.run_id).option(
        f"snapshot-property.{WRITER_PROP}", BOOTSTRAP.name
    ).append()


def _write_current(spark: SparkSession, cfg: TableConfig, target: _Target, snap: _Snapshot, partial: bool) -> None:
    """The current table from the changelog rows just written (the source is read once), replacing
    the bootstrapped shards (a partial bootstrap) or the whole table in one commit."""
    from pyspark.sql import functions as F

    selected = [shard for shard, _ in snap.points()]
    cur_cols = [SHARD_COL, *[n for n, _ in target.columns], OP_COL, LSN_COL, SEQ_COL, COMMIT_TS_COL]
    rows = (
        spark.table(target.changelog)
        .filter((F.col(RUN_COL) == snap.run_tag) & (F.col(OP_COL) == "r") & (F.col(COMMIT_TS_COL) == F.lit(snap.time)))
        .select(*cur_cols)
    )
    if cfg.deletes == "soft":
        rows = rows.withColumn(cfg.soft_delete_columns.flag, F.lit(False)).withColumn(
            cfg.soft_delete_columns.timestamp, F.lit(None).cast("timestamp")
        )
    cond = F.col(SHARD_COL).isin(selected) if partial else F.lit(True)
    # Columns the source no longer has (kept under keep_null) are NULL in the new snapshot.
    rows = conform_to(rows, spark.table(target.current).schema)
    rows.writeTo(target.current).options(**BULK_WRITE_OPTIONS).option("distribution-mode", CURRENT_DISTRIBUTION).option(
        "snapshot-property.cdc.watermark", snap.wm.to_json()
    ).option("snapshot-property.cdc.bootstrap", snap.run_id).option(
        f"snapshot-property.{WRITER_PROP}", BOOTSTRAP.name
    ).overwrite(cond)


def _result(
    spark: SparkSession, cfg: TableConfig, target: _Target, snap: _Snapshot, clock: PhaseClock
) -> SnapshotBootstrapResult:
    from pyspark.sql import functions as F

    selected = [shard for shard, _ in snap.points()]
    counts = {
        r[SHARD_COL]: r["n"]
        for r in spark.table(target.current)
        .filter(F.col(SHARD_COL).isin(selected))
        .groupBy(SHARD_COL)
        .agg(F.count(F.lit(1)).alias("n"))
        .collect()
    }
    total = sum(counts.values())
    elapsed = clock.elapsed()
    result = SnapshotBootstrapResult(
        table=cfg.name,
        run_id=snap.run_id,
        shards=counts,
        rows=total,
        endpoints=snap.per_endpoint,
        read_and_changelog_seconds=clock.seconds["read_and_changelog"],
        current_write_seconds=clock.seconds["current_write"],
        seconds=elapsed,
        rows_per_second=total / elapsed if elapsed else None,
        watermark=snap.wm,
    )
    log.info(
        "bootstrap %s: %s rows in %.1fs (%s rows/s) shards %s; handoff LSNs %s",
        cfg.name,
        total,
        elapsed,
        f"{result.rows_per_second or 0:,.0f}",
        counts,
        [ep["consistent_point"] for ep in snap.per_endpoint.values()],
    )
    return result
