"""The MERGE that applies a reduced batch to the current table (hard or soft deletes, truncates):
its text (merge_sql), the statement that runs it (run_merge), the (LSN, seq) ordering
predicates, and the key ranges that bound a MERGE. The ingest, the chunked bootstrap, the
audit's repair and the quarantine replay run the same statement. Unchanged TOAST values never reach it: the batch is
filled before (ingest.ingest_table.fill_from_table), so the MERGE reads no TOAST column of the
table."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cdc_lakehouse.columns import COMMIT_TS_COL, LSN_COL, OP_COL, SEQ_COL, SHARD_COL
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.identifiers import spark_ident
from cdc_lakehouse.lake.commits import sql_with_commit_properties

if TYPE_CHECKING:
    from collections.abc import Sequence

    from pyspark.sql import Column, SparkSession


def run_merge(
    spark: SparkSession,
    cfg: TableConfig,
    target: str,
    source: str,
    columns: list[str],
    props: dict[str, str],
    truncated: Sequence[str] = (),
    within: str | None = None,
) -> None:
    """The statement: MERGE the reduced rows of `source` (a view or a staged table) into `target`
    (the current table, or a branch of it under lake.commits.fenced_commit), `props` on its
    snapshot. `columns` are the lake columns it writes; truncated and within: see merge_sql."""
    sql_with_commit_properties(spark, merge_sql(cfg, target, source, columns, list(truncated), within), props)


def merge_sql(
    cfg: TableConfig,
    target: str,
    view: str,
    columns: list[str],
    truncated: list[str],
    within: str | None = None,
) -> str:
    """within: a condition on the target's rows that every row the source can match meets
    (within_keys); the scan of the target is pruned to the files that may hold them. Not with
    `truncated`: NOT MATCHED BY SOURCE must see every row (Spark then prunes nothing anyway)."""
    if within and truncated:
        raise ValueError("merge_sql: a key range (within) and truncated shards do not go together")
    key = [SHARD_COL, *cfg.primary_key]
    on = " AND ".join(f"t.{spark_ident(k)} = s.{spark_ident(k)}" for k in key)
    if within:
        on += f" AND ({within})"
    newer = f"(s.{LSN_COL} > t.{LSN_COL} OR (s.{LSN_COL} = t.{LSN_COL} AND s.{SEQ_COL} > t.{SEQ_COL}))"
    sets = ", ".join(f"t.{spark_ident(c)} = s.{spark_ident(c)}" for c in columns)
    ins_cols = ", ".join(spark_ident(c) for c in columns)
    ins_vals = ", ".join(f"s.{spark_ident(c)}" for c in columns)
    insertable = f"s.{OP_COL} <> 'd'"
    trunc = ", ".join(f"'{s}'" for s in truncated)
    if cfg.deletes == "hard":
        sql = (
            f"MERGE INTO {target} t USING {view} s ON {on} "
            f"WHEN MATCHED AND {newer} AND s.{OP_COL} = 'd' THEN DELETE "
            f"WHEN MATCHED AND {newer} THEN UPDATE SET {sets} "
            f"WHEN NOT MATCHED AND {insertable} THEN INSERT ({ins_cols}) VALUES ({ins_vals})"
        )
        if truncated:
            sql += f" WHEN NOT MATCHED BY SOURCE AND t.{SHARD_COL} IN ({trunc}) THEN DELETE"
        return sql
    flag, ts = spark_ident(cfg.soft_delete_columns.flag), spark_ident(cfg.soft_delete_columns.timestamp)
    meta = (
        f"t.{OP_COL} = 'd', t.{LSN_COL} = s.{LSN_COL}, t.{SEQ_COL} = s.{SEQ_COL}, t.{COMMIT_TS_COL} = s.{COMMIT_TS_COL}"
    )
    sql = (
        f"MERGE INTO {target} t USING {view} s ON {on} "
        f"WHEN MATCHED AND {newer} AND s.{OP_COL} = 'd' THEN UPDATE SET t.{flag} = true, "
        f"t.{ts} = s.{COMMIT_TS_COL}, {meta} "
        f"WHEN MATCHED AND {newer} THEN UPDATE SET {sets}, t.{flag} = false, t.{ts} = NULL "
        f"WHEN NOT MATCHED AND {insertable} THEN INSERT ({ins_cols}, {flag}, {ts}) "
        f"VALUES ({ins_vals}, false, NULL)"
    )
    if truncated:
        sql += (
            f" WHEN NOT MATCHED BY SOURCE AND t.{SHARD_COL} IN ({trunc}) AND NOT t.{flag} THEN UPDATE SET "
            f"t.{flag} = true, t.{ts} = current_timestamp()"
        )
    return sql


def lsn_newer(lsn_a: Column, seq_a: Column, lsn_b: Column, seq_b: Column) -> Column:
    """(lsn_a, seq_a) > (lsn_b, seq_b)"""
    return (lsn_a > lsn_b) | ((lsn_a == lsn_b) & (seq_a > seq_b))


# --- a key range the target's scan is pruned with ----------------------------------------------------

_INTEGRAL = {"tinyint", "smallint", "int", "bigint"}
_DECIMAL = re.compile(r"decimal\(\d+,\d+\)")


def range_kind(spark_type: str) -> str | None:
    """How a key column's bounds are carried (KeyRange.lo/hi), or None: not bounded (float keys,
    binary, timestamp_ntz ...; the range then only narrows the other columns).
    'micros' and 'days' are exact integers, where a timestamp or date printed as text would
    depend on the session's time zone or calendar; 'text' is the value cast to string."""
    if spark_type == "timestamp":
        return "micros"
    if spark_type == "date":
        return "days"
    if spark_type in _INTEGRAL or spark_type == "string" or _DECIMAL.fullmatch(spark_type):
        return "text"
    return None


