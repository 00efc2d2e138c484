"""CDC lakehouse: PostgreSQL logical replication -> Iceberg, run by Airflow.

Data path (one module per stage):
  capture   (source.py, pgoutput.py, capture.py, landing.py)  PostgreSQL WAL -> landing files
  ingest    (events.py, ingest.py)                            landing -> changelog -> current table
  bootstrap (bootstrap.py)                                    snapshot of every shard -> current table
  audit     (audit.py), maintenance (maintenance.py)          keys and housekeeping
Shared by DAGs (parse-time safe: no heavy imports here) and Spark jobs (shipped with --py-files).
"""

__version__ = "0.1.0"
