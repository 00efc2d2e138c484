"""lake.freshness: how fresh each shard of a table is in the lake, recorded as data (Spark driver).

Every ingest run appends one row per shard to `cdc_meta.freshness` (freshness_rows, committed
with the group's other tables by ingest.records, also on runs with no events where only
heartbeats moved the watermark). A row says, for one table and shard:

    last_source_commit_*   the newest source transaction of this table the pipeline has seen in
                           the shard (an insert, update, delete or truncate in the landing files)
    last_heartbeat_*       the newest `_cdc_heartbeat` commit of the shard (the capture writes one
                           per run, so it moves on quiet shards too)
    watermark_lsn/fresh_to the position committed in the lake: every source change of the shard
                           committed before fresh_to is visible
    lake_snapshot_id/...   the Iceberg commit of the current table that made that position visible
    freshness_seconds      how far behind the source the shard was when the run finished

The values are carried forward from the shard's previous row when a run saw no newer ones, so the
latest row per shard is complete by itself (latest_freshness). Rows are appended (the history shows
whether a quiet shard's heartbeat keeps moving while its last source commit stays put).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.lake.meta import META_TABLES
from cdc_lakehouse.lake.meta_rows import (  # one row of cdc_meta.freshness; its fields are the columns
    RawRow,
    ShardFreshness,
)
from cdc_lakehouse.lake.snapshots import current_ancestors, rows_matching
from cdc_lakehouse.landing.format import landing_spark_schema
from cdc_lakehouse.settings import LakeSettings
from cdc_lakehouse.watermark import WATERMARK_PROP, Watermark

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

    from cdc_lakehouse.landing.format import Manifest
    from cdc_lakehouse.landing.reader import Plan

FRESHNESS_TABLE = "freshness"


@dataclass(frozen=True)
class _Commit:
    """A source commit (a heartbeat or a change): its LSN and time."""

    lsn: int | None
    ts: datetime | None


def _ts(v: Any) -> datetime | None:
    """ISO text, microseconds since the epoch (what Spark reads hand over, see _micros) or a
    datetime (pyiceberg reads timestamptz as aware UTC) -> an aware UTC datetime."""
    if v is None:
        return None
    if isinstance(v, int):
        return datetime.fromtimestamp(v / 1_000_000, UTC)
    t = datetime.fromisoformat(v) if isinstance(v, str) else v
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


def _newer(a: _Commit | None, b: _Commit | None) -> _Commit | None:
    """The later of two commits, by commit time (LSNs of two servers do not compare; times do)."""
    if a is None or a.ts is None:
        return b if b is not None and b.ts is not None else a
    if b is None or b.ts is None:
        return a
    return b if (b.ts, b.lsn or 0) > (a.ts, a.lsn or 0) else a


# --- what the ingest calls ------------------------------------------------------------------------


def freshness_rows(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    plan: Plan,
    ingest_run: str,
    now: datetime | None = None,
    shard_commits: dict[str, dict[str, int]] | None = None,
) -> list[ShardFreshness]:
    """This run's freshness row per shard (ingest.records appends them with freshness_props).

    plan: the run's landing plan (its manifests carry the heartbeats, its files the changes).
    shard_commits: shard -> {"ts": micros, "lsn"} of the newest change in the files, when the
    ingest's fused plan observed it; otherwise the files are read here (one more Spark job)."""
    now = _ts(now) or datetime.now(UTC)
    cur = lake.qualified(cfg.current_table)
    snap_id, snap_at, committed_wm = _visible_commit(spark, cur)
    prev = previous_freshness(spark, lake, cfg.name)
    if shard_commits is not None:
        observed = {
            (g.endpoint_id, schema): _from_observed(shard_commits.get(shard)) for g, schema, shard in cfg.shards()
        }
        seen = {k: c for k, c in observed.items() if c is not None}
    else:
        seen = _source_commits(spark, cfg, plan.files) if plan.files else {}
    beats = _heartbeats(plan.manifests)
    rows = []
    for g, schema, shard in cfg.shards():
        ep = g.endpoint_id
        p = prev.get(shard)
        last_src = _newer(
            _Commit(p.last_source_commit_lsn, p.last_source_commit_ts) if p else None, seen.get((ep, schema))
        )
        last_hb = _newer(_Commit(p.last_heartbeat_lsn, p.last_heartbeat_ts) if p else None, beats.get((ep, schema)))
        pos = committed_wm.shards.get(shard) if committed_wm is not None else None
        fresh_to = _ts(pos.ts) if pos is not None else None
        rows.append(
            ShardFreshness(
                table_name=cfg.name,
                shard=shard,
                endpoint=ep,
                source_schema=schema,
                last_source_commit_lsn=last_src.lsn if last_src else None,
                last_source_commit_ts=last_src.ts if last_src else None,
                last_heartbeat_lsn=last_hb.lsn if last_hb else None,
                last_heartbeat_ts=last_hb.ts if last_hb else None,
                watermark_lsn=pos.lsn if pos is not None else None,
                fresh_to=fresh_to,
                lake_snapshot_id=snap_id,
                lake_committed_at=snap_at,
                freshness_seconds=None if fresh_to is None else (now - fresh_to).total_seconds(),
                ingest_run=ingest_run,
                updated_at=now,
            )
        )
    return rows


