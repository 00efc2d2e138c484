"""landing.values: PostgreSQL text -> Arrow arrays of the lake's types, where values enter (the capture).

pgoutput sends every value as its type's text output (DateStyle ISO, TimeZone UTC: source.session).
The capture types each column once per row group, in bulk: pyarrow's casts parse a whole column
in C++ (issue #56: typing in the ingest was a pattern check and a Spark cast per value, about 14 us
per event). A cast that fails for some values is split in halves until the values that fail are
found; those become NULL in the typed column and are returned as misfits (row -> their text), which
the writer keeps beside the image (landing.format, `after_raw`): the ingest quarantines them with
their text and a reason, never a silent NULL.

What fits is what the ingest's text casts accepted (lake.casts.cast_text): integers without a
sign or spaces, decimals without loss of scale or precision, 't'/'f' booleans, ISO dates and
timestamps of years 1-9999 (never 'infinity' or BC), '\\x' hex for bytea, one-dimensional arrays
whose every element fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from cdc_lakehouse.landing.format import arrow_type
from cdc_lakehouse.source.pgoutput import parse_pg_array

if TYPE_CHECKING:
    import pyarrow as pa

Texts = Sequence[str | None]
Misfits = dict[int, str]  # row -> the value's text


def typed_column(texts: Texts, lake_type: str | None) -> tuple[pa.Array, Misfits]:
    """One column's texts as an Arrow array of `lake_type` (text for a column without one:
    column_types decides in the ingest), and the values that did not fit."""
    import pyarrow as pa

    t = (lake_type or "string").replace(" ", "")
    if t == "string":
        return pa.array(texts, pa.string()), {}
    if t.startswith("array<"):
        return _array_column(texts, t[6:-1])
    if t == "boolean":
        return _boolean_column(texts)
    if t == "binary":
        return _binary_column(texts)
    text = pa.array(texts, pa.string())
    typ = arrow_type(t)
    if pa.types.is_decimal(typ):
        return _decimal_column(text, typ)
    return _cast_column(text, typ)


def _decimal_column(text: pa.Array, typ: pa.Decimal128Type) -> tuple[pa.Array, Misfits]:
    """numeric -> decimal(p,s): digits checked first (at most p-s before the point, at most s
    after it once trailing zeros go), then cast. pyarrow 21's cast alone is not enough: a value
    whose rescaled digits overflow 128 bits came back as another number, without an error
    ('1' followed by 30 zeros into decimal(38,18) gave 18960114910927365649.47...)."""
    import pyarrow.compute as pc

    whole = f"(0|[1-9][0-9]{{0,{typ.precision - typ.scale - 1}}})" if typ.precision > typ.scale else "0"
    fraction = rf"(\.[0-9]{{0,{typ.scale}}}0*)?" if typ.scale else r"(\.0*)?"
    fits = pc.fill_null(pc.match_substring_regex(text, f"^-?{whole}{fraction}$"), True)
    misfits: Misfits = {i: v for i, v in enumerate(pc.if_else(fits, None, text).to_pylist()) if v is not None}
    casted, more = _cast_column(pc.if_else(fits, text, None), typ)
    return casted, {**misfits, **more}


def _cast_column(text: pa.Array, typ: pa.DataType) -> tuple[pa.Array, Misfits]:
    """pyarrow's cast of the whole column; where it fails, the halves, down to the failing values."""
    import pyarrow as pa

    pieces: list[pa.Array] = []
    misfits: Misfits = {}

    def cast(offset: int, part: pa.Array) -> None:
        try:
            pieces.append(part.cast(typ))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            if len(part) == 1:
                misfits[offset] = part[0].as_py()
                pieces.append(pa.nulls(1, typ))
                return
            half = len(part) // 2
            cast(offset, part.slice(0, half))
            cast(offset + half, part.slice(half))

    cast(0, text)
    return (pieces[0] if len(pieces) == 1 else pa.concat_arrays(pieces)), misfits


def _boolean_column(texts: Texts) -> tuple[pa.Array, Misfits]:
    import pyarrow as pa

    known = {"t": True, "f": False, "true": True, "false": False}
    values: list[bool | None] = []
    misfits: Misfits = {}
    for i, v in enumerate(texts):
        b = known.get(v) if v is not None else None
        if v is not None and b is None:
            misfits[i] = v
        values.append(b)
    return pa.array(values, pa.bool_()), misfits


def _binary_column(texts: Texts) -> tuple[pa.Array, Misfits]:
    """bytea's hex output ('\\x0a1b')."""
    import pyarrow as pa

    values: list[bytes | None] = []
    misfits: Misfits = {}
    for i, v in enumerate(texts):
        if v is None:
            values.append(None)
            continue
        try:
            if not v.startswith("\\x"):
                raise ValueError(v)
            values.append(bytes.fromhex(v[2:]))
        except ValueError:
            misfits[i] = v
            values.append(None)
    return pa.array(values, pa.binary()), misfits


def _array_column(texts: Texts, elem: str) -> tuple[pa.Array, Misfits]:
    """PostgreSQL array literals -> lists of the element type. An array that does not parse (more
    than one dimension, explicit bounds) or has an element that does not fit is a misfit whole."""
    import pyarrow as pa

    misfits: Misfits = {}
    offsets, valid = [0], []
    flat: list[str | None] = []
    for i, v in enumerate(texts):
        items = None
        if v is not None:
            try:
                items = parse_pg_array(v)
            except ValueError:
                misfits[i] = v
        valid.append(items is not None)
        flat.extend(items or ())
        offsets.append(len(flat))
    values, bad = typed_column(flat, elem)
    if bad:  # the arrays holding an element that does not fit
        rows = iter(range(len(texts)))
        row = next(rows)
        for e in sorted(bad):
            while offsets[row + 1] <= e:
                row = next(rows)
            misfits[row] = str(texts[row])
            valid[row] = False
    mask = pa.array([not ok for ok in valid], pa.bool_())
    out = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values, type=pa.list_(arrow_type(elem)), mask=mask)
    return out, misfits
