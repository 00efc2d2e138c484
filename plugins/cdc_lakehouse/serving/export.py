"""One run of a serving export (docs/serving-export.md): a lake table in, a store namespace out.

    pin        the source's current snapshot, the alias and its current version's metadata
    plan       full (no version yet, `full`, a changed key/value schema), incremental, or
               nothing (the version already holds this snapshot); an expired position is an
               error asking for `full` (lake.holds: the export holds its position and pending
               snapshots on the source, for `max_lag_hours`)
    full       write version N+1 from executors, validate it (key count, a sample decoded and
               compared), mark it complete, switch the alias atomically, drop old versions
    incremental  mark the target snapshot pending in the live version's metadata, upsert the
               keys whose values changed and delete the keys that went, then move the
               version's position to the snapshot (compare-and-set on the metadata)

The position moves only after every write succeeded: a run killed mid-write leaves the alias
(full) or the position (incremental) where it was, and the next run rewrites what it may have
touched, so runs converge.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from cdc_lakehouse.columns import META_PREFIX
from cdc_lakehouse.derived.config import TreeConfig
from cdc_lakehouse.lake.holds import hold, lag_error, release_pending
from cdc_lakehouse.lake.ranges import (
    KeyRange,
    between,
    changelog_keys,
    fingerprint_diff,
    key_range,
    live_rows,
    table_snapshots,
)
from cdc_lakehouse.lake.snapshots import current_snapshot
from cdc_lakehouse.lake.tables import table_exists
from cdc_lakehouse.runtime.phases import PhaseClock, SparkJobs
from cdc_lakehouse.serving.config import ExportConfig, ResolvedSource, resolve_source
from cdc_lakehouse.serving.encoding import decoder, encoder, key_string, record_schema
from cdc_lakehouse.serving.stores import Alias, Store, VersionMeta, open_store, store_uri
from cdc_lakehouse.settings import LakeSettings

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from cdc_lakehouse.config import TableConfig

log = logging.getLogger(__name__)

CRASH_ENV = "CDC_TEST_CRASH_AT"  # `export_write:<n>`: a writer task fails after n items (kill tests)


@dataclass(frozen=True)
class ExportResult:
    """What one export run did. Figures a mode does not produce are None: a full run writes
    (rows_written), validates (keys, validated_sample) and retains (dropped_versions); an
    incremental run changes keys (keys_from, upserts, deletes, keys); a noop only pins; a rollback
    moves the alias back (version, previous) and starts no Spark job."""

    mode: str  # full | incremental | noop | rollback
    spark_jobs: int | None = None
    seconds: float | None = None
    phases: dict[str, float] | None = None  # seconds per phase
    keys_from: str | None = None
    version: int | None = None
    snapshot: int | None = None  # the source snapshot the version now holds
    rows_written: int | None = None
    upserts: int | None = None
    deletes: int | None = None
    keys: int | None = None
    validated_sample: int | None = None
    dropped_versions: list[int] | None = None
    previous: int | None = None  # rollback: the version rolled back from

    def to_dict(self) -> dict[str, Any]:
        """For the job's result line and the log: the figures the run produced."""
        always = (
            ("mode", "version", "previous") if self.mode == "rollback" else ("mode", "spark_jobs", "seconds", "phases")
        )
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None or f.name in always}


@dataclass
class ExportRun:
    """What the phases share."""

    ecfg: ExportConfig
    lake: LakeSettings
    store: Store
    uri: str = field(repr=False)  # a secret
    source: ResolvedSource
    table: str  # catalog-qualified source table
    snapshot: int | None
    key: list[str]
    values: list[str]
    value_schema: str
    alias: Alias | None
    live: VersionMeta | None  # the alias's current version
    mode: str = "full"
    # What the run reports (ExportResult), set by the phase that finds it:
    keys_from: str | None = None  # incremental: changelog | snapshot_diff
    version: int | None = None  # the version written (full) or changed (incremental)
    rows_written: int | None = None
    upserts: int | None = None
    deletes: int | None = None
    keys: int | None = None  # keys the version holds
    validated_sample: int | None = None
    dropped_versions: list[int] | None = None

    @property
    def ns(self) -> str:
        return self.ecfg.store.namespace

    # What plan_mode's choice guarantees: a run other than "full" has a live version, hence an alias.
    @property
    def exported(self) -> VersionMeta:
        """The live version an incremental, noop or held run starts from."""
        assert self.live is not None, "only a full export runs without a live version"
        return self.live

    @property
    def live_alias(self) -> Alias:
        assert self.alias is not None, "a live version is one the alias points at"
        return self.alias


