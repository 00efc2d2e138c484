"""The catalogs this process also reads with pyiceberg: each name with its load_catalog properties,
registered by runtime.session.get_spark for its lake, and the catalogs once loaded.

lake.snapshots reads a table's snapshots, properties and files through them: the table's metadata
file, read by this process, where Spark's metadata tables cost a Spark job each (on Spark
Connect, a request and a job per read; an ingest made about 18). Process state, below the lake
so that a new session can register its catalog without importing the lake."""

from __future__ import annotations

from typing import Any

_PROPERTIES: dict[str, dict[str, str]] = {}
_LOADED: dict[str, Any] = {}


def read_with_pyiceberg(catalog_name: str, properties: dict[str, str]) -> None:
    """Read this catalog with pyiceberg from now on (a changed registration loads it again)."""
    if _PROPERTIES.get(catalog_name) != properties:
        _PROPERTIES[catalog_name] = dict(properties)
        _LOADED.pop(catalog_name, None)


def reads_with_pyiceberg(catalog_name: str) -> bool:
    return catalog_name in _PROPERTIES


def pyiceberg_catalog(catalog_name: str) -> Any:
    """The registered catalog, loaded once per process (a KeyError for one never registered)."""
    from pyiceberg.catalog import load_catalog

    if catalog_name not in _LOADED:
        _LOADED[catalog_name] = load_catalog(catalog_name, **_PROPERTIES[catalog_name])
    return _LOADED[catalog_name]
