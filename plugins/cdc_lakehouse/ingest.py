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

import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from .config import COMMIT_TS_COL, LSN_COL, OP_COL, SEQ_COL, SHARD_COL, TableConfig
from .events import (
    FILE, PKCHANGE, RAW, REASONS, landing_spark_schema, latest_per_key, split_pk_changes, typed_events,
)
from .failpoints import crash_point
from .identifiers import spark_ident
from .lake import (
    INGESTED_COL, LSN_EVENT_COL, RUN_COL, UNAVAILABLE_COL, XID_COL, HadoopFS, SparkLanding, changelog_columns,
    meta_append, read_watermark, snapshot_summary, source_columns_of, sql_with_commit_properties, table_exists,
    watermark_json, with_commit_retries,
)
from .landing import list_manifests, manifest_files
from .settings import LakeSettings

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


class IngestError(RuntimeError):
    """Stops this table's ingest; the message names the table, the cause and the fix."""


class NotBootstrapped(IngestError):
    pass


class LandingGap(IngestError):
    pass


class SchemaChangeError(IngestError):
    pass


class ErrorBudgetExceeded(IngestError):
    pass


WIDENINGS = {("int", "bigint"), ("float", "double")}


@dataclass
class Plan:
    manifests: list[dict[str, Any]]
    files: list[str]
    new_watermark: dict[str, Any]
    problems: list[str] = field(default_factory=list)
    schema_changes: list[dict[str, Any]] = field(default_factory=list)


def shard_endpoints(cfg: TableConfig) -> dict[str, list[tuple[str, str]]]:
    """endpoint id -> [(schema, shard name)]"""
    out: dict[str, list[tuple[str, str]]] = {}
    for g, schema, shard in cfg.shards():
        out.setdefault(g.endpoint_id, []).append((schema, shard))
    return out


def plan_landing(landing: SparkLanding, cfg: TableConfig, watermark: dict[str, Any], upto_run: str | None,
                 check_files: bool = True) -> Plan:
    """Pending capture runs for this table, in slot order, stopping before any gap."""
    shards_wm = watermark.get("shards", {})
    new_wm = json.loads(json.dumps(watermark))
    new_wm.setdefault("runs", {})
    selected: list[dict[str, Any]] = []
    files: list[str] = []
    problems: list[str] = []
    changes: list[dict[str, Any]] = []
    for endpoint, shards in sorted(shard_endpoints(cfg).items()):
        missing = [shard for _, shard in shards if shard not in shards_wm]
        if missing:
            raise NotBootstrapped(
                f"{cfg.name}: shard(s) {missing} have no watermark, so they were never bootstrapped; trigger "
                f"cdc_bootstrap__{cfg.name} (conf {{\"shards\": {missing}}}) before ingesting them"
            )
        floor = min(shards_wm[shard]["lsn"] for _, shard in shards)
        manifests = list_manifests(landing, endpoint)
        pending = [m for m in manifests if m["end_lsn"] > floor]
        reached = floor
        last = None
        for m in pending:
            if upto_run is not None and m["run_id"] > upto_run:
                break  # a later interval's capture; never skip over it to reach an older-named run
            start = m.get("start_lsn")
            if start is not None and start > reached:
                problems.append(
                    f"{cfg.name}: landing gap on endpoint {endpoint}: changes between LSN {reached} and {start} are "
                    f"in no manifest (run {m['run_id']} starts after the table's position); a landing run was lost or "
                    "deleted before this table applied it"
                )
            for table, rel, info in manifest_files(m, {cfg.source.table}):
                uri = landing.file_uri(rel)
                if check_files:
                    size = landing.fs.size(uri)
                    if size is None or ("bytes" in info and size != info["bytes"]):
                        state = "missing" if size is None else f"truncated ({size} of {info['bytes']} bytes)"
                        problems.append(f"{cfg.name}: landing file {uri} listed by run {m['run_id']} is {state}")
                        continue
                files.append(uri)
            for ch in m.get("schema_changes", []):
                if ch["table"].split(".", 1)[-1] == cfg.source.table:
                    changes.append(ch)
            selected.append(m)
            reached = max(reached, m["end_lsn"])
            last = m
        if last is not None:
            for schema, shard in shards:
                hb = last.get("heartbeats", {}).get(schema)
                prev = shards_wm[shard]
                if last["end_lsn"] > prev["lsn"]:
                    new_wm["shards"][shard] = {"lsn": last["end_lsn"],
                                               "ts": hb["commit_ts"] if hb else last.get("last_commit_ts", prev.get("ts"))}
            new_wm["runs"][endpoint] = last["run_id"]
    return Plan(selected, files, new_wm, problems, changes)


