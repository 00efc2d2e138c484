"""Table configuration: one YAML file per replicated table, validated into typed objects.

A bad file yields a ConfigError naming the file, the field and the fix; the other files
still load, so one broken table never takes the other tables' DAGs down.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from cdc_lakehouse.identifiers import IdentifierError, check_ident, check_lake_ident

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails

# Columns the pipeline adds to lake tables: cdc_lakehouse.columns is their one home (source columns may not
# use the prefix).
from cdc_lakehouse.columns import META_PREFIX, SHARD_COL  # noqa: E402

_CRON_FIELD = re.compile(r"^[0-9*/,\-A-Za-z?LW#]+$")
_PRESETS = {"@hourly", "@daily", "@weekly", "@monthly", "@yearly", "@once", "@continuous"}
_TRANSFORM = re.compile(
    r"^(?:(?P<col>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<fn>bucket|truncate)\((?P<n>\d+),\s*(?P<arg>[A-Za-z_][A-Za-z0-9_]*)\)"
    r"|(?P<tfn>years|months|days|hours)\((?P<targ>[A-Za-z_][A-Za-z0-9_]*)\))$"
)


def _schedule(value: str | None) -> str | None:
    if value is None or value in _PRESETS:
        return value
    parts = value.split()
    if len(parts) != 5 or not all(_CRON_FIELD.match(p) for p in parts):
        raise ValueError(f"{value!r} is not a 5-field cron expression or a preset like @hourly")
    return value


Schedule = Annotated[str, AfterValidator(_schedule)]


class _Model(BaseModel):
    # Unknown keys are errors: a typo must not silently fall back to a default.
    model_config = ConfigDict(extra="forbid", frozen=True)


class ShardGroup(_Model):
    """Shards of one source endpoint: a PostgreSQL database reached through one connection."""

    conn_id: str = Field(description="Airflow connection id of the source host")
    database: str | None = Field(None, description="database; default: the connection's")
    schemas: list[str] = Field(min_length=1, description="shard schemas holding the table")

    @field_validator("conn_id")
    @classmethod
    def _conn(cls, v: str) -> str:
        if not re.match(r"^[A-Za-z0-9_.\-]{1,200}$", v):
            raise ValueError("connection ids use letters, digits, '_', '-' and '.'")
        return v

    @field_validator("database")
    @classmethod
    def _db(cls, v: str | None) -> str | None:
        return None if v is None else check_ident(v, "database")

    @field_validator("schemas")
    @classmethod
    def _schemas(cls, v: list[str]) -> list[str]:
        for s in v:
            check_ident(s, "shard schema")
        if len(set(v)) != len(v):
            raise ValueError("a shard schema is listed twice")
        return v

    @property
    def endpoint_id(self) -> str:
        """One replication slot and publication per endpoint (slots are per database)."""
        base = re.sub(r"[^a-z0-9_]", "_", self.conn_id.lower())
        return base if self.database is None else f"{base}__{self.database.lower()}"


class SourceConfig(_Model):
    table: str = Field(description="table name, the same in every shard")
    shards: list[ShardGroup] = Field(min_length=1)

    @field_validator("table")
    @classmethod
    def _table(cls, v: str) -> str:
        return check_ident(v, "source table")

    @model_validator(mode="after")
    def _unique_shards(self) -> SourceConfig:
        # One group per endpoint: capture and preflight key their work by endpoint, and a second
        # group of the same endpoint would hide the first one's schemas from them.
        endpoints: dict[str, int] = {}
        for i, g in enumerate(self.shards):
            if g.endpoint_id in endpoints:
                raise ValueError(
                    f"shard groups {endpoints[g.endpoint_id]} and {i} both read endpoint {g.endpoint_id!r} "
                    f"(conn_id {g.conn_id!r}, database {g.database!r}); list all its schemas in one group"
                )
            endpoints[g.endpoint_id] = i
        seen: set[str] = set()
        for g in self.shards:
            for s in g.schemas:
                name = shard_name(g, s)
                if name in seen:
                    raise ValueError(f"shard {name!r} appears twice")
                seen.add(name)
        return self


def shard_name(group: ShardGroup, schema: str) -> str:
    """The shard's name in the lake: its schema, prefixed by the database when shards are databases."""
    return schema if group.database is None else f"{group.database}.{schema}"


