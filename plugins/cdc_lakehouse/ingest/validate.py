"""Landing events -> validated, typed change events (pure DataFrame -> DataFrame functions).

Values arrive as PostgreSQL text. Each is cast to its lake type behind a format guard
(lake.casts). A value that does not fit gives the event a reason, and events with reasons go to
quarantine instead of the lake.

Ordering: events are ordered by (commit LSN, sequence in the transaction). The lake's
`_cdc_seq` is 2*seq, or 2*seq+1 for the second half of a primary-key change, which becomes a
delete of the old key followed by an upsert of the new one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cdc_lakehouse.config import COMMIT_TS_COL, LSN_COL, OP_COL, SHARD_COL, TableConfig
from cdc_lakehouse.lake.casts import cast_text
from cdc_lakehouse.lake.columns import LSN_EVENT_COL, RUN_COL, UNAVAILABLE_COL, XID_COL

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

VALID_OPS = ("c", "u", "d", "r", "t")
REASONS = "_reasons"
RAW = "_raw"
FILE = "_file"
BKEY = "_bkey_"  # prefix of the before-image key columns (primary-key changes)
PKCHANGE = "_pk_change"


def shard_expr(shard_map: dict[tuple[str, str], str]) -> Column:
    """(endpoint, schema) -> shard name, NULL for shards outside the table's config."""
    from pyspark.sql import functions as F

    pairs = []
    for (endpoint, schema), shard in sorted(shard_map.items()):
        pairs += [F.lit(f"{endpoint}/{schema}"), F.lit(shard)]
    m = F.create_map(*pairs)
    return m[F.concat_ws("/", F.col("source.endpoint"), F.col("source.schema"))]


def typed_events(
    df: DataFrame, cfg: TableConfig, lake_columns: list[tuple[str, str]], shard_map: dict[tuple[str, str], str]
) -> DataFrame:
    """Landing rows -> one row per event: shard, typed source columns, metadata, reasons, raw.

    `lake_columns` are the current table's source columns (name, Spark type). Columns an
    event does not carry (added later, or dropped at the source under a keep_null policy)
    are NULL; unchanged TOAST columns are NULL and listed in `_cdc_unavailable`.
    """
    from pyspark.sql import functions as F

    stage = _raw_stage(df, cfg.primary_key, lake_columns)
    op = F.col("op")
    cols, reasons = _typed_columns(cfg.primary_key, lake_columns)
    shard = shard_expr(shard_map)
    reason_arr = F.filter(F.array(*reasons), lambda x: x.isNotNull())
    unavailable = F.array_intersect(F.col("unavailable"), F.array(*[F.lit(c) for c, _ in lake_columns]))
    # Step 2: typed values and reasons; step 3: the raw payload and file, kept only for malformed
    # events (quarantine), cheap for the rest.
    typed_df = stage.select(
        shard.alias(SHARD_COL),
        *[c.alias(n) for n, c in cols.items()],
        F.when(op == "r", F.lit("c")).otherwise(op).alias(OP_COL),
        F.col("source.commit_lsn").alias(LSN_COL),
        F.col("source.seq").alias("_seq_raw"),
        F.col("source.commit_ts").alias(COMMIT_TS_COL),
        F.col("source.lsn").alias(LSN_EVENT_COL),
        F.col("source.xid").alias(XID_COL),
        # Only the lake's columns: an unconsumed column (config `columns:`) the source left
        # unchanged is none of the table's business.
        F.when(F.size(unavailable) > 0, unavailable).alias(UNAVAILABLE_COL),
        F.col("run_id").alias(RUN_COL),
        reason_arr.alias(REASONS),
        F.struct("op", "before", "after", "unavailable", "source", "run_id").alias("_event"),
    )
    bad = F.size(REASONS) > 0
    return (
        typed_df.withColumn(RAW, F.when(bad, F.to_json("_event")))
        .withColumn(FILE, F.when(bad, F.input_file_name()))
        .drop("_event")
    )


def _raw_stage(df: DataFrame, pk: list[str], lake_columns: list[tuple[str, str]]) -> DataFrame:
    """Step 1: each column's raw text once (after image for upserts, before image for deletes), so
    the casts and checks reference columns instead of repeating the lookups."""
    from pyspark.sql import functions as F

    op = F.col("op")
    is_upsert = op.isin("c", "u", "r")
    raw_cols = [
        F.when(is_upsert, F.col("after")[c]).when(op == "d", F.col("before")[c]).alias(f"_r_{c}")
        for c, _ in lake_columns
    ]
    bkey_raw = [F.when(op == "u", F.col("before")[k]).alias(f"_rb_{k}") for k in pk]
    return df.select(
        "op",
        "before",
        "after",
        "unavailable",
        "source",
        "run_id",
        *raw_cols,
        *bkey_raw,
        *[F.col("after")[k].alias(f"_ak_{k}") for k in pk],
        *[F.col("before")[k].alias(f"_bk_{k}") for k in pk],
    )


def _typed_columns(pk: list[str], lake_columns: list[tuple[str, str]]) -> tuple[dict[str, Column], list[Column]]:
    """The typed value of every column (and of the before-image key) over _raw_stage's columns, and
    the reasons an event is malformed (NULL where it is not)."""
    from pyspark.sql import functions as F

    types = dict(lake_columns)
    op = F.col("op")
    is_upsert = op.isin("c", "u", "r")
    reasons = [
        F.when(
            ~op.isin(*VALID_OPS) | op.isNull(),
            F.concat(F.lit("unknown op '"), F.coalesce(op, F.lit("null")), F.lit("'")),
        ),
        F.when(
            F.col("source.commit_lsn").isNull() | F.col("source.seq").isNull(),
            F.lit("missing source position (commit_lsn/seq)"),
        ),
        F.when(is_upsert & F.col("after").isNull(), F.lit("missing after image")),
        F.when((op == "d") & F.col("before").isNull(), F.lit("missing before image")),
    ]
    cols: dict[str, Column] = {}
    for name, typ in lake_columns:
        raw = F.col(f"_r_{name}")
        typed = cast_text(raw, typ)
        cols[name] = typed
        if typ != "string":
            reasons.append(
                F.when(
                    raw.isNotNull() & typed.isNull(),
                    F.concat(F.lit(f"column {name}: value '"), F.substring(raw, 1, 80), F.lit(f"' does not fit {typ}")),
                )
            )
    for k in pk:
        reasons.append(
            F.when(
                (is_upsert & F.col(f"_ak_{k}").isNull()) | ((op == "d") & F.col(f"_bk_{k}").isNull()),
                F.lit(f"missing key column {k}"),
            )
        )
        bk = cast_text(F.col(f"_rb_{k}"), types[k])
        cols[BKEY + k] = bk
        reasons.append(
            F.when(
                F.col(f"_rb_{k}").isNotNull() & bk.isNull(),
                F.lit(f"before image key column {k} does not fit {types[k]}"),
            )
        )
    return cols, reasons
