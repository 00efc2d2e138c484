"""Runtime: the Spark side. How a job gets its session, its code and its secrets.

Runs on the Spark driver (and builds what the executors receive).

  failpoints  CDC_TEST_CRASH_AT: crash at a named point; CDC_TEST_FAIL_AT: raise there (crash tests)
  jobs        the Spark jobs' command lines (spark_jobs/*.py are thin wrappers)
  packaging   the package as a zip for --py-files, rebuilt when stale
  secrets     how a job receives its secrets (never on a command line, in a conf or a log)
  session     the one SparkSession factory for jobs and tests
"""