class ErrorBudget(_Model):
    max_quarantined: int = Field(1000, ge=0, description="quarantined events per run before it fails")
    max_fraction: float = Field(0.01, ge=0, le=1, description="quarantined / read, per run")


class LakeTableConfig(_Model):
    namespace: str = "cdc"
    name: str | None = Field(None, description="lake table name; default: the config's name")
    partition_by: list[str] = Field(default_factory=lambda: [SHARD_COL])
    sort_by: list[str] | None = Field(None, description="default: the primary key")
    write_mode: Literal["merge-on-read", "copy-on-write"] = "merge-on-read"
    format_version: Literal[2, 3] = 2
    target_file_size_mb: int = Field(128, ge=1, le=4096)
    properties: dict[str, str] = Field(default_factory=dict)

    @field_validator("namespace", "name")
    @classmethod
    def _lake(cls, v: str | None) -> str | None:
        return None if v is None else check_lake_ident(v, "lake namespace/name")

    @field_validator("partition_by")
    @classmethod
    def _parts(cls, v: list[str]) -> list[str]:
        for p in v:
            if not _TRANSFORM.match(p.strip()):
                raise ValueError(
                    f"partition {p!r}: use a column, bucket(N, col), truncate(N, col) or years/months/days/hours(col)"
                )
        return [p.strip() for p in v]


class SchemaChangePolicy(_Model):
    mode: Literal["additive", "strict"] = Field(
        "additive",
        description="additive: add new columns and safe widenings automatically; strict: stop on any change",
    )
    dropped_columns: dict[str, Literal["keep_null", "drop"]] = Field(
        default_factory=dict,
        description="decision per column dropped at the source: keep it (NULL from now on) or drop it",
    )


class ConsumedColumns(_Model):
    """The source columns a table consumes (opt-out schema evolution): `include` lists them, or
    `exclude` lists the ones it does not. Changes to the other columns (added, dropped, retyped)
    never stop the table and never reach its lake tables."""

    include: list[str] | None = Field(None, description="only these columns (the primary key among them)")
    exclude: list[str] = Field(default_factory=list, description="every column but these")

    @field_validator("include", "exclude")
    @classmethod
    def _idents(cls, v: list[str] | None) -> list[str] | None:
        for c in v or []:
            check_ident(c, "consumed column")
        return v

    @model_validator(mode="after")
    def _one_way(self) -> ConsumedColumns:
        if self.include is not None and self.exclude:
            raise ValueError("set either columns.include or columns.exclude, not both")
        if self.include is not None and not self.include:
            raise ValueError("columns.include is empty; list the columns the table consumes, or remove it")
        return self

    def consumes(self, name: str) -> bool:
        return name in self.include if self.include is not None else name not in self.exclude

    @property
    def all(self) -> bool:
        """Every column (no list): the table follows every schema change of its source."""
        return self.include is None and not self.exclude


class IngestConfig(_Model):
    schedule: Schedule = "@hourly"
    group: str | None = Field(None, description="tables of one group share one Spark application")
    parallel_tables: int = Field(
        4,
        ge=1,
        le=64,
        description="a group's tables ingested at once, each on a Spark session of its own (the largest "
        "value among the group's tables); 1: one after another",
    )
    max_events_per_run: int = Field(2_000_000, ge=1)
    max_bytes_per_run: int = Field(2 * 1024**3, ge=1024)
    decoding_work_mem_kb: int | None = Field(
        None,
        ge=64,
        description="the source server's memory (logical_decoding_work_mem, kB) for decoding one "
        "transaction before it streams it to the capture, which spools it until its commit; the "
        "smallest among the endpoint's tables; unset: the server's setting (64MB by default)",
    )
    error_budget: ErrorBudget = ErrorBudget()
    missing_landing_files: Literal["fail", "skip"] = "fail"
    merge_join: Literal["auto", "shuffle", "colocated"] = Field(
        "auto",
        description="colocated: the batch is staged in an Iceberg table partitioned like the current "
        "table and the MERGE joins partition by partition (Spark's storage-partitioned join) instead "
        "of shuffling every row of the table; auto: colocated from colocated_min_rows",
    )
    colocated_min_rows: int = Field(5_000_000, ge=0, description="auto merge_join: colocated at this table size")

    @field_validator("group")
    @classmethod
    def _group(cls, v: str | None) -> str | None:
        return None if v is None else check_lake_ident(v, "ingest group")


