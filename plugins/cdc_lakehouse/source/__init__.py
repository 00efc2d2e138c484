"""Stage 1, the source: what a PostgreSQL endpoint must provide and how we read it.

Runs on the Airflow worker (capture, preflight) and on the Spark driver (bootstrap, audit and
repair reads). No heavy imports here: DAG files import this package at parse time.

  catalog      PostgreSQL types -> lake types, describe_table, every column as change-stream text
  errors       SourceError, PreflightError, SlotConflictError, SlotLostError
  markers      the chunked bootstrap's watermark messages in the WAL (written, and recognized by capture)
  pgoutput     decoder of the pgoutput logical replication protocol (version 1)
  publication  preflight checks, the publication, the server's identity (IDENTIFY_SYSTEM)
  session      the session settings (DateStyle, TimeZone, ...) rendered for libpq and for JDBC
  slots        replication slots, heartbeat tables and the slot's state
"""