def export(
    spark: SparkSession,
    lake: LakeSettings,
    ecfg: ExportConfig,
    tables: dict[str, TableConfig],
    derived: dict[str, TreeConfig],
    *,
    mode: str = "auto",
) -> ExportResult:
    """Bring the export's namespace up to the source's current snapshot; returns what the run did."""
    clock = PhaseClock()
    uri = store_uri(ecfg.store.conn_id)
    store = open_store(ecfg.store.kind, uri, buckets=ecfg.store.buckets, table_prefix=ecfg.store.table_prefix)
    try:
        store.check()
        with SparkJobs(spark, f"export {ecfg.name}") as jobs:
            with clock.phase("pin"):
                r = pin_run(spark, lake, ecfg, tables, derived, store, uri)
                r.mode = plan_mode(spark, r, full=mode == "full", resume=mode == "resume")
            if r.mode == "full":
                with clock.phase("write"):
                    version = write_full(spark, r)
                with clock.phase("validate"):
                    validate(spark, r, version)
                with clock.phase("switch"):
                    switch(r, version)
                    retain(r)
                hold_position(spark, r, r.snapshot)
            elif r.mode == "incremental":
                with clock.phase("write"):
                    write_changes(spark, r)
            elif r.mode == "noop":
                hold_position(spark, r, r.exported.snapshot)
            if mode == "resume" and r.alias and r.alias.held:
                r.store.switch_alias(r.ns, r.alias, r.alias.model_copy(update={"held": False}))
    finally:
        store.close()
    result = ExportResult(
        mode=r.mode,
        spark_jobs=jobs.count,
        seconds=round(clock.elapsed(), 1),
        phases=clock.rounded(),
        keys_from=r.keys_from,
        version=r.version,
        snapshot=r.snapshot if r.version is not None else None,
        rows_written=r.rows_written,
        upserts=r.upserts,
        deletes=r.deletes,
        keys=r.keys,
        validated_sample=r.validated_sample,
        dropped_versions=r.dropped_versions,
    )
    log.info("export %s: %s", ecfg.name, result.to_dict())
    return result


# --- pin and plan ---------------------------------------------------------------------------------


def pin_run(
    spark: SparkSession,
    lake: LakeSettings,
    ecfg: ExportConfig,
    tables: dict[str, TableConfig],
    derived: dict[str, TreeConfig],
    store: Store,
    uri: str,
) -> ExportRun:
    src = resolve_source(ecfg, tables, derived)
    table = lake.qualified(src.table)
    if not table_exists(spark, table):
        raise RuntimeError(f"export {ecfg.name}: source table {table} does not exist yet; run what writes it first")
    snap = current_snapshot(spark, table)
    snapshot = int(snap.snapshot_id) if snap is not None else None
    cols = [f.name for f in spark.table(table).schema.fields]
    key = list(ecfg.key or src.default_key or [])
    values = list(ecfg.values or [c for c in cols if c not in key and not c.startswith(META_PREFIX)])
    missing = [c for c in key + values if c not in cols]
    if missing:
        raise RuntimeError(
            f"export {ecfg.name}: column(s) {missing} are not in {table} (columns: {cols}); fix key/values"
        )
    schema = spark.table(table).select(*values).schema
    alias = store.alias(ecfg.store.namespace)
    live = store.meta(ecfg.store.namespace, alias.current) if alias else None
    return ExportRun(
        ecfg, lake, store, uri, src, table, snapshot, key, values, json.dumps(record_schema(schema)), alias, live
    )


def plan_mode(spark: SparkSession, r: ExportRun, *, full: bool, resume: bool = False) -> str:
    live = r.live
    if full or live is None or live.state != "complete":
        return "full"
    if r.live_alias.held and not resume:
        # A rollback holds the alias: moving the version it points at to the source's current
        # snapshot would bring back what the rollback took away.
        log.warning("export %s: alias held by a rollback; trigger mode=full or mode=resume", r.ecfg.name)
        return "held"
    reason = _changed_shape(r)
    if reason is None and live.snapshot == r.snapshot and not live.pending:
        return "noop"
    reason = reason or _unreadable_position(spark, r)
    if reason is not None:
        log.info("export %s: %s; writing a new version", r.ecfg.name, reason)
        return "full"
    return "incremental"