class AuditConfig(_Model):
    schedule: Schedule = "30 * * * *"
    freshness_sla_minutes: int = Field(120, ge=1)
    consecutive_mismatches: int = Field(3, ge=1, description="audits a key must mismatch before failing")
    mode: Literal["auto", "full", "checksum"] = "auto"
    checksum_min_rows: int = Field(1_000_000, ge=0, description="auto mode: checksum-first at this size")
    buckets: int = Field(256, ge=1, le=65536)
    sample_keys: int = Field(10, ge=0, le=1000)
    row_count_tolerance: float = Field(0.0, ge=0, le=1)
    repair: bool = False
    max_repair_keys: int = Field(100_000, ge=1)


class BaseMaintenanceConfig(_Model):
    """What every maintained Iceberg table shares: replicated tables, derived outputs, feed outputs."""

    schedule: Schedule = "15 3 * * *"
    snapshot_retention_hours: int = Field(168, ge=1)
    min_snapshots_to_keep: int = Field(5, ge=1)
    orphan_file_age_hours: int = Field(72, ge=24, description="never below a day: in-flight writes")
    min_input_files: int = Field(5, ge=2)
    # Maintenance proves nothing but rewrites committed while it ran from snapshot metadata alone
    # (maintenance.verify.only_rewrites_since). true adds a checksum of every row before and after: two
    # full reads of each table, an end-to-end check of Iceberg's rewrite itself.
    verify_content: bool = False


class MaintenanceConfig(BaseMaintenanceConfig):
    compaction: Literal["binpack", "sort"] = "sort"
    latest_view: Literal["table", "view", "none"] = "table"
    landing_retention_hours: int = Field(168, ge=1)


class OutputMaintenanceConfig(BaseMaintenanceConfig):
    """Maintenance of an output the project writes for a consumer (a derived table, a feed
    consumer's Iceberg output): bin-pack compaction with every delete file applied."""

    target_file_size_mb: int = Field(128, ge=1, le=4096)


class BootstrapConfig(_Model):
    max_connections_per_host: int = Field(2, ge=1, le=64)
    partitions_per_shard: int = Field(4, ge=1, le=1024)
    fetch_size: int = Field(10_000, ge=100)
    # Both read the typed select list (bootstrap/typed_select.py) under the same snapshot and cap.
    # jdbc: Spark's JDBC reader; copy: ADBC's binary COPY into Arrow on the Python workers
    # (bootstrap/copy_read.py; adbc-driver-postgresql on every worker). jdbc stays the default:
    # whole bootstraps of 10M rows measured 0.35 of COPY with jdbc and 0.32 with copy, one run each
    # (docs/bench-bootstrap-typed.md, issue #56), and it needs nothing beyond PySpark on the workers.
    reader: Literal["jdbc", "copy"] = "jdbc"
    # snapshot: one exported snapshot per endpoint for the whole read (bootstrap/snapshot.py).
    # chunked: key-range chunks between WAL watermarks, nothing held open between chunks,
    # resumable (bootstrap/chunked.py). auto: chunked when the source's estimated row count
    # (pg_class.reltuples, summed over the shards) reaches auto_chunked_rows.
    mode: Literal["snapshot", "chunked", "auto"] = "auto"
    chunk_rows: int = Field(50_000, ge=1, le=10_000_000)
    # 5M rows: about a minute of exported snapshot on the 2-core machine (docs/benchmarks-history.md, ~90k
    # rows/s), short enough that the snapshot's held xmin costs little vacuum; above it, the
    # hours-long snapshot that issue #21 is about starts to matter, and chunking pays for its
    # per-chunk MERGE. Small tables keep the snapshot mode, which is faster.
    auto_chunked_rows: int = Field(5_000_000, ge=0)
    # After each chunk's low marker, how long a chunk waits at most for transactions that may
    # have committed below the marker to become visible (source.markers.wait_until_visible): a
    # commit waiting for a synchronous standby that is down waits with it. Past this, the run stops
    # with an error naming the transactions; it resumes after its last recorded chunk.
    commit_wait_seconds: int = Field(600, ge=1)


