"""A table's snapshots read through Iceberg's Java API on the driver, not through the metadata
tables (`t.history`, `t.snapshots`): a SQL query on those is a Spark job (several, with a join),
and the ingest reads them around every commit (issue #16: Spark jobs are the ingest's cost on
small batches). Same answers: the current snapshot, and its ancestors newest first."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def iceberg_table(spark: SparkSession, table: str) -> Any:
    """org.apache.iceberg.Table for `catalog.namespace.table`, refreshed from the catalog: another
    process (a killed run, maintenance, a concurrent writer) may have committed since it was cached."""
    jvm = spark._jvm
    t = jvm.org.apache.iceberg.spark.Spark3Util.loadIcebergTable(spark._jsparkSession, table)
    t.refresh()
    return t


def current_ancestors(spark: SparkSession, table: str, ref: str | None = None) -> Iterator[Any]:
    """The current snapshot, then its parent, ... (what `t.history WHERE is_current_ancestor`
    lists, newest first); stops where expired snapshots cut the chain. With `ref`, the same from
    that branch's head (nothing if the branch has no snapshot)."""
    t = iceberg_table(spark, table)
    snap = t.currentSnapshot() if ref is None else t.snapshot(ref)
    while snap is not None:
        yield snap
        parent = snap.parentId()
        snap = t.snapshot(parent) if parent is not None else None


def branch_names(spark: SparkSession, table: str) -> list[str]:
    """The table's branches (`main` included), as `SELECT name FROM t.refs WHERE type = 'BRANCH'`
    lists them, without its Spark job."""
    refs = iceberg_table(spark, table).refs()
    return sorted(str(name) for name in refs.keySet() if refs.get(name).isBranch())


def current_snapshot(spark: SparkSession, table: str) -> Any | None:
    return next(current_ancestors(spark, table), None)


def summary_of(snapshot: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in snapshot.summary().items()}
