"""A table's snapshots, typed: read through Iceberg's metadata tables (`t.snapshots`, `t.refs`), the
public SQL any Spark session has, Spark Connect's included.

One query per look: every snapshot the table still has (id, parent, operation, summary, commit
time) and which one `main` points at. The ancestors of the current snapshot are then walked in
Python. The catalog's cached copy of the table is dropped first (REFRESH TABLE): another process
(a killed run, maintenance, a concurrent writer) may have committed since this session loaded it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cdc_lakehouse.runtime.catalogs import pyiceberg_catalog, reads_with_pyiceberg
from cdc_lakehouse.runtime.phases import metadata_reads
from cdc_lakehouse.watermark import Watermark, watermark_in

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

MAIN = "main"


@dataclass(frozen=True)
class Snapshot:
    """One snapshot of a table, as Iceberg's metadata table lists it."""

    snapshot_id: int
    parent_id: int | None
    operation: str | None  # append, overwrite, delete, replace (a compaction: no row changed)
    summary: dict[str, str] = field(default_factory=dict, hash=False, compare=False)
    timestamp_ms: int = 0


@dataclass(frozen=True)
class TableSnapshots:
    """Every snapshot a table still has, and the one a ref (main) points at."""

    table: str
    by_id: dict[int, Snapshot]
    current_id: int | None
    refs: dict[str, int] = field(default_factory=dict)  # branch or tag name -> its snapshot
    branches: frozenset[str] = frozenset()

    @property
    def current(self) -> Snapshot | None:
        return self.by_id.get(self.current_id) if self.current_id is not None else None

    def ancestors(self, start: int | None = None) -> Iterator[Snapshot]:
        """`start` (default: the current snapshot), then its parent, ...; stops where expired
        snapshots cut the chain."""
        sid = self.current_id if start is None else start
        while sid is not None and sid in self.by_id:
            snap = self.by_id[sid]
            yield snap
            sid = snap.parent_id


def read_snapshots(spark: SparkSession, table: str, *, refresh: bool = True) -> TableSnapshots:
    """Every snapshot of `table` (catalog.namespace.name) and its refs, freshly from the catalog.
    With `refresh`, Spark's cached copy is dropped too, for what the caller reads through Spark
    next (see _refresh_if_moved)."""
    catalog_name, _, ident = table.partition(".")
    if reads_with_pyiceberg(catalog_name):
        loaded = _pyiceberg_table(catalog_name, ident)
        if refresh:
            _refresh_if_moved(spark, table, str(loaded.metadata_location))
        return _from_pyiceberg(table, loaded.metadata)
    if refresh:
        spark.sql(f"REFRESH TABLE {table}")
    with metadata_reads(spark):
        rows = spark.sql(
            "SELECT s.snapshot_id, s.parent_id, s.operation, s.summary, "
            "CAST(unix_millis(s.committed_at) AS BIGINT) AS ts, NULL AS ref, NULL AS ref_type "
            f"FROM {table}.snapshots s "
            "UNION ALL SELECT r.snapshot_id, NULL, NULL, NULL, NULL, r.name, r.type "
            f"FROM {table}.refs r"
        ).collect()
    by_id: dict[int, Snapshot] = {}
    refs: dict[str, int] = {}
    branches: set[str] = set()
    for r in rows:
        if r["ref"] is not None:
            refs[r["ref"]] = int(r["snapshot_id"])
            if r["ref_type"] == "BRANCH":
                branches.add(r["ref"])
            continue
        sid = int(r["snapshot_id"])
        parent = r["parent_id"]
        by_id[sid] = Snapshot(
            sid,
            None if parent is None else int(parent),
            r["operation"],
            dict(r["summary"] or {}),
            int(r["ts"] or 0),
        )
    return TableSnapshots(table, by_id, refs.get(MAIN), refs, frozenset(branches))


# (Spark session, table) -> the table's metadata file when this process last refreshed that
# session's cached copy of it (_refresh_if_moved).
_REFRESHED_AT: dict[tuple[str, str], str] = {}


def _refresh_if_moved(spark: SparkSession, table: str, metadata_location: str) -> None:
    """REFRESH TABLE, unless the table has not moved since this session last refreshed it.

    Every commit writes a new metadata file, so an unchanged metadata file means no commit since
    that refresh: the session's cached copy, loaded after it, is the current table. The skip saves
    a request and the session's reload of the table: an ingest read a table's snapshots 17 times,
    each with a REFRESH of 20 ms on the local Spark Connect server, 0.35 s of a small table's
    2.9 s (bench/tables_bench.py --profile; docs/benchmarks-history.md, #56)."""
    key = (_session_key(spark), table)
    if _REFRESHED_AT.get(key) == metadata_location:
        return
    spark.sql(f"REFRESH TABLE {table}")
    _REFRESHED_AT[key] = metadata_location


