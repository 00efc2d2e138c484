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

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cdc_lakehouse.bootstrap.copy_read import ReadSource, ReadTask, read_with_copy, select_sql
from cdc_lakehouse.bootstrap.typed_select import TypedSelect, text_columns, typed_select
from cdc_lakehouse.columns import SHARD_COL
from cdc_lakehouse.config import ShardGroup, TableConfig
from cdc_lakehouse.identifiers import pg_ident, pg_qualified
from cdc_lakehouse.settings import LakeSettings, SourceEndpoint, source_uri
from cdc_lakehouse.source.catalog import (
    EndpointTables,
    SourceTable,
    describe_table,
    key_is_enforced,
    key_violations,
)
from cdc_lakehouse.source.ddl import capture_ddl
from cdc_lakehouse.source.errors import PreflightError
from cdc_lakehouse.source.publication import check_publication, consumed_column_lists, source_identity
from cdc_lakehouse.source.publication import preflight as source_preflight
from cdc_lakehouse.source.session import jdbc_properties
from cdc_lakehouse.source.slots import ensure_capture_slot, ensure_heartbeat_tables, lost_because, slot_name

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)


class BootstrapError(RuntimeError):
    pass


@dataclass
class ShardSource:
    group: ShardGroup
    schema: str
    shard: str
    endpoint: SourceEndpoint


def shards_by_endpoint(cfg: TableConfig, shards: list[str] | None) -> dict[str, list[ShardSource]]:
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


def source_schema(cfg: TableConfig, table: SourceTable) -> list[tuple[str, str]]:
    # Only the columns the table consumes (config `columns:`): the others never reach the lake.
    return [
        (c.name, cfg.column_types.get(c.name) or c.lake_type or "")
        for c in table.columns
        if cfg.columns.consumes(c.name)
    ]


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
        eptables = EndpointTables(
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
            problems += source_preflight(conn, eptables)
            conn.commit()
            with conn.cursor() as cur:
                for s in shard_sources:
                    info = describe_table(cur, s.schema, cfg.source.table)
                    if info is None:
                        continue  # reported by source_preflight
                    cols = source_schema(cfg, info)
                    if any(not t for _, t in cols):
                        continue  # reported by source_preflight, with the fix
                    if columns is None:
                        columns, first = cols, f"{s.schema}.{cfg.source.table} on {ep.label}"
                        pg_types = {c.name: c.pg_type for c in info.columns}
                    elif cols != columns:
                        diff = sorted(set(cols) ^ set(columns))
                        problems.append(
                            f"{cfg.name}: shard {s.shard} has columns that differ from {first}: {diff}; "
                            "all shards of a table must have the same columns and types"
                        )
                    problems += _key_problems(cur, cfg, s)
            conn.commit()
        finally:
            conn.close()
    if problems:
        raise PreflightError(sorted(set(problems)))
    assert columns is not None
    return columns, pg_types


def _key_problems(cur, cfg: TableConfig, s: ShardSource) -> list[str]:
    """The lake key must identify rows; checked on the data when no constraint enforces it."""
    if key_is_enforced(cur, s.schema, cfg.source.table, cfg.primary_key):
        return []
    v = key_violations(cur, s.schema, cfg.source.table, cfg.primary_key)
    if not v:
        return []
    return [
        f"{cfg.name}: {v}; the lake key must be unique and not null: fix the data "
        "or set primary_key to the table's real key"
    ]


def prepare_endpoint(
    endpoint_id: str,
    shard_sources: list[ShardSource],
    cfg: TableConfig,
    all_tables: dict[str, tuple[list[str], list[str]]] | None,
    table_configs: list[TableConfig] | None,
    lake: LakeSettings,
) -> None:
    """Heartbeat tables, publication membership and the capture slot, before any snapshot.
    table_configs (every valid config, when none is broken): the publication's column lists for
    consumed-columns tables, the same ones the capture sets (source.publication); without them an
    existing list is reported as a problem rather than trusted."""
    import psycopg2

    ep = shard_sources[0].endpoint
    tables = dict(all_tables or {})
    schemas = sorted(set(tables.get(cfg.source.table, ([], []))[0]) | {s.schema for s in shard_sources})
    tables[cfg.source.table] = (schemas, cfg.primary_key)
    eptables = EndpointTables(endpoint_id, shard_sources[0].group.conn_id, tables)
    conn = psycopg2.connect(ep.dsn(), application_name="cdc_lakehouse bootstrap")
    try:
        ensure_heartbeat_tables(conn, eptables.schemas)
        conn.commit()
        capture_ddl(conn, eptables)
        lists = consumed_column_lists(conn, eptables, table_configs) if table_configs else None
        problems = check_publication(conn, eptables, column_lists=lists)
        conn.commit()
        if problems:
            raise PreflightError(problems)
        slot = slot_name(endpoint_id)
        lost = ensure_capture_slot(conn, slot, lambda: _forget_capture_attempts(lake, endpoint_id))
        if lost is not None:
            # The WAL it held is gone; this bootstrap's snapshot is taken after the new slot's
            # start, and every other table's ingest stops at the gap until its shards here are
            # re-bootstrapped too (cdc_recover__<endpoint> does all of them, #52).
            log.warning(
                "bootstrap %s: capture slot %s of endpoint %s was invalidated (%s) and is replaced. "
                "Every table on the endpoint needs its shards there re-bootstrapped: %s",
                cfg.name,
                slot,
                endpoint_id,
                lost_because(lost),
                sorted(eptables.tables),
            )
    finally:
        conn.close()


def _forget_capture_attempts(lake: LakeSettings, endpoint_id: str) -> None:
    """Before a new capture slot: the landing's attempt records of the endpoint go (capture.positions)."""
    from cdc_lakehouse.capture.positions import forget_attempts
    from cdc_lakehouse.landing.stores import open_landing

    forget_attempts(open_landing(lake.landing_uri, lake.landing_conn_id), endpoint_id)


def export_snapshot(ep: SourceEndpoint, endpoint_id: str, run_id: str):
    """A temporary slot with an exported snapshot; returns (connection to keep open, P, snapshot name,
    the server's identity)."""
    import psycopg2
    from psycopg2.extras import LogicalReplicationConnection

    from cdc_lakehouse.source.pgoutput import lsn_to_int

    conn = psycopg2.connect(
        ep.dsn(), connection_factory=LogicalReplicationConnection, application_name="cdc_lakehouse bootstrap snapshot"
    )
    name = slot_name(f"boot_{endpoint_id}_{run_id}")[:63]
    cur = conn.cursor()
    identity = source_identity(cur)
    cur.execute(f"CREATE_REPLICATION_SLOT {pg_ident(name)} TEMPORARY LOGICAL pgoutput (SNAPSHOT 'export')")
    created = cur.fetchone()
    assert created is not None  # CREATE_REPLICATION_SLOT returns one row
    _, consistent_point, snapshot_name, _ = created
    return conn, lsn_to_int(consistent_point), snapshot_name, identity


def ctid_ranges(ep: SourceEndpoint, schema: str, table: str, parts: int) -> list[str]:
    """ctid ranges over the table's blocks: each partition reads only its blocks (TID range scan)."""
    import psycopg2

    conn = psycopg2.connect(ep.dsn())
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT pg_relation_size(%s::regclass) / current_setting('block_size')::bigint",
                (pg_qualified(schema, table),),
            )
            row = cur.fetchone()
            assert row is not None  # a SELECT without FROM returns one row
            blocks = int(row[0])
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


