"""CDC lakehouse: PostgreSQL logical replication -> Iceberg, run by Airflow.

The package is laid out along the data path, one subpackage per stage:

  source    PostgreSQL endpoints: catalog, types, session settings, publication, slots, pgoutput
    -> capture    the slot's committed transactions -> landing files (Airflow worker)
    -> landing    Parquet events + one manifest per run: the format, stores, writer, reader
    -> ingest     landing -> changelog -> current table (Spark driver)
    -> lake       Iceberg tables: metadata columns, DDL, watermark, commits, meta tables
    -> views (latest-per-key view), maintenance (housekeeping), audit (source = lake?)
  bootstrap  a consistent snapshot of every shard -> the lake, handed to the change stream
    -> derived    tables computed from lake tables: the block tree (ancestors, effective grants)

Around it:
  orchestration  the Airflow side: DAG factory, tasks, the Spark operator, alerts
  runtime        the Spark side: SparkSession, job command lines, --py-files zip, secrets
  config.py (table configs), settings.py (lake and source connections), identifiers.py, cli.py
  columns.py (the _cdc_* metadata columns) and watermark.py (the cdc.watermark snapshot property),
  the vocabulary of every layer

Shared by DAGs (parse-time safe: the __init__ files import nothing, config and settings stay
light) and Spark jobs (shipped with --py-files, without orchestration/). The development stack
(local stack, workload, demo) is `devstack/` at the repository root: not part of this package.
"""

__version__ = "0.1.0"
