"""Typed values where they enter: the snapshot's SELECT sends each column in its lake type, and
PostgreSQL itself checks that the value fits.

Before (issue #56), every value was selected as PostgreSQL's text (source.catalog.text_select) and
cast in Spark behind a regular-expression format guard (lake.casts.cast_text): at 10M rows the
casts cost about as much as the read (docs/benchmarks-history.md, "The snapshot bootstrap at 10M on Spark 4.1,
step by step": read 31-43 s, casts 24-34 s). Here a column whose PostgreSQL type has an exact lake
type is selected as that type, and the values the lake type cannot hold are found on the source
side with the same rules cast_text applies to their text:

  PostgreSQL type            lake type          does not fit (cast_text's guard would refuse it)
  smallint, integer, bigint  int, bigint        never
  boolean                    boolean            never
  real, double precision     float, double      never (NaN, +-Infinity, -0 and subnormals travel as bits)
  numeric[(p,s)]             decimal(P,S)       NaN, +-Infinity, |x| >= 10^(P-S), more than S decimals
  date                       date               +-infinity, BC, years after 9999
  timestamp with time zone   timestamp          +-infinity, BC, years after 9999 (printed in UTC)
  timestamp                  timestamp_ntz      +-infinity, BC, years after 9999
  bytea                      binary             never
  anything                   string             never (the text the change stream carries)

A value that does not fit is sent as NULL, and the row's `_cdc_misfit` column names it with the
message typed_rows has always raised ("column c: value '<text>' does not fit <type>"), its text
cut to 60 characters as before: the bootstrap still stops with the raw text and the reason, and
nothing becomes a silent NULL. Every other column (arrays, and column_types that change a type)
is selected as text and cast in Spark by cast_text, exactly as before.

Pure Python until `to_lake` is called (pyspark is imported there).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cdc_lakehouse.columns import SHARD_COL
from cdc_lakehouse.identifiers import pg_ident
from cdc_lakehouse.source.catalog import lake_type as natural_lake_type
from cdc_lakehouse.source.catalog import text_select

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

MISFIT_COL = "_cdc_misfit"
_DEC = re.compile(r"^decimal\((\d+),(\d+)\)$")
_PG_NUMERIC = re.compile(r"^numeric(?:\((\d+)(?:,(\d+))?\))?$")

# Lake type -> (the PostgreSQL type the value is sent as, the range its text prints with a 4-digit
# year AD: cast_text's guard accepts exactly these). Timestamps with time zone print in the
# session's TimeZone, which source.session fixes to UTC for every reader.
_TIME_RANGES = {
    "date": ("date", "'0001-01-01'::date", "'9999-12-31'::date", "<="),
    "timestamp": (
        "timestamptz",
        "'0001-01-01 00:00:00+00'::timestamptz",
        "'10000-01-01 00:00:00+00'::timestamptz",
        "<",
    ),
    "timestamp_ntz": ("timestamp", "'0001-01-01 00:00:00'::timestamp", "'10000-01-01 00:00:00'::timestamp", "<"),
}
_TIME_TYPES = {"date": "date", "timestamp with time zone": "timestamptz", "timestamp without time zone": "timestamp"}
_SAME = {
    ("smallint", "int"): "int4",
    ("integer", "int"): "int4",
    ("bigint", "bigint"): "int8",
    ("boolean", "boolean"): "bool",
    ("real", "float"): "float4",
    ("double precision", "double"): "float8",
    ("bytea", "binary"): "bytea",
}


@dataclass(frozen=True)
class ColumnRead:
    """How one column is selected and turned into its lake type.

    native: PostgreSQL sends the lake type's value (`value_sql`), NULL when it does not fit, and
    `fits_sql` (None: every value fits) says which; otherwise `value_sql` is the column's text and
    Spark casts it with cast_text."""

    name: str
    lake_type: str
    native: bool
    value_sql: str
    text_sql: str  # the value as the change stream prints it, for the "does not fit" message
    fits_sql: str | None = None

    def misfit_sql(self) -> str | None:
        """The message of a value that does not fit, NULL when it fits (or is NULL)."""
        if self.fits_sql is None:
            return None
        prefix = _pg_string(f"column {self.name}: value '")
        suffix = _pg_string(f"' does not fit {self.lake_type}")
        return f"CASE WHEN NOT ({self.fits_sql}) THEN {prefix} || left({self.text_sql}, 60) || {suffix} END"


@dataclass(frozen=True)
class TypedSelect:
    """The snapshot's select list: each column typed where PostgreSQL can send it so, and the
    row's `_cdc_misfit` message."""

    columns: tuple[ColumnRead, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @property
    def checks_on_source(self) -> bool:
        return any(c.fits_sql is not None for c in self.columns)

    def select_list(self) -> str:
        cols = [f"{c.value_sql} AS {pg_ident(c.name)}" for c in self.columns]
        misfits = [m for c in self.columns if (m := c.misfit_sql()) is not None]
        if misfits:
            cols.append(f"NULLIF(concat_ws('; ', {', '.join(misfits)}), '') AS {pg_ident(MISFIT_COL)}")
        return ", ".join(cols)

    def output_names(self) -> tuple[str, ...]:
        """The columns the select list returns, in order."""
        return (*self.names, MISFIT_COL) if self.checks_on_source else self.names

    def spark_types(self, numeric_as_text: bool = False) -> list[tuple[str, str]]:
        """(name, Spark type) of the selected columns as a reader delivers them. numeric_as_text:
        the reader hands numerics over as their text (ADBC: PostgreSQL's numeric is wider than
        Arrow's decimal128), cast by to_lake with no guard (they fit: PostgreSQL checked)."""
        out = []
        for c in self.columns:
            t = c.lake_type if c.native else "string"
            if numeric_as_text and _DEC.match(t):
                t = "string"
            out.append((c.name, t))
        if self.checks_on_source:
            out.append((MISFIT_COL, "string"))
        return out

    def lake_values(self, df: DataFrame) -> DataFrame:
        """The reader's columns in their lake types, the shard first, unchecked: a value that does
        not fit is NULL (the misfit column says which)."""
        from pyspark.sql import functions as F

        return df.select(F.col(SHARD_COL), *[typed.alias(c.name) for c, typed, _ in self._casts()])

    def to_lake(self, df: DataFrame, table: str, key: list[str]) -> DataFrame:
        """The reader's columns in their lake types, plus the shard; a value that does not fit
        stops the job with the message typed_rows has always raised (nothing written)."""
        from pyspark.sql import functions as F

        casts = self._casts()
        checks = ([F.col(MISFIT_COL)] if self.checks_on_source else []) + [m for _, _, m in casts if m is not None]
        problem = F.concat_ws("; ", *checks) if checks else F.lit("")
        keydesc = F.to_json(F.struct(*[F.col(k) for k in [SHARD_COL, *key]]))
        shard = F.when(
            problem != "",
            F.raise_error(
                F.concat(
                    F.lit(f"{table}: bootstrap stopped, nothing was written: row "),
                    keydesc,
                    F.lit(": "),
                    problem,
                    F.lit(". Set column_types in the table config to a type that holds these values."),
                )
            ),
        ).otherwise(F.col(SHARD_COL))
        # As in typed_rows: the check is part of the shard column, which every write keeps, so the
        # optimizer cannot prune it, and it sits in the one projection with the casts.
        return df.select(shard.alias(SHARD_COL), *[typed.alias(c.name) for c, typed, _ in casts])

    def _casts(self) -> list[tuple[ColumnRead, Column, Column | None]]:
        """Per column: its lake-typed value, and for text columns the message when it does not fit."""
        from pyspark.sql import functions as F

        from cdc_lakehouse.lake.casts import cast_text

        out: list[tuple[ColumnRead, Column, Column | None]] = []
        for c in self.columns:
            raw = F.col(c.name)
            if c.native:
                # A no-op where the reader delivered the lake type; numeric text -> decimal otherwise.
                out.append((c, raw.cast(c.lake_type), None))
                continue
            typed = cast_text(raw, c.lake_type)
            message = F.concat(
                F.lit(f"column {c.name}: value '"), F.substring(raw, 1, 60), F.lit(f"' does not fit {c.lake_type}")
            )
            out.append((c, typed, F.when(typed.isNull() & raw.isNotNull(), message)))
        return out


def _pg_string(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def column_read(name: str, pg_type: str, lake_type: str) -> ColumnRead:
    """One column's read: typed when its PostgreSQL type maps exactly onto lake_type (the table
    above), its text otherwise."""
    q = pg_ident(name)
    text = text_select(name, pg_type, lake_type)
    lt = lake_type.replace(" ", "")
    if lt == "string":
        return ColumnRead(name, lake_type, True, text, text)
    if natural_lake_type(pg_type) is None:
        return ColumnRead(name, lake_type, False, text, text)  # a domain, an enum, an array: as text
    base = re.sub(r"\(\d+\)$", "", pg_type.strip())
    same = _SAME.get((base, lt))
    if same is not None:
        # Cast to the lake type's width: smallint travels as integer, which the lake's int is.
        return ColumnRead(name, lake_type, True, q if base != "smallint" else f"{q}::int4", text)
    dec = _DEC.match(lt)
    num = _PG_NUMERIC.match(pg_type.strip())
    if dec and num:
        return _numeric_read(name, q, text, lake_type, (int(dec.group(1)), int(dec.group(2))), num)
    time_type = _TIME_TYPES.get(re.sub(r"\(\d\)", "", base))
    if lt in _TIME_RANGES and _TIME_RANGES[lt][0] == time_type:
        _, lo, hi, op = _TIME_RANGES[lt]
        fits = f"{q} >= {lo} AND {q} {op} {hi}"
        return ColumnRead(name, lake_type, True, f"CASE WHEN {fits} THEN {q} END", text, fits)
    return ColumnRead(name, lake_type, False, text, text)


def _numeric_read(name: str, q: str, text: str, lake_type: str, ps: tuple[int, int], num: re.Match) -> ColumnRead:
    """numeric -> decimal(P,S): fits when finite, below 10^(P-S) in magnitude and with at most S
    decimals (trailing zeros aside), the values cast_text's guard accepts."""
    p, s = ps
    src_p = int(num.group(1)) if num.group(1) else None
    src_s = int(num.group(2) or 0) if src_p is not None else None
    if src_p is not None and src_s is not None and src_s <= s and src_p - src_s <= p - s:
        # The column's own precision and scale fit: only NaN can be out (a constrained numeric
        # holds no infinity).
        fits = f"{q} <> 'NaN'::numeric"
    else:
        # NaN and +-Infinity compare above every number, so the magnitude test refuses them too.
        fits = f"abs({q}) < 1e{p - s} AND {q} = round({q}, {s})"
    value = f"(CASE WHEN {fits} THEN {q} END)::numeric({p},{s})"
    return ColumnRead(name, lake_type, True, value, text, fits)


def typed_select(columns: list[tuple[str, str]], pg_types: dict[str, str] | None) -> TypedSelect:
    """The select list of (name, lake type) columns whose PostgreSQL types are pg_types."""
    pg_types = pg_types or {}
    return TypedSelect(tuple(column_read(n, pg_types.get(n, ""), t) for n, t in columns))


def text_columns(columns: list[tuple[str, str]]) -> TypedSelect:
    """Columns a reader hands over as text (the chunked mode's CSV): every one cast by cast_text."""
    return TypedSelect(tuple(ColumnRead(n, t, False, "", "") for n, t in columns))
