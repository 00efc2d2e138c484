"""Incremental ingest of one table: landing -> raw changelog -> current table.

    plan      which capture runs are pending (manifests above the table's watermark, in
              slot order, with no gap), and which files hold this table's events
    schema    compare the events' schemas with the lake table; evolve or stop
    validate  typed events; malformed ones to quarantine, within the error budget
    dedupe    at-least-once delivery: drop repeated (shard, commit LSN, seq)
    fill      unchanged TOAST columns get their value from earlier events or the table
    changelog append, with the changelog's own watermark in the same commit
    reduce    latest event per key
    merge     LSN-guarded MERGE, with the new watermark in the same commit

Each of the two commits filters events by its own table's watermark, so a crash between
them, a retry, a rerun of an old interval or a replayed landing file all converge.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from cdc_lakehouse.config import COMMIT_TS_COL, LSN_COL, OP_COL, SEQ_COL, SHARD_COL, TableConfig
from cdc_lakehouse.ingest.backfill import backfill_added_columns
from cdc_lakehouse.ingest.reduce import latest_per_key, split_pk_changes
from cdc_lakehouse.ingest.validate import BKEY, FILE, RAW, REASONS, landing_spark_schema, typed_events
from cdc_lakehouse.lake.columns import INGESTED_COL, UNAVAILABLE_COL
from cdc_lakehouse.lake.commits import fenced_commit, snapshot_summary, sql_with_commit_properties
from cdc_lakehouse.lake.meta import meta_append
from cdc_lakehouse.lake.tables import conform_to, source_columns_of, table_exists
from cdc_lakehouse.lake.watermark import read_watermark, watermark_json
from cdc_lakehouse.landing.reader import HadoopFS, SparkLanding
from cdc_lakehouse.runtime.failpoints import crash_point
from cdc_lakehouse.settings import LakeSettings

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
from cdc_lakehouse.ingest.backfill import columns_to_backfill, finish_backfill
from cdc_lakehouse.ingest.errors import ErrorBudgetExceeded, LandingGap, NotBootstrapped, SchemaChangeError
from cdc_lakehouse.ingest.merge import lsn_newer, merge_sql, wm_map
from cdc_lakehouse.ingest.quarantine import as_held, held_back, hold_dependents, write_quarantine
from cdc_lakehouse.ingest.schema import BACKFILL, apply_schema_actions, event_schemas, manifest_schemas, schema_actions
from cdc_lakehouse.ingest.toast import BROADCAST_ROWS, NO_TABLE, UNAV_LEFT, fill_unavailable
from cdc_lakehouse.landing.reader import Plan, plan_landing


def ingest_table(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    *,
    upto_run: str | None,
    ingest_run: str,
    interval_end: str | None = None,
    log=print,
    config_file: str | None = None,
) -> dict[str, Any]:
    """Apply every pending capture run (up to `upto_run`) to the table; returns the run's metrics."""
    from pyspark.sql import functions as F

    t0 = time.time()
    started = datetime.now(UTC)
    cur = lake.qualified(cfg.current_table)
    cl = lake.qualified(cfg.changelog_table)
    if not table_exists(spark, cur):
        raise NotBootstrapped(
            f"{cfg.name}: lake table {cur} does not exist; trigger the DAG cdc_bootstrap__{cfg.name} to load it first"
        )
    wm = read_watermark(spark, cur)
    if wm is None:
        raise NotBootstrapped(
            f"{cfg.name}: {cur} has no cdc.watermark (not created by a bootstrap?); "
            f"re-bootstrap with cdc_bootstrap__{cfg.name}"
        )
    cwm_read = read_watermark(spark, cl)
    cwm = cwm_read or {"shards": {}}
    landing = SparkLanding(spark, lake.landing_uri)
    plan = plan_landing(landing, cfg, wm, upto_run)
    metrics: dict[str, Any] = {
        "table_name": cfg.name,
        "ingest_run": ingest_run,
        "interval_end": interval_end,
        "landing_runs": [m["run_id"] for m in plan.manifests],
        "events_read": 0,
        "duplicates": 0,
        "already_applied": 0,
        "inserts": 0,
        "updates": 0,
        "deletes": 0,
        "stale_skipped": 0,
        "truncates": 0,
        "quarantined": 0,
        "changelog_rows": 0,
        "write_mode": cfg.lake.write_mode,
        "started_at": started,
        "status": "ok",
        "error": None,
    }
    if plan.problems:
        msg = "\n".join(plan.problems)
        if cfg.ingest.missing_landing_files == "fail":
            raise LandingGap(
                msg + f"\nTo continue without those events set ingest.missing_landing_files: skip for "
                f"{cfg.name}; the hourly audit then finds the affected keys and its repair re-reads them"
            )
        log(f"WARNING {cfg.name}: continuing past landing problems (missing_landing_files: skip):\n{msg}")
        metrics["status"] = "ok_with_gaps"
    lake_cols = source_columns_of(spark, cur, cfg)
    # A backfill of added columns that an earlier run committed as pending but did not finish.
    if plan.new_watermark.pop(BACKFILL, None):
        backfill_added_columns(spark, lake, cfg, wm[BACKFILL], lake_cols, ingest_run)
    added = columns_to_backfill(cfg, plan, wm)
    if added:
        plan.new_watermark[BACKFILL] = added
    new_wm_json = watermark_json(plan.new_watermark)
    timings: dict[str, float] = {"plan": time.time() - t0}
    metrics["timings"] = timings

    if not plan.files:
        # Nothing to apply (quiet shards): the heartbeats still move the watermark forward.
        def _advance() -> None:
            empty_cl = spark.createDataFrame([], spark.table(cl).schema)
            empty_cl.writeTo(cl).option("snapshot-property.cdc.watermark", new_wm_json).append()
            spark.createDataFrame([], spark.table(cur).schema).writeTo(cur).option(
                "snapshot-property.cdc.watermark", new_wm_json
            ).append()

        if plan.new_watermark != wm:
            fenced_commit(spark, cur, wm, plan.new_watermark, _advance, what=f"{cfg.name} watermark")
        return _finish(spark, lake, cfg, metrics, plan, t0, t0, log)

    raw = (
        spark.read.schema(landing_spark_schema()).parquet(*plan.files).filter(F.col("source.table") == cfg.source.table)
    )
    schemas, latest = manifest_schemas(plan, cfg)
    if not latest:
        schemas, latest = event_schemas(raw)  # runs written without schemas in their manifest
    known = {
        schema: set(wm["shards"][shard]["columns"])
        for _, schema, shard in cfg.shards()
        if "columns" in wm["shards"].get(shard, {})
    }
    ddl, errors = schema_actions(cfg, lake_cols, schemas, latest, config_file or "", known)
    if errors:
        raise SchemaChangeError("\n".join(errors))
    apply_schema_actions(spark, cur, cl, ddl, log)
    if ddl:
        lake_cols = source_columns_of(spark, cur, cfg)

    t_phase = time.time()
    shard_map = {(g.endpoint_id, schema): shard for g, schema, shard in cfg.shards()}
    wm_floor = wm_map(wm)
    typed = typed_events(raw, cfg, lake_cols, shard_map).filter(F.col(SHARD_COL).isNotNull())
    # Events the table already has (replays, reruns) are dropped before validation, so an old
    # malformed event is not quarantined twice.
    typed = typed.withColumn("_applied", F.col(LSN_COL) < F.coalesce(wm_floor[F.col(SHARD_COL)], F.lit(0)))
    # Local checkpoints at phase boundaries: computed once, and later queries plan against the
    # stored rows instead of re-optimizing the wide validation expressions each time.
    typed = typed.localCheckpoint(eager=True)
    pend = ~F.col("_applied")
    ok = pend & (F.size(REASONS) == 0)
    pk_change = F.lit(False)
    for k in cfg.primary_key:
        pk_change = pk_change | (F.col(BKEY + k).isNotNull() & ~F.col(BKEY + k).eqNullSafe(F.col(k)))
    counts = (
        typed.groupBy()
        .agg(
            F.count(F.lit(1)).alias("n"),
            F.sum(F.col("_applied").cast("int")).alias("applied"),
            F.sum((pend & (F.size(REASONS) > 0)).cast("int")).alias("bad"),
            F.sum((ok & (F.col(OP_COL) != "t")).cast("int")).alias("valid"),
            F.sum((ok & (F.col(OP_COL) == "u") & pk_change).cast("int")).alias("pk_changes"),
            F.sum((ok & (F.col(OP_COL) == "t")).cast("int")).alias("truncates"),
            F.collect_set(F.when(ok & (F.col(OP_COL) == "t"), F.col(SHARD_COL))).alias("truncated"),
            F.array_distinct(F.flatten(F.collect_set(F.when(ok, F.col(UNAVAILABLE_COL))))).alias("unavailable"),
            F.min(F.when(pend, F.col(COMMIT_TS_COL))).alias("min_ts"),
            F.max(F.when(pend, F.col(COMMIT_TS_COL))).alias("max_ts"),
        )
        .collect()[0]
    )
    timings["validate"] = time.time() - t_phase
    metrics["events_read"] = int(counts["n"] or 0)
    metrics["already_applied"] = int(counts["applied"] or 0)
    pending = typed.filter(pend).drop("_applied")
    bad = pending.filter(F.size(REASONS) > 0)
    n_bad = int(counts["bad"] or 0)
    n_new = metrics["events_read"] - metrics["already_applied"]
    if n_bad:
        metrics["quarantined"] = write_quarantine(spark, lake, cfg, bad, ingest_run)
        budget = cfg.ingest.error_budget
        if n_bad > budget.max_quarantined or (n_new and n_bad / n_new > budget.max_fraction):
            top = (
                bad.select(F.explode(REASONS).alias("r"))
                .groupBy("r")
                .count()
                .orderBy(F.desc("count"))
                .limit(5)
                .collect()
            )
            raise ErrorBudgetExceeded(
                f"{cfg.name}: {n_bad} of {n_new} events are malformed, over the error budget "
                f"(max_quarantined {budget.max_quarantined}, max_fraction {budget.max_fraction}). Top reasons: "
                + "; ".join(f"{r['r']} (x{r['count']})" for r in top)
                + f". They are in {lake.meta_table('quarantine')} (table_name = '{cfg.name}'); nothing was applied. "
                "Fix the source or the table config (e.g. column_types), or raise ingest.error_budget, then rerun."
            )
    t_phase = time.time()
    valid = pending.filter(F.size(REASONS) == 0).drop(REASONS, RAW, FILE)
    events = split_pk_changes(valid.filter(F.col(OP_COL) != "t"), cfg)
    truncs = valid.filter(F.col(OP_COL) == "t").withColumn(SEQ_COL, F.col("_seq_raw") * 2)
    events = events.dropDuplicates([SHARD_COL, LSN_COL, SEQ_COL])
    truncs = truncs.dropDuplicates([SHARD_COL, LSN_COL, SEQ_COL])
    events = events.localCheckpoint(eager=True)
    n_events = events.count()
    # Every valid event, plus the delete half of each key change, minus what arrived twice.
    metrics["duplicates"] = int(counts["valid"] or 0) + int(counts["pk_changes"] or 0) - n_events
    current_df = spark.table(cur)
    names = list(counts["unavailable"] or [])
    if names:
        events = fill_unavailable(events, current_df, cfg, names).localCheckpoint(eager=True)
    else:
        events = events.withColumn(UNAV_LEFT, F.array().cast("array<string>")).withColumn(NO_TABLE, F.lit(False))
    truncated = sorted(counts["truncated"] or [])
    metrics["truncates"] = int(counts["truncates"] or 0)
    timings["prepare"] = time.time() - t_phase

    # 1) changelog: append what it does not have yet, with its new watermark.
    cl_floor = wm_map(cwm)
    ingested = F.current_timestamp()

    def _changelog() -> int:
        rows = events.unionByName(truncs, allowMissingColumns=True).filter(
            F.col(LSN_COL) >= F.coalesce(cl_floor[F.col(SHARD_COL)], F.lit(0))
        )
        rows = conform_to(rows.withColumn(INGESTED_COL, ingested), spark.table(cl).schema)
        rows.writeTo(cl).option("snapshot-property.cdc.watermark", new_wm_json).append()

    crash_point("ingest_before_changelog")
    t_phase = time.time()
    committed = fenced_commit(spark, cl, cwm_read, plan.new_watermark, _changelog, what=f"{cfg.name} changelog")
    metrics["changelog_rows"] = int(snapshot_summary(spark, cl).get("added-records", 0)) if committed else 0
    timings["changelog"] = time.time() - t_phase
    crash_point("ingest_after_changelog")

    # 2) current table: latest event per key, LSN-guarded MERGE, watermark in the same commit.
    t_phase = time.time()
    reduced = latest_per_key(events, [SHARD_COL, *cfg.primary_key])
    if truncated:
        # Keys whose last event precedes their shard's truncate are gone.
        tmax = truncs.groupBy(SHARD_COL).agg(F.max(F.struct(LSN_COL, SEQ_COL, COMMIT_TS_COL)).alias("_t"))
        reduced = reduced.join(F.broadcast(tmax), SHARD_COL, "left")
        before_t = F.col("_t").isNotNull() & lsn_newer(
            F.col("_t")[LSN_COL], F.col("_t")[SEQ_COL], F.col(LSN_COL), F.col(SEQ_COL)
        )
        reduced = (
            reduced.withColumn(OP_COL, F.when(before_t, F.lit("d")).otherwise(F.col(OP_COL)))
            .withColumn(COMMIT_TS_COL, F.when(before_t, F.col("_t")[COMMIT_TS_COL]).otherwise(F.col(COMMIT_TS_COL)))
            .withColumn(SEQ_COL, F.when(before_t, F.col("_t")[SEQ_COL]).otherwise(F.col(SEQ_COL)))
            .withColumn(LSN_COL, F.when(before_t, F.col("_t")[LSN_COL]).otherwise(F.col(LSN_COL)))
            .drop("_t")
        )
    cur_cols = [c for c, _ in [(SHARD_COL, ""), *lake_cols]] + [OP_COL, LSN_COL, SEQ_COL, COMMIT_TS_COL]
    # A local checkpoint: computed once, and a deterministic plan (copy-on-write MERGE requires it).
    reduced = reduced.select(*cur_cols, UNAV_LEFT, NO_TABLE, UNAVAILABLE_COL).localCheckpoint(eager=True)
    needs_base = (F.col(OP_COL) != "d") & (F.size(UNAV_LEFT) > 0)
    totals = (
        reduced.groupBy()
        .agg(
            F.count(F.lit(1)).alias("n"),
            F.sum((F.col(OP_COL) != "d").cast("int")).alias("upserts"),
            F.sum(needs_base.cast("int")).alias("needs_base"),
            F.sum(((F.col(OP_COL) != "d") & (F.size(F.coalesce(UNAVAILABLE_COL, F.array())) > 0)).cast("int")).alias(
                "filled"
            ),
            F.min(COMMIT_TS_COL).alias("min_ts"),
            F.max(COMMIT_TS_COL).alias("max_ts"),
        )
        .collect()[0]
    )
    key = [SHARD_COL, *cfg.primary_key]
    live = ~F.col(cfg.soft_delete_columns.flag) if cfg.deletes == "soft" else F.lit(True)
    tgt = current_df.select(*key, F.col(LSN_COL).alias("_t_lsn"), F.col(SEQ_COL).alias("_t_seq"), live.alias("_t_live"))
    # Rows whose unchanged TOAST value has no trustworthy source are held back (see held_back);
    # the MERGE then never sees them. Orphans (no row in the table either) are found by the
    # classification below, which scans the table's keys anyway.
    held = (
        held_back(spark, lake, cfg, reduced, tgt, lake_cols, totals)
        if totals["needs_base"] or totals["filled"]
        else None
    )
    n_held = hold_dependents(spark, lake, cfg, held, ingest_run, metrics, log)
    if n_held:
        reduced = reduced.join(held.select(*key), key, "left_anti").localCheckpoint(eager=True)
    # Classify against the table for exact insert/update/delete counts: the batch's keys are
    # broadcast and the table's key columns scanned once.
    keys = reduced.select(*key, LSN_COL, SEQ_COL, OP_COL, needs_base.alias("_needs_base"))
    if (totals["n"] or 0) <= BROADCAST_ROWS:
        keys = F.broadcast(keys)
    newer = lsn_newer(F.col(LSN_COL), F.col(SEQ_COL), F.col("_t_lsn"), F.col("_t_seq"))
    is_del = F.col(OP_COL) == "d"
    c = (
        tgt.join(keys, key, "inner")
        .groupBy()
        .agg(
            F.sum((~is_del).cast("int")).alias("matched_upserts"),
            F.sum((~is_del & newer).cast("int")).alias("upd"),
            F.sum((is_del & newer & F.col("_t_live")).cast("int")).alias("del"),
            F.sum((~newer).cast("int")).alias("stale"),
            F.sum(F.col("_needs_base").cast("int")).alias("based"),
        )
        .collect()[0]
    )
    metrics.update(
        inserts=int(totals["upserts"] or 0) - n_held - int(c["matched_upserts"] or 0),
        updates=int(c["upd"] or 0),
        deletes=int(c["del"] or 0),
        stale_skipped=int(c["stale"] or 0),
    )
    left_needing = reduced.filter(needs_base).count() if n_held else int(totals["needs_base"] or 0)
    if left_needing > int(c["based"] or 0):
        # An unchanged TOAST value whose key is neither earlier in the batch nor in the table: the
        # value exists nowhere we can read. The MERGE does not insert such rows; they are kept
        # in quarantine rather than given a NULL.
        orphans = reduced.filter(needs_base).join(tgt.select(*key), key, "left_anti")
        orphans = as_held(
            orphans.withColumn(
                REASONS,
                F.array(
                    F.concat(
                        F.lit("unchanged TOAST column(s) "),
                        F.array_join(UNAV_LEFT, ", "),
                        F.lit(" not sent by the source and the key has no earlier row in the batch or the lake"),
                    )
                ),
            ),
            key,
        )
        metrics["inserts"] -= hold_dependents(spark, lake, cfg, orphans, ingest_run, metrics, log)
    c = {"min_ts": totals["min_ts"], "max_ts": totals["max_ts"]}
    timings["reduce_classify"] = time.time() - t_phase
    view = f"cdc_batch_{cfg.name}"
    reduced.createOrReplaceTempView(view)
    sql = merge_sql(cfg, cur, view, cur_cols, truncated, toast_columns=names)
    pre = snapshot_summary(spark, cur)
    t_apply = time.time()
    fenced_commit(
        spark,
        cur,
        wm,
        plan.new_watermark,
        lambda: sql_with_commit_properties(spark, sql, {"cdc.watermark": new_wm_json, "cdc.ingest-run": ingest_run}),
        what=f"{cfg.name} merge",
    )
    apply_s = time.time() - t_apply
    crash_point("ingest_after_merge")
    if added:
        metrics["backfilled"] = finish_backfill(spark, lake, cfg, cur, plan, added, ingest_run)
    post = snapshot_summary(spark, cur)
    metrics["apply_seconds"] = apply_s
    timings["merge"] = apply_s
    _write_stats(metrics, pre, post)
    now = datetime.now(UTC)
    if c["min_ts"] is not None:
        metrics["lag_seconds_max"] = (now - c["min_ts"].replace(tzinfo=UTC)).total_seconds()
        metrics["lag_seconds_min"] = (now - c["max_ts"].replace(tzinfo=UTC)).total_seconds()
    return _finish(spark, lake, cfg, metrics, plan, t0, t_apply, log)