def read_shards(
    spark: SparkSession,
    cfg: TableConfig,
    shard_sources: list[ShardSource],
    snapshot: str,
    columns: list[tuple[str, str]],
    pg_types: dict[str, str] | None = None,
) -> DataFrame:
    """All shards of one endpoint under one exported snapshot, at most N connections at once, in
    the lake's types: typed on the source where PostgreSQL's type maps exactly, the rest as text
    cast in Spark (bootstrap.typed_select); a value that does not fit stops the job. Read with
    binary COPY into Arrow on the executors (ADBC), or Spark's JDBC reader (bootstrap.reader)."""
    select = typed_select(columns, pg_types)
    ep = shard_sources[0].endpoint
    ranges = [
        (s, pred)
        for s in shard_sources
        for pred in ctid_ranges(ep, s.schema, cfg.source.table, cfg.bootstrap.partitions_per_shard)
    ]
    read = _read_with_copy if cfg.bootstrap.reader == "copy" else _read_with_jdbc
    return select.to_lake(read(spark, cfg, ranges, snapshot, select), cfg.name, cfg.primary_key)


def _read_with_jdbc(
    spark: SparkSession, cfg: TableConfig, ranges: list[tuple[ShardSource, str]], snapshot: str, select: TypedSelect
) -> DataFrame:
    """One JDBC query per ctid range; Spark maps the typed columns onto its own types."""
    from functools import reduce

    from pyspark.sql import functions as F

    ep = ranges[0][0].endpoint
    # timestamp without time zone as Spark's timestamp_ntz (the lake's type), not a local time.
    props = {**jdbc_properties(ep, cfg.bootstrap.fetch_size, snapshot), "preferTimestampNTZ": "true"}
    frames = []
    for s, pred in ranges:
        query = f"({select_sql(select.select_list(), pg_qualified(s.schema, cfg.source.table), pred)}) q"
        frames.append(spark.read.jdbc(ep.jdbc_url(), query, properties=props).withColumn(SHARD_COL, F.lit(s.shard)))
    df = reduce(lambda a, b: a.unionByName(b), frames)
    # coalesce merges partitions without a shuffle: at most N tasks (connections) per host.
    return df.coalesce(min(cfg.bootstrap.max_connections_per_host, len(frames)))


def _read_with_copy(
    spark: SparkSession, cfg: TableConfig, ranges: list[tuple[ShardSource, str]], snapshot: str, select: TypedSelect
) -> DataFrame:
    """The same SELECT per ctid range, run by the executors through ADBC (binary COPY into Arrow)."""
    ep = ranges[0][0].endpoint
    tasks = []
    for s, pred in ranges:
        label = f"{s.schema}.{cfg.source.table}" + (f" ({pred})" if pred else "") + f" on {ep.label}"
        sql = select_sql(select.select_list(), pg_qualified(s.schema, cfg.source.table), pred)
        tasks.append(ReadTask(s.shard, label, sql))
    src = ReadSource(ep.dsn(), snapshot, tuple(select.spark_types(numeric_as_text=True)), cfg.name, ep.label)
    return read_with_copy(spark, src, tasks, cfg.bootstrap.max_connections_per_host)


def typed_rows(df: DataFrame, cfg: TableConfig, columns: list[tuple[str, str]]) -> DataFrame:
    """Text columns -> lake types with the ingest's casts; a value that does not fit fails the job
    (nothing written). For readers that hand over text (the chunked mode's CSV chunks)."""
    return text_columns(columns).to_lake(df, cfg.name, cfg.primary_key)