def _changed_shape(r: ExportRun) -> str | None:
    live = r.exported
    if live.value_schema != r.value_schema or live.key_columns != r.key or live.source != r.table:
        return "key, values, their types or the source changed"
    if r.ecfg.store.kind == "redis" and live.buckets not in (None, r.ecfg.store.buckets):
        return "store.buckets changed"
    return None


def _unreadable_position(spark: SparkSession, r: ExportRun) -> str | None:
    live = r.exported
    if live.snapshot is None:
        return "the version was exported while the source had no snapshot"
    known = set(table_snapshots(spark, r.table)[0])
    gone = [s for s in [live.snapshot, *live.pending] if s not in known]
    if gone:
        # Not a silent new version: an export this far behind is something to look at.
        fix = f"trigger cdc_export__{r.ecfg.name} with mode=full (a new version from the current snapshot)"
        raise lag_error("export", r.ecfg.name, r.table, gone[0], r.ecfg.max_lag_hours, fix)
    return None


def hold_position(spark: SparkSession, r: ExportRun, snapshot: int | None) -> None:
    """Hold the version's position on the source (lake.holds); the pending snapshots' holds go."""
    if snapshot is not None:
        hold(spark, r.table, "export", r.ecfg.name, snapshot, r.ecfg.max_lag_hours)
    pending = [*(r.live.pending if r.live else []), *([r.snapshot] if r.snapshot is not None else [])]
    release_pending(spark, r.table, "export", r.ecfg.name, pending)


# --- read -----------------------------------------------------------------------------------------


def rows_at(spark: SparkSession, r: ExportRun, snapshot: int | None) -> DataFrame:
    """The source at a snapshot, without soft-deleted rows: those are deletes for a reader."""
    return live_rows(spark, r.table, r.source.table_cfg, snapshot)


def changed_keys(spark: SparkSession, r: ExportRun, since: list[int]) -> DataFrame:
    """Every key the store may hold a wrong value for: from the changelog when the source is a
    table's current rows and lake.ranges' rule allows it (cheap: the changes, not the table),
    else from a diff of snapshots."""
    rng, cfg = changelog_range(spark, r, since), r.source.table_cfg
    keys = changelog_keys(spark, r.lake, cfg, rng.lo_watermark, rng.hi_watermark) if rng and cfg else None
    r.keys_from = "changelog" if keys is not None else "snapshot_diff"
    return keys if keys is not None else diff_keys(spark, r, since)


def changelog_range(spark: SparkSession, r: ExportRun, since: list[int]) -> KeyRange | None:
    """The range from the exported snapshot E to this run's S when its changelog names every
    changed key (lake.ranges.key_range) and every pending snapshot lies in [E, S] (a changelog
    from E covers them then); else None: diff snapshots (docs/serving-export.md)."""
    cfg = r.source.table_cfg
    if cfg is None or r.ecfg.source.read != "current" or r.key != cfg.lake_key or r.snapshot is None:
        # Another key: a change of a non-key column that is in it, or a delete (whose event
        # carries only the primary key), leaves the old key in no changelog row.
        return None
    snaps, _ = table_snapshots(spark, r.table)
    lo = r.exported.snapshot
    rng = key_range(snaps, lo, r.snapshot)
    if rng.mode != "changelog" or lo is None:  # (a changelog range has a start)
        log.info("export %s: diffing snapshots: %s", r.ecfg.name, rng.reason)
        return None
    inside = {lo} | {s.snapshot_id for s in between(snaps, lo, r.snapshot) or []}
    return rng if set(since) <= inside else None


def diff_keys(spark: SparkSession, r: ExportRun, since: list[int]) -> DataFrame:
    """Keys whose value at this run's snapshot differs from their value at any of `since` (the
    exported position and the pending snapshots of runs that did not commit), or that exist in
    only one of the two."""
    now = rows_at(spark, r, r.snapshot)
    keys: DataFrame | None = None
    for s in since:
        diff = fingerprint_diff(rows_at(spark, r, s), now, r.key, r.values)
        keys = diff if keys is None else keys.unionByName(diff)
    assert keys is not None, "an incremental run diffs from at least its exported snapshot"
    return keys.distinct()


# --- write (on the executors) ---------------------------------------------------------------------


def _fail_after() -> int | None:
    point = os.environ.get(CRASH_ENV, "")
    return int(point.split(":", 1)[1]) if point.startswith("export_write:") else None


COUNTS_SCHEMA = "upserts long, deletes long"


