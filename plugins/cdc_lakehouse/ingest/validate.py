"""Landing events -> validated, typed change events (pure DataFrame -> DataFrame functions).

Values arrive as PostgreSQL text. Each is cast to its lake type behind a format guard,
because Spark's casts silently truncate ('1.5' -> 1), round (1.239 -> 1.24 for
decimal(10,2)) or drop a ' BC' suffix from dates. A value that does not fit gives the event
a reason, and events with reasons go to quarantine instead of the lake.

Ordering: events are ordered by (commit LSN, sequence in the transaction). The lake's
`_cdc_seq` is 2*seq, or 2*seq+1 for the second half of a primary-key change, which becomes a
delete of the old key followed by an upsert of the new one.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from cdc_lakehouse.config import COMMIT_TS_COL, LSN_COL, OP_COL, SHARD_COL, TableConfig
from cdc_lakehouse.lake.columns import LSN_EVENT_COL, RUN_COL, UNAVAILABLE_COL, XID_COL
from cdc_lakehouse.landing.format import EVENT_SCHEMA, EventField

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

VALID_OPS = ("c", "u", "d", "r", "t")
REASONS = "_reasons"
RAW = "_raw"
FILE = "_file"
BKEY = "_bkey_"  # prefix of the before-image key columns (primary-key changes)
PKCHANGE = "_pk_change"


def _spark_type(f: EventField):
    from pyspark.sql import types as T

    if f.type == "struct":
        return T.StructType([T.StructField(c.name, _spark_type(c)) for c in f.fields])
    return {
        "string": T.StringType,
        "int64": T.LongType,
        "timestamp": T.TimestampType,
        "map<string,string>": lambda: T.MapType(T.StringType(), T.StringType()),
        "list<string>": lambda: T.ArrayType(T.StringType()),
    }[f.type]()


def landing_spark_schema():
    """The Spark schema of a landing file, from the one event schema (landing.format.EVENT_SCHEMA)."""
    from pyspark.sql.types import StructField, StructType

    return StructType([StructField(f.name, _spark_type(f)) for f in EVENT_SCHEMA])


_DEC = re.compile(r"^decimal\((\d+),\s*(\d+)\)$")


# One return per lake type: the cast of PostgreSQL text to that type.
def cast_text(raw: Column, lake_type: str) -> Column:  # noqa: PLR0911
    """PostgreSQL text -> lake type; NULL when the text does not fit (callers check)."""
    from pyspark.sql import functions as F

    t = lake_type.replace(" ", "")
    if t in ("bigint", "int", "smallint", "tinyint"):
        return F.when(raw.rlike(r"^-?[0-9]+$"), raw.cast(t))
    if t == "boolean":
        return F.when(raw.isin("t", "true"), F.lit(True)).when(raw.isin("f", "false"), F.lit(False))
    m = _DEC.match(t)
    if m:
        p, s = int(m.group(1)), int(m.group(2))
        # Trailing zeros beyond the scale are harmless (unconstrained numeric prints them).
        trimmed = F.regexp_replace(F.regexp_replace(raw, r"(\.[0-9]*?)0+$", "$1"), r"\.$", "")
        int_digits = f"(0|[0-9]{{1,{p - s}}})" if p > s else "0"
        frac = rf"(\.[0-9]{{1,{s}}})?" if s > 0 else ""
        return F.when(trimmed.rlike(rf"^-?{int_digits}{frac}$"), trimmed.cast(t))
    if t in ("float", "double"):
        return F.when(raw.rlike(r"^(-?[0-9.]+([eE][-+]?[0-9]+)?|NaN|-?Infinity)$"), raw.cast(t))
    if t == "string":
        return raw
    if t == "date":
        return F.when(raw.rlike(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$"), F.to_date(raw))
    if t == "timestamp":
        return F.when(
            raw.rlike(
                r"^[0-9]{4}-[0-9]{2}-[0-9]{2}[ T][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?([+-][0-9]{2}(:?[0-9]{2}){0,2}|Z)?$"
            ),
            raw.cast("timestamp"),
        )
    if t == "timestamp_ntz":
        return F.when(
            raw.rlike(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}[ T][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?$"),
            raw.cast("timestamp_ntz"),
        )
    if t == "binary":
        return F.when(raw.rlike(r"^\\x([0-9a-fA-F]{2})*$"), F.unhex(F.substring(raw, 3, 1 << 30)))
    if t.startswith("array<") and t.endswith(">"):
        elem = t[6:-1]
        arr = F.from_json(raw, "array<string>")
        if elem == "string":
            return arr
        typed = F.transform(arr, lambda x: cast_text(x, elem))
        ok = F.forall(F.arrays_zip(arr.alias("a"), typed.alias("b")), lambda z: z["a"].isNull() | z["b"].isNotNull())
        return F.when(ok, typed)
    raise ValueError(f"no cast for lake type {lake_type!r}")


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