def _session_key(spark: SparkSession) -> str:
    """The session's id (Spark Connect's, or the classic JVM session's UUID): each session has a
    catalog, and so a cache, of its own."""
    connect = getattr(spark, "session_id", None)
    return str(connect) if connect else str(spark._jsparkSession.sessionUUID())


def _read_by_pyiceberg(table: str) -> tuple[str, str] | None:
    """(catalog name, namespace.name) of `table`, or None where this process does not read its
    catalog with pyiceberg (the caller then asks Spark)."""
    catalog_name, _, ident = table.partition(".")
    return (catalog_name, ident) if reads_with_pyiceberg(catalog_name) else None


def catalog_table_exists(table: str) -> bool | None:
    """Whether the catalog has `table`, from pyiceberg; None: ask Spark (_read_by_pyiceberg)."""
    named = _read_by_pyiceberg(table)
    return None if named is None else bool(pyiceberg_catalog(named[0]).table_exists(named[1]))


def catalog_table_properties(table: str) -> dict[str, str] | None:
    """The table's properties, from its current metadata; None: ask Spark (_read_by_pyiceberg)."""
    named = _read_by_pyiceberg(table)
    return None if named is None else dict(_pyiceberg_table(*named).metadata.properties)


def _pyiceberg_table(catalog_name: str, ident: str) -> Any:
    return pyiceberg_catalog(catalog_name).load_table(ident)


def loaded_by_pyiceberg(table: str) -> Any:
    """`table` freshly loaded by pyiceberg (a pyiceberg Table), or None where this process does
    not read its catalog with pyiceberg (the caller then asks Spark)."""
    named = _read_by_pyiceberg(table)
    return None if named is None else _pyiceberg_table(*named)


def _scan_matching(table: str, column: str, value: str) -> Any:
    """pyiceberg's scan of the rows of `table` whose `column` is `value` (files pruned by the
    manifests), or None where this process does not read the catalog with pyiceberg."""
    from pyiceberg.expressions import EqualTo

    loaded = loaded_by_pyiceberg(table)
    if loaded is None:
        return None
    condition = EqualTo(column, value)  # type: ignore[call-arg]  # pydantic model: mypy sees only its fields
    return loaded.scan(row_filter=condition)


def files_matching(table: str, column: str, value: str) -> int | None:
    """How many data files of `table` may hold rows whose `column` is `value`, from the table's
    manifests (pyiceberg's scan planning: partition and column bounds, no Spark job); None where
    this process does not read the catalog with pyiceberg (the caller then asks Spark)."""
    scan = _scan_matching(table, column, value)
    return None if scan is None else sum(1 for _ in scan.plan_files())


def rows_matching(table: str, column: str, value: str) -> Any:
    """The rows of `table` whose `column` is `value`, as a pyarrow Table read by pyiceberg (no
    Spark job); None where this process does not read the catalog with pyiceberg (the caller
    then asks Spark). For the small metadata tables: every matching row comes back."""
    scan = _scan_matching(table, column, value)
    return None if scan is None else scan.to_arrow()


def _from_pyiceberg(table: str, meta: Any) -> TableSnapshots:
    by_id = {
        s.snapshot_id: Snapshot(
            s.snapshot_id,
            s.parent_snapshot_id,
            s.summary.operation.value if s.summary is not None else None,
            dict(s.summary.additional_properties) if s.summary is not None else {},
            int(s.timestamp_ms),
        )
        for s in meta.snapshots
    }
    refs = {name: ref.snapshot_id for name, ref in meta.refs.items()}
    branches = frozenset(name for name, ref in meta.refs.items() if ref.snapshot_ref_type.value == "branch")
    return TableSnapshots(table, by_id, refs.get(MAIN), refs, branches)


def current_ancestors(spark: SparkSession, table: str, ref: str | None = None) -> Iterator[Snapshot]:
    """The current snapshot, then its parent, ... (newest first). With `ref`, the same from that
    branch's head (nothing if the branch has no snapshot)."""
    snaps = read_snapshots(spark, table)
    if ref is None:
        return snaps.ancestors()
    head = snaps.refs.get(ref)
    return snaps.ancestors(head) if head is not None else iter(())


def branch_names(spark: SparkSession, table: str) -> list[str]:
    """The table's branches (`main` included)."""
    return sorted(read_snapshots(spark, table).branches)


def current_snapshot(spark: SparkSession, table: str) -> Snapshot | None:
    return read_snapshots(spark, table).current


def summary_of(snapshot: Snapshot) -> dict[str, str]:
    return dict(snapshot.summary)


def read_watermark(spark: SparkSession, table: str) -> Watermark | None:
    """The newest `cdc.watermark` (cdc_lakehouse.watermark) among the current snapshot and its
    ancestors. Iceberg's catalog caches loaded tables; another process (a killed run, maintenance)
    may have committed since, and a stale watermark would re-apply events the table already has:
    current_ancestors refreshes the table first."""
    return watermark_in(current_ancestors(spark, table))