def _write_batches(batches, *, kind, uri, options, ns, version, key, values, value_schema, fail_after):
    """Executor side (mapInArrow): encode and write one partition's Arrow batches; rows whose
    `_present` is false are deletes. Yields one row: how many upserts and deletes it wrote.

    Arrow batches, not Rows: Row objects cost a third of a full export's write time (docs/benchmarks-history.md)."""
    import pyarrow as pa

    store = open_store(kind, uri, **options)
    encode = encoder(value_schema)
    counts = {"upserts": 0, "deletes": 0}

    def items():
        n = 0
        for batch in batches:
            for d in batch.to_pylist(maps_as_pydicts="strict"):
                if fail_after is not None and n >= fail_after:
                    raise RuntimeError(f"{CRASH_ENV}: export_write failpoint after {n} items")
                n += 1
                k = [d[c] for c in key]
                if any(v is None for v in k):
                    raise ValueError(
                        f"a source row has NULL in key column(s) {[c for c in key if d[c] is None]}: "
                        "store keys must be non-null; choose key columns that are never NULL"
                    )
                if d.pop("_present", True):
                    counts["upserts"] += 1
                    yield key_string(k), encode({c: d[c] for c in values})
                else:
                    counts["deletes"] += 1
                    yield key_string(k), None

    try:
        store.write(ns, version, items())
    finally:
        store.close()
    yield pa.RecordBatch.from_pydict({c: [v] for c, v in counts.items()}, pa.schema([(c, pa.int64()) for c in counts]))


def write_rows(spark: SparkSession, r: ExportRun, df: DataFrame, version: int) -> tuple[int, int]:
    """(upserts, deletes) written by the executors in one Spark job."""
    from pyspark.sql import functions as F

    fn = functools.partial(
        _write_batches,
        kind=r.ecfg.store.kind,
        uri=r.uri,  # a secret: it travels inside the task closure, never in the Spark conf or UI
        options={"buckets": r.ecfg.store.buckets, "table_prefix": r.ecfg.store.table_prefix},
        ns=r.ns,
        version=version,
        key=r.key,
        values=r.values,
        value_schema=r.value_schema,
        fail_after=_fail_after(),
    )
    counts = utc_naive(df).mapInArrow(fn, COUNTS_SCHEMA).agg(F.sum("upserts"), F.sum("deletes")).first()
    assert counts is not None  # a global aggregate has one row
    return int(counts[0] or 0), int(counts[1] or 0)


def utc_naive(df: DataFrame) -> DataFrame:
    """Timestamps as naive UTC wall time: Python receives a TIMESTAMP as naive *local* time of the
    worker, which Avro's timestamp-micros would read as UTC (the session's zone is UTC, so the
    cast to TIMESTAMP_NTZ is the UTC wall time). Top-level columns only."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import TimestampType

    return df.select(
        *[
            F.col(f.name).cast("timestamp_ntz").alias(f.name) if isinstance(f.dataType, TimestampType) else f.name
            for f in df.schema.fields
        ]
    )


def write_full(spark: SparkSession, r: ExportRun) -> int:
    version = max([0, *r.store.versions(r.ns)]) + 1
    meta = VersionMeta(
        version=version,
        value_schema=r.value_schema,
        key_columns=r.key,
        source=r.table,
        snapshot=r.snapshot,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    r.store.new_version(r.ns, meta)
    upserts, _ = write_rows(spark, r, rows_at(spark, r, r.snapshot).select(*r.key, *r.values), version)
    r.version, r.rows_written = version, upserts
    return version


def write_changes(spark: SparkSession, r: ExportRun) -> None:
    """Incremental: pending first (so a kill leaves a trace), then the writes, then the position."""
    from pyspark.sql import functions as F

    live = r.exported
    since = [s for s in dict.fromkeys([live.snapshot, *live.pending]) if s is not None]
    marked = live.model_copy(update={"pending": sorted({*live.pending, r.snapshot} - {None})})
    # Held before it is recorded as pending: whatever the metadata names, expiry keeps.
    if r.snapshot is not None:
        hold(spark, r.table, "export", r.ecfg.name, r.snapshot, r.ecfg.max_lag_hours, pending=True)
    r.store.put_meta(r.ns, live, marked)
    now = rows_at(spark, r, r.snapshot).select(*r.key, *r.values).withColumn("_present", F.lit(True))
    rows = changed_keys(spark, r, since).join(now, r.key, "left").fillna(False, subset=["_present"])
    upserts, deletes = write_rows(spark, r, rows, live.version)
    count = r.store.count(r.ns, live.version)
    expected = rows_at(spark, r, r.snapshot).count()
    if count != expected:
        raise RuntimeError(
            f"export {r.ecfg.name}: version {live.version} holds {count} keys after the changes, the source "
            f"{expected} rows: the key {r.key} is not unique, or another writer changed the namespace. "
            "The position did not move; run a full export (DAG param mode=full)."
        )
    crash_point("export_before_position")
    done = marked.model_copy(update={"snapshot": r.snapshot, "pending": [], "count": count})
    r.store.put_meta(r.ns, marked, done)
    hold_position(spark, r, r.snapshot)
    r.version, r.upserts, r.deletes, r.keys = live.version, upserts, deletes, count


# --- validate, switch, retain ----------------------------------------------------------------------


def validate(spark: SparkSession, r: ExportRun, version: int) -> None:
    """The new version holds one key per source row, and a sample decodes to the source's values."""
    written = r.rows_written
    count = r.store.count(r.ns, version)
    if count != written:
        raise RuntimeError(
            f"export {r.ecfg.name}: version {version} holds {count} keys for {written} source rows: the key "
            f"{r.key} is not unique in {r.table}. Set `key` to unique columns; the alias did not move."
        )
    sample = utc_naive(rows_at(spark, r, r.snapshot).select(*r.key, *r.values)).limit(r.ecfg.validate_sample).collect()
    encode, decode = encoder(r.value_schema), decoder(r.value_schema)
    keys = [key_string([row[k] for k in r.key]) for row in sample]
    stored = r.store.read(r.ns, version, keys)
    for row, k, got in zip(sample, keys, stored):
        d = row.asDict(recursive=True)
        want = decode(encode({c: d[c] for c in r.values}))
        if got is None or decode(got) != want:
            raise RuntimeError(f"export {r.ecfg.name}: version {version} key {k} does not match the source row")
    r.keys, r.validated_sample = count, len(sample)


