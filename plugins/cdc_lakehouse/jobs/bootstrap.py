"""The bootstrap job (spark_jobs/bootstrap.py): a table's snapshot of every shard (or some) into
its current table (bootstrap.bootstrap_table.bootstrap_table); a Debezium-fed table loads from Debezium's own
snapshot events instead (bootstrap.debezium.bootstrap_debezium)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from cdc_lakehouse.jobs.params import JobParams, flag
from cdc_lakehouse.jobs.runner import StageResult, load_tables, run_per_table, table_configs

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from cdc_lakehouse.config import TableConfig
    from cdc_lakehouse.settings import LakeSettings


@dataclass(frozen=True, kw_only=True)
class BootstrapParams(JobParams):
    description = "Snapshot bootstrap of a table (all shards or some)"

    tables: tuple[str, ...] = flag(help="comma-separated table names (config 'name')")
    shards: tuple[str, ...] = flag((), help="comma-separated shard names; empty = all")
    run_id: str | None = flag(None, help="this run's id (default: <now>)")
    pause_after_chunks: int = flag(
        0, help="chunked mode: stop cleanly after this many chunks (0 = to the end); the next run resumes"
    )
    endpoints: tuple[str, ...] = flag(
        (),
        help="comma-separated endpoint ids: only the shards read through them (after a slot was lost: "
        "cdc_recover__<endpoint>); not with --shards",
    )
    columns: tuple[str, ...] = flag(
        (), help="comma-separated columns: fill only these of the existing rows, online (bootstrap.column)"
    )


def selected_shards(cfg: TableConfig, p: BootstrapParams) -> list[str] | None:
    """The shards this run bootstraps: those given, those of the endpoints given, or all (None)."""
    if not p.endpoints:
        return list(p.shards) or None
    if p.shards:
        raise ValueError(f"{cfg.name}: give either shards or endpoints, not both")
    shards = [shard for e in p.endpoints for shard in cfg.shards_on(e)]
    if not shards:
        endpoints = sorted({g.endpoint_id for g, _, _ in cfg.shards()})
        raise ValueError(
            f"{cfg.name}: no shard is read through endpoint(s) {list(p.endpoints)}; its endpoints: {endpoints}"
        )
    return shards


@dataclass(frozen=True)
class BootstrapScope:
    """What bootstrap_table takes from the parameters: the shards, and for a recovery (endpoints)
    the snapshot mode whatever bootstrap.mode says (a chunked run keeps the lost positions)."""

    shards: list[str] | None
    snapshot_only: bool


def bootstrap_scope(cfg: TableConfig, p: BootstrapParams) -> BootstrapScope:
    return BootstrapScope(selected_shards(cfg, p), bool(p.endpoints))


def main(p: BootstrapParams) -> int:
    def fn(spark: SparkSession, lake: LakeSettings, cfg: TableConfig, file: str | None) -> StageResult:
        from cdc_lakehouse.bootstrap.bootstrap_table import bootstrap_table

        run = p.run_id or datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        cs = table_configs(p.config_dir)
        if cfg.landing.kind == "debezium_s3":  # Debezium's own snapshot ('r' events) loads it
            from cdc_lakehouse.bootstrap.debezium import bootstrap_debezium

            return bootstrap_debezium(spark, lake, cfg)
        scope = bootstrap_scope(cfg, p)
        if p.endpoints and p.columns:
            raise ValueError(f"{cfg.name}: a column backfill (columns) does not recover an endpoint; give one of them")
        done = [0]

        def should_stop(_state) -> bool:  # asked after every chunk; the run stops at the round's end
            done[0] += 1
            return 0 < p.pause_after_chunks <= done[0]

        if p.columns:
            from cdc_lakehouse.bootstrap.column import backfill_columns

            return backfill_columns(
                spark, lake, cfg, list(p.columns), run_id=run, shards=scope.shards, should_stop=should_stop
            )
        return bootstrap_table(
            spark,
            lake,
            cfg,
            run_id=run,
            all_endpoint_tables=cs.endpoint_tables(),
            should_stop=should_stop,
            # A broken config's columns cannot be narrowed out: then no lists (see capture_endpoint).
            table_configs=None if cs.errors else list(cs.tables.values()),
            shards=scope.shards,
            snapshot_only=scope.snapshot_only,
        )

    return run_per_table("bootstrap", p.app_name, lambda: load_tables(p.config_dir, p.tables), fn)
