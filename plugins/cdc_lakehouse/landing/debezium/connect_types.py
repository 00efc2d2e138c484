"""landing.debezium.connect_types: Debezium's Connect schema of a column (its PostgreSQL and lake type) and its values as PostgreSQL
text, as our own capture lands them (landing.format).
"""

from __future__ import annotations

import base64
import json
import logging
import math
import struct
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from cdc_lakehouse.source.catalog import SchemaColumn, lake_type

if TYPE_CHECKING:
    pass


log = logging.getLogger(__name__)

# Naive UTC: Debezium's timestamps without time zone count from here.
EPOCH = datetime(1970, 1, 1)  # noqa: DTZ001


class DebeziumFormatError(ValueError):
    """A record the conversion cannot turn into PostgreSQL text; the message names the fix."""


# --- the Connect schema of a column ----------------------------------------------------------------

# Connect schema (type, semantic name) -> PostgreSQL type, for the lake type (source.catalog.lake_type).
_PG_TYPES = {
    "int8": "smallint",
    "int16": "smallint",
    "int32": "integer",
    "int64": "bigint",
    "boolean": "boolean",
    "float": "real",  # JsonConverter's names for Connect's FLOAT32/FLOAT64
    "double": "double precision",
    "float32": "real",
    "float64": "double precision",
    "string": "text",
    "bytes": "bytea",
}
_PG_SEMANTIC = {
    "io.debezium.data.VariableScaleDecimal": "numeric",
    "io.debezium.time.Date": "date",
    "org.apache.kafka.connect.data.Date": "date",
    "io.debezium.time.Timestamp": "timestamp without time zone",
    "io.debezium.time.MicroTimestamp": "timestamp without time zone",
    "io.debezium.time.NanoTimestamp": "timestamp without time zone",
    "org.apache.kafka.connect.data.Timestamp": "timestamp without time zone",
    "io.debezium.time.ZonedTimestamp": "timestamp with time zone",
    "io.debezium.time.Time": "time without time zone",
    "io.debezium.time.MicroTime": "time without time zone",
    "io.debezium.time.NanoTime": "time without time zone",
    "org.apache.kafka.connect.data.Time": "time without time zone",
    "io.debezium.time.ZonedTime": "time with time zone",
    "io.debezium.data.Uuid": "uuid",
    "io.debezium.data.Json": "jsonb",
    "io.debezium.data.Xml": "xml",
    "io.debezium.data.Enum": "text",
    "io.debezium.data.Ltree": "text",
}
DECIMAL = "org.apache.kafka.connect.data.Decimal"
UNSUPPORTED_FIX = {
    "io.debezium.time.MicroDuration": "set interval.handling.mode=string on the connector is not enough either "
    "(ISO 8601 text); map the column out with column.exclude.list or cast it in a view",
    "io.debezium.data.Bits": "exclude the column (column.exclude.list) or store it as text",
}


def pg_type(col: dict[str, Any], where: str) -> str:
    """The PostgreSQL type behind a Connect field schema."""
    sem, typ = col.get("name"), col.get("type")
    if typ == "array":
        return pg_type(col["items"], where) + "[]"
    if sem == DECIMAL:
        params = col.get("parameters") or {}
        prec = params.get("connect.decimal.precision")
        return f"numeric({prec},{params.get('scale', 0)})" if prec else "numeric"
    if sem in _PG_SEMANTIC:
        return _PG_SEMANTIC[sem]
    if sem is None and typ in _PG_TYPES:
        return _PG_TYPES[typ]
    fix = UNSUPPORTED_FIX.get(sem or "", "exclude the column (column.exclude.list) or cast it to text at the source")
    raise DebeziumFormatError(f"{where}: Debezium type {sem or typ!r} is not supported. Fix: {fix}")


def table_columns(value_schema: dict[str, Any], key: list[str], where: str) -> list[SchemaColumn]:
    """The row's columns as our events' table_schema lists them (name, type, lake_type, key)."""
    cols = []
    for f in value_schema.get("fields", []):
        params = f.get("parameters") or {}
        source_type = params.get("__debezium.source.column.type", "").upper()
        if f.get("type") in ("double", "float64") and source_type in ("NUMERIC", "DECIMAL", "MONEY"):
            raise DebeziumFormatError(
                f"{where}: column {f['field']!r} is {source_type} sent as a double (decimal.handling.mode=double), "
                "which loses digits. Fix: set decimal.handling.mode=precise or string on the connector"
            )
        pt = pg_type(f, f"{where}: column {f['field']!r}")
        cols.append(SchemaColumn(name=f["field"], type=pt, lake_type=lake_type(pt), key=f["field"] in key))
    return cols


# --- values -> PostgreSQL text ---------------------------------------------------------------------


def _unscaled(v: Any) -> int:
    raw = base64.b64decode(v) if isinstance(v, str) else bytes(v)
    return int.from_bytes(raw, "big", signed=True)


def decimal_text(v: Any, scale: int) -> str:
    """Connect Decimal (base64 or raw big-endian two's complement, or a Decimal) -> numeric text."""
    d = v if isinstance(v, Decimal) else Decimal(_unscaled(v)).scaleb(-scale)
    return f"{d:f}"


