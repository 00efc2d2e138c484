"""Audit: the lake holds exactly the source's keys and values, checked across runs; repairs.

Runs on the Spark driver (source reads through JDBC and psycopg2, lake reads through Spark).

  compare   both sides of the comparison: row hashes or bucket sums of the source and the lake
  errors    the audit's own failure (no trustworthy verdict, or a failing one)
  hashing   the same canonical text and hash of a row in PostgreSQL and in Spark
  inflight  keys changed at the source after the watermark (not yet mismatches)
  quality   Great Expectations checks of an audited table
  repair    persistently mismatched keys re-read from the source and merged like an ingest
  result    what one audit returns, and the clock that times its phases
  audit_table  the end-to-end audit of one table
"""
