"""Stage 3, the landing zone: change events as Parquet files plus one manifest per capture run.

Written on the Airflow worker (capture), read on the Spark driver (ingest, audit, maintenance).
The format is described in docs/landing-format.md.

  errors  why the landing cannot be applied to a table (not bootstrapped, gap, coverage, identity)
  format  layout, the one event schema (as Arrow and Spark schemas), the manifest model
  reader  manifests in capture order and the plan of pending runs for a table (Spark driver)
  stores  local directory and s3:// stores the capture writes through
  writer  Parquet writer of one run's events per source table, bounded in memory
"""
