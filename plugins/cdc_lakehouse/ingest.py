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
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from .backfill import backfill_added_columns
from .config import COMMIT_TS_COL, LSN_COL, OP_COL, SEQ_COL, SHARD_COL, TableConfig
from .events import (
    BKEY,
    FILE,
    PKCHANGE,
    RAW,
    REASONS,
    landing_spark_schema,
    latest_per_key,
    split_pk_changes,
    typed_events,
)
from .failpoints import crash_point
from .identifiers import spark_ident
from .lake import (
    INGESTED_COL,
    LSN_EVENT_COL,
    RUN_COL,
    UNAVAILABLE_COL,
    XID_COL,
    HadoopFS,
    SparkLanding,
    add_column,
    conform_to,
    fenced_commit,
    meta_append,
    read_watermark,
    snapshot_summary,
    source_columns_of,
    sql_with_commit_properties,
    table_exists,
    watermark_json,
    with_commit_retries,
)
from .landing import list_manifests, manifest_files
from .settings import LakeSettings
from .source import identity_mismatch

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


class SourceIdentityChanged(IngestError):
    """A shard's landing runs come from another server or endpoint than its lake position."""


class CoverageError(IngestError):
    """A landing run did not capture one of the table's shards (not published for the whole run)."""


class ErrorBudgetExceeded(IngestError):
    pass


WIDENINGS = {("int", "bigint"), ("float", "double")}
BACKFILL = "backfill"  # watermark key: added columns whose older rows still need the source's value


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


def plan_landing(
    landing: SparkLanding, cfg: TableConfig, watermark: dict[str, Any], upto_run: str | None, check_files: bool = True
) -> Plan:
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
                f'cdc_bootstrap__{cfg.name} (conf {{"shards": {missing}}}) before ingesting them'
            )
        manifests = same_source_manifests(cfg, endpoint, shards, shards_wm, list_manifests(landing, endpoint))
        floor = min(shards_wm[shard]["lsn"] for _, shard in shards)
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
            check_coverage(cfg, endpoint, shards, shards_wm, m)
            for _table, rel, info in manifest_files(m, {cfg.source.table}):
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
                    changes.append({**ch, "endpoint": endpoint})
            selected.append(m)
            reached = max(reached, m["end_lsn"])
            last = m
        if last is not None:
            for schema, shard in shards:
                hb = last.get("heartbeats", {}).get(schema)
                prev = shards_wm[shard]
                if last["end_lsn"] > prev["lsn"]:
                    # Keep what else the position records (its endpoint and server identity).
                    new_wm["shards"][shard] = {
                        **prev,
                        "lsn": last["end_lsn"],
                        "endpoint": endpoint,
                        "source": prev.get("source") or last.get("source_identity"),
                        "ts": hb["commit_ts"] if hb else last.get("last_commit_ts", prev.get("ts")),
                    }
            new_wm["runs"][endpoint] = last["run_id"]
    return Plan(selected, files, new_wm, problems, changes)


