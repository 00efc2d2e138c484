"""lake.points: consistent points across the tables of one source endpoint.

Iceberg commits one table at a time, and each table's ingest is its own DAG run: between the
commits of `block` and of `permission`, a reader of both can see one half of a source
transaction that wrote to both. A consistent point closes that gap without a multi-table commit.

A point of endpoint E is a source position L and, for every current table captured through E, a
snapshot whose `cdc.watermark` puts each of the table's shards of E at exactly L, on one source
server, with no column backfill pending. The watermark is exclusive (cdc_lakehouse.watermark): every
transaction of E committed below L is in each of those snapshots and none at or above L, so a
reader that reads every table at its snapshot id sees each transaction whole or not at all.
One capture run reads the whole endpoint up to one position (its manifest's end), and each
ingest moves every shard of E to the end of the last run it applied, quiet shards included
(heartbeats), so the tables meet at each capture run's end that all of them committed at. Each
table's snapshot is its first commit at L (a later one there, such as an audit repair, holds
values read from the source after L), and none after a commit of rows read past L
(`cdc.read-upto`, table_positions).

Points are derived from the tables' own snapshot histories (no second source of truth that a
killed run could leave behind); `cdc_meta.consistent_points` records them for engines that read
tables but not snapshot summaries, and the ingest task's Asset event announces the newest. A
point lives as long as every one of its snapshots does (maintenance expires old snapshots).

What a point does not promise: positions of two endpoints never compare (a source transaction
never spans two databases), so a point is per endpoint; a Debezium-fed table (its positions are
Kafka offsets) never joins one; during a chunked bootstrap a point can form before its last
chunk; a quarantined event is missing from it until replayed.

Pure over `SnapshotInfo` (lake.ranges); `read_points` loads the histories with pyiceberg, without
Spark. CLI: `python -m cdc_lakehouse.lake.points [--endpoint E] [--all]` prints points as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from cdc_lakehouse.lake.ranges import SnapshotInfo, pyiceberg_snapshots, table_snapshots
from cdc_lakehouse.watermark import ServerIdentity

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from cdc_lakehouse.config import ConfigSet
    from cdc_lakehouse.settings import LakeSettings


class ConsistentPoint(BaseModel):
    """Every table of `endpoint` at one source position: read each at its snapshot id."""

    model_config = ConfigDict(frozen=True)

    endpoint: str
    lsn: int  # exclusive, as in the watermark
    source: ServerIdentity | None = None  # the server identity the position belongs to
    run_id: str | None = None  # the capture run that ended at lsn, when every table names it
    snapshots: dict[str, int]  # lake table (catalog.namespace.name) -> snapshot id

    def as_of_sql(self, table: str) -> str:
        """Spark SQL reading `table` at this point."""
        return f"SELECT * FROM {table} VERSION AS OF {self.snapshots[table]}"


@dataclass(frozen=True)
class TableHistory:
    """One table of an endpoint, as the rule needs it: its snapshots, the current one, and the
    names of its shards that the endpoint captures."""

    table: str
    snaps: Mapping[int, SnapshotInfo]
    current: int | None
    shards: frozenset[str]


def _source_key(source: ServerIdentity | None) -> str:
    return json.dumps(source or {}, sort_keys=True)


def table_positions(h: TableHistory, endpoint: str) -> dict[tuple[int, str], tuple[int, str | None]]:
    """(position, server) -> (the first snapshot at exactly that position, the run it names),
    over the ancestors of the current snapshot whose watermark puts every shard of h at one
    position of `endpoint`, with no backfill pending and no row read from the source past it.

    The first: a later commit at the same position (an audit repair, a backfill) holds values
    read from the source after it. And a commit of rows read between WAL markers (a chunk of a
    chunked bootstrap or of a column backfill, `cdc.read-upto`), or of an added column's values
    re-read by the ingest's backfill (the WAL position after the read), makes every position of
    its shards below that unusable from then on: those rows may be newer."""
    line = []
    sid = h.current
    while sid is not None and sid in h.snaps:
        line.append(h.snaps[sid])
        sid = h.snaps[sid].parent_id
    out: dict[tuple[int, str], tuple[int, str | None]] = {}
    read: dict[str, int] = {}
    for snap in reversed(line):  # oldest first
        for shard, lsn in (snap.read_upto or {}).items():
            read[shard] = max(read.get(shard, lsn), lsn)
        wm = snap.watermark
        if wm is None or wm.backfill:
            continue  # not a complete position, or rows still waiting for a column's values
        at = [wm.shards.get(s) for s in h.shards]
        if not at or any(p is None or p.endpoint not in (None, endpoint) for p in at):
            continue
        lsns = {p.lsn for p in at if p is not None}
        servers = {_source_key(p.source) for p in at if p is not None}
        if len(lsns) != 1 or len(servers) != 1:
            continue
        lsn = lsns.pop()
        if any(read.get(s, 0) > lsn for s in h.shards):
            continue
        out.setdefault((lsn, servers.pop()), (snap.snapshot_id, wm.runs.get(endpoint)))
    return out


def consistent_points(endpoint: str, tables: Iterable[TableHistory]) -> list[ConsistentPoint]:
    """Every point the tables' current histories still hold, newest (highest position) first."""
    tables = list(tables)
    if not tables:
        return []
    per_table = {h.table: table_positions(h, endpoint) for h in tables}
    common = set.intersection(*(set(p) for p in per_table.values()))
    points = []
    for lsn, server in sorted(common, reverse=True):
        found = {t: p[(lsn, server)] for t, p in per_table.items()}
        runs = {run for _, run in found.values()}
        points.append(
            ConsistentPoint(
                endpoint=endpoint,
                lsn=lsn,
                source=json.loads(server) or None,
                run_id=runs.pop() if len(runs) == 1 else None,
                snapshots={t: sid for t, (sid, _) in sorted(found.items())},
            )
        )
    return points


