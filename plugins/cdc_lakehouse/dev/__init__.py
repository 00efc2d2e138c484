"""Development: the local stack, a workload and the demo. Not part of the data path, and not
shipped to Spark executors (the --py-files zip leaves it out).

Runs on a developer machine or in tests.

  demo        the demo: a Notion-like source on local PostgreSQL, replicated through Airflow
  localstack  a private PostgreSQL cluster for development, the demo and tests
  workload    a Notion-like source and workload (blocks, spaces, permissions in sharded schemas)
"""
