"""Keys and values as the store holds them (docs/serving-export.md).

Values are Avro binary without a header (schemaless): the schema is written once per version
in its metadata, so any reader can decode any version, and a changed table schema gives a new
version with its own schema. Keys are the key columns' values as a compact JSON array, e.g.
`[3,1042]`: unambiguous for composite keys and readable from any language.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from datetime import date, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from pyspark.sql.types import DataType, StructType


def key_string(values: list[Any] | tuple[Any, ...]) -> str:
    return json.dumps(list(values), separators=(",", ":"), default=_key_default, ensure_ascii=False)


def _key_default(v: Any) -> Any:
    if isinstance(v, (datetime, date)):
        return v.isoformat()
    if isinstance(v, Decimal):
        return str(v)
    raise TypeError(f"a key column value of type {type(v).__name__} cannot be part of a store key")


def _avro_type(dt: DataType, name: str) -> Any:  # noqa: PLR0911 - one return per Spark type family
    from pyspark.sql import types as T

    simple = {
        T.BooleanType: "boolean",
        T.ByteType: "int",
        T.ShortType: "int",
        T.IntegerType: "int",
        T.LongType: "long",
        T.FloatType: "float",
        T.DoubleType: "double",
        T.StringType: "string",
        T.BinaryType: "bytes",
    }
    for cls, avro in simple.items():
        if isinstance(dt, cls):
            return avro
    if isinstance(dt, T.DecimalType):
        return {"type": "bytes", "logicalType": "decimal", "precision": dt.precision, "scale": dt.scale}
    if isinstance(dt, T.DateType):
        return {"type": "int", "logicalType": "date"}
    if isinstance(dt, T.TimestampNTZType):
        return {"type": "long", "logicalType": "local-timestamp-micros"}
    if isinstance(dt, T.TimestampType):
        return {"type": "long", "logicalType": "timestamp-micros"}
    if isinstance(dt, T.ArrayType):
        return {"type": "array", "items": _nullable(_avro_type(dt.elementType, name + "_item"))}
    if isinstance(dt, T.MapType) and isinstance(dt.keyType, T.StringType):
        return {"type": "map", "values": _nullable(_avro_type(dt.valueType, name + "_value"))}
    if isinstance(dt, T.StructType):
        return record_schema(dt, name)
    raise ValueError(f"column {name!r}: Spark type {dt.simpleString()} has no Avro mapping; leave it out of `values`")


def _nullable(t: Any) -> list[Any]:
    return ["null", t]


def record_schema(schema: StructType, name: str = "value") -> dict[str, Any]:
    """The Avro record of a Spark struct; every field nullable (a source column may be NULL)."""
    return {
        "type": "record",
        "name": name,
        "fields": [
            {"name": f.name, "type": _nullable(_avro_type(f.dataType, f"{name}_{f.name}")), "default": None}
            for f in schema.fields
        ],
    }


def encoder(value_schema: str) -> Callable[[dict[str, Any]], bytes]:
    """A function dict -> Avro bytes; parse the schema once per partition, not per row."""
    import fastavro

    parsed = fastavro.parse_schema(json.loads(value_schema))
    buf = io.BytesIO()  # one buffer per encoder: getvalue() copies, so reusing it is safe

    def encode(record: dict[str, Any]) -> bytes:
        buf.seek(0)
        buf.truncate()
        fastavro.schemaless_writer(buf, parsed, record)
        return buf.getvalue()

    return encode


def decoder(value_schema: str) -> Callable[[bytes], dict[str, Any]]:
    import fastavro

    parsed = fastavro.parse_schema(json.loads(value_schema))
    # cast: a value schema is a record, which fastavro decodes to a dict.
    return lambda data: cast(dict[str, Any], fastavro.schemaless_reader(io.BytesIO(data), parsed, None))
