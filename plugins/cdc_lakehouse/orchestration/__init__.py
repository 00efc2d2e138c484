"""Orchestration: the Airflow side. DAGs, tasks, operators and alerts.

Runs in the Airflow scheduler (DAG parsing: light imports only) and on Airflow workers (tasks).
Spark work is submitted as Spark jobs (cdc_lakehouse.jobs), never run in the worker's process. Not
shipped to Spark executors (the --py-files zip leaves it out).

  alerts       alerts through Airflow's notifiers (e-mail, SNS, Slack, ...)
  dag_docs     doc_md of the generated DAGs
  dag_factory  builds the per-table DAGs from the table configs
  operators    the project's Spark submit operator (the provider's, plus lake settings and secrets)
  tasks        what the Airflow tasks run
"""
