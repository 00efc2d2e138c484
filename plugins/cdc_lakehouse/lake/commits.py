"""lake.commits: Iceberg commits (Spark driver) that carry snapshot properties, retries on commit
conflicts, and the commit fenced on the table's watermark (optimistic concurrency between writers)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cdc_lakehouse.lake.snapshots import current_snapshot, summary_of
from cdc_lakehouse.lake.watermark import read_watermark, watermark_json

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

logger = logging.getLogger(__name__)

# --- commits that carry snapshot properties ---------------------------------------------------


def sql_with_commit_properties(spark: SparkSession, sql: str, props: dict[str, str]) -> None:
    """Run a row-level SQL command (MERGE/DELETE/UPDATE) whose Iceberg commit carries props."""
    with_commit_properties(spark, props, lambda: spark.sql(sql))


def with_commit_properties(spark: SparkSession, props: dict[str, str], fn: Callable[[], object]) -> None:
    """Run fn so that every Iceberg commit its Spark writes make carries props (a SQL command, or a
    write whose code we do not own, such as lake.freshness's append).

    SQL has no write options, so this goes through Iceberg's CommitMetadata, a thread-local
    set around the call. py4j's pinned-thread mode runs our callback's Spark calls on the
    same JVM thread that set it.
    """
    from pyspark.java_gateway import ensure_callback_server_started

    jvm = spark._jvm
    ensure_callback_server_started(spark.sparkContext._gateway)
    jmap = jvm.java.util.HashMap()
    for k, v in props.items():
        jmap.put(k, v)
    failure: list[BaseException] = []

    class _Run:
        def call(self):
            try:
                fn()
            except BaseException as exc:  # re-raised below with its Python type
                failure.append(exc)
                raise

        class Java:
            implements = ["java.util.concurrent.Callable"]

    try:
        jvm.org.apache.iceberg.spark.CommitMetadata.withCommitProperties(
            jmap, _Run(), jvm.java.lang.RuntimeException().getClass()
        )
    except Exception:
        if failure:
            raise failure[0] from None
        raise


def is_commit_conflict(exc: BaseException) -> bool:
    text = str(exc)
    return any(
        s in text
        for s in (
            "CommitFailedException",
            "ValidationException: Found conflicting",
            "Found new conflicting",
            "Cannot commit",
            "CommitStateUnknownException",
        )
    )


def with_commit_retries(fn, *, attempts: int = 5, what: str = "commit"):
    """Retry fn on Iceberg commit conflicts (a concurrent writer won); fn must recompute from scratch."""
    for i in range(1, attempts + 1):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001
            if i == attempts or not is_commit_conflict(exc):
                raise
            wait = min(30.0, 0.5 * 2**i)
            logger.warning(f"{what}: commit conflict ({type(exc).__name__}); retry {i}/{attempts - 1} in {wait:.1f}s")
            time.sleep(wait)


class ConcurrentWriterError(RuntimeError):
    """Another writer committed to the table since this run read its watermark."""


def fenced_commit(
    spark: SparkSession, table: str, expected: dict[str, Any] | None, new: dict[str, Any], commit, *, what: str
) -> bool:
    """Commit only while the table's watermark is still the one this run started from.

    Optimistic concurrency on the watermark: a zombie driver, a manual job or a second deployment
    that committed in between makes this run stop before it appends rows twice or moves the
    watermark back. Checked again before every retry, so a commit whose outcome was unknown
    (CommitStateUnknownException) is resolved first: if it landed, it is not repeated. Returns
    False when an earlier attempt of this very commit had already landed.

    Residual window: between the check and Iceberg's own commit (milliseconds); Airflow's
    per-table pool keeps our own writers out of it."""

    def attempt() -> bool:
        now = read_watermark(spark, table)
        if now == new:
            return False
        if now != expected:
            raise ConcurrentWriterError(
                f"{what}: {table} was committed by another writer since this run started (watermark "
                f"{watermark_json(expected or {})} -> {watermark_json(now or {})}); nothing was written by this "
                "run. Check for a second deployment, a manual job or a run that outlived its task, then rerun"
            )
        commit()
        return True

    return with_commit_retries(attempt, what=what)


def current_snapshot_id(spark: SparkSession, table: str) -> int | None:
    snap = current_snapshot(spark, table)
    return None if snap is None else int(snap.snapshotId())


def snapshot_summary(spark: SparkSession, table: str) -> dict[str, str]:
    """Summary of the table's current snapshot."""
    snap = current_snapshot(spark, table)
    return {} if snap is None else summary_of(snap)
