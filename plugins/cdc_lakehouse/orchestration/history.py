"""The run history the jobs keep in cdc_meta, read in Airflow workers (pyiceberg, no Spark):
the alerts' rules and the lineage facets both start here."""

from __future__ import annotations

from typing import TypeVar

from cdc_lakehouse.lake.meta_rows import from_row

R = TypeVar("R")


def meta_rows(lake, name: str, record: type[R], column: str, value: str, fields: tuple[str, ...]) -> list[R] | None:
    """Rows of cdc_meta.<name> where column == value, as records of its table with only `fields`
    read (the others are None); pyiceberg, no Spark. None if the table does not exist."""
    from pyiceberg.catalog import load_catalog
    from pyiceberg.exceptions import NoSuchTableError
    from pyiceberg.expressions import EqualTo

    catalog = load_catalog(lake.catalog_name, **lake.pyiceberg_properties())
    try:
        table = catalog.load_table(lake.meta_table(name))
    except NoSuchTableError:
        return None
    # Keywords: pyiceberg's (term, literal) constructor takes the model's field names too, and the
    # pydantic type-checker plugin knows only those.
    rows = table.scan(row_filter=EqualTo(term=column, value=value), selected_fields=fields).to_arrow().to_pylist()
    return [from_row(record, r) for r in rows]