# --- schema -------------------------------------------------------------------------------------

def _event_schemas(raw: DataFrame) -> tuple[list[list[dict]], dict[str, list[dict]]]:
    """All distinct event schemas, and the latest schema per source shard schema."""
    from pyspark.sql import functions as F

    rows = (raw.groupBy(F.col("source.schema").alias("s"))
            .agg(F.max_by("table_schema", F.struct("source.commit_lsn", "source.seq")).alias("latest"),
                 F.collect_set("table_schema").alias("all"))
            .collect())
    all_schemas: dict[str, list[dict]] = {}
    latest: dict[str, list[dict]] = {}
    for r in rows:
        if r["latest"]:
            latest[r["s"]] = json.loads(r["latest"])
        for s in r["all"] or []:
            all_schemas.setdefault(s, json.loads(s))
    return list(all_schemas.values()), latest


def _dec(t: str) -> tuple[int, int] | None:
    import re

    m = re.match(r"^decimal\((\d+),\s*(\d+)\)$", t)
    return (int(m.group(1)), int(m.group(2))) if m else None


def schema_actions(cfg: TableConfig, lake_cols: list[tuple[str, str]], schemas: list[list[dict]],
                   latest: dict[str, list[dict]], file_hint: str = "") -> tuple[list[str], list[str]]:
    """DDL to run before the data (additive changes) and the errors that stop the table."""
    lake = dict(lake_cols)
    ddl: list[str] = []
    errors: list[str] = []
    where = file_hint or f"include/tables/{cfg.name}.yaml"
    seen_added: set[str] = set()
    for sch in schemas:
        for c in sch:
            name = c["name"]
            want = cfg.column_types.get(name) or c.get("lake_type")
            if name not in lake:
                if name in seen_added:
                    continue
                seen_added.add(name)
                if not want:
                    errors.append(f"{cfg.name}: new source column {name!r} has unsupported type {c.get('type')!r}; "
                                  f"set column_types: {{{name}: string}} in {where}")
                elif cfg.schema_changes.mode == "strict":
                    errors.append(f"{cfg.name}: source column {name!r} ({c.get('type')}) was added and the table's "
                                  f"schema_changes.mode is strict; set it to additive in {where}, or re-bootstrap")
                else:
                    ddl.append(f"ADD COLUMN {spark_ident(name)} {want}")
            elif want and lake[name] != want:
                old, new = lake[name], want
                od, nd = _dec(old), _dec(new)
                if (old, new) in WIDENINGS or (od and nd and nd[1] == od[1] and nd[0] > od[0]):
                    if cfg.schema_changes.mode == "additive":
                        ddl.append(f"ALTER COLUMN {spark_ident(name)} TYPE {new}")
                        lake[name] = new
                        continue
                errors.append(
                    f"{cfg.name}: source column {name!r} changed type from {old} to {new} ({c.get('type')}), which the lake "
                    f"table cannot take in place. Choose: set column_types: {{{name}: {old}}} in {where} if the values "
                    f"still fit (values that do not are quarantined), or re-bootstrap the table after setting the new type"
                )
    for shard_schema, sch in latest.items():
        names = {c["name"] for c in sch}
        for name in lake:
            if name in names or name in seen_added:
                continue
            policy = cfg.schema_changes.dropped_columns.get(name)
            if name in cfg.primary_key:
                errors.append(f"{cfg.name}: primary key column {name!r} disappeared from the source (shard "
                              f"{shard_schema}); re-bootstrap the table with the new key")
            elif policy == "drop":
                stmt = f"DROP COLUMN {spark_ident(name)}"
                if stmt not in ddl:
                    ddl.append(stmt)
            elif policy != "keep_null":
                errors.append(
                    f"{cfg.name}: source column {name!r} was dropped (shard {shard_schema}) but the lake table keeps it, "
                    f"so ingest stopped for this table. Choose in {where}: schema_changes.dropped_columns: "
                    f"{{{name}: keep_null}} to keep it (NULL from now on), or {{{name}: drop}} to drop it from the "
                    "current table (the changelog keeps its history); then rerun the failed task"
                )
    return ddl, sorted(set(errors))


