"""audit.quality: split out of audit.py."""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Any

from cdc_lakehouse.config import LSN_COL, SHARD_COL, TableConfig
from cdc_lakehouse.lake.meta import meta_append
from cdc_lakehouse.landing.reader import HadoopFS
from cdc_lakehouse.settings import LakeSettings

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


# --- Great Expectations ---------------------------------------------------------------------------------


def quality_checks(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    lake_df: DataFrame,
    wm: dict[str, Any],
    per_shard: dict[str, dict[str, Any]],
    lake_counts: dict[str, int],
    audit_run: str,
    now: datetime,
    log=print,
) -> list[dict[str, Any]]:
    """Great Expectations 1.x on the lake table; results go to cdc_meta.quality_results and a JSON
    report next to the warehouse, whose path the task log prints."""
    import great_expectations as gx
    import great_expectations.expectations as gxe

    ctx = gx.get_context(mode="ephemeral")
    ds = ctx.data_sources.add_spark(f"lake_{cfg.name}")
    asset = ds.add_dataframe_asset(cfg.name)
    bd = asset.add_batch_definition_whole_dataframe("current")
    suite = gx.ExpectationSuite(name=f"cdc_{cfg.name}")
    suite.add_expectation(gxe.ExpectCompoundColumnsToBeUnique(column_list=[SHARD_COL, *cfg.primary_key]))
    for k in [*cfg.primary_key, LSN_COL]:
        suite.add_expectation(gxe.ExpectColumnValuesToNotBeNull(column=k))
    source_total = sum(st["source_rows"] for st in per_shard.values() if st.get("source_rows") is not None) or None
    if source_total is None:
        source_total = sum(
            lake_counts.get(s, 0) + st.get("missing", 0) - st.get("extra", 0) for s, st in per_shard.items()
        )
    in_flight = sum(st.get("in_flight", 0) for st in per_shard.values())
    slack = int(source_total * cfg.audit.row_count_tolerance) + in_flight
    suite.add_expectation(
        gxe.ExpectTableRowCountToBeBetween(min_value=max(0, source_total - slack), max_value=source_total + slack)
    )
    # GX makes a dozen passes over the frame: cache it (key columns and LSN only, small), and
    # BASIC results skip the queries that list sample rows of passing expectations.
    lake_df = lake_df.persist()
    try:
        results = [
            _gx_rows(bd.get_batch(batch_parameters={"dataframe": lake_df}).validate(suite, result_format="BASIC"))
        ]
    finally:
        lake_df.unpersist()
    # Freshness from the heartbeats: how old is the newest source commit the lake is known to hold.
    ts = [datetime.fromisoformat(v["ts"]) for v in wm.get("shards", {}).values() if v.get("ts")]
    fresh_min = (now - min(ts)).total_seconds() / 60 if ts else None
    fdf = spark.createDataFrame([(fresh_min,)], "freshness_minutes double")
    fasset = ds.add_dataframe_asset(f"{cfg.name}_freshness")
    fsuite = gx.ExpectationSuite(name=f"cdc_{cfg.name}_freshness")
    fsuite.add_expectation(
        gxe.ExpectColumnValuesToBeBetween(
            column="freshness_minutes", min_value=0, max_value=cfg.audit.freshness_sla_minutes
        )
    )
    fsuite.add_expectation(gxe.ExpectColumnValuesToNotBeNull(column="freshness_minutes"))
    fres = (
        fasset.add_batch_definition_whole_dataframe("f").get_batch(batch_parameters={"dataframe": fdf}).validate(fsuite)
    )
    results.append(_gx_rows(fres))
    flat = [r for rs in results for r in rs]
    rows = [
        {
            "table_name": cfg.name,
            "audit_run": audit_run,
            "expectation": r["expectation"],
            "success": r["success"],
            "observed": r["observed"],
            "details": r["details"],
            "checked_at": now,
        }
        for r in flat
    ]
    meta_append(spark, lake, "quality_results", rows)
    report = f"{lake.warehouse.rstrip('/')}/_quality/{cfg.name}/{audit_run.replace(':', '_').replace('+', '_')}.json"
    try:
        _write_text(spark, report, json.dumps(flat, indent=2, default=str))
        log(f"audit {cfg.name}: Great Expectations report {report}")
    except Exception as exc:  # noqa: BLE001
        log(f"audit {cfg.name}: could not store the Great Expectations report: {exc}")
    return flat


def _gx_rows(result) -> list[dict[str, Any]]:
    out = []
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
    fs = HadoopFS(spark)
    path, hfs = fs._fs(uri)
    out = hfs.create(path, True)
    try:
        out.write(bytearray(text.encode("utf-8")))
    finally:
        out.close()
