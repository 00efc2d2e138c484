"""ingest.merge: the MERGE that applies a reduced batch to the current table (hard or soft deletes,
truncates), and the (LSN, seq) ordering predicates. Unchanged TOAST values never reach it: the
batch is filled before (ingest.run.fill_from_table), so the MERGE reads no TOAST column of the
table."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cdc_lakehouse.config import COMMIT_TS_COL, LSN_COL, OP_COL, SEQ_COL, SHARD_COL, TableConfig
from cdc_lakehouse.identifiers import spark_ident

if TYPE_CHECKING:
    from pyspark.sql import Column


def merge_sql(
    cfg: TableConfig,
    target: str,
    view: str,
    columns: list[str],
    truncated: list[str],
) -> str:
    key = [SHARD_COL, *cfg.primary_key]
    on = " AND ".join(f"t.{spark_ident(k)} = s.{spark_ident(k)}" for k in key)
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