# --- TOAST ---------------------------------------------------------------------------------------

WORK = "_unav_work"


def fill_unavailable(events: DataFrame, current: DataFrame, cfg: TableConfig) -> tuple[DataFrame, DataFrame | None]:
    """Give unchanged TOAST columns their value: from the key's earlier events in the batch, from
    the old key for a primary-key change, else from the current table. Events whose value is
    nowhere are returned separately, for quarantine; nothing is ever filled with NULL."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    names = [r[0] for r in events.select(F.explode(UNAVAILABLE_COL)).distinct().collect()]
    if not names:
        return events, None
    pk = cfg.primary_key
    key = [SHARD_COL, *pk]
    fkey = [SHARD_COL, *[f"_fill_key_{k}" for k in pk]]
    need = events.filter(F.size(F.coalesce(F.col(UNAVAILABLE_COL), F.array())) > 0)
    involved = need.select(*key).unionByName(need.select(*[F.col(a).alias(b) for a, b in zip(fkey, key)])).distinct()
    sub = events.join(F.broadcast(involved), key, "left_semi").withColumn(
        WORK, F.coalesce(F.col(UNAVAILABLE_COL), F.array().cast("array<string>")))
    rest = events.join(F.broadcast(involved), key, "left_anti")

    w = Window.partitionBy(*key).orderBy(LSN_COL, SEQ_COL).rowsBetween(Window.unboundedPreceding, -1)

    def from_history(df: DataFrame) -> DataFrame:
        for c in names:
            src = F.when((F.col(OP_COL) != "d") & ~F.array_contains(WORK, c), F.struct(F.col(c).alias("v")))
            df = df.withColumn(f"_prev_{c}", F.last(src, ignorenulls=True).over(w))
        for c in names:
            take = F.array_contains(WORK, c) & ~F.col(PKCHANGE) & F.col(f"_prev_{c}").isNotNull()
            df = df.withColumn(c, F.when(take, F.col(f"_prev_{c}")["v"]).otherwise(F.col(c)))
            df = df.withColumn(WORK, F.when(take, F.array_remove(WORK, c)).otherwise(F.col(WORK)))
        return df

    sub = from_history(sub)
    # Primary-key change: the new key starts from the old key's state just before the change,
    # which is what its delete half (same commit, seq - 1) saw.
    partner = sub.filter(F.col(OP_COL) == "d").select(
        *[F.col(a).alias(b) for a, b in zip(key, fkey)], F.col(LSN_COL),
        (F.col(SEQ_COL) + 1).alias(SEQ_COL), *[F.col(f"_prev_{c}").alias(f"_old_{c}") for c in names])
    sub = sub.drop(*[f"_prev_{c}" for c in names]).join(partner, [*fkey, LSN_COL, SEQ_COL], "left")
    for c in names:
        take = F.array_contains(WORK, c) & F.col(PKCHANGE) & F.col(f"_old_{c}").isNotNull()
        sub = sub.withColumn(c, F.when(take, F.col(f"_old_{c}")["v"]).otherwise(F.col(c)))
        sub = sub.withColumn(WORK, F.when(take, F.array_remove(WORK, c)).otherwise(F.col(WORK)))
    sub = from_history(sub.drop(*[f"_old_{c}" for c in names])).drop(*[f"_prev_{c}" for c in names])
    # Last resort: the row as the current table holds it (before this batch).
    base = current.select(*[F.col(a).alias(b) for a, b in zip(key, fkey)],
                          *[F.struct(F.col(c).alias("v")).alias(f"_base_{c}") for c in names])
    sub = sub.join(base, fkey, "left")
    for c in names:
        take = F.array_contains(WORK, c) & F.col(f"_base_{c}").isNotNull()
        sub = sub.withColumn(c, F.when(take, F.col(f"_base_{c}")["v"]).otherwise(F.col(c)))
        sub = sub.withColumn(WORK, F.when(take, F.array_remove(WORK, c)).otherwise(F.col(WORK)))
    sub = sub.drop(*[f"_base_{c}" for c in names])
    unresolved = sub.filter(F.size(WORK) > 0).withColumn(REASONS, F.array(F.concat(
        F.lit("unchanged TOAST column(s) "), F.array_join(WORK, ", "),
        F.lit(" not sent by the source and the key has no earlier row in the batch or the lake"))))
    resolved = sub.filter(F.size(WORK) == 0).drop(WORK)
    return rest.unionByName(resolved), unresolved.drop(WORK)


# --- the run ---------------------------------------------------------------------------------------

def _merge_sql(cfg: TableConfig, target: str, view: str, columns: list[str], truncated: list[str]) -> str:
    key = [SHARD_COL, *cfg.primary_key]
    on = " AND ".join(f"t.{spark_ident(k)} = s.{spark_ident(k)}" for k in key)
    newer = (f"(s.{LSN_COL} > t.{LSN_COL} OR (s.{LSN_COL} = t.{LSN_COL} AND s.{SEQ_COL} > t.{SEQ_COL}))")
    sets = ", ".join(f"t.{spark_ident(c)} = s.{spark_ident(c)}" for c in columns)
    ins_cols = ", ".join(spark_ident(c) for c in columns)
    ins_vals = ", ".join(f"s.{spark_ident(c)}" for c in columns)
    trunc = ", ".join(f"'{s}'" for s in truncated)
    if cfg.deletes == "hard":
        sql = (f"MERGE INTO {target} t USING {view} s ON {on} "
               f"WHEN MATCHED AND {newer} AND s.{OP_COL} = 'd' THEN DELETE "
               f"WHEN MATCHED AND {newer} THEN UPDATE SET {sets} "
               f"WHEN NOT MATCHED AND s.{OP_COL} <> 'd' THEN INSERT ({ins_cols}) VALUES ({ins_vals})")
        if truncated:
            sql += f" WHEN NOT MATCHED BY SOURCE AND t.{SHARD_COL} IN ({trunc}) THEN DELETE"
        return sql
    flag, ts = spark_ident(cfg.soft_delete_columns.flag), spark_ident(cfg.soft_delete_columns.timestamp)
    meta = f"t.{OP_COL} = 'd', t.{LSN_COL} = s.{LSN_COL}, t.{SEQ_COL} = s.{SEQ_COL}, t.{COMMIT_TS_COL} = s.{COMMIT_TS_COL}"
    sql = (f"MERGE INTO {target} t USING {view} s ON {on} "
           f"WHEN MATCHED AND {newer} AND s.{OP_COL} = 'd' THEN UPDATE SET t.{flag} = true, "
           f"t.{ts} = s.{COMMIT_TS_COL}, {meta} "
           f"WHEN MATCHED AND {newer} THEN UPDATE SET {sets}, t.{flag} = false, t.{ts} = NULL "
           f"WHEN NOT MATCHED AND s.{OP_COL} <> 'd' THEN INSERT ({ins_cols}, {flag}, {ts}) "
           f"VALUES ({ins_vals}, false, NULL)")
    if truncated:
        sql += (f" WHEN NOT MATCHED BY SOURCE AND t.{SHARD_COL} IN ({trunc}) AND NOT t.{flag} THEN UPDATE SET "
                f"t.{flag} = true, t.{ts} = current_timestamp()")
    return sql


def _newer(lsn_a, seq_a, lsn_b, seq_b):
    """(lsn_a, seq_a) > (lsn_b, seq_b)"""
    return (lsn_a > lsn_b) | ((lsn_a == lsn_b) & (seq_a > seq_b))


def _wm_map(wm: dict[str, Any]):
    from pyspark.sql import functions as F

    pairs = []
    for shard, v in sorted(wm.get("shards", {}).items()):
        pairs += [F.lit(shard), F.lit(int(v["lsn"]))]
    return F.create_map(*pairs) if pairs else F.create_map().cast("map<string,bigint>")


def _quarantine(spark: SparkSession, lake: LakeSettings, cfg: TableConfig, bad: DataFrame, ingest_run: str) -> int:
    """Idempotent: an event quarantined by an earlier attempt of the same data is not added twice."""
    from pyspark.sql import functions as F

    rows = bad.select(
        F.lit(cfg.name).alias("table_name"), F.col(SHARD_COL).alias("shard"),
        F.array_join(REASONS, "; ").alias("reason"), F.col(RAW).alias("raw"),
        F.col(LSN_COL).alias("commit_lsn"), F.col("_seq_raw").alias("seq"),
        F.col(RUN_COL).alias("landing_run"), F.col(FILE).alias("landing_file"),
        F.lit(ingest_run).alias("ingest_run"), F.current_timestamp().alias("quarantined_at"),
    ).dropDuplicates(["commit_lsn", "seq", "landing_file", "reason"])
    n = rows.count()
    if n == 0:
        return 0
    view = f"cdc_quarantine_{cfg.name}"
    rows.createOrReplaceTempView(view)
    q = lake.qualified(lake.meta_table("quarantine"))
    with_commit_retries(lambda: spark.sql(
        f"MERGE INTO {q} t USING {view} s ON t.table_name = s.table_name AND t.commit_lsn <=> s.commit_lsn "
        "AND t.seq <=> s.seq AND t.landing_file = s.landing_file AND t.reason = s.reason "
        "WHEN NOT MATCHED THEN INSERT *"), what=f"{cfg.name} quarantine")
    return n


def ingest_table(spark: SparkSession, lake: LakeSettings, cfg: TableConfig, *, upto_run: str | None,
                 ingest_run: str, interval_end: str | None = None, log=print,
                 config_file: str | None = None) -> dict[str, Any]:
    """Apply every pending capture run (up to `upto_run`) to the table; returns the run's metrics."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    t0 = time.time()
    started = datetime.now(timezone.utc)
    cur = lake.qualified(cfg.current_table)
    cl = lake.qualified(cfg.changelog_table)
    if not table_exists(spark, cur):
        raise NotBootstrapped(f"{cfg.name}: lake table {cur} does not exist; trigger the DAG "
                              f"cdc_bootstrap__{cfg.name} to load it first")
    wm = read_watermark(spark, cur)
    if wm is None:
        raise NotBootstrapped(f"{cfg.name}: {cur} has no cdc.watermark (not created by a bootstrap?); "
                              f"re-bootstrap with cdc_bootstrap__{cfg.name}")
    cwm = read_watermark(spark, cl) or {"shards": {}}
    landing = SparkLanding(spark, lake.landing_uri)
    plan = plan_landing(landing, cfg, wm, upto_run)
    metrics: dict[str, Any] = {
        "table_name": cfg.name, "ingest_run": ingest_run, "interval_end": interval_end,
        "landing_runs": [m["run_id"] for m in plan.manifests], "events_read": 0, "duplicates": 0,
        "already_applied": 0, "inserts": 0, "updates": 0, "deletes": 0, "stale_skipped": 0, "truncates": 0,
        "quarantined": 0, "changelog_rows": 0, "write_mode": cfg.lake.write_mode, "started_at": started,
        "status": "ok", "error": None,
    }
    if plan.problems:
        msg = "\n".join(plan.problems)
        if cfg.ingest.missing_landing_files == "fail":
            raise LandingGap(msg + f"\nTo continue without those events set ingest.missing_landing_files: skip for "
                             f"{cfg.name}; the hourly audit then finds the affected keys and its repair re-reads them")
        log(f"WARNING {cfg.name}: continuing past landing problems (missing_landing_files: skip):\n{msg}")
        metrics["status"] = "ok_with_gaps"
    new_wm_json = watermark_json(plan.new_watermark)
    lake_cols = source_columns_of(spark, cur, cfg)

    if not plan.files:
        # Nothing to apply (quiet shards): the heartbeats still move the watermark forward.
        def _advance() -> None:
            empty_cl = spark.createDataFrame([], spark.table(cl).schema)
            empty_cl.writeTo(cl).option("snapshot-property.cdc.watermark", new_wm_json).append()
            spark.createDataFrame([], spark.table(cur).schema).writeTo(cur).option(
                "snapshot-property.cdc.watermark", new_wm_json).append()

        if plan.new_watermark != wm:
            with_commit_retries(_advance, what=f"{cfg.name} watermark")
        return _finish(spark, lake, cfg, metrics, plan, t0, t0, log)

    raw = spark.read.schema(landing_spark_schema()).parquet(*plan.files).filter(
        F.col("source.table") == cfg.source.table)
    schemas, latest = _event_schemas(raw)
    ddl, errors = schema_actions(cfg, lake_cols, schemas, latest, config_file or "")
    if errors:
        raise SchemaChangeError("\n".join(errors))
    for stmt in ddl:
        log(f"{cfg.name}: schema change applied to {cur}: {stmt}")
        spark.sql(f"ALTER TABLE {cur} {stmt}")
        if not stmt.startswith("DROP"):
            spark.sql(f"ALTER TABLE {cl} {stmt}")
    if ddl:
        lake_cols = source_columns_of(spark, cur, cfg)

    shard_map = {(g.endpoint_id, schema): shard for g, schema, shard in cfg.shards()}
    wm_floor = _wm_map(wm)
    typed = typed_events(raw, cfg, lake_cols, shard_map).filter(F.col(SHARD_COL).isNotNull())
    # Events the table already has (replays, reruns) are dropped before validation, so an old
    # malformed event is not quarantined twice.
    typed = typed.withColumn("_applied", F.col(LSN_COL) < F.coalesce(wm_floor[F.col(SHARD_COL)], F.lit(0)))
    typed = typed.persist(StorageLevel.MEMORY_AND_DISK)
    counts = typed.groupBy().agg(
        F.count(F.lit(1)).alias("n"), F.sum(F.col("_applied").cast("int")).alias("applied"),
        F.sum(((F.size(REASONS) > 0) & ~F.col("_applied")).cast("int")).alias("bad"),
        F.min(F.when(~F.col("_applied"), F.col(COMMIT_TS_COL))).alias("min_ts"),
        F.max(F.when(~F.col("_applied"), F.col(COMMIT_TS_COL))).alias("max_ts"),
    ).collect()[0]
    metrics["events_read"] = int(counts["n"] or 0)
    metrics["already_applied"] = int(counts["applied"] or 0)
    pending = typed.filter(~F.col("_applied")).drop("_applied")
    bad = pending.filter(F.size(REASONS) > 0)
    n_bad = int(counts["bad"] or 0)
    n_new = metrics["events_read"] - metrics["already_applied"]
    if n_bad:
        metrics["quarantined"] = _quarantine(spark, lake, cfg, bad, ingest_run)
        budget = cfg.ingest.error_budget
        if n_bad > budget.max_quarantined or (n_new and n_bad / n_new > budget.max_fraction):
            top = (bad.select(F.explode(REASONS).alias("r")).groupBy("r").count().orderBy(F.desc("count")).limit(5)
                   .collect())
            raise ErrorBudgetExceeded(
                f"{cfg.name}: {n_bad} of {n_new} events are malformed, over the error budget "
                f"(max_quarantined {budget.max_quarantined}, max_fraction {budget.max_fraction}). Top reasons: "
                + "; ".join(f"{r['r']} (x{r['count']})" for r in top)
                + f". They are in {lake.meta_table('quarantine')} (table_name = '{cfg.name}'); nothing was applied. "
                "Fix the source or the table config (e.g. column_types), or raise ingest.error_budget, then rerun."
            )
    valid = pending.filter(F.size(REASONS) == 0).drop(REASONS, RAW)
    events = split_pk_changes(valid.filter(F.col(OP_COL) != "t"), cfg)
    truncs = valid.filter(F.col(OP_COL) == "t").withColumn(SEQ_COL, F.col("_seq_raw") * 2)
    before = events.count()
    events = events.dropDuplicates([SHARD_COL, LSN_COL, SEQ_COL])
    truncs = truncs.dropDuplicates([SHARD_COL, LSN_COL, SEQ_COL])
    events = events.persist(StorageLevel.MEMORY_AND_DISK)
    metrics["duplicates"] = before - events.count()

    current_df = spark.table(cur)
    events, unresolved = fill_unavailable(events, current_df, cfg)
    if unresolved is not None:
        unresolved = unresolved.withColumn(RAW, F.lit(None).cast("string"))
        n_unres = unresolved.count()
        if n_unres:
            unres = unresolved.withColumn(RAW, F.to_json(F.struct(*[F.col(c) for c in [SHARD_COL, *cfg.primary_key,
                                                                                         LSN_COL, SEQ_COL]])))
            metrics["quarantined"] += _quarantine(spark, lake, cfg, unres, ingest_run)
            log(f"WARNING {cfg.name}: {n_unres} event(s) quarantined: TOAST value unavailable")
    events = events.persist(StorageLevel.MEMORY_AND_DISK)
    truncated = sorted(r[0] for r in truncs.select(SHARD_COL).distinct().collect())
    metrics["truncates"] = int(truncs.count()) if truncated else 0

    # 1) changelog: append what it does not have yet, with its new watermark.
    cl_cols = [c for c, _ in changelog_columns(lake_cols)]
    cl_floor = _wm_map(cwm)
    ingested = F.current_timestamp()

    def _changelog() -> int:
        rows = events.unionByName(truncs, allowMissingColumns=True).filter(
            F.col(LSN_COL) >= F.coalesce(cl_floor[F.col(SHARD_COL)], F.lit(0)))
        rows = rows.withColumn(INGESTED_COL, ingested).select(*cl_cols)
        n = rows.count()
        rows.writeTo(cl).option("snapshot-property.cdc.watermark", new_wm_json).append()
        return n

    crash_point("ingest_before_changelog")
    metrics["changelog_rows"] = with_commit_retries(_changelog, what=f"{cfg.name} changelog")
    crash_point("ingest_after_changelog")

    # 2) current table: latest event per key, LSN-guarded MERGE, watermark in the same commit.
    reduced = latest_per_key(events, [SHARD_COL, *cfg.primary_key])
    if truncated:
        # Keys whose last event precedes their shard's truncate are gone.
        tmax = truncs.groupBy(SHARD_COL).agg(F.max(F.struct(LSN_COL, SEQ_COL, COMMIT_TS_COL)).alias("_t"))
        reduced = reduced.join(F.broadcast(tmax), SHARD_COL, "left")
        before_t = F.col("_t").isNotNull() & _newer(F.col("_t")[LSN_COL], F.col("_t")[SEQ_COL], F.col(LSN_COL), F.col(SEQ_COL))
        reduced = (reduced.withColumn(OP_COL, F.when(before_t, F.lit("d")).otherwise(F.col(OP_COL)))
                   .withColumn(COMMIT_TS_COL, F.when(before_t, F.col("_t")[COMMIT_TS_COL]).otherwise(F.col(COMMIT_TS_COL)))
                   .withColumn(SEQ_COL, F.when(before_t, F.col("_t")[SEQ_COL]).otherwise(F.col(SEQ_COL)))
                   .withColumn(LSN_COL, F.when(before_t, F.col("_t")[LSN_COL]).otherwise(F.col(LSN_COL)))
                   .drop("_t"))
    cur_cols = [c for c, _ in [(SHARD_COL, ""), *lake_cols]] + [OP_COL, LSN_COL, SEQ_COL, COMMIT_TS_COL]
    reduced = reduced.select(*cur_cols).persist(StorageLevel.MEMORY_AND_DISK)
    # Classify against the table (key columns only) for exact insert/update/delete counts.
    live = ~F.col(cfg.soft_delete_columns.flag) if cfg.deletes == "soft" else F.lit(True)
    tgt = current_df.select(SHARD_COL, *cfg.primary_key, F.col(LSN_COL).alias("_t_lsn"), F.col(SEQ_COL).alias("_t_seq"),
                            live.alias("_t_live"))
    cls = reduced.join(tgt, [SHARD_COL, *cfg.primary_key], "left")
    newer = F.col("_t_lsn").isNull() | _newer(F.col(LSN_COL), F.col(SEQ_COL), F.col("_t_lsn"), F.col("_t_seq"))
    is_del = F.col(OP_COL) == "d"
    c = cls.groupBy().agg(
        F.sum((~is_del & F.col("_t_lsn").isNull()).cast("int")).alias("ins"),
        F.sum((~is_del & F.col("_t_lsn").isNotNull() & newer).cast("int")).alias("upd"),
        F.sum((is_del & F.col("_t_lsn").isNotNull() & newer & F.col("_t_live")).cast("int")).alias("del"),
        F.sum((F.col("_t_lsn").isNotNull() & ~newer).cast("int")).alias("stale"),
        F.min(COMMIT_TS_COL).alias("min_ts"), F.max(COMMIT_TS_COL).alias("max_ts"),
    ).collect()[0]
    metrics.update(inserts=int(c["ins"] or 0), updates=int(c["upd"] or 0), deletes=int(c["del"] or 0),
                   stale_skipped=int(c["stale"] or 0))
    view = f"cdc_batch_{cfg.name}"
    reduced.createOrReplaceTempView(view)
    merge_cols = [x for x in cur_cols]
    sql = _merge_sql(cfg, cur, view, merge_cols, truncated)
    pre = snapshot_summary(spark, cur)
    t_apply = time.time()
    with_commit_retries(lambda: sql_with_commit_properties(spark, sql, {"cdc.watermark": new_wm_json,
                                                                        "cdc.ingest-run": ingest_run}),
                        what=f"{cfg.name} merge")
    apply_s = time.time() - t_apply
    crash_point("ingest_after_merge")
    post = snapshot_summary(spark, cur)
    metrics["apply_seconds"] = apply_s
    _write_stats(metrics, pre, post)
    now = datetime.now(timezone.utc)
    if c["min_ts"] is not None:
        metrics["lag_seconds_max"] = (now - c["min_ts"].replace(tzinfo=timezone.utc)).total_seconds()
        metrics["lag_seconds_min"] = (now - c["max_ts"].replace(tzinfo=timezone.utc)).total_seconds()
    for df in (typed, events, reduced):
        df.unpersist()
    return _finish(spark, lake, cfg, metrics, plan, t0, t_apply, log)


