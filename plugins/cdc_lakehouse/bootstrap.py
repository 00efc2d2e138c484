"""Snapshot bootstrap: a consistent copy of every shard, handed to the change stream with no gap.

The handoff, per endpoint (one database):
  1. the endpoint's capture slot exists (created first if needed), so the WAL from now on
     stays available to the incremental path;
  2. a TEMPORARY logical slot is created with an exported snapshot. PostgreSQL guarantees
     that this snapshot sees exactly the transactions that committed before the slot's
     consistent point P, and none at or after it;
  3. every shard of the endpoint is read under that snapshot (parallel ctid ranges, a cap on
     connections per host), while the temporary slot's connection holds the snapshot;
  4. the rows are written with the table's watermark for those shards set to P in the same
     Iceberg commit; the ingest applies exactly the transactions with commit LSN >= P.
Reading `pg_current_wal_lsn()` next to a plain snapshot would not do: a transaction can have
its commit record before that LSN and still be invisible to the snapshot, and be lost.

The rows also go to the changelog as op 'r' after a 't' marker for each shard (so the
latest-per-key view forgets keys that vanished while the shard was not replicated).
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from . import source as src
from .config import COMMIT_TS_COL, LSN_COL, OP_COL, SEQ_COL, SHARD_COL, ShardGroup, TableConfig
from .events import cast_text
from .identifiers import pg_ident, pg_qualified
from .lake import (
    INGESTED_COL,
    LSN_EVENT_COL,
    RUN_COL,
    UNAVAILABLE_COL,
    XID_COL,
    add_column,
    changelog_columns,
    conform_to,
    create_lake_tables,
    read_watermark,
    source_columns_of,
    table_exists,
    watermark_json,
)
from .settings import LakeSettings, SourceEndpoint, source_uri

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


class BootstrapError(RuntimeError):
    pass


@dataclass
class ShardSource:
    group: ShardGroup
    schema: str
    shard: str
    endpoint: SourceEndpoint


def _endpoints(cfg: TableConfig, shards: list[str] | None) -> dict[str, list[ShardSource]]:
    out: dict[str, list[ShardSource]] = {}
    known = {s for _, _, s in cfg.shards()}
    unknown = sorted(set(shards or []) - known)
    if unknown:
        raise BootstrapError(f"{cfg.name}: shard(s) {unknown} are not in the table config (known: {sorted(known)})")
    for g, schema, shard in cfg.shards():
        if shards and shard not in shards:
            continue
        ep = SourceEndpoint.from_uri(source_uri(g.conn_id), g.database)
        out.setdefault(g.endpoint_id, []).append(ShardSource(g, schema, shard, ep))
    return out


def source_schema(cfg: TableConfig, table: src.SourceTable) -> list[tuple[str, str]]:
    return [(c.name, cfg.column_types.get(c.name) or c.lake_type or "") for c in table.columns]


def preflight(
    cfg: TableConfig, endpoints: dict[str, list[ShardSource]]
) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """Everything that must hold before a byte is written; returns the source columns (name, lake
    type) and their PostgreSQL types."""
    import psycopg2

    problems: list[str] = []
    columns: list[tuple[str, str]] | None = None
    pg_types: dict[str, str] = {}
    first = ""
    for endpoint_id, shard_sources in endpoints.items():
        ep = shard_sources[0].endpoint
        eptables = src.EndpointTables(
            endpoint_id,
            shard_sources[0].group.conn_id,
            {cfg.source.table: ([s.schema for s in shard_sources], cfg.primary_key)},
        )
        try:
            conn = psycopg2.connect(ep.dsn(), connect_timeout=15, application_name="cdc_lakehouse bootstrap")
        except psycopg2.OperationalError as exc:
            problems.append(
                f"{cfg.name}: cannot connect to source {shard_sources[0].group.conn_id} ({ep.label}): "
                f"{str(exc).strip()}; check the Airflow connection and that the host is reachable"
            )
            continue
        try:
            problems += src.preflight(conn, eptables)
            conn.commit()
            with conn.cursor() as cur:
                for s in shard_sources:
                    info = src.describe_table(cur, s.schema, cfg.source.table)
                    if info is None:
                        continue  # reported by src.preflight
                    cols = source_schema(cfg, info)
                    bad = [f"{n} ({c.pg_type})" for (n, t), c in zip(cols, info.columns) if not t]
                    if bad:
                        continue  # reported by src.preflight, with the fix
                    if columns is None:
                        columns, first = cols, f"{s.schema}.{cfg.source.table} on {ep.label}"
                        pg_types = {c.name: c.pg_type for c in info.columns}
                    elif cols != columns:
                        diff = sorted(set(cols) ^ set(columns))
                        problems.append(
                            f"{cfg.name}: shard {s.shard} has columns that differ from {first}: {diff}; "
                            "all shards of a table must have the same columns and types"
                        )
                    if not src.key_is_enforced(cur, s.schema, cfg.source.table, cfg.primary_key):
                        v = src.key_violations(cur, s.schema, cfg.source.table, cfg.primary_key)
                        if v:
                            problems.append(
                                f"{cfg.name}: {v}; the lake key must be unique and not null: fix the data "
                                "or set primary_key to the table's real key"
                            )
            conn.commit()
        finally:
            conn.close()
    if problems:
        raise src.PreflightError(sorted(set(problems)))
    assert columns is not None
    return columns, pg_types


def _prepare_endpoint(
    endpoint_id: str,
    shard_sources: list[ShardSource],
    cfg: TableConfig,
    all_tables: dict[str, tuple[list[str], list[str]]] | None,
) -> None:
    """Heartbeat tables, publication membership and the capture slot, before any snapshot."""
    import psycopg2

    ep = shard_sources[0].endpoint
    tables = dict(all_tables or {})
    schemas = sorted(set(tables.get(cfg.source.table, ([], []))[0]) | {s.schema for s in shard_sources})
    tables[cfg.source.table] = (schemas, cfg.primary_key)
    eptables = src.EndpointTables(endpoint_id, shard_sources[0].group.conn_id, tables)
    conn = psycopg2.connect(ep.dsn(), application_name="cdc_lakehouse bootstrap")
    try:
        src.ensure_heartbeat_tables(conn, eptables.schemas)
        conn.commit()
        problems = src.check_publication(conn, eptables)
        conn.commit()
        if problems:
            raise src.PreflightError(problems)
        slot = src.slot_name(endpoint_id)
        state = src.slot_state(conn, slot)
        if state.exists and state.wal_status == "lost":
            raise src.SlotLostError(
                f"{cfg.name}: capture slot {slot} was invalidated; drop it "
                f"(SELECT pg_drop_replication_slot('{slot}')) and re-bootstrap every table on "
                f"endpoint {endpoint_id}"
            )
        if not state.exists:
            src.create_slot(conn, slot)
    finally:
        conn.close()


def _export_snapshot(ep: SourceEndpoint, endpoint_id: str, run_id: str):
    """A temporary slot with an exported snapshot; returns (connection to keep open, P, snapshot name,
    the server's identity)."""
    import psycopg2
    from psycopg2.extras import LogicalReplicationConnection

    from .pgoutput import lsn_to_int

    conn = psycopg2.connect(
        ep.dsn(), connection_factory=LogicalReplicationConnection, application_name="cdc_lakehouse bootstrap snapshot"
    )
    name = src.slot_name(f"boot_{endpoint_id}_{run_id}")[:63]
    cur = conn.cursor()
    identity = src.source_identity(cur)
    cur.execute(f"CREATE_REPLICATION_SLOT {pg_ident(name)} TEMPORARY LOGICAL pgoutput (SNAPSHOT 'export')")
    _, consistent_point, snapshot_name, _ = cur.fetchone()
    return conn, lsn_to_int(consistent_point), snapshot_name, identity


def _ranges(ep: SourceEndpoint, schema: str, table: str, parts: int) -> list[str]:
    """ctid ranges over the table's blocks: each partition reads only its blocks (TID range scan)."""
    import psycopg2

    conn = psycopg2.connect(ep.dsn())
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT pg_relation_size(%s::regclass) / current_setting('block_size')::bigint",
                (pg_qualified(schema, table),),
            )
            blocks = int(cur.fetchone()[0])
    finally:
        conn.close()
    if blocks < parts * 8 or parts <= 1:
        return [""]
    step = -(-blocks // parts)
    preds = []
    for i in range(parts):
        lo, hi = i * step, (i + 1) * step
        cond = f"ctid >= '({lo},0)'::tid" + (f" AND ctid < '({hi},0)'::tid" if i < parts - 1 else "")
        preds.append(cond)
    return preds


def _select_list(columns: list[tuple[str, str]], pg_types: dict[str, str] | None = None) -> str:
    # Text, as the change stream carries it: both paths then share one set of casts.
    pg_types = pg_types or {}
    return ", ".join(f"{src.text_select(n, pg_types.get(n, ''), t)} AS {pg_ident(n)}" for n, t in columns)


def read_shards(
    spark: SparkSession,
    cfg: TableConfig,
    shard_sources: list[ShardSource],
    snapshot: str,
    columns: list[tuple[str, str]],
    pg_types: dict[str, str] | None = None,
) -> DataFrame:
    """All shards of one endpoint under one exported snapshot, at most N connections at once."""
    from functools import reduce

    from pyspark.sql import functions as F

    ep = shard_sources[0].endpoint
    init = (
        f"SET TRANSACTION ISOLATION LEVEL REPEATABLE READ; SET TRANSACTION SNAPSHOT '{snapshot}'; "
        "SET TimeZone='UTC'; SET DateStyle='ISO'; SET IntervalStyle='iso_8601'; SET extra_float_digits=3; "
        "SET bytea_output='hex'"
    )
    props = {
        "user": ep.user,
        "driver": "org.postgresql.Driver",
        "fetchsize": str(cfg.bootstrap.fetch_size),
        "sessionInitStatement": init,
    }
    if ep.password:
        props["password"] = ep.password
    frames = []
    for s in shard_sources:
        for pred in _ranges(ep, s.schema, cfg.source.table, cfg.bootstrap.partitions_per_shard):
            where = f" WHERE {pred}" if pred else ""
            query = (
                f"(SELECT {_select_list(columns, pg_types)} FROM {pg_qualified(s.schema, cfg.source.table)}{where}) q"
            )
            df = spark.read.jdbc(ep.jdbc_url(), query, properties=props).withColumn(SHARD_COL, F.lit(s.shard))
            frames.append(df)
    df = reduce(lambda a, b: a.unionByName(b), frames)
    # coalesce merges partitions without a shuffle: at most N tasks (connections) per host.
    return df.coalesce(min(cfg.bootstrap.max_connections_per_host, len(frames)))


def typed_rows(df: DataFrame, cfg: TableConfig, columns: list[tuple[str, str]]) -> DataFrame:
    """Text -> lake types with the ingest's casts; a value that does not fit fails the job (nothing written)."""
    from pyspark.sql import functions as F

    out = [F.col(SHARD_COL)]
    checks = []
    for name, typ in columns:
        raw = F.col(name)
        typed = cast_text(raw, typ)
        out.append(typed.alias(name))
        checks.append(
            F.when(
                raw.isNotNull() & typed.isNull(),
                F.concat(F.lit(f"column {name}: value '"), F.substring(raw, 1, 60), F.lit(f"' does not fit {typ}")),
            )
        )
    problem = F.concat_ws("; ", *checks)
    keydesc = F.to_json(F.struct(*[F.col(k) for k in [SHARD_COL, *cfg.primary_key]]))
    guarded = F.when(
        problem != "",
        F.raise_error(
            F.concat(
                F.lit(f"{cfg.name}: bootstrap stopped, nothing was written: row "),
                keydesc,
                F.lit(": "),
                problem,
                F.lit(". Set column_types in the table config to a type that holds these values."),
            )
        ),
    )
    # A filter (not a dropped column) so the optimizer cannot prune the check away.
    return df.select(*out, guarded.alias("_guard")).filter(F.col("_guard").isNull()).drop("_guard")


def bootstrap_table(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    *,
    run_id: str,
    shards: list[str] | None = None,
    all_endpoint_tables: dict[str, dict] | None = None,
    log=print,
) -> dict[str, Any]:
    from pyspark.sql import functions as F

    t0 = time.time()
    endpoints = _endpoints(cfg, shards)
    if not endpoints:
        raise BootstrapError(f"{cfg.name}: no shards selected")
    columns, pg_types = preflight(cfg, endpoints)
    cur = lake.qualified(cfg.current_table)
    cl = lake.qualified(cfg.changelog_table)
    exists = table_exists(spark, cur)
    partial = bool(shards) and set(shards) != {s for _, _, s in cfg.shards()}
    if partial and exists and SHARD_COL not in cfg.lake.partition_by:
        raise BootstrapError(
            f"{cfg.name}: re-bootstrapping single shards needs the table partitioned by {SHARD_COL} "
            "(lake.partition_by); re-bootstrap the whole table instead"
        )
    if not exists:
        create_lake_tables(spark, lake, cfg, columns)
        log(f"bootstrap {cfg.name}: created {cur} and {cl}")
    else:
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
        columns = [(n, t) for n, t in source_columns_of(spark, cur, cfg) if n in dict(columns)]

    wm = (read_watermark(spark, cur) if exists else None) or {"v": 1, "shards": {}, "runs": {}}
    cwm = (read_watermark(spark, cl) if exists else None) or {"v": 1, "shards": {}, "runs": {}}
    snap_time = datetime.now(UTC).replace(tzinfo=None)
    per_endpoint: dict[str, Any] = {}
    frames = []
    with ExitStack() as stack:
        for endpoint_id, shard_sources in endpoints.items():
            ep_tables = (all_endpoint_tables or {}).get(endpoint_id)
            _prepare_endpoint(endpoint_id, shard_sources, cfg, ep_tables)
            conn, point, snapshot, identity = _export_snapshot(shard_sources[0].endpoint, endpoint_id, run_id)
            stack.callback(conn.close)
            per_endpoint[endpoint_id] = {"consistent_point": point, "shards": [s.shard for s in shard_sources]}
            log(f"bootstrap {cfg.name}: endpoint {endpoint_id} snapshot {snapshot} at LSN {point}")
            df = read_shards(spark, cfg, shard_sources, snapshot, columns, pg_types)
            frames.append(df)
            for s in shard_sources:
                # The position and the server it belongs to: positions of another identity never compare.
                wm["shards"][s.shard] = {
                    "lsn": point,
                    "ts": snap_time.replace(tzinfo=UTC).isoformat(),
                    "endpoint": endpoint_id,
                    "source": identity,
                    "columns": [n for n, _ in columns],
                }
                cwm["shards"][s.shard] = wm["shards"][s.shard]
        from functools import reduce

        raw = reduce(lambda a, b: a.unionByName(b), frames)
        typed = typed_rows(raw, cfg, columns)
        # The snapshot rows, as changelog events: op 'r' at (P, -1), after a truncate marker at (P, -2).
        lsn_map = F.create_map(
            *[
                x
                for ep in per_endpoint.values()
                for s in ep["shards"]
                for x in (F.lit(s), F.lit(ep["consistent_point"]))
            ]
        )
        rows = (
            typed.withColumn(OP_COL, F.lit("r"))
            .withColumn(LSN_COL, lsn_map[F.col(SHARD_COL)])
            .withColumn(SEQ_COL, F.lit(-1).cast("bigint"))
            .withColumn(COMMIT_TS_COL, F.lit(snap_time))
            .withColumn(LSN_EVENT_COL, F.col(LSN_COL))
            .withColumn(XID_COL, F.lit(None).cast("bigint"))
            .withColumn(UNAVAILABLE_COL, F.lit(None).cast("array<string>"))
            .withColumn(RUN_COL, F.lit(f"bootstrap-{run_id}"))
            .withColumn(INGESTED_COL, F.current_timestamp())
        )
        cl_cols = [c for c, _ in changelog_columns(columns)]
        markers = spark.createDataFrame(
            [(s, ep["consistent_point"]) for ep in per_endpoint.values() for s in ep["shards"]],
            f"{SHARD_COL} string, {LSN_COL} bigint",
        )
        for name, typ in columns:
            markers = markers.withColumn(name, F.lit(None).cast(typ))
        markers = (
            markers.withColumn(OP_COL, F.lit("t"))
            .withColumn(SEQ_COL, F.lit(-2).cast("bigint"))
            .withColumn(COMMIT_TS_COL, F.lit(snap_time))
            .withColumn(LSN_EVENT_COL, F.col(LSN_COL))
            .withColumn(XID_COL, F.lit(None).cast("bigint"))
            .withColumn(UNAVAILABLE_COL, F.lit(None).cast("array<string>"))
            .withColumn(RUN_COL, F.lit(f"bootstrap-{run_id}"))
            .withColumn(INGESTED_COL, F.current_timestamp())
        )
        t_read = time.time()
        # 1) changelog (one read of the source), 2) current table from those rows, atomically per shard.
        # No shuffle before the changelog write: every snapshot row goes to one day partition,
        # and the JDBC tasks write as they read (10M rows: 207 s -> 183 s without the shuffle).
        conform_to(markers.select(*cl_cols).unionByName(rows.select(*cl_cols)), spark.table(cl).schema).writeTo(
            cl
        ).option("distribution-mode", "none").option("snapshot-property.cdc.watermark", watermark_json(cwm)).option(
            "snapshot-property.cdc.bootstrap", run_id
        ).append()
    read_s = time.time() - t_read
    selected = [s for ep in per_endpoint.values() for s in ep["shards"]]
    cur_cols = [SHARD_COL, *[n for n, _ in columns], OP_COL, LSN_COL, SEQ_COL, COMMIT_TS_COL]
    snap = (
        spark.table(cl)
        .filter(
            (F.col(RUN_COL) == f"bootstrap-{run_id}")
            & (F.col(OP_COL) == "r")
            & (F.col(COMMIT_TS_COL) == F.lit(snap_time))
        )
        .select(*cur_cols)
    )
    if cfg.deletes == "soft":
        snap = snap.withColumn(cfg.soft_delete_columns.flag, F.lit(False)).withColumn(
            cfg.soft_delete_columns.timestamp, F.lit(None).cast("timestamp")
        )
    cond = F.col(SHARD_COL).isin(selected) if partial else F.lit(True)
    t_write = time.time()
    # Columns the source no longer has (kept under keep_null) are NULL in the new snapshot.
    snap = conform_to(snap, spark.table(cur).schema)
    snap.writeTo(cur).option("snapshot-property.cdc.watermark", watermark_json(wm)).option(
        "snapshot-property.cdc.bootstrap", run_id
    ).overwrite(cond)
    write_s = time.time() - t_write
    counts = {
        r[SHARD_COL]: r["n"]
        for r in spark.table(cur)
        .filter(F.col(SHARD_COL).isin(selected))
        .groupBy(SHARD_COL)
        .agg(F.count(F.lit(1)).alias("n"))
        .collect()
    }
    total = sum(counts.values())
    elapsed = time.time() - t0
    result = {
        "table": cfg.name,
        "run_id": run_id,
        "shards": counts,
        "rows": total,
        "endpoints": per_endpoint,
        "read_and_changelog_seconds": read_s,
        "current_write_seconds": write_s,
        "seconds": elapsed,
        "rows_per_second": total / elapsed if elapsed else None,
        "watermark": wm,
    }
    log(
        f"bootstrap {cfg.name}: {total} rows in {elapsed:.1f}s ({result['rows_per_second'] or 0:,.0f} rows/s) "
        f"shards {counts}; handoff LSNs {[ep['consistent_point'] for ep in per_endpoint.values()]}"
    )
    return result
