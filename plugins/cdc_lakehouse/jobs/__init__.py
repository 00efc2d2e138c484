"""The Spark jobs: what each takes and does, above every stage, since it runs them.

  params     a job's parameters as a frozen dataclass: its command line, generated (to_argv, from_argv)
  runner     how every job runs: secrets, configs, one SparkSession, the stage per table, result lines
  registry   every job once: name (= spark_jobs/<name>.py), parameters, main
  ingest, bootstrap, maintenance, audit, derive, export, feed_block_counts
             one module per job: its parameters and its main; `feed` holds what every feed
             consumer job takes (dag_parts.feed_consumer_dag passes it)

Each job imports its stage inside its main, so a job loads only the code it runs, and the DAG
factory can import the parameters at parse time.
"""