class LandingSource(_Model):
    """Where the table's change events come from (docs/debezium.md). `capture`: our own capture
    DAG and landing zone (the default). `debezium_s3`: the files Confluent's S3 sink connector
    writes from the topics of Debezium's PostgreSQL connector; the capture DAG then skips it."""

    kind: Literal["capture", "debezium_s3"] = "capture"
    uri: str | None = Field(None, description="debezium_s3: the sink's bucket/prefix (s3://... or a local path)")
    topics_dir: str = Field("topics", description="the sink's topics.dir")
    topic_prefix: str | dict[str, str] | None = Field(
        None, description="Debezium's topic.prefix; or conn_id -> prefix when shards are on several servers"
    )
    format: Literal["json", "avro"] = Field("json", description="json: JsonFormat with schemas.enable=true")
    partitions: int = Field(1, ge=1, le=1024, description="partitions of each table topic")
    unavailable_value: str = Field("__debezium_unavailable_value", description="unavailable.value.placeholder")
    decimal_handling_mode: str = Field("precise", description="the connector's decimal.handling.mode")

    @field_validator("decimal_handling_mode")
    @classmethod
    def _decimal_mode(cls, v: str) -> str:
        if v not in ("precise", "string"):
            raise ValueError(
                f"decimal_handling_mode {v!r} is not supported: 'double' loses digits of numeric columns. "
                "Fix: set decimal.handling.mode=precise (the default) or string on the Debezium connector "
                "and the same value here"
            )
        return v

    @field_validator("topics_dir")
    @classmethod
    def _topics_dir(cls, v: str) -> str:
        if not re.match(r"^[A-Za-z0-9_.\-/]{1,200}$", v) or ".." in v.split("/"):
            raise ValueError(f"topics_dir {v!r}: use letters, digits, '_', '-', '.' and '/'")
        return v.strip("/")

    @model_validator(mode="after")
    def _debezium_needs(self) -> LandingSource:
        if self.kind == "debezium_s3" and (not self.uri or not self.topic_prefix):
            raise ValueError(
                "landing kind debezium_s3 needs `uri` (the S3 sink's bucket/prefix) and `topic_prefix` "
                "(the Debezium connector's topic.prefix)"
            )
        return self

    def prefix_for(self, conn_id: str) -> str:
        """The Debezium topic prefix of the shards reached through `conn_id`."""
        if isinstance(self.topic_prefix, dict):
            if conn_id not in self.topic_prefix:
                raise ValueError(
                    f"landing.topic_prefix has no entry for connection {conn_id!r}; add {conn_id}: <topic.prefix>"
                )
            return self.topic_prefix[conn_id]
        return self.topic_prefix or ""


class SoftDeleteColumns(_Model):
    flag: str = "is_deleted"
    timestamp: str = "deleted_at"


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([a-z]+)$", re.I)
_DURATION_UNITS = {
    **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), 1),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), 60),
    **dict.fromkeys(("h", "hr", "hour", "hours"), 3600),
    **dict.fromkeys(("d", "day", "days"), 86400),
}


def _off(v: Any) -> Any:
    """`off` (YAML reads a bare off as false), `false` or 0 disable a threshold."""
    if v is False or (isinstance(v, str) and v.strip().lower() in ("off", "none", "disabled")):
        return 0
    return v


def _duration(v: Any) -> float:
    v = _off(v)
    if v == 0:
        return 0.0
    m = _DURATION.match(v.strip()) if isinstance(v, str) else None
    if not m or m.group(2).lower() not in _DURATION_UNITS:
        raise ValueError(f"{v!r} is not a duration: write a number and a unit, like 90m, 2h or 1d (or off)")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]


