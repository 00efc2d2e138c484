"""lake.commits: Iceberg commits (Spark driver) that carry snapshot properties, retries on commit
conflicts, and the commit fenced on the table's position at publish time (a write to a branch,
published by a fast-forward only while main has not moved: optimistic concurrency between
writers that Iceberg itself enforces)."""

from __future__ import annotations

import itertools
import json
import logging
import random
import re
import time
import uuid
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from cdc_lakehouse.lake.snapshots import (
    branch_names,
    current_ancestors,
    current_snapshot,
    loaded_by_pyiceberg,
    summary_of,
)
from cdc_lakehouse.lake.tables import table_exists
from cdc_lakehouse.runtime.failpoints import crash_point
from cdc_lakehouse.watermark import StoredJson, watermark_in

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

logger = logging.getLogger(__name__)
T = TypeVar("T")
P = TypeVar("P")

# --- commits that carry snapshot properties ---------------------------------------------------


def sql_with_commit_properties(spark: SparkSession, sql: str, props: dict[str, str]) -> None:
    """Run a row-level SQL command (MERGE/DELETE/UPDATE) whose Iceberg commit carries props."""
    with_commit_properties(spark, props, lambda: spark.sql(sql))


# Iceberg 1.11+ on Spark 4 adds the session's `spark.sql.iceberg.snapshot-property.<key>` settings
# to the summary of every snapshot a write of that session commits (apache/iceberg#14545; the
# key is SparkSQLProperties.SNAPSHOT_PROPERTY_PREFIX in Iceberg 1.12.0).
SNAPSHOT_PROPERTY_CONF = "spark.sql.iceberg.snapshot-property."


def with_commit_properties(spark: SparkSession, props: dict[str, str], fn: Callable[[], object]) -> None:
    """Run fn so that every Iceberg commit its Spark writes make carries props (a SQL command, or a
    write whose code we do not own, such as lake.freshness's append): set as session settings
    around the call, and removed afterwards whatever happens. A session runs one job at a time
    (one Airflow task, one Connect session), so no other write of the session can pick them up."""
    keys = {SNAPSHOT_PROPERTY_CONF + k: v for k, v in props.items()}
    before = {k: spark.conf.get(k, None) for k in keys}
    for k, v in keys.items():
        spark.conf.set(k, v)
    try:
        fn()
    finally:
        for k, old in before.items():
            spark.conf.set(k, old) if old is not None else spark.conf.unset(k)


def is_commit_conflict(exc: BaseException) -> bool:
    text = str(exc)
    return any(
        s in text
        for s in (
            "CommitFailedException",
            # Iceberg's ValidationException of a row-level commit: "ValidationException: Found ..."
            # from a JVM stack, "(org.apache.iceberg.exceptions.ValidationException) Found ..."
            # from Spark Connect, which the first form alone did not match (#51).
            "ValidationException: Found conflicting",
            "ValidationException) Found conflicting",
            "Found new conflicting",
            "Cannot commit",
            "CommitStateUnknownException",
            MAIN_MOVED,
        )
    )


def with_commit_retries(fn: Callable[[], T], *, attempts: int = 5, what: str = "commit") -> T:
    """Retry fn on Iceberg commit conflicts (a concurrent writer won); fn must recompute from scratch."""
    for i in range(1, attempts):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001
            if not is_commit_conflict(exc):
                raise
            # Jittered: writers that lost to each other do not all come back at the same moment.
            wait = min(30.0, 0.5 * 2**i) * random.uniform(0.5, 1.0)
            logger.warning(f"{what}: commit conflict ({type(exc).__name__}); retry {i}/{attempts - 1} in {wait:.1f}s")
            time.sleep(wait)
    return fn()  # the last attempt: its conflict, if any, propagates


class ConcurrentWriterError(RuntimeError):
    """Another writer committed to the table since this run read its position."""


# --- commits fenced at publish time -------------------------------------------------------------

# A fenced commit's branch: `cdc_w_<UTC time it was made>_<random>`. The time lets a later writer
# tell a killed run's leftover from a branch still in use without a clock of the catalog's.
BRANCH_PREFIX = "cdc_w_"
_BRANCH_NAME = re.compile(rf"{BRANCH_PREFIX}(\d{{14}})_[0-9a-f]{{8}}")
# No fenced write runs this long (the DAGs' task timeouts are 2-3 h): an older branch is a killed
# run's. Until it is dropped its snapshots are kept from expiry, so it is not left for long.
STALE_BRANCH_AGE = timedelta(days=1)
_SWEEP_EVERY_S = 3600.0  # per table and process: a leftover is rare, and listing refs is a load
_swept: dict[str, float] = {}
# Iceberg's refusal when main is no longer an ancestor of the branch: another writer moved it.
MAIN_MOVED = "Cannot fast-forward"
_REF_ATTEMPTS = 5


