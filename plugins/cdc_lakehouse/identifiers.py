"""Identifier validation and quoting.

Every name that reaches SQL (schemas, tables, columns, slots, publications) comes from
config or from the source catalog; it is validated here and always quoted when used.
"""

from __future__ import annotations

import re

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_LAKE_IDENT = re.compile(r"^[a-z_][a-z0-9_]{0,127}$")


class IdentifierError(ValueError):
    pass


def check_ident(value: str, what: str = "identifier") -> str:
    """A PostgreSQL-safe identifier: letters, digits, underscore, at most 63 chars."""
    if not isinstance(value, str) or not _IDENT.match(value):
        raise IdentifierError(
            f"{what} {value!r} is not a valid identifier: use letters, digits and '_', "
            "starting with a letter or '_', at most 63 characters"
        )
    return value


def check_lake_ident(value: str, what: str = "lake name") -> str:
    """Lake (Iceberg) names are lower case so every engine resolves them the same way."""
    if not isinstance(value, str) or not _LAKE_IDENT.match(value):
        raise IdentifierError(f"{what} {value!r} is not a valid lake name: use lower-case letters, digits and '_'")
    return value


def pg_ident(value: str) -> str:
    """Quote for PostgreSQL after validation (quotes are doubled anyway, as a second guard)."""
    check_ident(value)
    return '"' + value.replace('"', '""') + '"'


def pg_qualified(schema: str, table: str) -> str:
    return f"{pg_ident(schema)}.{pg_ident(table)}"


def spark_ident(value: str) -> str:
    """Quote for Spark SQL (backticks)."""
    if not isinstance(value, str) or not _IDENT.match(value):
        raise IdentifierError(f"column {value!r} is not a valid identifier")
    return "`" + value.replace("`", "``") + "`"