def switch(r: ExportRun, version: int) -> None:
    meta = r.store.meta(r.ns, version)
    assert meta is not None, f"version {version} was created by write_full"
    r.store.put_meta(r.ns, meta, meta.model_copy(update={"state": "complete", "count": r.keys}))
    crash_point("export_before_switch")
    r.store.switch_alias(r.ns, r.alias, Alias(current=version, previous=r.alias.current if r.alias else None))


def retain(r: ExportRun) -> None:
    """Keep the alias's two versions and the newest `keep_versions` complete ones; drop the rest
    (older versions, and versions of runs that failed before their switch)."""
    alias = r.store.alias(r.ns)
    assert alias is not None, "switch set it"
    keep = {alias.current, alias.previous} - {None}
    complete = [v for v in sorted(r.store.versions(r.ns), reverse=True) if _complete(r.store, r.ns, v)]
    keep |= set(complete[: r.ecfg.keep_versions])
    dropped = [v for v in r.store.versions(r.ns) if v not in keep]
    for v in dropped:
        r.store.drop_version(r.ns, v)
    r.dropped_versions = dropped


def _complete(store: Store, ns: str, version: int) -> bool:
    m = store.meta(ns, version)
    return m is not None and m.state == "complete"


def crash_point(name: str) -> None:
    from cdc_lakehouse.runtime.failpoints import crash_point as fail

    fail(name)


# --- operations -----------------------------------------------------------------------------------


def rollback(store: Store, ns: str) -> Alias:
    """Point the alias back at the previous version (kept complete by retention); the version rolled
    back from becomes the previous one, so rolling forward again is one more rollback. The alias
    is then held: `auto` runs leave it alone until a `full` run (a new version) or a `resume`."""
    alias = store.alias(ns)
    if alias is None or alias.previous is None or not _complete(store, ns, alias.previous):
        raise RuntimeError(f"namespace {ns!r}: no complete previous version to roll back to (alias: {alias})")
    new = Alias(current=alias.previous, previous=alias.current, held=True)
    store.switch_alias(ns, alias, new)
    return new


def rollback_export(ecfg: ExportConfig) -> ExportResult:
    store = open_store(
        ecfg.store.kind, store_uri(ecfg.store.conn_id), buckets=ecfg.store.buckets, table_prefix=ecfg.store.table_prefix
    )
    try:
        alias = rollback(store, ecfg.store.namespace)
    finally:
        store.close()
    log.info("export %s: alias of %s rolled back to version %s", ecfg.name, ecfg.store.namespace, alias.current)
    return ExportResult(mode="rollback", version=alias.current, previous=alias.previous)
