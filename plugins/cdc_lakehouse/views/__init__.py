"""Views: the latest-per-key view of a replicated table, computed from its changelog.

Runs on the Spark driver, published by maintenance (maintenance.maintain_table.maintain_table).

  latest   the latest row per key without deleted keys: as a DataFrame, and the same query as SQL
  publish  the view in the catalog: an Iceberg table replaced atomically, or an Iceberg view

Its columns are the current table's: the metadata columns of cdc_lakehouse.columns (CURRENT) around the
source columns, so the view and the current table line up column for column.
"""