def _size(v: Any) -> int:
    v = _off(v)
    if isinstance(v, bool):
        raise ValueError("a size is a number of bytes or a number and a unit, like 10GiB or 500MB (or off)")
    try:
        n = int(TypeAdapter(ByteSize).validate_python(v))
    except ValidationError:
        raise ValueError(
            f"{v!r} is not a size: write bytes or a number and a unit, like 10GiB or 500MB (or off)"
        ) from None
    if n < 0:
        raise ValueError("a size cannot be negative")
    return n


# Seconds (0 = off), parsed from "2h", "90m", "1d", "off".
Duration = Annotated[float, BeforeValidator(_duration)]
# Bytes (0 = off), parsed from "10GiB", "500MB", 1073741824, "off".
Size = Annotated[int, BeforeValidator(_size)]
AlertKind = Literal["task_failed", "audit_failing", "wal_retained", "freshness"]


class AlertThresholds(_Model):
    """When an alert fires. Unset fields inherit the project defaults (include/alerting.yaml);
    0 or `off` disables that alert."""

    audit_failed_runs: int | None = Field(None, ge=0, description="alert when the audit fails N runs in a row")
    retained_wal_bytes: Size | None = Field(None, description="alert when a capture slot retains more WAL")
    freshness_sla: Duration | None = Field(
        None, description="alert when the lake lags the source by more; default: audit.freshness_sla_minutes"
    )
    renotify_every_runs: int | None = Field(
        None, ge=1, description="while a condition lasts, repeat its alert every N runs"
    )

    @field_validator("audit_failed_runs", mode="before")
    @classmethod
    def _runs_off(cls, v: Any) -> Any:
        return _off(v)


class TableAlerts(AlertThresholds):
    channels: list[str] | None = Field(
        None, description="names of channels in include/alerting.yaml; default: every channel"
    )


APPROVALS_ENV = "CDC_APPROVALS"  # "off" in the workers' environment: no action waits for a person


def switched_on(environ: Mapping[str, str], name: str) -> bool:
    """A deployment switch of the workers' environment: on unless set to off, false, 0 or no."""
    return environ.get(name, "on").strip().lower() not in ("off", "false", "0", "no")


def approvals_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return switched_on(environ, APPROVALS_ENV)


class ApprovalsConfig(_Model):
    """Which destructive actions on this table wait for a person in Airflow's UI (its
    human-in-the-loop approval, orchestration/approvals.py). CDC_APPROVALS=off in the workers'
    environment turns every approval off, for unattended deployments."""

    rebootstrap: bool = Field(
        True,
        description="a bootstrap or a column backfill of a table that already holds a complete "
        "position and rows waits for an approval (a first load or a resumed chunked load does not)",
    )
    quarantine_replay: bool = Field(
        True, description="a quarantine replay (cdc_replay__<table>) of quarantined events waits for an approval"
    )
    repair_above_keys: int | None = Field(
        1000,
        ge=0,
        description="an audit repair (audit.repair: true) of more persistent keys than this waits for an "
        "approval in cdc_audit__<table>; null: the audit always repairs at once",
    )
    dropped_columns: bool = Field(
        True,
        description="a source column dropped with no schema_changes.dropped_columns entry waits for a person's "
        "keep/drop choice in the ingest DAG (decide_dropped); false: the table stops, naming the YAML fix",
    )
    response_timeout_hours: float | None = Field(
        None, gt=0, description="an unanswered approval fails its run after this long; none: it waits"
    )

    def repair_limit(self, environ: Mapping[str, str] = os.environ) -> int | None:
        """How many keys an audit repairs without asking; None: any number."""
        return self.repair_above_keys if approvals_enabled(environ) else None


class HistoryConfig(_Model):
    """A history table (`<namespace>.<name>__history`, docs/history-tables.md): every version of
    every row, kept by the ingest job from the changelog after each batch."""

    enabled: bool = Field(False, description="keep the table's history (slowly changing dimension type 2)")


