"""lake.holds: the snapshot a consumer of a table still needs, held against snapshot expiry.

A consumer (a change-feed consumer, a derived table, a serving export) reads a table from the
snapshot it read last: its offset, its input watermark, its exported position (and a serving
export's pending snapshots). It holds that snapshot with an Iceberg tag on the table,
`cdc_consumer_<kind>_<name>`, moved every time it commits its position, as Paimon's consumer
ids hold back its expiry. Any engine's `expire_snapshots` keeps a tagged snapshot while the tag
lives; this project's maintenance also keeps every snapshot after the oldest live hold (and
after the snapshot below it carrying the table's position), so the consumer's next read still
sees the table's history between its two snapshots (range_floor_ms, maintenance.expiry.expire).

A hold lasts `max_lag_hours` after the consumer last moved it. Iceberg counts a tag's RETAIN
from its snapshot's commit time, not from the tag's creation, so the RETAIN set is the snapshot's
age plus the max lag: a consumer that is up to date on a table quiet for longer than its max lag
keeps its hold. A consumer that stays away longer loses it; once the snapshot is expired, its next
run fails with ConsumerLagError naming it, the table and the fix (never a silent gap, never a
silent full resync). SQL only: DDL and the `refs` / `snapshots` metadata tables.

List and drop holds: `python -m cdc_lakehouse.cli holds list|drop` (a retired consumer's hold
would otherwise keep its snapshots until its max lag runs out).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Literal, cast

from cdc_lakehouse.identifiers import check_lake_ident
from cdc_lakehouse.runtime.phases import metadata_reads

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

HOLD_PREFIX = "cdc_consumer_"
PENDING = "__pending_"
HoldKind = Literal["feed", "derived", "export"]
KINDS: tuple[str, ...] = ("feed", "derived", "export")
# Twice the tables' default snapshot retention (168 h): a hold only protects what expiry would
# otherwise remove, so a max lag at or below the retention would add nothing. Two weeks covers a
# consumer down over a holiday; past it, the snapshots it pins cost more than a full resync.
DEFAULT_MAX_LAG_HOURS = 336
HOUR_MS = 3_600_000


class ConsumerLagError(RuntimeError):
    """A consumer needs a snapshot that expiry removed: it lagged past its hold, or the hold was
    dropped. The message names the consumer, the table and the fix; nothing was written."""


@dataclass(frozen=True)
class Hold:
    """One consumer's hold on one table: a tag and the snapshot it keeps."""

    table: str  # catalog-qualified
    name: str  # the tag
    snapshot_id: int
    committed_at_ms: int  # the held snapshot's commit time
    retain_ms: int | None  # the tag's max age, from committed_at_ms (None: kept for ever)

    @property
    def expires_at_ms(self) -> int | None:
        return None if self.retain_ms is None else self.committed_at_ms + self.retain_ms

    def lapsed(self, now_ms: int) -> bool:
        return self.expires_at_ms is not None and self.expires_at_ms <= now_ms

    @property
    def consumer(self) -> str:
        """`<kind>:<name>` of the consumer holding it (pending holds included)."""
        kind, _, name = self.name[len(HOLD_PREFIX) :].partition("_")
        return f"{kind}:{name.split(PENDING, 1)[0]}"

    def as_dict(self) -> dict[str, object]:
        return {
            "table": self.table,
            "hold": self.name,
            "consumer": self.consumer,
            "snapshot_id": self.snapshot_id,
            "expires_at": None if self.expires_at_ms is None else _iso(self.expires_at_ms),
        }


def hold_name(kind: HoldKind, consumer: str, pending: int | None = None) -> str:
    """The tag of a consumer's position (or of one of its pending snapshots)."""
    if kind not in KINDS:
        raise ValueError(f"unknown consumer kind {kind!r}: use one of {KINDS}")
    check_lake_ident(consumer, f"{kind} consumer name")
    return f"{HOLD_PREFIX}{kind}_{consumer}" + ("" if pending is None else f"{PENDING}{int(pending)}")