@dataclass(frozen=True)
class KeyRange:
    """One key column's lowest and highest value among one shard's source rows, as range_kind
    carries them (integers for micros and days, else text)."""

    column: str
    spark_type: str
    lo: int | str
    hi: int | str


def within_keys(ranges: dict[str, list[KeyRange]]) -> str | None:
    """The target rows the source rows can match: per shard, every bounded key column between
    the source's lowest and highest value of that shard; None for no shard (no range at all).
    Literals only, so the condition reaches the Iceberg scan as a filter and files outside the
    range are not read (a chunked bootstrap's round touches only its chunks' key range, not the
    table loaded so far). Values travel as integers or as hex (`X'..'`, UTF-8): a string literal
    would depend on the session's spark.sql.parser.escapedStringLiterals, and a bound read wrong
    would turn a match into a second row."""
    per_shard = []
    for shard, cols in sorted(ranges.items()):
        parts = [f"t.{spark_ident(SHARD_COL)} = {_text(shard)}"]
        for r in cols:
            c = f"t.{spark_ident(r.column)}"
            parts.append(f"{c} BETWEEN {_literal(r, r.lo)} AND {_literal(r, r.hi)}")
        per_shard.append("(" + " AND ".join(parts) + ")")
    return " OR ".join(per_shard) if per_shard else None


def _text(v: str) -> str:
    return f"CAST(X'{v.encode().hex()}' AS STRING)"


def _literal(r: KeyRange, v: int | str) -> str:
    match range_kind(r.spark_type):
        case "micros":
            return f"timestamp_micros({int(v)})"
        case "days":
            return f"date_from_unix_date({int(v)})"
        case "text" if r.spark_type in _INTEGRAL:
            return f"CAST({int(v)} AS {r.spark_type})"
        case "text" if r.spark_type == "string":
            return _text(str(v))
        case "text":
            return f"CAST({_text(str(v))} AS {r.spark_type})"  # decimal(p,s)
    raise ValueError(f"key column {r.column}: no range literal for type {r.spark_type}")