class TableConfig(_Model):
    name: str = Field(description="the table's id: DAG ids, pools and lake names derive from it")
    description: str = ""
    owner: str = "data-platform"
    tags: list[str] = Field(default_factory=list)
    source: SourceConfig
    primary_key: list[str] = Field(min_length=1)
    column_types: dict[str, str] = Field(
        default_factory=dict, description="lake type overrides, e.g. {amount: 'decimal(20,4)'}"
    )
    deletes: Literal["hard", "soft"] = "hard"
    soft_delete_columns: SoftDeleteColumns = SoftDeleteColumns()
    schema_changes: SchemaChangePolicy = SchemaChangePolicy()
    columns: ConsumedColumns = ConsumedColumns()
    lake: LakeTableConfig = LakeTableConfig()
    ingest: IngestConfig = IngestConfig()
    audit: AuditConfig = AuditConfig()
    maintenance: MaintenanceConfig = MaintenanceConfig()
    bootstrap: BootstrapConfig = BootstrapConfig()
    landing: LandingSource = LandingSource()
    retries: int = Field(2, ge=0, le=10)
    alert_emails: list[str] = Field(default_factory=list, description="also e-mailed every alert of this table")
    alerts: TableAlerts = TableAlerts()
    approvals: ApprovalsConfig = ApprovalsConfig()
    history: HistoryConfig = HistoryConfig()

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_lake_ident(v, "table name")

    @field_validator("primary_key")
    @classmethod
    def _pk(cls, v: list[str]) -> list[str]:
        for c in v:
            check_ident(c, "primary key column")
            if c.startswith(META_PREFIX):
                raise ValueError(f"column {c!r} uses the reserved prefix {META_PREFIX!r}")
        return v

    @field_validator("column_types")
    @classmethod
    def _types(cls, v: dict[str, str]) -> dict[str, str]:
        for col, typ in v.items():
            check_ident(col, "column")
            if not re.match(r"^[a-z]+(\(\d+(,\s*\d+)?\))?$", typ):
                raise ValueError(f"column {col!r}: type {typ!r} is not a Spark type name like decimal(20,4)")
        return v

    @model_validator(mode="after")
    def _cross(self) -> TableConfig:
        for c in self.soft_delete_columns.flag, self.soft_delete_columns.timestamp:
            check_ident(c, "soft delete column")
        for c in self.sort_by_columns:
            check_ident(c, "sort column")
        self._check_consumed()
        if self.ingest.merge_join == "colocated" and not self.colocatable:
            raise ValueError(
                f"ingest.merge_join: colocated needs lake.partition_by to name key columns only "
                f"({self.lake_key}), not {self.lake.partition_by}: Spark joins partition by partition "
                "only on the join key; set merge_join: auto or shuffle, or partition by the key"
            )
        return self

    def _check_consumed(self) -> None:
        """The key and the sort columns must be consumed: the lake table is keyed and sorted by them."""
        fix = "add them to columns.include" if self.columns.include is not None else "remove them from columns.exclude"
        for what, cols in (("primary_key", self.primary_key), ("lake.sort_by", self.sort_by_columns)):
            left_out = [c for c in cols if not self.columns.consumes(c)]
            if left_out:
                raise ValueError(f"{what} column(s) {left_out} are not consumed (columns); {fix}")

    def consumed(self, names: list[str]) -> list[str]:
        """The names this table consumes, in their order: what the bootstrap reads, the ingest
        evolves and the publication's column list carries."""
        return [n for n in names if self.columns.consumes(n)]

    # --- derived names -------------------------------------------------------------
    @property
    def lake_name(self) -> str:
        return self.lake.name or self.name

    @property
    def current_table(self) -> str:
        return f"{self.lake.namespace}.{self.lake_name}"

    @property
    def changelog_table(self) -> str:
        return f"{self.lake.namespace}.{self.lake_name}__changelog"

    @property
    def history_table(self) -> str:
        return f"{self.lake.namespace}.{self.lake_name}__history"

    @property
    def latest_view(self) -> str:
        return f"{self.lake.namespace}.{self.lake_name}__latest"

    @property
    def lake_key(self) -> list[str]:
        """Keys are unique per shard; the lake key includes the shard."""
        return [SHARD_COL, *self.primary_key]

    @property
    def colocatable(self) -> bool:
        """Whether the MERGE can join partition by partition (ingest.merge_join): the table is
        partitioned by identity on key columns only, which the batch's staging table copies."""
        parts = self.lake.partition_by
        return bool(parts) and all(p in self.lake_key for p in parts)

    @property
    def sort_by_columns(self) -> list[str]:
        return list(self.lake.sort_by) if self.lake.sort_by else list(self.primary_key)

    @property
    def pool(self) -> str:
        """One Airflow pool slot per table: writers of a table never overlap."""
        return f"cdc_table__{self.name}"

    def shards(self) -> list[tuple[ShardGroup, str, str]]:
        """(group, schema, shard name) for every shard."""
        return [(g, s, shard_name(g, s)) for g in self.source.shards for s in g.schemas]

    def shards_on(self, endpoint_id: str) -> list[str]:
        """The names of the shards read through one endpoint (what its lost slot takes with it)."""
        return [shard for g, _, shard in self.shards() if g.endpoint_id == endpoint_id]

    def shard_map(self) -> dict[tuple[str, str], str]:
        """(endpoint, schema) -> shard name."""
        return {(g.endpoint_id, schema): shard for g, schema, shard in self.shards()}