def holds(spark: SparkSession, table: str) -> list[Hold]:
    """Every consumer hold on the table (one query of its metadata tables)."""
    with metadata_reads(spark):
        rows = spark.sql(
            f"SELECT r.name, r.snapshot_id, r.max_reference_age_in_ms AS retain_ms, unix_millis(s.committed_at) AS at "
            f"FROM {table}.refs r JOIN {table}.snapshots s ON r.snapshot_id = s.snapshot_id WHERE r.type = 'TAG'"
        ).collect()
    return sorted(
        (Hold(table, r["name"], int(r["snapshot_id"]), int(r["at"]), r["retain_ms"]) for r in rows),
        key=lambda h: h.name,
    )


def consumer_holds(spark: SparkSession, table: str) -> list[Hold]:
    return [h for h in holds(spark, table) if h.name.startswith(HOLD_PREFIX)]


def snapshot_time_ms(spark: SparkSession, table: str, snapshot_id: int) -> int | None:
    """The snapshot's commit time, or None when the table no longer has it (expired)."""
    rows = spark.sql(
        f"SELECT unix_millis(committed_at) AS at FROM {table}.snapshots WHERE snapshot_id = {int(snapshot_id)}"
    ).collect()
    return int(rows[0]["at"]) if rows else None


def hold(
    spark: SparkSession,
    table: str,
    kind: HoldKind,
    consumer: str,
    snapshot_id: int,
    max_lag_hours: int,
    *,
    pending: bool = False,
    now_ms: int | None = None,
) -> None:
    """Hold `snapshot_id` of `table` for the consumer for `max_lag_hours` from now. A hold moved
    less than half a max lag ago at the same snapshot is left as it is: a consumer that runs every
    few minutes does not commit table metadata every time."""
    from cdc_lakehouse.lake.commits import with_commit_retries

    name = hold_name(kind, consumer, snapshot_id if pending else None)
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    lag_ms = int(max_lag_hours) * HOUR_MS
    held = next((h for h in consumer_holds(spark, table) if h.name == name), None)
    if held is not None and held.snapshot_id == snapshot_id:
        left = held.expires_at_ms
        if left is None or left - now_ms >= lag_ms // 2:
            return
    at = snapshot_time_ms(spark, table, snapshot_id)
    if at is None:
        raise ConsumerLagError(
            f"{kind} consumer {consumer}: snapshot {snapshot_id} of {table} was expired before it could be held; "
            "maintenance ran while the consumer was still reading it. Rerun the consumer: it reads again from "
            "its last committed position"
        )
    minutes = -(-(max(now_ms - at, 0) + lag_ms) // 60_000)  # RETAIN counts from the snapshot's commit
    sql = (
        f"ALTER TABLE {table} CREATE OR REPLACE TAG `{name}` AS OF VERSION {int(snapshot_id)} RETAIN {minutes} MINUTES"
    )
    with_commit_retries(lambda: spark.sql(sql), what=f"hold {name} on {table}")


def release(spark: SparkSession, table: str, names: list[str]) -> list[str]:
    """Drop the named holds (those that exist); returns the names given."""
    from cdc_lakehouse.lake.commits import with_commit_retries

    for name in names:
        if not name.startswith(HOLD_PREFIX):
            raise ValueError(f"{name!r} is not a consumer hold (they start with {HOLD_PREFIX})")
        sql = f"ALTER TABLE {table} DROP TAG IF EXISTS `{name}`"
        with_commit_retries(partial(spark.sql, sql), what=f"release {name} on {table}")
    return names


def release_pending(spark: SparkSession, table: str, kind: HoldKind, consumer: str, snapshots: list[int]) -> None:
    """Drop the consumer's holds of pending snapshots (its position moved past them)."""
    release(spark, table, [hold_name(kind, consumer, s) for s in dict.fromkeys(snapshots)])


@dataclass(frozen=True)
class Sweep:
    """What maintenance found on a table: holds still live, and lapsed ones it dropped."""

    kept: list[Hold]
    dropped: list[Hold]


def range_floor_ms(spark: SparkSession, table: str, kept: list[Hold], prop: str) -> int | None:
    """Commit time of the oldest snapshot the live holds need: each held snapshot and, below it,
    the nearest one carrying the table's position (`prop`), where a reader's next range starts
    (lake.ranges.effective_watermark). A consumer may hold a snapshot that carries none (a
    compaction's); with that ancestor expired, its next range could only be diffed, never read
    from the changelog. None without live holds."""
    if not kept:
        return None
    rows = spark.sql(
        f"SELECT snapshot_id, parent_id, unix_millis(committed_at) AS at, summary['{prop}'] IS NOT NULL AS carries "
        f"FROM {table}.snapshots"
    ).collect()
    snaps = {r["snapshot_id"]: r for r in rows}
    floor = None
    for h in kept:
        at, sid = h.committed_at_ms, h.snapshot_id
        while sid in snaps:  # down to the carrier, or to where the history was already cut
            at = min(at, snaps[sid]["at"])
            if snaps[sid]["carries"]:
                break
            sid = snaps[sid]["parent_id"]
        floor = at if floor is None else min(floor, at)
    return floor


def sweep(spark: SparkSession, table: str, now: datetime) -> Sweep:
    """Drop the holds whose max lag ran out at `now` (maintenance's clock, so a run for a given
    time decides the same as Iceberg's own expiry would then), keep the others."""
    now_ms = int(now.timestamp() * 1000)
    found = consumer_holds(spark, table)
    dropped = [h for h in found if h.lapsed(now_ms)]
    for h in dropped:
        log.warning(
            "%s: consumer %s lost its hold on snapshot %s (%s): its max lag ran out at %s; its next run "
            "fails with the fix once the snapshot is expired",
            table,
            h.consumer,
            h.snapshot_id,
            h.name,
            _iso(h.expires_at_ms),
        )
    release(spark, table, [h.name for h in dropped])
    return Sweep([h for h in found if not h.lapsed(now_ms)], dropped)


def lag_error(
    kind: HoldKind, consumer: str, table: str, snapshot_id: int, max_lag_hours: int | None, fix: str
) -> ConsumerLagError:
    """The error of a consumer whose snapshot is gone: who, which table, why, and the fix."""
    lag = f"more than {max_lag_hours} h (its max_lag_hours)" if max_lag_hours else "longer than its max lag"
    return ConsumerLagError(
        f"{kind} consumer {consumer} of {table} is too far behind: snapshot {snapshot_id}, which its next "
        f"incremental run starts from, was expired. The consumer did not move its hold ({hold_name(kind, consumer)}) "
        f"for {lag}, or the hold was dropped, so the changes since cannot be read; nothing was written. "
        f"Fix: {fix}"
    )


def _iso(ms: int | None) -> str | None:
    from datetime import UTC

    return None if ms is None else datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="seconds")


# --- operators: list and drop (python -m cdc_lakehouse.cli holds) ------------------------------


def lake_tables(spark: SparkSession, catalog: str) -> list[str]:
    """Every table of the catalog, `catalog.namespace.table` (one level of namespaces, as here)."""
    out = []
    for ns in spark.sql(f"SHOW NAMESPACES IN {catalog}").collect():
        for t in spark.sql(f"SHOW TABLES IN {catalog}.{ns[0]}").collect():
            if not t["isTemporary"]:
                out.append(f"{catalog}.{ns[0]}.{t['tableName']}")
    return sorted(out)


def drop_consumer(spark: SparkSession, tables: list[str], consumer: str) -> list[Hold]:
    """Drop every hold of `consumer` (`<kind>:<name>`, its pending holds too) on the tables: a
    retired consumer then stops keeping snapshots. Returns the holds dropped."""
    kind, _, name = consumer.partition(":")
    hold_name(cast(HoldKind, kind), name)  # validates both parts (the kind at run time)
    gone = []
    for table in tables:
        mine = [h for h in consumer_holds(spark, table) if h.consumer == consumer]
        release(spark, table, [h.name for h in mine])
        gone += mine
    return gone