def ts_text(micros: int) -> str:
    """Microseconds since the epoch -> timestamp text as PostgreSQL prints it."""
    dt = EPOCH + timedelta(microseconds=micros)
    return _trim(dt.strftime("%Y-%m-%d %H:%M:%S.%f"))


def time_text(micros: int) -> str:
    day = datetime(2000, 1, 1)  # noqa: DTZ001 (only the time of day is printed)
    return _trim((day + timedelta(microseconds=micros)).strftime("%H:%M:%S.%f"))


def _trim(text: str) -> str:
    """PostgreSQL prints fractions without trailing zeros, and none when whole."""
    return text.rstrip("0").rstrip(".") if "." in text else text


def zoned_text(v: str) -> str:
    """ZonedTimestamp (ISO 8601, UTC from PostgreSQL) -> '2024-01-02 03:04:05.5+00'."""
    dt = datetime.fromisoformat(v.replace("Z", "+00:00")).astimezone(UTC)
    return _trim(dt.strftime("%Y-%m-%d %H:%M:%S.%f")) + "+00"


def float_text(v: float, single: bool) -> str:
    if math.isnan(v):
        return "NaN"
    if v in (float("inf"), float("-inf")):
        return "Infinity" if v > 0 else "-Infinity"
    if single:  # the shortest text that reads back as the same float4, as PostgreSQL prints it
        f4 = struct.unpack("f", struct.pack("f", v))[0]
        for p in range(1, 10):
            s = f"{v:.{p}g}"
            if struct.unpack("f", struct.pack("f", float(s)))[0] == f4:
                return s
    s = repr(float(v))
    return s[:-2] if s.endswith(".0") else s


_TIME_UNITS = {
    "io.debezium.time.Timestamp": 1000,
    "org.apache.kafka.connect.data.Timestamp": 1000,
    "io.debezium.time.MicroTimestamp": 1,
    "io.debezium.time.NanoTimestamp": -1000,
    "io.debezium.time.Time": 1000,
    "org.apache.kafka.connect.data.Time": 1000,
    "io.debezium.time.MicroTime": 1,
    "io.debezium.time.NanoTime": -1000,
}


def _micros(v: int, sem: str) -> int:
    unit = _TIME_UNITS[sem]
    return v * unit if unit > 0 else v // -unit


def to_text(col: dict[str, Any], v: Any) -> str | None:  # noqa: PLR0911 (one return per type)
    """A Debezium value -> the text PostgreSQL prints for it (what our capture lands)."""
    if v is None:
        return None
    sem, typ = col.get("name"), col.get("type")
    if typ == "array":
        return json.dumps([to_text(col["items"], x) for x in v], separators=(",", ":"))
    if sem == DECIMAL:
        return decimal_text(v, int((col.get("parameters") or {}).get("scale", 0)))
    if sem == "io.debezium.data.VariableScaleDecimal":
        return f"{v:f}" if isinstance(v, Decimal) else decimal_text(v["value"], int(v["scale"]))
    if sem in ("io.debezium.time.Date", "org.apache.kafka.connect.data.Date"):
        return (v if isinstance(v, date) else date(1970, 1, 1) + timedelta(days=v)).isoformat()
    if sem in _TIME_UNITS:
        return _temporal_text(v, sem)
    if sem == "io.debezium.time.ZonedTimestamp":
        return zoned_text(v)
    if sem == "io.debezium.time.ZonedTime":
        zoned: str = v
        return zoned[:-1] + "+00" if zoned.endswith("Z") else zoned
    if typ == "boolean":
        return "t" if v else "f"
    if typ in ("float", "double", "float32", "float64"):
        return float_text(v, typ in ("float", "float32"))
    if typ == "bytes":
        return "\\x" + (base64.b64decode(v) if isinstance(v, str) else bytes(v)).hex()
    return str(v)


def _temporal_text(v: Any, sem: str) -> str:
    if isinstance(v, datetime):  # Avro logical types, decoded by fastavro
        return ts_text(int((v.astimezone(UTC).replace(tzinfo=None) - EPOCH) / timedelta(microseconds=1)))
    if isinstance(v, time):
        return _trim(v.strftime("%H:%M:%S.%f"))
    micros = _micros(int(v), sem)
    return ts_text(micros) if "Timestamp" in sem else time_text(micros)


def is_unavailable(col: dict[str, Any], v: Any, placeholder: str) -> bool:
    """An unchanged TOASTed value Debezium did not have (unavailable.value.placeholder)."""
    if v is None:
        return False
    if isinstance(v, str):
        if col.get("type") == "bytes":
            return v == base64.b64encode(placeholder.encode()).decode()
        return v == placeholder
    if isinstance(v, bytes):
        return v == placeholder.encode()
    if isinstance(v, list) and len(v) == 1:
        return is_unavailable(col.get("items") or {}, v[0], placeholder)
    return False


def row_texts(
    schema: dict[str, Any], row: dict[str, Any] | None, placeholder: str
) -> tuple[dict[str, str | None] | None, list[str]]:
    """(column -> text, unavailable columns) of a before/after struct."""
    if row is None:
        return None, []
    out: dict[str, str | None] = {}
    unavailable: list[str] = []
    for f in schema.get("fields", []):
        name = f["field"]
        v = row.get(name)
        if is_unavailable(f, v, placeholder):
            unavailable.append(name)
            continue
        out[name] = to_text(f, v)
    return out, unavailable
