"""PostgreSQL text -> lake types: the one cast every reader of source text uses.

Change events (ingest.validate), snapshot rows (bootstrap.snapshot), backfilled columns
(ingest.backfill), replayed quarantine keys (ingest.quarantine) and the audit's source reads
(audit.compare, inflight, repair) all carry values as PostgreSQL prints them. Each is cast behind a
format guard, because Spark's casts silently truncate ('1.5' -> 1), round (1.239 -> 1.24 for
decimal(10,2)) or drop a ' BC' suffix from dates: a value that does not fit becomes NULL, and the
caller decides what that means (a quarantine reason, a mismatch).

Pure Python until called: pyspark is imported inside the function.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import Column

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
