"""bootstrap.run: split out of bootstrap.py."""

from __future__ import annotations

import time
from contextlib import ExitStack
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from cdc_lakehouse.config import COMMIT_TS_COL, LSN_COL, OP_COL, SEQ_COL, SHARD_COL, TableConfig
from cdc_lakehouse.lake.columns import INGESTED_COL, LSN_EVENT_COL, RUN_COL, UNAVAILABLE_COL, XID_COL
from cdc_lakehouse.lake.tables import (
    add_column,
    changelog_columns,
    conform_to,
    create_lake_tables,
    source_columns_of,
    table_exists,
)
from cdc_lakehouse.lake.watermark import read_watermark, watermark_json
from cdc_lakehouse.settings import LakeSettings

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
from cdc_lakehouse.bootstrap.snapshot import (
    BootstrapError,
    export_snapshot,
    preflight,
    prepare_endpoint,
    read_shards,
    shards_by_endpoint,
    typed_rows,
)


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
    endpoints = shards_by_endpoint(cfg, shards)
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
            prepare_endpoint(endpoint_id, shard_sources, cfg, ep_tables)
            conn, point, snapshot, identity = export_snapshot(shard_sources[0].endpoint, endpoint_id, run_id)
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
