"""Orchestration: the Airflow side. DAGs, tasks, operators and alerts.

Runs in the Airflow scheduler (DAG parsing: light imports only) and on Airflow workers (tasks).
Spark work is submitted as Spark jobs (cdc_lakehouse.jobs), never run in the worker's process. Not
shipped to Spark executors (the --py-files zip leaves it out).

  alerts       alerts through Airflow's notifiers (e-mail, SNS, Slack, ...)
  dag_docs     doc_md of the DAGs, per table (each DAG file's docstring leads it)
  dag_parts    what the DAG files in dags/ are built of: configs, tasks, assets, pools, settings
  operators    the project's Spark submit operator (the provider's, plus lake settings and secrets)
  tasks        what the Airflow tasks run
"""