def latest_point(endpoint: str, tables: Iterable[TableHistory]) -> ConsistentPoint | None:
    points = consistent_points(endpoint, tables)
    return points[0] if points else None


# --- reading the histories (pyiceberg) ----------------------------------------------------------


def endpoint_members(cs: ConfigSet) -> dict[str, dict[str, frozenset[str]]]:
    """endpoint -> {lake table (catalog-less): its shard names on that endpoint}; tables fed by
    Debezium (Kafka offsets, not positions) are left out."""
    out: dict[str, dict[str, frozenset[str]]] = {}
    for cfg in cs.tables.values():
        if cfg.landing.kind != "capture":
            continue
        for g, _schema, shard in cfg.shards():
            members = out.setdefault(g.endpoint_id, {})
            members[cfg.current_table] = members.get(cfg.current_table, frozenset()) | {shard}
    return out


def pyiceberg_history(tbl: Any, table: str, shards: frozenset[str]) -> TableHistory:
    snaps, current = pyiceberg_snapshots(tbl)
    return TableHistory(table, snaps, current, shards)


def spark_history(spark: SparkSession, table: str, shards: frozenset[str]) -> TableHistory:
    """The same through the session (lake.ranges.table_snapshots)."""
    snaps, current = table_snapshots(spark, table)
    return TableHistory(table, snaps, current, shards)


def read_points(
    lake: LakeSettings, cs: ConfigSet, endpoints: Iterable[str] | None = None, *, catalog: Any = None
) -> dict[str, list[ConsistentPoint]]:
    """endpoint -> its points, newest first, read from the catalog with pyiceberg. An endpoint
    with a table not created yet has none."""
    from pyiceberg.catalog import load_catalog
    from pyiceberg.exceptions import NoSuchTableError

    catalog = catalog or load_catalog(lake.catalog_name, **lake.pyiceberg_properties())
    members = endpoint_members(cs)
    out: dict[str, list[ConsistentPoint]] = {}
    for endpoint in sorted(endpoints if endpoints is not None else members):
        histories = []
        try:
            for table, shards in sorted(members.get(endpoint, {}).items()):
                histories.append(pyiceberg_history(catalog.load_table(table), lake.qualified(table), shards))
        except NoSuchTableError:
            histories = []
        out[endpoint] = consistent_points(endpoint, histories)
    return out


def record_points(spark: SparkSession, lake: LakeSettings, cs: ConfigSet, endpoints: Iterable[str], run: str) -> int:
    """Append to cdc_meta.consistent_points every point of `endpoints` above the newest one
    recorded (one row per table of a point); returns how many points. Called by the ingest job
    after its tables committed: the last of two overlapping jobs to commit sees the point both
    made. Two jobs finishing together may both record it; read the table with DISTINCT."""
    from datetime import UTC, datetime

    from cdc_lakehouse.lake.meta import meta_append
    from cdc_lakehouse.lake.meta_rows import PointTable
    from cdc_lakehouse.lake.tables import sql_string, table_exists

    members = endpoint_members(cs)
    meta = lake.qualified(lake.meta_table("consistent_points"))
    rows: list[PointTable] = []
    recorded = 0
    for endpoint in sorted(set(endpoints)):
        tables = {lake.qualified(t): shards for t, shards in sorted(members.get(endpoint, {}).items())}
        if not tables or not all(table_exists(spark, t) for t in tables):
            continue
        points = consistent_points(endpoint, (spark_history(spark, t, s) for t, s in tables.items()))
        recorded_max = {
            r["source"]: r["lsn"]
            for r in spark.sql(
                f"SELECT source, max(lsn) AS lsn FROM {meta} WHERE endpoint = {sql_string(endpoint)} GROUP BY source"
            ).collect()
        }
        now = datetime.now(UTC).replace(tzinfo=None)
        for p in points:
            newest = recorded_max.get(_source_key(p.source))  # positions of one server only compare
            if newest is not None and p.lsn <= newest:
                continue
            recorded += 1
            for table, sid in p.snapshots.items():
                rows.append(
                    PointTable(
                        endpoint=endpoint,
                        lsn=p.lsn,
                        table_name=table,
                        snapshot_id=sid,
                        run_id=p.run_id,
                        source=_source_key(p.source),
                        recorded_at=now,
                        ingest_run=run,
                    )
                )
    meta_append(spark, lake, "consistent_points", rows)
    return recorded


def main(argv: list[str] | None = None) -> int:
    from cdc_lakehouse.config import load_table_configs
    from cdc_lakehouse.settings import LakeSettings, tables_dir

    ap = argparse.ArgumentParser(prog="python -m cdc_lakehouse.lake.points", description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoint", action="append", help="an endpoint id (default: every endpoint)")
    ap.add_argument("--all", action="store_true", help="every point still readable, not only the newest")
    ap.add_argument("--config-dir", help="the tables' YAML folder (default: CDC_TABLES_DIR)")
    args = ap.parse_args(argv)
    found = read_points(LakeSettings.from_env(), load_table_configs(args.config_dir or tables_dir()), args.endpoint)
    shown = {e: [p.model_dump() for p in (ps if args.all else ps[:1])] for e, ps in found.items()}
    json.dump(shown, sys.stdout, indent=2, sort_keys=True)
    print()
    return 0 if all(found.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