@dataclass(frozen=True)
class ConfigError:
    file: str
    field: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.file}: field '{self.field}': {self.message}. Fix: {self.fix}"


@dataclass
class ConfigSet:
    tables: dict[str, TableConfig]
    errors: list[ConfigError]
    files: dict[str, str]  # table name -> file

    def endpoints(self) -> dict[str, list[tuple[TableConfig, ShardGroup]]]:
        """endpoint id -> the tables (and their shard group) captured through it."""
        out: dict[str, list[tuple[TableConfig, ShardGroup]]] = {}
        for t in self.tables.values():
            for g in t.source.shards:
                out.setdefault(g.endpoint_id, []).append((t, g))
        return out

    def endpoint_tables(self) -> dict[str, dict[str, tuple[list[str], list[str]]]]:
        """endpoint id -> source table -> (shard schemas of every config reading it, primary key)."""
        out: dict[str, dict[str, tuple[list[str], list[str]]]] = {}
        for endpoint, members in self.endpoints().items():
            tables = out.setdefault(endpoint, {})
            for t, g in members:
                schemas, _ = tables.get(t.source.table, ([], t.primary_key))
                tables[t.source.table] = (schemas + [s for s in g.schemas if s not in schemas], t.primary_key)
        return out

    def endpoint_column_types(self) -> dict[str, dict[str, dict[str, str]]]:
        """endpoint id -> source table -> column -> the lake type its configs read it as
        (column_types). Configs that read one column as two types (or one of them as its own
        type) get `string`: its values then land as text, which either type is cast from."""
        out: dict[str, dict[str, dict[str, str]]] = {}
        for endpoint, members in self.endpoints().items():
            readers: dict[str, list[dict[str, str]]] = {}
            for t, _ in members:
                readers.setdefault(t.source.table, []).append(t.column_types)
            out[endpoint] = {table: _agreed_types(types) for table, types in readers.items()}
        return out


def _agreed_types(column_types: list[dict[str, str]]) -> dict[str, str]:
    columns = {c for types in column_types for c in types}
    agreed = {c: {types.get(c) for types in column_types} for c in columns}
    return {c: (next(iter(ts)) or "string") if len(ts) == 1 else "string" for c, ts in agreed.items() if ts != {None}}


CONFIG_REFERENCE = "docs/configuration.md"


def _fix_for(loc: str, err: ErrorDetails) -> str:
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return f"remove '{loc}' or check its spelling against the configuration reference in {CONFIG_REFERENCE}"
    if kind == "missing":
        return f"add '{loc}'"
    if kind == "literal_error":
        return "use one of the values listed in the message"
    return f"correct the value as the message says (see the configuration reference in {CONFIG_REFERENCE})"