def freshness_props(table_name: str, rows: list[ShardFreshness]) -> dict[str, str]:
    """The snapshot properties the commit of a table's freshness rows carries: the rows themselves,
    so the next run finds its carry-forward values in metadata (previous_freshness) instead of a
    Spark read. (The rows are aware UTC datetimes: Spark converts them to instants whatever the
    session's time zone.)"""
    return {_prop(table_name): _rows_json(rows)}


def _prop(table_name: str) -> str:
    return f"cdc.freshness.{table_name}"


def _rows_json(rows: list[ShardFreshness]) -> str:
    import json

    return json.dumps([asdict(r) for r in rows], default=lambda v: v.isoformat(), separators=(",", ":"))


def _from_observed(c: dict[str, int] | None) -> _Commit | None:
    return None if not c else _Commit(c.get("lsn"), _ts(c.get("ts")))


# How many of the freshness table's newest snapshots to search for a table's last rows before
# reading the table instead (one commit per table and run: this covers many tables).
_SNAPSHOTS_SEARCHED = 1000


def previous_freshness(spark: SparkSession, lake: LakeSettings, table_name: str) -> dict[str, ShardFreshness]:
    """shard -> the table's newest row, from the snapshot properties of the freshness table's
    recent commits (driver metadata, no Spark job); read from the table when no recent commit
    carries them (rows written before they did, or snapshots expired)."""
    import json
    from itertools import islice

    name = lake.qualified(lake.meta_table(FRESHNESS_TABLE))
    for snap in islice(current_ancestors(spark, name), _SNAPSHOTS_SEARCHED):
        text = snap.summary.get(_prop(table_name))
        if text is not None:
            return latest_per_shard(json.loads(text))
    return latest_freshness(spark, lake, table_name)


def _micros(col: str) -> Column:
    """A timestamp column as microseconds since the epoch: Spark's collect() would hand back naive
    datetimes in the driver's local zone, which _ts could not tell from UTC."""
    from pyspark.sql import functions as F

    return F.unix_micros(F.col(col))


def _visible_commit(spark: SparkSession, table: str) -> tuple[int | None, datetime | None, Watermark | None]:
    """(snapshot id, commit time, watermark) of the newest snapshot of the current table that
    carries a watermark: the commit that made the table's positions visible (a later maintenance
    snapshot carries none, and changes nothing a reader sees)."""
    for snap in current_ancestors(spark, table):
        wm = snap.summary.get(WATERMARK_PROP)
        if wm is not None:
            at = datetime.fromtimestamp(int(snap.timestamp_ms) / 1000, UTC)
            return int(snap.snapshot_id), at, Watermark.from_json(wm)
    return None, None, None