def publish_point(table: str) -> str:
    """The failpoint between a fenced write and its publish (tests hold a writer there)."""
    return f"fence_publish:{table}"


def fenced_commit(
    spark: SparkSession,
    table: str,
    expected: Any,
    new: Any,
    write: Callable[[str], object],
    *,
    what: str,
    position: Callable[[Iterable[Any]], Any] = watermark_in,
    conflict: Callable[[Any], Exception] | None = None,
) -> bool:
    """Commit `write` only if the table's position is still `expected` when the commit is
    published, not merely when the write started.

    `write(target)` makes the run's commit(s) to `target`, `<table>.branch_<name>`: a branch
    created at the snapshot the position was read from (DataFrameWriterV2 or SQL on that name).
    They must carry `new` (`position` reads it from a chain of snapshots, newest first; the
    cdc.watermark by default). The branch is published by fast-forwarding main to it (CALL
    system.fast_forward), which Iceberg commits only while main is still an ancestor of the
    branch: nothing may have been committed to main since the position was read, a
    compare-and-swap on the table's current snapshot. A zombie driver, a manual job or a second
    deployment that committed meanwhile makes the publish fail, and the position is read again:
    `new` (an earlier attempt of this commit, or another run of the same batch, landed): False,
    nothing more is written; moved elsewhere: ConcurrentWriterError (or `conflict(now)`), and
    nothing of this run is visible; unmoved (a compaction, an online bootstrap's chunk, a
    repair): the write is made again from the new current snapshot. True when this call
    published. The snapshot properties ride on the branch's commit, so main carries them after
    the fast-forward. The branch is dropped whatever happens."""

    def attempt() -> bool:
        base, now = _position_at_current(spark, table, position)
        if now == new and new != expected:
            return False
        if now != expected:
            raise conflict(now) if conflict else _moved(table, what, expected, now)
        _write_and_publish(spark, table, base, write, lambda ref: position(current_ancestors(spark, table, ref)) == new)
        return True

    _drop_stale_branches(spark, table, datetime.now(UTC))
    return with_commit_retries(attempt, what=what)


def commit_unless_moved(
    spark: SparkSession,
    table: str,
    plan: Callable[[Iterable[Any]], P | None],
    write: Callable[[str, P], object],
    *,
    what: str,
    attempts: int = 10,
) -> P | None:
    """A check-then-write made one step: `plan(snapshots)` (the table's current snapshot, then
    its ancestors) decides what to write, None for nothing; `write(target, planned)` commits it
    to `target`, a branch at the snapshot it was planned from, published by the fast-forward of
    fenced_commit. A commit to main in between (any writer's, not only one of the same data)
    makes the publish fail, and the write is planned again from the new state, so two writers
    can never both act on a check that only one of them may pass (ingest.records: two runs of a
    batch each finding it unrecorded). Returns what this call published, None if nothing. More
    attempts than a fenced commit's: every other writer of the table is a competitor here."""

    def attempt() -> P | None:
        base, planned = _position_at_current(spark, table, plan)
        if planned is not None:
            _write_and_publish(spark, table, base, lambda target: write(target, planned), None)
        return planned

    _drop_stale_branches(spark, table, datetime.now(UTC))
    return with_commit_retries(attempt, attempts=attempts, what=what)


def _moved(table: str, what: str, expected: Any, now: Any) -> ConcurrentWriterError:
    def brief(wm: Any) -> str:
        return wm.to_json() if isinstance(wm, StoredJson) else json.dumps(wm, default=str)

    return ConcurrentWriterError(
        f"{what}: {table} was committed by another writer since this run started (position "
        f"{brief(expected or {})} -> {brief(now or {})}); nothing of this run was published. Check "
        "for a second deployment, a manual job or a run that outlived its task, then rerun"
    )


def _position_at_current(spark: SparkSession, table: str, position: Callable[[Iterable[Any]], T]) -> tuple[int, T]:
    """(current snapshot id, the position as of it), from one fresh load of the table. A table
    without a snapshot first gets an empty one: a branch needs a snapshot to start from (two
    writers doing so at once is harmless: neither carries a position)."""
    chain = current_ancestors(spark, table)  # refreshes the table first (lake.snapshots)
    head = next(chain, None)
    if head is None:
        if not commit_empty_snapshot(table):
            spark.createDataFrame([], spark.table(table).schema).writeTo(table).append()
        chain = current_ancestors(spark, table)
        head = next(chain)
    return int(head.snapshot_id), position(itertools.chain([head], chain))


