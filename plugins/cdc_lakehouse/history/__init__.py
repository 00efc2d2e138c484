"""History tables: every version of every row (slowly changing dimension type 2), kept from the
changelog after each ingest (docs/history-tables.md).

  versions  changelog rows -> versions: TOAST fill, truncates, one state per key and transaction
  maintain  the run: plan, read the new changelog rows, the open versions, one fenced commit

Nothing here imports Spark at module level.
"""
