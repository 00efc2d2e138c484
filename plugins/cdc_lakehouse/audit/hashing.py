"""audit.hashing: split out of audit.py."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from cdc_lakehouse.identifiers import pg_ident
from cdc_lakehouse.source.catalog import pg_text

if TYPE_CHECKING:
    from pyspark.sql import Column

SEP = "\x1f"
NULL = "\\N"


# --- canonical text of a value, in PostgreSQL and in Spark -------------------------------------
#
# Both sides must print every value the lake can hold identically, or the audit reports (and with
# repair on, "repairs" every hour) rows that are equal. Text renderings of floats and decimals
# differ between the two engines (scientific notation, 15 vs 17 digits, overflow of a fixed
# decimal), so floats compare by their IEEE bits and decimals in plain notation without trailing
# zeros. Infinite dates and timestamps (the lake cannot hold them) print as text instead of
# failing the query. Arrays compare element by element with the element's canonical form.


def pg_canonical(col: str, lake_type: str, pg_type: str = "") -> str:
    return f"coalesce({_pg_canon(pg_ident(col), lake_type, pg_type)}, E'\\\\N')"


# One return per lake type: each line is the canonical text of that type, read side by side with spark_canonical.
def _pg_canon(q: str, lake_type: str, pg_type: str) -> str:  # noqa: PLR0911
    t = lake_type.replace(" ", "")
    if t.startswith("array<"):
        elem = _pg_canon("u.e", t[6:-1], pg_type.removesuffix("[]"))
        return (
            f"CASE WHEN {q} IS NULL THEN NULL ELSE '[' || coalesce((SELECT string_agg(coalesce({elem}, "
            f"E'\\\\N'), ',' ORDER BY u.o) FROM unnest({q}) WITH ORDINALITY AS u(e, o)), '') || ']' END"
        )
    if t.startswith("decimal"):
        return f"trim_scale({q}::numeric)::text"
    if t == "double":
        return (
            f"CASE WHEN {q}::float8 = 'NaN'::float8 THEN 'NaN' "
            f"ELSE (('x' || encode(float8send({q}::float8), 'hex'))::bit(64)::bigint)::text END"
        )
    if t == "float":
        return (
            f"CASE WHEN {q}::float4 = 'NaN'::float4 THEN 'NaN' "
            f"ELSE (('x' || encode(float4send({q}::float4), 'hex'))::bit(32)::int)::text END"
        )
    if t == "date":
        return f"CASE WHEN isfinite({q}) THEN ({q} - date '1970-01-01')::text ELSE {q}::text END"
    if t in ("timestamp", "timestamp_ntz"):
        return f"CASE WHEN isfinite({q}) THEN (extract(epoch from {q}) * 1000000)::bigint::text ELSE {q}::text END"
    if t == "binary":
        return f"encode({q}, 'hex')"
    return pg_text(q, pg_type)


def spark_canonical(col: Column, lake_type: str) -> Column:
    from pyspark.sql import functions as F

    return F.coalesce(_spark_canon(col, lake_type), F.lit(NULL))


# One return per lake type: each line is the canonical text of that type, read side by side with pg_canonical.
def _spark_canon(col: Column, lake_type: str) -> Column:  # noqa: PLR0911
    from pyspark.sql import functions as F

    t = lake_type.replace(" ", "")
    if t.startswith("array<"):
        elem = t[6:-1]
        items = F.transform(col, lambda e: spark_canonical(e, elem))
        return F.when(col.isNotNull(), F.concat(F.lit("["), F.array_join(items, ","), F.lit("]")))
    m = re.match(r"^decimal\((\d+),(\d+)\)$", t)
    if m:
        # format_number prints the exact decimal in plain notation (cast to string may print 1E-18).
        e = F.regexp_replace(F.format_number(col, int(m.group(2))), ",", "")
        e = F.regexp_replace(F.regexp_replace(e, r"(\.[0-9]*[1-9])0+$", "$1"), r"\.0*$", "")
        return F.when(e == "-0", F.lit("0")).otherwise(e)
    if t in ("double", "float"):
        cls, fn = ("java.lang.Double", "doubleToLongBits") if t == "double" else ("java.lang.Float", "floatToIntBits")
        # reflect() cannot take NULL for a primitive argument: NULLs stay NULL before it.
        return (
            F.when(col.isNull(), F.lit(None).cast("string"))
            .when(F.isnan(col), F.lit("NaN"))
            .otherwise(F.reflect(F.lit(cls), F.lit(fn), col))
        )
    if t == "date":
        return F.datediff(col, F.lit("1970-01-01").cast("date")).cast("string")
    if t == "timestamp":
        return F.unix_micros(col).cast("string")
    if t == "timestamp_ntz":
        return F.unix_micros(col.cast("timestamp")).cast("string")
    if t == "binary":
        return F.lower(F.hex(col))
    return col.cast("string")


def pg_row_hash(columns: list[tuple[str, str]], pg_types: dict[str, str] | None = None) -> str:
    pg_types = pg_types or {}
    return "md5(concat_ws(chr(31), " + ", ".join(pg_canonical(c, t, pg_types.get(c, "")) for c, t in columns) + "))"


def spark_row_hash(columns: list[tuple[str, str]]) -> Column:
    from pyspark.sql import functions as F

    return F.md5(F.concat_ws(SEP, *[spark_canonical(F.col(c), t) for c, t in columns]))


def pg_bucket(key_cols: list[tuple[str, str]], buckets: int) -> str:
    k = "concat_ws(chr(31), " + ", ".join(pg_canonical(c, t) for c, t in key_cols) + ")"
    return f"((('x' || substr(md5({k}), 1, 7))::bit(28)::int) % {buckets})"


def spark_bucket(key_cols: list[tuple[str, str]], buckets: int) -> Column:
    from pyspark.sql import functions as F

    k = F.concat_ws(SEP, *[spark_canonical(F.col(c), t) for c, t in key_cols])
    return F.pmod(F.conv(F.substring(F.md5(k), 1, 7), 16, 10).cast("bigint"), F.lit(buckets)).cast("int")


def pg_hash_num(h: str) -> str:
    return f"(('x' || substr({h}, 1, 15))::bit(60)::bigint)"


def spark_hash_num(h: Column) -> Column:
    from pyspark.sql import functions as F

    return F.conv(F.substring(h, 1, 15), 16, 10).cast("decimal(38,0)")