def _write_stats(metrics: dict[str, Any], pre: dict[str, str], post: dict[str, str]) -> None:
    def n(d: dict[str, str], k: str) -> int:
        return int(d.get(k, 0) or 0)

    added = n(post, "added-files-size")
    removed = n(post, "removed-files-size")
    metrics.update(
        data_files_added=n(post, "added-data-files"),
        data_files_removed=n(post, "deleted-data-files"),
        delete_files_added=n(post, "added-delete-files"),
        bytes_written=added,
        bytes_removed=removed,
    )
    records, size = n(pre, "total-records"), n(pre, "total-files-size")
    changed = metrics["inserts"] + metrics["updates"] + metrics["deletes"]
    if records and changed:
        metrics["changed_rows_bytes"] = int(size / records * changed)
        metrics["write_amplification"] = (
            added / metrics["changed_rows_bytes"] if metrics["changed_rows_bytes"] else None
        )


def _finish(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    metrics: dict[str, Any],
    plan: Plan,
    t0: float,
    t_apply: float,
    log,
) -> dict[str, Any]:
    now = datetime.now(UTC)
    metrics["committed_at"] = now
    metrics["total_seconds"] = time.time() - t0
    metrics["watermark"] = watermark_json(plan.new_watermark)
    ts = [v.get("ts") for v in plan.new_watermark.get("shards", {}).values() if v.get("ts")]
    if ts:
        oldest = min(datetime.fromisoformat(t) for t in ts)
        metrics["freshness_seconds"] = (now - oldest).total_seconds()
    meta_append(spark, lake, "ingest_runs", [{k: v for k, v in metrics.items() if k != "timings"}])
    wa = metrics.get("write_amplification")
    log(
        f"ingest {cfg.name}: runs {metrics['landing_runs']} events {metrics['events_read']} "
        f"(applied before {metrics['already_applied']}, duplicates {metrics['duplicates']}) inserts "
        f"{metrics['inserts']} updates {metrics['updates']} deletes {metrics['deletes']} stale "
        f"{metrics['stale_skipped']} truncates {metrics['truncates']} quarantined {metrics['quarantined']}; "
        f"files +{metrics.get('data_files_added', 0)}/-{metrics.get('data_files_removed', 0)} deletes "
        f"+{metrics.get('delete_files_added', 0)}, bytes written {metrics.get('bytes_written', 0)}, write amplification "
        f"{'n/a' if wa is None else f'{wa:.2f}'}; apply {metrics.get('apply_seconds', 0):.1f}s total "
        f"{metrics['total_seconds']:.1f}s; freshness {metrics.get('freshness_seconds', 0) or 0:.0f}s; phases "
        + ", ".join(f"{k} {v:.1f}s" for k, v in (metrics.get("timings") or {}).items())
    )
    return metrics


def hadoop_fs(spark: SparkSession) -> HadoopFS:
    return HadoopFS(spark)
