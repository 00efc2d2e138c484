"""The tables maintenance works on: a Target per Iceberg table, with its compaction settings and
the snapshot property carrying its position (which expiry keeps and the run must not change)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cdc_lakehouse.config import BaseMaintenanceConfig, OutputMaintenanceConfig, TableConfig
from cdc_lakehouse.history.maintain import HISTORY_PROP, history_position_in
from cdc_lakehouse.lake.snapshots import current_ancestors, read_watermark
from cdc_lakehouse.settings import LakeSettings
from cdc_lakehouse.watermark import WATERMARK_PROP

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from cdc_lakehouse.derived.config import TreeConfig


@dataclass(frozen=True)
class Target:
    """One Iceberg table maintenance compacts and expires, and what it must leave as it found it."""

    owner: str  # the config it belongs to: messages, cdc_meta.maintenance_runs.table_name
    kind: str  # current | changelog | history | output | unresolved | feed_output (maintenance_runs.target)
    table: str  # catalog-qualified
    settings: BaseMaintenanceConfig
    target_file_bytes: int
    sort: bool
    format_version: int
    writers: str  # what keeps its writers apart (named when another writer is caught)
    # The snapshot property carrying the table's position, and how its writer reads the position
    # back: expiry keeps its newest carrier, and maintenance must leave the position unchanged.
    position_prop: str = WATERMARK_PROP
    read_position: Callable[[SparkSession, str], Any] = read_watermark


def table_targets(lake: LakeSettings, cfg: TableConfig) -> list[Target]:
    """A replicated table's current table (its configured compaction), changelog (bin-pack) and
    history, where it keeps one (bin-pack)."""
    size = cfg.lake.target_file_size_mb * 1024 * 1024
    writers = f"they share the one-slot Airflow pool {cfg.pool}, imported by scripts/airflow_init.sh"
    sort = cfg.maintenance.compaction == "sort"
    return [
        Target(
            cfg.name,
            "current",
            lake.qualified(cfg.current_table),
            cfg.maintenance,
            size,
            sort,
            cfg.lake.format_version,
            writers,
        ),
        Target(cfg.name, "changelog", lake.qualified(cfg.changelog_table), cfg.maintenance, size, False, 2, writers),
        *_history_target(lake, cfg, size, writers),
    ]


def _history_target(lake: LakeSettings, cfg: TableConfig, size: int, writers: str) -> list[Target]:
    """The table's history (docs/history-tables.md), where it keeps one: its MERGEs add delete
    files like the current table's, and its position is the changelog snapshot it read up to."""
    if not cfg.history.enabled:
        return []
    return [
        Target(
            cfg.name,
            "history",
            lake.qualified(cfg.history_table),
            cfg.maintenance,
            size,
            False,
            cfg.lake.format_version,
            writers,
            position_prop=HISTORY_PROP,
            read_position=lambda spark, table: history_position_in(current_ancestors(spark, table)),
        )
    ]


def derived_targets(lake: LakeSettings, dcfg: TreeConfig) -> list[Target]:
    """A derived table's output and unresolved tables. Both carry the tree's watermark: expiry keeps
    its newest carrier on each (the next run finds the unresolved snapshot matching the output's
    watermark there)."""
    from cdc_lakehouse.derived.derive_tree import read_tree_watermark

    m = dcfg.maintenance
    size = m.target_file_size_mb * 1024 * 1024
    pool = f"they share the one-slot Airflow pool {dcfg.pool}"
    return [
        Target(dcfg.name, kind, lake.qualified(t), m, size, False, 2, pool, read_position=read_tree_watermark)
        for kind, t in (("output", dcfg.output_table), ("unresolved", dcfg.unresolved_table))
    ]


def feed_output_target(lake: LakeSettings, consumer: str, output: str, settings: OutputMaintenanceConfig) -> Target:
    """A feed consumer's exactly-once Iceberg output (`namespace.table`), whose position is the
    consumer's offsets (feed.offsets)."""
    from cdc_lakehouse.feed.offsets import OFFSETS_PROP, output_offsets

    return Target(
        consumer,
        "feed_output",
        lake.qualified(output),
        settings,
        settings.target_file_size_mb * 1024 * 1024,
        False,
        2,
        f"the consumer's runs and this maintenance are tasks of one DAG, cdc_feed__{consumer}, one run at a time",
        OFFSETS_PROP,
        lambda s, t: output_offsets(s, t, consumer),
    )
