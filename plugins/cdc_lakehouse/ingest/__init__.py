"""Stage 4, ingest: landing files -> the changelog -> the current table, once per interval.

Runs on the Spark driver (a Spark job started by Airflow's Spark operator).

  backfill    values of columns added at the source, for rows that predate the ALTER
  errors      IngestError and its kinds (schema change, error budget); the landing's are in landing.errors
  quarantine  events that cannot be applied, into the quarantine meta table
  reduce      the lake's order (_cdc_seq, key changes split in two) and the latest event per key
  ingest_table  the ingest of one table: plan, validate, changelog, merge, watermark
  schema      schema changes of the source -> lake DDL, by the table's policy
  toast       unchanged TOAST values the events did not carry, filled from the batch or the table
  validate    landing events -> typed, validated change events (malformed ones get reasons)
"""
