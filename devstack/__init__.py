"""The development stack: the local stack, a workload and the demo. Not part of the data path,
and not shipped: it lives beside the package (plugins/cdc_lakehouse), not in it, so neither the
Airflow image nor the Spark --py-files zip carries it, and the package never imports it
(tests/unit/test_layout.py). It imports the package; scripts/env.sh puts the repository root on
PYTHONPATH next to plugins/ for that.

Runs on a developer machine or in tests.

  airflow_init  Airflow on SQLite for the local stack and the tests (scripts/airflow_init.sh)
  demo          the demo: a Notion-like source on local PostgreSQL, replicated through Airflow
  localstack    a private PostgreSQL cluster (and Redis, S3, Spark Connect) for development, the demo and tests
  workload      a Notion-like source and workload (blocks, spaces, permissions in sharded schemas)
"""