def commit_empty_snapshot(table: str) -> bool:
    """A first, empty snapshot for a table that has none, committed by pyiceberg: no Spark job
    (a Spark append of no rows is one). False where this process does not read the catalog with
    pyiceberg (the caller then appends through Spark). Another writer's first snapshot landing
    in between is as good: its commit conflict is taken as done."""
    from pyiceberg.exceptions import CommitFailedException

    loaded = loaded_by_pyiceberg(table)
    if loaded is None:
        return False
    if loaded.metadata.current_snapshot_id is None:
        try:
            loaded.append(loaded.schema().as_arrow().empty_table())
        except CommitFailedException:
            pass
    return True


def _write_and_publish(
    spark: SparkSession,
    table: str,
    base: int,
    write: Callable[[str], object],
    carries_new: Callable[[str], bool] | None,
) -> None:
    branch = f"{BRANCH_PREFIX}{datetime.now(UTC):%Y%m%d%H%M%S}_{uuid.uuid4().hex[:8]}"
    _ref_ddl(spark, table, f"ALTER TABLE {table} CREATE BRANCH {branch} AS OF VERSION {base}")
    try:
        write(f"{table}.branch_{branch}")
        if carries_new is not None and not carries_new(
            branch
        ):  # e.g. a write that went to the table itself: it was not fenced
            raise RuntimeError(
                f"{table}: the fenced write did not commit its new position to {table}.branch_{branch}, the "
                "target it was given; write there (DataFrameWriterV2 or SQL on that name), never to the table"
            )
        crash_point(publish_point(table))
        # The whole name, catalog first: given `namespace.table`, Iceberg first looks the namespace
        # up as a catalog and logs a WARN with a stack trace (CatalogNotFoundException) every time.
        catalog = table.split(".", 1)[0]
        _ref_ddl(spark, table, f"CALL {catalog}.system.fast_forward('{table}', 'main', '{branch}')")
    finally:
        try:
            _ref_ddl(spark, table, f"ALTER TABLE {table} DROP BRANCH IF EXISTS {branch}")
        except Exception as exc:  # noqa: BLE001 - the publish's outcome is what counts; see _drop_stale_branches
            logger.warning("%s: could not drop the branch %s (%s); a later writer drops it", table, branch, exc)


def _ref_ddl(spark: SparkSession, table: str, sql: str) -> None:
    """A branch's create, fast-forward or drop. Iceberg commits them as a swap of the table's
    metadata that it never re-applies on a newer version: any other commit in between (another
    writer's branch, not only main moving) fails it, so it is made again from a fresh load. A
    fast-forward that main's move made impossible is not: that is the fence."""
    for i in range(1, _REF_ATTEMPTS + 1):
        try:
            spark.sql(sql).collect()
            return
        except Exception as exc:
            if MAIN_MOVED in str(exc) or i == _REF_ATTEMPTS or not is_commit_conflict(exc):
                raise
            spark.sql(f"REFRESH TABLE {table}")


def _drop_stale_branches(spark: SparkSession, table: str, now: datetime) -> list[str]:
    """Drop the fenced-commit branches killed runs left on the table (older than
    STALE_BRANCH_AGE); returns their names. Best effort, once an hour per table and process."""
    clock = time.monotonic()
    if clock - _swept.get(table, -_SWEEP_EVERY_S) < _SWEEP_EVERY_S:
        return []
    _swept[table] = clock
    dropped: list[str] = []
    try:
        names = branch_names(spark, table) if table_exists(spark, table) else []
    except Exception as exc:  # noqa: BLE001 - see the docstring
        logger.warning("%s: could not list its branches (%s)", table, exc)
        return dropped
    for name in names:
        made = branch_made_at(name)
        if made is None or now - made < STALE_BRANCH_AGE:
            continue  # not ours, or maybe a run still going
        try:
            _ref_ddl(spark, table, f"ALTER TABLE {table} DROP BRANCH IF EXISTS {name}")
        except Exception as exc:  # noqa: BLE001 - see the docstring
            logger.warning("%s: could not drop the stale branch %s (%s)", table, name, exc)
            continue
        logger.warning("%s: dropped %s, the branch of a fenced commit whose run did not finish", table, name)
        dropped.append(name)
    return dropped


def branch_made_at(name: str) -> datetime | None:
    """When a fenced commit made the branch `name`; None for any other branch."""
    m = _BRANCH_NAME.fullmatch(name)
    return datetime.strptime(m.group(1), "%Y%m%d%H%M%S").replace(tzinfo=UTC) if m else None


def current_snapshot_id(spark: SparkSession, table: str) -> int | None:
    snap = current_snapshot(spark, table)
    return None if snap is None else int(snap.snapshot_id)


def snapshot_summary(spark: SparkSession, table: str) -> dict[str, str]:
    """Summary of the table's current snapshot."""
    snap = current_snapshot(spark, table)
    return {} if snap is None else summary_of(snap)