def same_source_manifests(
    cfg: TableConfig,
    endpoint: str,
    shards: list[tuple[str, str]],
    shards_wm: dict[str, Any],
    manifests: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """The endpoint's runs whose LSNs may be compared with the shards' positions.

    A position is only meaningful on the server (system, timeline, database) and endpoint that
    produced it. A shard whose config now points at another endpoint, or whose endpoint now
    delivers runs from another server, stops with the fix instead of comparing foreign LSNs
    (which would drop changes as "already applied"). Runs of an older identity that finished
    before the shard's position was taken (history from before a re-bootstrap) are skipped."""
    fix = f're-bootstrap the shard: trigger cdc_bootstrap__{cfg.name} with conf {{"shards": [...]}}'
    for _, shard in shards:
        was = shards_wm[shard].get("endpoint")
        if was is not None and was != endpoint:
            raise SourceIdentityChanged(
                f"{cfg.name}: shard {shard} is now read through endpoint {endpoint} but its lake position was taken "
                f"on endpoint {was}; positions of two endpoints do not compare, so nothing was applied. Fix: "
                + fix.replace("[...]", f'["{shard}"]')
            )
    out = []
    for m in manifests:
        seen = m.get("source_identity")
        foreign = False
        for _, shard in shards:
            rec = shards_wm[shard]
            why = identity_mismatch(rec.get("source"), seen)
            if why is None:
                continue
            foreign = True
            if _after(m.get("finished_at"), rec.get("ts")):
                raise SourceIdentityChanged(
                    f"{cfg.name}: shard {shard}: landing run {m['run_id']} on endpoint {endpoint} comes from another "
                    f"source server than the shard's lake position ({why}); after a move or a failover LSNs of the "
                    "two servers do not compare, so nothing was applied. Fix: " + fix.replace("[...]", f'["{shard}"]')
                )
        if not foreign:
            out.append(m)
    return out


def _after(a: str | None, b: str | None) -> bool:
    """ISO time a is later than b (unknown times count as later: refuse rather than guess)."""
    if not a or not b:
        return True
    return datetime.fromisoformat(a) > datetime.fromisoformat(b)


def check_coverage(
    cfg: TableConfig, endpoint: str, shards: list[tuple[str, str]], shards_wm: dict[str, Any], m: dict[str, Any]
) -> None:
    """A run counts for a shard only if the shard's table was published for the whole run.

    Runs written before manifests listed their publication (format 1) are trusted."""
    if "published" not in m:
        return
    published = set(m["published"])
    at_start = set(m["published_at_start"] if "published_at_start" in m else m["published"])
    for schema, shard in shards:
        name = f"{schema}.{cfg.source.table}"
        if m["end_lsn"] <= shards_wm[shard]["lsn"]:
            continue
        # Added during the run is fine when the shard's position (its bootstrap) came after the add.
        covered = name in published and (name in at_start or shards_wm[shard]["lsn"] >= (m.get("start_lsn") or 0))
        if not covered:
            raise CoverageError(
                f"{cfg.name}: landing run {m['run_id']} on endpoint {endpoint} did not capture shard {shard}: "
                f"{name} was not in publication {m.get('publication')} for the whole run, so its changes in that "
                f"window were never read and the shard's position cannot move past it. Fix: make sure the table "
                f"stays in the publication, then re-bootstrap the shard: trigger cdc_bootstrap__{cfg.name} with conf "
                f'{{"shards": ["{shard}"]}}'
            )


# --- schema -------------------------------------------------------------------------------------


def manifest_schemas(plan: Plan, cfg: TableConfig) -> tuple[list[list[dict]], dict[str, list[dict]]]:
    """The table's schemas as the capture saw them (relation messages), from the runs' manifests:
    every schema of the batch, and the latest per shard. No scan of the events is needed."""
    all_schemas: dict[str, list[dict]] = {}
    latest: dict[str, list[dict]] = {}
    for m in plan.manifests:
        for key, cols in (m.get("schemas") or {}).items():
            schema, _, table = key.rpartition(".")
            if table != cfg.source.table:
                continue
            all_schemas.setdefault(json.dumps(cols, sort_keys=True), cols)
            latest[schema] = cols
    return list(all_schemas.values()), latest


def _event_schemas(raw: DataFrame) -> tuple[list[list[dict]], dict[str, list[dict]]]:
    """All distinct event schemas, and the latest schema per source shard schema."""
    from pyspark.sql import functions as F

    rows = (
        raw.groupBy(F.col("source.schema").alias("s"))
        .agg(
            F.max_by("table_schema", F.struct("source.commit_lsn", "source.seq")).alias("latest"),
            F.collect_set("table_schema").alias("all"),
        )
        .collect()
    )
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


def schema_actions(
    cfg: TableConfig,
    lake_cols: list[tuple[str, str]],
    schemas: list[list[dict]],
    latest: dict[str, list[dict]],
    file_hint: str = "",
    known: dict[str, set[str]] | None = None,
) -> tuple[list[str], list[str]]:
    """DDL to run before the data (additive changes) and the errors that stop the table.

    `known`: per shard schema, the columns the shard is known to have had (its watermark). A lake
    column missing from a shard's latest schema is dropped there only if the shard had it: a shard
    with no writes since a column was added elsewhere still shows its older schema."""
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
                    errors.append(
                        f"{cfg.name}: new source column {name!r} has unsupported type {c.get('type')!r}; "
                        f"set column_types: {{{name}: string}} in {where}"
                    )
                elif cfg.schema_changes.mode == "strict":
                    errors.append(
                        f"{cfg.name}: source column {name!r} ({c.get('type')}) was added and the table's "
                        f"schema_changes.mode is strict; set it to additive in {where}, or re-bootstrap"
                    )
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
        had = (known or {}).get(shard_schema)
        for name in lake:
            if name in names or name in seen_added or (had is not None and name not in had):
                continue
            policy = cfg.schema_changes.dropped_columns.get(name)
            if name in cfg.primary_key:
                errors.append(
                    f"{cfg.name}: primary key column {name!r} disappeared from the source (shard "
                    f"{shard_schema}); re-bootstrap the table with the new key"
                )
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


def apply_schema_actions(spark: SparkSession, cur: str, cl: str, ddl: list[str], log) -> None:
    """Run the DDL on the current table, and what applies of it on the changelog: the changelog
    keeps dropped columns (their history), so a column added back may already be there."""
    for stmt in ddl:
        log(f"schema change applied to {cur}: {stmt}")
        spark.sql(f"ALTER TABLE {cur} {stmt}")
        if stmt.startswith("ADD COLUMN "):
            name, typ = stmt.removeprefix("ADD COLUMN ").split(" ", 1)
            add_column(spark, cl, name.strip("`").replace("``", "`"), typ)
        elif not stmt.startswith("DROP"):
            spark.sql(f"ALTER TABLE {cl} {stmt}")


# --- TOAST ---------------------------------------------------------------------------------------

WORK = "_unav_work"
BROADCAST_ROWS = 2_000_000  # key sets up to this size are broadcast instead of shuffling the table


UNAV_LEFT = "_unav_left"  # columns still without a value after the batch: the MERGE takes the table's
NO_TABLE = "_unav_no_table"  # ... unless the key was deleted or re-created in the batch: then held back
GEN = "_unav_gen"


def fill_unavailable(events: DataFrame, current: DataFrame, cfg: TableConfig, names: list[str]) -> DataFrame:
    """Give unchanged TOAST columns their value from the batch itself: the key's latest earlier
    event that carried it, or for a primary-key change the old key's state. What the batch cannot
    provide stays listed in `_unav_left`; the MERGE then keeps the table's value, which costs no
    extra read. Nothing is ever filled with NULL."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    pk = cfg.primary_key
    key = [SHARD_COL, *pk]
    fkey = [SHARD_COL, *[f"_fill_key_{k}" for k in pk]]
    need = events.filter(F.size(F.coalesce(F.col(UNAVAILABLE_COL), F.array())) > 0)
    involved = need.select(*key).unionByName(need.select(*[F.col(a).alias(b) for a, b in zip(fkey, key)])).distinct()
    involved = involved.localCheckpoint(eager=True)
    n_involved = involved.count()
    inv = F.broadcast(involved) if n_involved <= BROADCAST_ROWS else involved
    sub = events.join(inv, key, "left_semi").withColumn(
        WORK, F.coalesce(F.col(UNAVAILABLE_COL), F.array().cast("array<string>"))
    )
    rest = events.join(inv, key, "left_anti").withColumn(UNAV_LEFT, F.array().cast("array<string>"))

    # A value never crosses a delete of its key: events after the key's n-th delete in the batch
    # (a delete, or the delete half of a key change) form generation n and look back only within it.
    # Otherwise "move 1 -> 99, move 2 -> 1, update 1" would give key 1 the value 1 had before.
    order = Window.partitionBy(*key).orderBy(LSN_COL, SEQ_COL)
    before = order.rowsBetween(Window.unboundedPreceding, -1)
    sub = sub.withColumn(GEN, F.coalesce(F.sum((F.col(OP_COL) == "d").cast("int")).over(before), F.lit(0)))
    gen_order = Window.partitionBy(*key, GEN).orderBy(LSN_COL, SEQ_COL)
    # The table's value of the key is the right base only while the key has not been deleted or
    # (re)created by a key change earlier in the batch.
    sub = sub.withColumn(
        NO_TABLE,
        (F.col(GEN) > 0)
        | F.max(F.col(PKCHANGE).cast("int")).over(gen_order.rowsBetween(Window.unboundedPreceding, 0)).cast("boolean"),
    )
    w = gen_order.rowsBetween(Window.unboundedPreceding, -1)

    def from_history(df: DataFrame) -> DataFrame:
        for c in names:
            src = F.when((F.col(OP_COL) != "d") & ~F.array_contains(WORK, c), F.struct(F.col(c).alias("v")))
            df = df.withColumn(f"_prev_{c}", F.last(src, ignorenulls=True).over(w))
        for c in names:
            take = F.array_contains(WORK, c) & ~F.col(PKCHANGE) & F.col(f"_prev_{c}").isNotNull()
            df = df.withColumn(c, F.when(take, F.col(f"_prev_{c}")["v"]).otherwise(F.col(c)))
            df = df.withColumn(WORK, F.when(take, F.array_remove(WORK, c)).otherwise(F.col(WORK)))
        return df

    def from_partner(df: DataFrame) -> DataFrame:
        # Primary-key change: the new key starts from the old key's state just before the change,
        # which is what its delete half (same commit, seq - 1) saw.
        partner = df.filter(F.col(OP_COL) == "d").select(
            *[F.col(a).alias(b) for a, b in zip(key, fkey)],
            F.col(LSN_COL),
            (F.col(SEQ_COL) + 1).alias(SEQ_COL),
            *[F.col(f"_prev_{c}").alias(f"_old_{c}") for c in names],
        )
        df = df.drop(*[f"_prev_{c}" for c in names]).join(partner, [*fkey, LSN_COL, SEQ_COL], "left")
        for c in names:
            take = F.array_contains(WORK, c) & F.col(PKCHANGE) & F.col(f"_old_{c}").isNotNull()
            df = df.withColumn(c, F.when(take, F.col(f"_old_{c}")["v"]).otherwise(F.col(c)))
            df = df.withColumn(WORK, F.when(take, F.array_remove(WORK, c)).otherwise(F.col(WORK)))
        # Later events of the new key inherit what the key change just received.
        return from_history(df.drop(*[f"_old_{c}" for c in names])).drop(*[f"_prev_{c}" for c in names])

    def pk_unresolved(df: DataFrame) -> int:
        return df.filter(F.col(PKCHANGE) & (F.size(WORK) > 0)).count()

    def propagate(df: DataFrame) -> DataFrame:
        # A key changed twice in one batch (a -> b -> c) resolves one link per pass.
        left = -1
        for _ in range(32):
            df = from_partner(from_history(df)).localCheckpoint(eager=True)
            now = pk_unresolved(df)
            if now in (0, left):
                break
            left = now
        return df

    sub = propagate(sub)
    # A key change whose old row is only in the table: read those few old keys (rare), then let
    # the chain and the new key's later events in the batch inherit the value.
    pk_missing = sub.filter(F.col(PKCHANGE) & (F.size(WORK) > 0)).select(*fkey).distinct().collect()
    if pk_missing:
        cond = None
        for r in pk_missing:
            c1 = F.lit(True)
            for a, b in zip(key, fkey):
                c1 = c1 & (F.col(a) == F.lit(r[b]))
            cond = c1 if cond is None else cond | c1
        base = current.filter(cond).select(
            *[F.col(a).alias(b) for a, b in zip(key, fkey)],
            *[F.struct(F.col(c).alias("v")).alias(f"_base_{c}") for c in names],
        )
        # The table's value is the old key's value only if no earlier event of the old key in this
        # batch set the column (an insert, a delete, a key change into it, or an update carrying it).
        orig = F.coalesce(F.col(UNAVAILABLE_COL), F.array().cast("array<string>"))
        flags = sub
        for c in names:
            changed = (F.col(OP_COL) != "u") | F.col(PKCHANGE) | ~F.array_contains(orig, c)
            flags = flags.withColumn(f"_set_{c}", F.max(changed.cast("int")).over(w))
        roots = flags.filter(F.col(OP_COL) == "d").select(
            *[F.col(a).alias(b) for a, b in zip(key, fkey)],
            F.col(LSN_COL),
            (F.col(SEQ_COL) + 1).alias(SEQ_COL),
            *[(F.coalesce(F.col(f"_set_{c}"), F.lit(0)) == 0).alias(f"_root_{c}") for c in names],
        )
        sub = sub.join(F.broadcast(base), fkey, "left").join(roots, [*fkey, LSN_COL, SEQ_COL], "left")
        for c in names:
            take = (
                F.array_contains(WORK, c)
                & F.col(PKCHANGE)
                & F.col(f"_base_{c}").isNotNull()
                & F.coalesce(F.col(f"_root_{c}"), F.lit(False))
            )
            sub = sub.withColumn(c, F.when(take, F.col(f"_base_{c}")["v"]).otherwise(F.col(c)))
            sub = sub.withColumn(WORK, F.when(take, F.array_remove(WORK, c)).otherwise(F.col(WORK)))
        sub = sub.drop(*[f"_root_{c}" for c in names])
        sub = propagate(sub.drop(*[f"_base_{c}" for c in names]))
    rest = rest.withColumn(NO_TABLE, F.lit(False))
    return rest.unionByName(sub.drop(GEN).withColumnRenamed(WORK, UNAV_LEFT))


# --- the run ---------------------------------------------------------------------------------------


def _merge_sql(
    cfg: TableConfig,
    target: str,
    view: str,
    columns: list[str],
    truncated: list[str],
    toast_columns: list[str] | None = None,
) -> str:
    key = [SHARD_COL, *cfg.primary_key]
    on = " AND ".join(f"t.{spark_ident(k)} = s.{spark_ident(k)}" for k in key)
    newer = f"(s.{LSN_COL} > t.{LSN_COL} OR (s.{LSN_COL} = t.{LSN_COL} AND s.{SEQ_COL} > t.{SEQ_COL}))"
    toast = set(toast_columns or [])

    def value(c: str) -> str:
        # An unchanged TOAST value the batch could not supply: keep the table's.
        q = spark_ident(c)
        return f"CASE WHEN array_contains(s.{UNAV_LEFT}, '{c}') THEN t.{q} ELSE s.{q} END" if c in toast else f"s.{q}"

    sets = ", ".join(f"t.{spark_ident(c)} = {value(c)}" for c in columns)
    ins_cols = ", ".join(spark_ident(c) for c in columns)
    ins_vals = ", ".join(f"s.{spark_ident(c)}" for c in columns)
    insertable = f"s.{OP_COL} <> 'd'" + (f" AND size(s.{UNAV_LEFT}) = 0" if toast else "")
    trunc = ", ".join(f"'{s}'" for s in truncated)
    if cfg.deletes == "hard":
        sql = (
            f"MERGE INTO {target} t USING {view} s ON {on} "
            f"WHEN MATCHED AND {newer} AND s.{OP_COL} = 'd' THEN DELETE "
            f"WHEN MATCHED AND {newer} THEN UPDATE SET {sets} "
            f"WHEN NOT MATCHED AND {insertable} THEN INSERT ({ins_cols}) VALUES ({ins_vals})"
        )
        if truncated:
            sql += f" WHEN NOT MATCHED BY SOURCE AND t.{SHARD_COL} IN ({trunc}) THEN DELETE"
        return sql
    flag, ts = spark_ident(cfg.soft_delete_columns.flag), spark_ident(cfg.soft_delete_columns.timestamp)
    meta = (
        f"t.{OP_COL} = 'd', t.{LSN_COL} = s.{LSN_COL}, t.{SEQ_COL} = s.{SEQ_COL}, t.{COMMIT_TS_COL} = s.{COMMIT_TS_COL}"
    )
    sql = (
        f"MERGE INTO {target} t USING {view} s ON {on} "
        f"WHEN MATCHED AND {newer} AND s.{OP_COL} = 'd' THEN UPDATE SET t.{flag} = true, "
        f"t.{ts} = s.{COMMIT_TS_COL}, {meta} "
        f"WHEN MATCHED AND {newer} THEN UPDATE SET {sets}, t.{flag} = false, t.{ts} = NULL "
        f"WHEN NOT MATCHED AND {insertable} THEN INSERT ({ins_cols}, {flag}, {ts}) "
        f"VALUES ({ins_vals}, false, NULL)"
    )
    if truncated:
        sql += (
            f" WHEN NOT MATCHED BY SOURCE AND t.{SHARD_COL} IN ({trunc}) AND NOT t.{flag} THEN UPDATE SET "
            f"t.{flag} = true, t.{ts} = current_timestamp()"
        )
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
        F.lit(cfg.name).alias("table_name"),
        F.col(SHARD_COL).alias("shard"),
        F.array_join(REASONS, "; ").alias("reason"),
        F.col(RAW).alias("raw"),
        F.col(LSN_COL).alias("commit_lsn"),
        F.col("_seq_raw").alias("seq"),
        F.col(RUN_COL).alias("landing_run"),
        F.col(FILE).alias("landing_file"),
        F.lit(ingest_run).alias("ingest_run"),
        F.current_timestamp().alias("quarantined_at"),
    ).dropDuplicates(["commit_lsn", "seq", "landing_file", "reason"])
    n = rows.count()
    if n == 0:
        return 0
    view = f"cdc_quarantine_{cfg.name}"
    rows.createOrReplaceTempView(view)
    q = lake.qualified(lake.meta_table("quarantine"))
    with_commit_retries(
        lambda: spark.sql(
            f"MERGE INTO {q} t USING {view} s ON t.table_name = s.table_name AND t.commit_lsn <=> s.commit_lsn "
            "AND t.seq <=> s.seq AND t.landing_file <=> s.landing_file AND t.reason = s.reason "
            "WHEN NOT MATCHED THEN INSERT *"
        ),
        what=f"{cfg.name} quarantine",
    )
    return n


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
        schemas, latest = _event_schemas(raw)  # runs written without schemas in their manifest
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
    wm_floor = _wm_map(wm)
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
        metrics["quarantined"] = _quarantine(spark, lake, cfg, bad, ingest_run)
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
    cl_floor = _wm_map(cwm)
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
        before_t = F.col("_t").isNotNull() & _newer(
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
    n_held = _hold(spark, lake, cfg, held, ingest_run, metrics, log)
    if n_held:
        reduced = reduced.join(held.select(*key), key, "left_anti").localCheckpoint(eager=True)
    # Classify against the table for exact insert/update/delete counts: the batch's keys are
    # broadcast and the table's key columns scanned once.
    keys = reduced.select(*key, LSN_COL, SEQ_COL, OP_COL, needs_base.alias("_needs_base"))
    if (totals["n"] or 0) <= BROADCAST_ROWS:
        keys = F.broadcast(keys)
    newer = _newer(F.col(LSN_COL), F.col(SEQ_COL), F.col("_t_lsn"), F.col("_t_seq"))
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
        orphans = _as_held(
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
        metrics["inserts"] -= _hold(spark, lake, cfg, orphans, ingest_run, metrics, log)
    c = {"min_ts": totals["min_ts"], "max_ts": totals["max_ts"]}
    timings["reduce_classify"] = time.time() - t_phase
    view = f"cdc_batch_{cfg.name}"
    reduced.createOrReplaceTempView(view)
    sql = _merge_sql(cfg, cur, view, cur_cols, truncated, toast_columns=names)
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


def held_back(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    reduced: DataFrame,
    tgt: DataFrame,
    lake_cols: list[tuple[str, str]],
    totals,
) -> DataFrame | None:
    """Rows whose unchanged TOAST value has no trustworthy source, as quarantine rows (or None).

    The MERGE would take the table's value for them, which is wrong when (a) the key was deleted
    or re-created by a key change earlier in the batch and the batch could not supply the value,
    or (b) a quarantined event of the key (this batch or an earlier one) is newer than the table's
    row: the value it carried never reached the table. Held rows keep the table's older row
    (never a mix); the audit reports the key, and a fixed replay or a repair brings it back.
    Only (b) reads the table's positions, and only when this table has quarantined events."""
    from pyspark.sql import functions as F

    key = [SHARD_COL, *cfg.primary_key]
    needs_base = (F.col(OP_COL) != "d") & (F.size(UNAV_LEFT) > 0)
    filled = (F.col(OP_COL) != "d") & (F.size(F.coalesce(UNAVAILABLE_COL, F.array())) > 0)
    reason = F.when(
        needs_base & F.col(NO_TABLE),
        F.concat(
            F.lit("unchanged TOAST column(s) "),
            F.array_join(F.coalesce(UNAV_LEFT, F.array()), ", "),
            F.lit(" follow a delete or key change of this key in the batch whose value the batch does not hold"),
        ),
    )
    rows = reduced.filter(needs_base & F.col(NO_TABLE)) if totals["needs_base"] else None
    if totals["filled"] and has_quarantine(spark, lake, cfg):
        q = open_quarantine_keys(spark, lake, cfg, lake_cols)
        rows = reduced.filter(needs_base | filled).join(F.broadcast(q), key, "inner").join(tgt, key, "left")
        after_table = F.col("_t_lsn").isNull() | _newer(
            F.col("_q_lsn"), F.col("_q_seq"), F.col("_t_lsn"), F.col("_t_seq")
        )
        depends = filled & after_table & _newer(F.col(LSN_COL), F.col(SEQ_COL), F.col("_q_lsn"), F.col("_q_seq"))
        reason = reason.when(
            depends,
            F.concat(
                F.lit("unchanged TOAST column(s) depend on quarantined event at commit LSN "),
                F.col("_q_lsn").cast("string"),
                F.lit(" of this key, whose values never reached the table"),
            ),
        )
        rows = rows.unionByName(
            reduced.filter(needs_base & F.col(NO_TABLE)).join(q, key, "left_anti"), allowMissingColumns=True
        )
    if rows is None:
        return None
    rows = rows.withColumn(REASONS, F.array(reason)).filter(F.col(REASONS)[0].isNotNull()).localCheckpoint(eager=True)
    return None if rows.isEmpty() else _as_held(rows, key)


def _as_held(rows: DataFrame, key: list[str]) -> DataFrame:
    """Reduced rows with REASONS -> the shape _quarantine takes (the key and position as payload)."""
    from pyspark.sql import functions as F

    return (
        rows.withColumn(RAW, F.to_json(F.struct(*key, LSN_COL, SEQ_COL)))
        .withColumn("_seq_raw", F.floor(F.col(SEQ_COL) / 2).cast("bigint"))
        .withColumn(RUN_COL, F.lit(None).cast("string"))
        .withColumn(FILE, F.lit(None).cast("string"))
    )


def _hold(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    held: DataFrame | None,
    ingest_run: str,
    metrics: dict[str, Any],
    log,
) -> int:
    if held is None:
        return 0
    n = _quarantine(spark, lake, cfg, held, ingest_run)
    metrics["quarantined"] += n
    if n:
        log(f"WARNING {cfg.name}: {n} event(s) held back in quarantine: unchanged TOAST value unknown")
    return n


def has_quarantine(spark: SparkSession, lake: LakeSettings, cfg: TableConfig) -> bool:
    """Any quarantined event of this table (one partition of the quarantine table, read lazily)."""
    from pyspark.sql import functions as F

    q = spark.table(lake.qualified(lake.meta_table("quarantine")))
    return not q.filter(F.col("table_name") == cfg.name).limit(1).isEmpty()


def open_quarantine_keys(
    spark: SparkSession, lake: LakeSettings, cfg: TableConfig, lake_cols: list[tuple[str, str]]
) -> DataFrame:
    """Per key, the newest quarantined event of this table: (shard, key..., _q_lsn, _q_seq, _q_reason)."""
    from pyspark.sql import functions as F

    from .events import cast_text

    types = dict(lake_cols)
    q = spark.table(lake.qualified(lake.meta_table("quarantine"))).filter(F.col("table_name") == cfg.name)
    after = F.from_json(F.get_json_object("raw", "$.after"), "map<string,string>")
    before = F.from_json(F.get_json_object("raw", "$.before"), "map<string,string>")
    cols = [F.col("shard").alias(SHARD_COL)]
    for k in cfg.primary_key:
        text = F.coalesce(after[k], before[k], F.get_json_object("raw", f"$.{k}"))
        cols.append(cast_text(text, types[k]).alias(k))
    # Lake order is 2*seq (+1 for the insert half of a key change): compare in lake order.
    cols += [
        F.col("commit_lsn").alias("_q_lsn"),
        (F.col("seq") * 2 + 1).alias("_q_seq"),
        F.col("reason").alias("_q_reason"),
    ]
    keyed = q.select(*cols).filter(F.col(SHARD_COL).isNotNull() & F.col("_q_lsn").isNotNull())
    for k in cfg.primary_key:
        keyed = keyed.filter(F.col(k).isNotNull())
    key = [SHARD_COL, *cfg.primary_key]
    return (
        keyed.groupBy(*key)
        .agg(F.max(F.struct("_q_lsn", "_q_seq", "_q_reason")).alias("_q"))
        .select(
            *key,
            F.col("_q._q_lsn").alias("_q_lsn"),
            F.col("_q._q_seq").alias("_q_seq"),
            F.col("_q._q_reason").alias("_q_reason"),
        )
    )


def columns_to_backfill(cfg: TableConfig, plan: Plan, wm: dict[str, Any]) -> list[dict[str, Any]]:
    """The batch's schema changes that added columns to a shard, each with the columns it added.

    A shard's known columns are kept in its watermark (set by the bootstrap): a column seen for
    the first time since is new even when the capture had no earlier schema to diff with (no
    events of the shard since its bootstrap). Updates the new watermark's known columns."""
    shard_of = {(g.endpoint_id, schema): shard for g, schema, shard in cfg.shards()}
    known = {s: set(v["columns"]) for s, v in wm.get("shards", {}).items() if "columns" in v}
    out = []
    for ch in plan.schema_changes:
        shard = shard_of.get((ch.get("endpoint"), ch["table"].rpartition(".")[0]))
        if shard is None:
            continue
        cols = ch.get("columns")
        if shard in known and cols is not None:
            new = [c for c in cols if c not in known[shard]]
        else:
            new = list(ch.get("added") or [])
        if cols is not None:
            known[shard] = set(cols)
        if new:
            out.append({**ch, "added": new})
    for shard, cols in known.items():
        if shard in plan.new_watermark.get("shards", {}):
            plan.new_watermark["shards"][shard]["columns"] = sorted(cols)
    return out


def finish_backfill(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    cur: str,
    plan: Plan,
    added: list[dict[str, Any]],
    ingest_run: str,
) -> int:
    """Fill the columns the batch added for rows that predate them, then clear the pending mark."""
    lake_cols = source_columns_of(spark, cur, cfg)
    n = backfill_added_columns(spark, lake, cfg, added, lake_cols, ingest_run)
    done = {k: v for k, v in plan.new_watermark.items() if k != BACKFILL}

    def clear() -> None:
        spark.createDataFrame([], spark.table(cur).schema).writeTo(cur).option(
            "snapshot-property.cdc.watermark", watermark_json(done)
        ).append()

    fenced_commit(spark, cur, plan.new_watermark, done, clear, what=f"{cfg.name} backfill done")
    plan.new_watermark = done
    return n


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


__all__ = [
    "ingest_table",
    "plan_landing",
    "schema_actions",
    "fill_unavailable",
    "IngestError",
    "NotBootstrapped",
    "LandingGap",
    "SchemaChangeError",
    "ErrorBudgetExceeded",
    "LSN_EVENT_COL",
    "XID_COL",
]
