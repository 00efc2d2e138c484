"""The `_cdc_*` metadata columns: one registry, the definition every other spelling derives from.

Like Iceberg's `MetadataColumns`: each column has its name, its type (as Spark SQL spells it in
DDL, and as Iceberg stores it), a one-line meaning, and the tables that carry it: the current
table, the changelog, and (under another name) the quarantine meta table. Lake DDL
(lake.tables), the latest-per-key view (views) and the ingest read names and types from here;
`cdc_lakehouse.config` re-exports the names it always had (SHARD_COL, LSN_COL, ...).

Pure Python, no Spark import: DAG files reach it at parse time through config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

META_PREFIX = "_cdc_"  # reserved: source columns may not use it

# Final: each name then has its literal type, so it is a TableKind where one is expected.
CURRENT: Final = "current"
CHANGELOG: Final = "changelog"
QUARANTINE: Final = "quarantine"
HISTORY: Final = "history"
TableKind = Literal["current", "changelog", "quarantine", "history"]


@dataclass(frozen=True)
class MetadataColumn:
    name: str
    type: str  # Spark SQL DDL type
    iceberg_type: str  # the Iceberg type the column has in the table's schema
    doc: str
    tables: frozenset[str]  # CURRENT / CHANGELOG: carried under `name`
    leading: bool = False  # placed before the source columns (else after them)
    quarantine: str | None = None  # its name in the quarantine meta table, when that carries it

    def carried_by(self, table: TableKind) -> bool:
        return self.quarantine is not None if table == QUARANTINE else table in self.tables

    def ddl(self) -> tuple[str, str]:
        return self.name, self.type


_BOTH = frozenset({CURRENT, CHANGELOG})
_CL = frozenset({CHANGELOG})
_HIST = frozenset({HISTORY})

SHARD = MetadataColumn(
    "_cdc_shard",
    "string",
    "string",
    "the source shard (schema, or database.schema); part of every lake key",
    _BOTH | _HIST,
    leading=True,
    quarantine="shard",
)
OP = MetadataColumn(
    "_cdc_op",
    "string",
    "string",
    "the change behind the row: c insert, u update, d delete (soft deletes), r snapshot; changelog also t "
    "truncate; a history version: the change that opened it",
    _BOTH | _HIST,
)
COMMIT_LSN = MetadataColumn(
    "_cdc_commit_lsn",
    "bigint",
    "long",
    "LSN of the source transaction's commit; with _cdc_seq the order in which changes apply",
    _BOTH,
    quarantine="commit_lsn",
)
SEQ = MetadataColumn(
    "_cdc_seq",
    "bigint",
    "long",
    "order within the transaction: 2*seq, 2*seq+1 for the upsert half of a key change "
    "(the quarantine's `seq` is the source's seq itself)",
    _BOTH,
)
COMMIT_TS = MetadataColumn(
    "_cdc_commit_ts",
    "timestamp",
    "timestamptz",
    "commit time of the source transaction (the changelog is partitioned by its day)",
    _BOTH,
)
LSN_EVENT = MetadataColumn("_cdc_lsn", "bigint", "long", "LSN of the change itself", _CL)
XID = MetadataColumn("_cdc_xid", "bigint", "long", "source transaction id (NULL for snapshot rows)", _CL)
UNAVAILABLE = MetadataColumn(
    "_cdc_unavailable",
    "array<string>",
    "list<string>",
    "unchanged TOAST columns the event did not carry (not NULL at the source)",
    _CL,
)
RUN_ID = MetadataColumn(
    "_cdc_run_id",
    "string",
    "string",
    "the capture run that landed the event (bootstrap-<run> / repair runs for their rows)",
    _CL,
    quarantine="landing_run",
)
INGESTED_AT = MetadataColumn(
    "_cdc_ingested_at", "timestamp", "timestamptz", "when the ingest wrote the changelog row", _CL
)
# A history table's versions (history.versions; docs/history-tables.md): one row per state of a key
# that a source transaction left, valid from its commit to the commit that changed or removed it.
VALID_FROM_LSN = MetadataColumn(
    "_cdc_valid_from_lsn", "bigint", "long", "commit LSN of the transaction that made this version", _HIST
)
VALID_FROM = MetadataColumn("_cdc_valid_from", "timestamp", "timestamptz", "commit time of that transaction", _HIST)
VALID_TO_LSN = MetadataColumn(
    "_cdc_valid_to_lsn",
    "bigint",
    "long",
    "commit LSN of the transaction that changed or removed the row (NULL: the version is current)",
    _HIST,
)
VALID_TO = MetadataColumn("_cdc_valid_to", "timestamp", "timestamptz", "commit time of that transaction", _HIST)
IS_CURRENT = MetadataColumn("_cdc_is_current", "boolean", "boolean", "the key's live version now", _HIST)
MOVED_FROM = MetadataColumn(
    "_cdc_moved_from",
    "string",
    "string",
    "a primary-key change opened this version: the old key, as JSON of its key columns",
    _HIST,
)
MOVED_TO = MetadataColumn(
    "_cdc_moved_to",
    "string",
    "string",
    "a primary-key change closed this version: the new key, as JSON of its key columns",
    _HIST,
)

# In table order: leading columns, then (after the source columns) the rest.
METADATA_COLUMNS: tuple[MetadataColumn, ...] = (
    SHARD,
    OP,
    COMMIT_LSN,
    SEQ,
    COMMIT_TS,
    LSN_EVENT,
    XID,
    UNAVAILABLE,
    RUN_ID,
    INGESTED_AT,
    VALID_FROM_LSN,
    VALID_FROM,
    VALID_TO_LSN,
    VALID_TO,
    IS_CURRENT,
    MOVED_FROM,
    MOVED_TO,
)
BY_NAME: dict[str, MetadataColumn] = {c.name: c for c in METADATA_COLUMNS}
METADATA_NAMES: frozenset[str] = frozenset(BY_NAME)


def columns_of(table: TableKind, *, leading: bool | None = None) -> list[MetadataColumn]:
    """The metadata columns a table carries, in table order (leading=True/False: one side only)."""
    return [c for c in METADATA_COLUMNS if c.carried_by(table) and (leading is None or c.leading == leading)]


def ddl_of(table: TableKind, *, leading: bool | None = None) -> list[tuple[str, str]]:
    """(name, Spark type) of columns_of(...)."""
    return [c.ddl() for c in columns_of(table, leading=leading)]


def names_of(table: TableKind, *, leading: bool | None = None) -> list[str]:
    return [c.name for c in columns_of(table, leading=leading)]


# The names modules import today (config re-exports the first five).
SHARD_COL = SHARD.name
OP_COL = OP.name
LSN_COL = COMMIT_LSN.name
SEQ_COL = SEQ.name
COMMIT_TS_COL = COMMIT_TS.name
LSN_EVENT_COL = LSN_EVENT.name
XID_COL = XID.name
UNAVAILABLE_COL = UNAVAILABLE.name
RUN_COL = RUN_ID.name
INGESTED_COL = INGESTED_AT.name
VALID_FROM_LSN_COL = VALID_FROM_LSN.name
VALID_FROM_COL = VALID_FROM.name
VALID_TO_LSN_COL = VALID_TO_LSN.name
VALID_TO_COL = VALID_TO.name
IS_CURRENT_COL = IS_CURRENT.name
MOVED_FROM_COL = MOVED_FROM.name
MOVED_TO_COL = MOVED_TO.name