def validation_errors(exc: ValidationError, file: str, reference: str = CONFIG_REFERENCE) -> list[ConfigError]:
    """One ConfigError per pydantic error: the field's dotted path, the message (with the value
    given) and the fix; `reference` is the document that lists the fields."""
    errors = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = err["msg"].removeprefix("Value error, ")
        if "input" in err and err.get("type") not in ("missing",) and not isinstance(err["input"], dict):
            msg += f" (got {err['input']!r})"
        errors.append(ConfigError(file, loc, msg, _fix_for(loc, err).replace(CONFIG_REFERENCE, reference)))
    return errors


def parse_table_config(data: Any, file: str) -> tuple[TableConfig | None, list[ConfigError]]:
    if not isinstance(data, dict):
        return None, [
            ConfigError(file, "<root>", "the file is not a YAML mapping", "write `name: ...` etc. at top level")
        ]
    try:
        return TableConfig.model_validate(data), []
    except ValidationError as exc:
        return None, validation_errors(exc, file)
    except IdentifierError as exc:  # raised from model validators
        return None, [ConfigError(file, "<identifier>", str(exc), "rename it")]


def yaml_files(directory: str | Path, errors: list[ConfigError]) -> Iterator[tuple[str, Any]]:
    """(file, parsed YAML) of every *.yaml/*.yml under directory, sorted (none if it does not
    exist); a file that is not valid YAML becomes a ConfigError naming its line instead."""
    directory = Path(directory)
    for path in sorted(directory.glob("*.y*ml")) if directory.is_dir() else []:
        try:
            yield str(path), yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"line {mark.line + 1}" if mark else "<yaml>"
            problem = getattr(exc, "problem", None) or exc
            errors.append(ConfigError(str(path), where, f"not valid YAML: {problem}", "fix the YAML syntax"))


def load_table_configs(directory: str | Path) -> ConfigSet:
    """Every *.yaml under directory; errors are collected per file, never raised."""
    directory = Path(directory)
    tables: dict[str, TableConfig] = {}
    files: dict[str, str] = {}
    errors: list[ConfigError] = []
    for rel, data in yaml_files(directory, errors):
        cfg, errs = parse_table_config(data, rel)
        errors.extend(errs)
        if cfg is None:
            continue
        if cfg.name in tables:
            errors.append(
                ConfigError(
                    rel,
                    "name",
                    f"table {cfg.name!r} is already defined in {files[cfg.name]}",
                    "give each table a unique name",
                )
            )
            continue
        clash = _shared_source(cfg, tables)
        if clash:
            errors.append(
                ConfigError(
                    rel,
                    "source",
                    f"{clash[1]} is already read by table {clash[0]!r} ({files[clash[0]]})",
                    "read each source shard from one table config; split the shards between the configs or remove one",
                )
            )
            continue
        tables[cfg.name] = cfg
        files[cfg.name] = rel
    return ConfigSet(tables, errors, files)


def _shared_source(cfg: TableConfig, tables: dict[str, TableConfig]) -> tuple[str, str] | None:
    """(other table, what) when another config already reads one of cfg's source shards."""
    mine = {(g.endpoint_id, s, cfg.source.table) for g, s, _ in cfg.shards()}
    my_endpoints = {g.endpoint_id for g in cfg.source.shards}
    for other in tables.values():
        for g, s, _ in other.shards():
            if (g.endpoint_id, s, other.source.table) in mine:
                return other.name, f"source table {s}.{other.source.table} on endpoint {g.endpoint_id!r}"
            if (
                g.endpoint_id in my_endpoints
                and other.source.table == cfg.source.table
                and other.primary_key != cfg.primary_key
            ):
                return other.name, (
                    f"source table {other.source.table} on endpoint {g.endpoint_id!r} with another "
                    f"primary_key ({other.primary_key})"
                )
    return None


def load_table_config(path: str | Path) -> TableConfig:
    """One file; raises ValueError listing every problem (for CLIs and Spark jobs)."""
    path = Path(path)
    cfg, errors = parse_table_config(yaml.safe_load(path.read_text()), str(path))
    if errors:
        raise ValueError("\n".join(str(e) for e in errors))
    assert cfg is not None
    return cfg
