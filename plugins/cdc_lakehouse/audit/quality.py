"""Great Expectations checks of an audited table: key uniqueness and completeness, the row count
against the source's, and freshness against the SLA."""

from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import TYPE_CHECKING

from cdc_lakehouse.columns import LSN_COL, SHARD_COL
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.lake.meta import meta_append
from cdc_lakehouse.lake.meta_rows import QualityResult
from cdc_lakehouse.landing.reader import LandingFS
from cdc_lakehouse.settings import LakeSettings

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from cdc_lakehouse.audit.result import QualityCheck, ShardStats
    from cdc_lakehouse.watermark import Watermark

logger = logging.getLogger(__name__)


def preload_great_expectations() -> None:
    """Import Great Expectations on a background thread. The import alone took 7 s here, more
    than its checks; started when the audit starts, it overlaps the comparison (the driver then
    mostly waits on Spark and PostgreSQL). A failed import is left for quality_checks to raise."""
    import threading

    def _load() -> None:
        try:
            import great_expectations  # noqa: F401
            import great_expectations.expectations  # noqa: F401
        except Exception:  # noqa: BLE001 - quality_checks' own import reports it
            logger.debug("preloading great_expectations failed", exc_info=True)

    threading.Thread(target=_load, name="gx-preload", daemon=True).start()


def quality_checks(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    lake_df: DataFrame,
    wm: Watermark,
    per_shard: dict[str, ShardStats],
    lake_counts: dict[str, int],
    audit_run: str,
    now: datetime,
) -> list[QualityCheck]:
    """Great Expectations 1.x on the lake table; results go to cdc_meta.quality_results and a JSON
    report next to the warehouse, whose path the task log prints.

    `lake_df` is data the caller has already loaded (persisted): GX makes a dozen passes over it."""
    import great_expectations as gx

    ctx = gx.get_context(mode="ephemeral")
    ds = ctx.data_sources.add_spark(f"lake_{cfg.name}")
    # The freshness ages are one number per shard, computed on the driver: validated as a pandas
    # frame they cost no Spark job (as a Spark frame they took 7).
    pds = ctx.data_sources.add_pandas(f"lake_{cfg.name}_freshness")
    flat = [
        *_check_table(ds, cfg, lake_df, per_shard, lake_counts),
        *_check_freshness(spark, lake, pds, cfg, wm, now),
    ]
    meta_append(
        spark,
        lake,
        "quality_results",
        [QualityResult(table_name=cfg.name, audit_run=audit_run, **r, checked_at=now) for r in flat],
    )
    report = f"{lake.warehouse.rstrip('/')}/_quality/{cfg.name}/{audit_run.replace(':', '_').replace('+', '_')}.json"
    try:
        _write_text(spark, report, json.dumps(flat, indent=2, default=str))
        logger.info("audit %s: Great Expectations report %s", cfg.name, report)
    except Exception as exc:  # noqa: BLE001 - the report is a convenience; the results are in cdc_meta
        logger.warning("audit %s: could not store the Great Expectations report: %s", cfg.name, exc)
    return flat


def _expected_rows(per_shard: dict[str, ShardStats], lake_counts: dict[str, int]) -> int:
    """The source's row count; in full mode (no source count) the lake's, corrected by the keys
    the audit found missing and extra."""
    total = sum(n for st in per_shard.values() if (n := st.get("source_rows")) is not None) or None
    if total is None:
        total = sum(lake_counts.get(s, 0) + st.get("missing", 0) - st.get("extra", 0) for s, st in per_shard.items())
    return total


def _check_table(
    ds, cfg: TableConfig, lake_df: DataFrame, per_shard: dict[str, ShardStats], lake_counts: dict[str, int]
) -> list[QualityCheck]:
    import great_expectations as gx
    import great_expectations.expectations as gxe

    bd = ds.add_dataframe_asset(cfg.name).add_batch_definition_whole_dataframe("current")
    suite = gx.ExpectationSuite(name=f"cdc_{cfg.name}")
    suite.add_expectation(gxe.ExpectCompoundColumnsToBeUnique(column_list=[SHARD_COL, *cfg.primary_key]))
    for k in [*cfg.primary_key, LSN_COL]:
        suite.add_expectation(gxe.ExpectColumnValuesToNotBeNull(column=k))
    source_total = _expected_rows(per_shard, lake_counts)
    # Keys in flight may be inserts or deletes the lake has not applied yet.
    slack = int(source_total * cfg.audit.row_count_tolerance) + sum(st.get("in_flight", 0) for st in per_shard.values())
    suite.add_expectation(
        gxe.ExpectTableRowCountToBeBetween(min_value=max(0, source_total - slack), max_value=source_total + slack)
    )
    # BASIC results skip the queries that list sample rows of passing expectations.
    return _gx_rows(bd.get_batch(batch_parameters={"dataframe": lake_df}).validate(suite, result_format="BASIC"))