def _heartbeats(manifests: list[Manifest]) -> dict[tuple[str, str], _Commit | None]:
    """(endpoint, schema) -> the newest heartbeat in the run's manifests (None: only heartbeats without a time)."""
    out: dict[tuple[str, str], _Commit | None] = {}
    for m in manifests:
        for schema, hb in m.heartbeats.items():
            key = (m.endpoint or "", schema)
            out[key] = _newer(out.get(key), _Commit(hb.commit_lsn, _ts(hb.commit_ts)))
    return out


def _source_commits(spark: SparkSession, cfg: TableConfig, files: list[str]) -> dict[tuple[str, str], _Commit]:
    """(endpoint, schema) -> the newest commit of this table's changes in the run's landing files
    (one aggregation over the source struct only; Parquet reads just those columns)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StructType

    # Only `source`: both landing formats hold it as is (landing.format).
    schema = StructType([landing_spark_schema()["source"]])
    df = spark.read.schema(schema).parquet(*files).filter(F.col("source.table") == cfg.source.table)
    rows = (
        df.groupBy(F.col("source.endpoint").alias("ep"), F.col("source.schema").alias("schema"))
        .agg(
            F.max(F.struct(_micros("source.commit_ts").alias("ts"), F.col("source.commit_lsn").alias("lsn"))).alias("c")
        )
        .collect()
    )
    return {(r["ep"], r["schema"]): _Commit(r["c"]["lsn"], _ts(r["c"]["ts"])) for r in rows}


# --- what the audit, the alerts and the demo read -------------------------------------------------


def latest_freshness(spark: SparkSession, lake: LakeSettings, table_name: str) -> dict[str, ShardFreshness]:
    """shard -> the table's newest cdc_meta.freshness row (empty before the first ingest). Read by
    pyiceberg where this process reads the catalog with it: no Spark job (a table's first ingest
    read it through Spark, one job of its budget: tests/integration/test_ingest.py)."""
    from pyspark.sql import functions as F

    name = lake.qualified(lake.meta_table(FRESHNESS_TABLE))
    read = rows_matching(name, "table_name", table_name)
    if read is not None:
        return latest_per_shard(read.to_pylist())
    t = spark.table(name).filter(F.col("table_name") == table_name)
    t = t.select(*[_micros(c).alias(c) if k == "timestamp" else F.col(c) for c, k in META_TABLES[FRESHNESS_TABLE][0]])
    return latest_per_shard([r.asDict() for r in _newest_rows(t).collect()])


def _newest_rows(t: DataFrame) -> DataFrame:
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    w = Window.partitionBy("shard").orderBy(F.col("updated_at").desc(), F.col("ingest_run").desc())
    return t.withColumn("_n", F.row_number().over(w)).filter("_n = 1").drop("_n")


def latest_per_shard(rows: Iterable[RawRow]) -> dict[str, ShardFreshness]:
    """shard -> its newest row, from rows of one table (read by Spark or pyiceberg)."""
    cols = [c for c, _ in META_TABLES[FRESHNESS_TABLE][0]]
    out: dict[str, ShardFreshness] = {}
    for r in rows:
        f = from_row({c: r.get(c) for c in cols})
        if f.shard not in out or (f.updated_at, f.ingest_run) > (out[f.shard].updated_at, out[f.shard].ingest_run):
            out[f.shard] = f
    return out


def from_row(r: RawRow) -> ShardFreshness:
    ts_cols = {c for c, k in META_TABLES[FRESHNESS_TABLE][0] if k == "timestamp"}
    values: dict[str, Any] = {k: (_ts(v) if k in ts_cols else v) for k, v in r.items()}
    return ShardFreshness(**values)