def _write_stats(metrics: dict[str, Any], pre: dict[str, str], post: dict[str, str]) -> None:
    def n(d: dict[str, str], k: str) -> int:
        return int(d.get(k, 0) or 0)

    added = n(post, "added-files-size")
    removed = n(post, "removed-files-size")
    metrics.update(
        data_files_added=n(post, "added-data-files"), data_files_removed=n(post, "deleted-data-files"),
        delete_files_added=n(post, "added-delete-files"), bytes_written=added, bytes_removed=removed,
    )
    records, size = n(pre, "total-records"), n(pre, "total-files-size")
    changed = metrics["inserts"] + metrics["updates"] + metrics["deletes"]
    if records and changed:
        metrics["changed_rows_bytes"] = int(size / records * changed)
        metrics["write_amplification"] = added / metrics["changed_rows_bytes"] if metrics["changed_rows_bytes"] else None


def _finish(spark: SparkSession, lake: LakeSettings, cfg: TableConfig, metrics: dict[str, Any], plan: Plan,
            t0: float, t_apply: float, log) -> dict[str, Any]:
    now = datetime.now(timezone.utc)
    metrics["committed_at"] = now
    metrics["total_seconds"] = time.time() - t0
    metrics["watermark"] = watermark_json(plan.new_watermark)
    ts = [v.get("ts") for v in plan.new_watermark.get("shards", {}).values() if v.get("ts")]
    if ts:
        oldest = min(datetime.fromisoformat(t) for t in ts)
        metrics["freshness_seconds"] = (now - oldest).total_seconds()
    meta_append(spark, lake, "ingest_runs", [metrics])
    wa = metrics.get("write_amplification")
    log(
        f"ingest {cfg.name}: runs {metrics['landing_runs']} events {metrics['events_read']} "
        f"(applied before {metrics['already_applied']}, duplicates {metrics['duplicates']}) inserts "
        f"{metrics['inserts']} updates {metrics['updates']} deletes {metrics['deletes']} stale "
        f"{metrics['stale_skipped']} truncates {metrics['truncates']} quarantined {metrics['quarantined']}; "
        f"files +{metrics.get('data_files_added', 0)}/-{metrics.get('data_files_removed', 0)} deletes "
        f"+{metrics.get('delete_files_added', 0)}, bytes written {metrics.get('bytes_written', 0)}, write amplification "
        f"{'n/a' if wa is None else f'{wa:.2f}'}; apply {metrics.get('apply_seconds', 0):.1f}s total "
        f"{metrics['total_seconds']:.1f}s; freshness {metrics.get('freshness_seconds', 0) or 0:.0f}s"
    )
    return metrics


def hadoop_fs(spark: SparkSession) -> HadoopFS:
    return HadoopFS(spark)


__all__ = ["ingest_table", "plan_landing", "schema_actions", "fill_unavailable", "IngestError", "NotBootstrapped",
           "LandingGap", "SchemaChangeError", "ErrorBudgetExceeded", "LSN_EVENT_COL", "XID_COL"]