def _check_freshness(
    spark: SparkSession, lake: LakeSettings, ds, cfg: TableConfig, wm: Watermark, now: datetime
) -> list[QualityCheck]:
    """Freshness per shard, from cdc_meta.freshness (lake.freshness): how old each shard's lake
    position (its last applied change or heartbeat) is now. A shard with no row yet (ingested
    before that table existed) falls back to its watermark's time."""
    import great_expectations as gx
    import great_expectations.expectations as gxe
    import pandas as pd

    ages = shard_ages(spark, lake, cfg, wm, now)
    fresh: list[tuple[str | None, float | None]] = [(shard, age) for shard, age in sorted(ages.items())]
    fdf = pd.DataFrame(
        fresh or [(None, None)],
        columns=["shard", "freshness_minutes"],
    ).astype({"shard": "object", "freshness_minutes": "float64"})
    fasset = ds.add_dataframe_asset(f"{cfg.name}_freshness")
    fsuite = gx.ExpectationSuite(name=f"cdc_{cfg.name}_freshness")
    fsuite.add_expectation(
        gxe.ExpectColumnValuesToBeBetween(
            column="freshness_minutes", min_value=0, max_value=cfg.audit.freshness_sla_minutes
        )
    )
    # No heartbeat at all is NULL, which the range check alone would let pass.
    fsuite.add_expectation(gxe.ExpectColumnValuesToNotBeNull(column="freshness_minutes"))
    fbatch = fasset.add_batch_definition_whole_dataframe("f").get_batch(batch_parameters={"dataframe": fdf})
    rows = _gx_rows(fbatch.validate(fsuite))
    # GX lists the values out of range, not whose they are: name the shards and their ages.
    stale = {s: a for s, a in ages.items() if a is None or a > cfg.audit.freshness_sla_minutes}
    for r in rows:
        if not r["success"]:
            r["details"] = json.dumps({**json.loads(r["details"]), "stale_shards_minutes": stale}, default=str)
    return rows


def shard_ages(
    spark: SparkSession, lake: LakeSettings, cfg: TableConfig, wm: Watermark, now: datetime
) -> dict[str, float | None]:
    """shard -> minutes its lake position is behind `now` (None: no time known)."""
    from cdc_lakehouse.lake.freshness import latest_freshness

    rows = latest_freshness(spark, lake, cfg.name)
    out: dict[str, float | None] = {}
    for _, _, shard in cfg.shards():
        f = rows.get(shard)
        ts = f.fresh_to if f is not None else None
        pos = wm.shards.get(shard)
        if ts is None and pos is not None and pos.ts:
            ts = datetime.fromisoformat(pos.ts)
        out[shard] = None if ts is None else (now - ts).total_seconds() / 60
    return out


def _gx_rows(result) -> list[QualityCheck]:
    out: list[QualityCheck] = []
    for r in result.results:
        cfg = r.expectation_config
        observed = r.result.get("observed_value", r.result.get("unexpected_count"))
        out.append(
            {
                "expectation": f"{cfg.type}({json.dumps({k: v for k, v in cfg.kwargs.items() if k != 'batch_id'}, default=str)})",
                "success": bool(r.success),
                "observed": json.dumps(observed, default=str),
                "details": json.dumps(
                    {
                        k: v
                        for k, v in r.result.items()
                        if k in ("unexpected_count", "unexpected_percent", "partial_unexpected_list")
                    },
                    default=str,
                ),
            }
        )
    return out


def _write_text(spark: SparkSession, uri: str, text: str) -> None:
    LandingFS(spark).write_bytes(uri, text.encode("utf-8"))
