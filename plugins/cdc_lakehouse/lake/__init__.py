"""Stage 5, the lake: the Iceberg tables and what is written with their commits.

Runs on the Spark driver. The vocabulary every layer shares sits below it, at the package's top:
cdc_lakehouse.columns (the _cdc_* metadata columns) and cdc_lakehouse.watermark (the watermark).

  batches    batch ids: each table of a multi-table run commits a batch once; resume after a kill
  casts      PostgreSQL text -> lake types, behind format guards (ingest, bootstrap, audit)
  commits    commits with snapshot properties, retries on conflicts, commits fenced at publish time
  holds      a consumer's hold on the snapshot it still needs (an Iceberg tag), kept from expiry
  ingest_metrics  the figures of one table's ingest run, the record of cdc_meta.ingest_runs
  merge      the MERGE into the current table (the LSN guard) and the key-range predicates that
             bound it; the ingest and the chunked bootstrap run the same statement
  meta       the pipeline's own tables (quarantine, run figures, audit results)
  meta_rows  their rows as typed records, whose fields generate the tables' columns
  ranges     which keys changed between two snapshots: the changelog or a snapshot diff (one rule
             for the change feed, serving exports and derived trees)
  snapshots  the current snapshot and its ancestors, typed: by pyiceberg, or the metadata tables
  tables     DDL of the current table and the changelog, properties, adding columns
  writers    the cdc.writer snapshot property: the registry of who commits to a table
"""
