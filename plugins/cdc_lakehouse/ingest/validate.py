"""Landing events -> validated, typed change events (pure DataFrame -> DataFrame functions).

Values arrive typed where they entered (format 2), or as PostgreSQL text cast behind a format
guard (format 1): ingest.landed reads either. A value that does not fit gives the event a reason,
and events with reasons go to quarantine instead of the lake.

Ordering: events are ordered by (commit LSN, sequence in the transaction). The lake's
`_cdc_seq` is 2*seq, or 2*seq+1 for the second half of a primary-key change, which becomes a
delete of the old key followed by an upsert of the new one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cdc_lakehouse.columns import (
    COMMIT_TS_COL,
    LSN_COL,
    LSN_EVENT_COL,
    OP_COL,
    RUN_COL,
    SHARD_COL,
    UNAVAILABLE_COL,
    XID_COL,
)
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.ingest.landed import Images, Landed, images_of

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
    landed: Landed | DataFrame,
    cfg: TableConfig,
    lake_columns: list[tuple[str, str]],
    shard_map: dict[tuple[str, str], str],
) -> DataFrame:
    """Landing rows -> one row per event: shard, typed source columns, metadata, reasons, raw.

    `landed` is the batch's files (ingest.landed), or format-1 rows built elsewhere (a quarantined
    payload). `lake_columns` are the current table's source columns (name, Spark type). Columns
    an event does not carry (added later, or dropped at the source under a keep_null policy) are
    NULL; unchanged TOAST columns are NULL and listed in `_cdc_unavailable`.
    """
    from functools import reduce

    if not isinstance(landed, Landed):
        landed = Landed.of(landed)
    frames = [_typed_frame(images_of(f, landed), cfg.primary_key, lake_columns, shard_map) for f in landed.frames]
    return reduce(lambda a, b: a.unionByName(b), frames)


def _typed_frame(
    images: Images, pk: list[str], lake_columns: list[tuple[str, str]], shard_map: dict[tuple[str, str], str]
) -> DataFrame:
    """One frame's events typed (the format's Images), with the reasons they are malformed; the raw
    payload and file are kept only for those (quarantine), cheap for the rest."""
    from pyspark.sql import functions as F

    op = F.col("op")
    cols, reasons = _typed_columns(images, pk, lake_columns)
    unavailable = F.array_intersect(F.col("unavailable"), F.array(*[F.lit(c) for c, _ in lake_columns]))
    # array_compact, not filter(.., lambda): a lambda keeps the whole projection interpreted
    # (no code generation), 2.5 s of 3.6 s for 200k typed events (bench/ingest_bench.py, 2M).
    reason_arr = F.array_compact(F.array(*reasons))
    bad = F.size(reason_arr) > 0
    # The raw payload and the file are kept only for malformed events (quarantine): under `bad`,
    # Spark evaluates them for those rows only (a typed frame's payload writes every value as text).
    # The file is a column of the scan, not input_file_name(), where the frame was read from files.
    file_name = F.col("_metadata.file_path") if images.frame.from_files else F.input_file_name()
    return images.frame.rows.select(
        shard_expr(shard_map).alias(SHARD_COL),
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
        F.when(bad, images.payload()).alias(RAW),
        F.when(bad, file_name).alias(FILE),
    )


def _typed_columns(
    images: Images, pk: list[str], lake_columns: list[tuple[str, str]]
) -> tuple[dict[str, Column], list[Column]]:
    """The typed value of every column (and of the before-image key) and the reasons an event is
    malformed (NULL where it is not)."""
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
        F.when(is_upsert & ~images.present("after"), F.lit("missing after image")),
        F.when((op == "d") & ~images.present("before"), F.lit("missing before image")),
    ]
    cols: dict[str, Column] = {}
    for name, typ in lake_columns:
        cols[name], reason = images.value(name, typ)
        if reason is not None:
            reasons.append(reason)
    for k in pk:
        reasons.append(
            F.when(
                (is_upsert & ~images.has_key("after", k)) | ((op == "d") & ~images.has_key("before", k)),
                F.lit(f"missing key column {k}"),
            )
        )
        bk, bk_reason = images.value(k, types[k], "old_key")
        cols[BKEY + k] = bk
        if bk_reason is not None:
            reasons.append(F.when(bk_reason.isNotNull(), F.lit(f"before image key column {k} does not fit {types[k]}")))
    return cols, reasons
