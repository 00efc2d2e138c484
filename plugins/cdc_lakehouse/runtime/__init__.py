"""Runtime: the Spark side. How a job gets its session, its code and its secrets.

Runs on the Spark driver (and builds what the executors receive). Below every stage and the
configs: imports nothing of the package but settings and secrecy at module level.

  failpoints  CDC_TEST_CRASH_AT: crash at a named point; CDC_TEST_FAIL_AT: raise there (crash tests)
  phases      seconds per named phase, the Spark jobs a phase ran, checkpoints, metadata reads
  packaging   the package as a zip for --py-files, rebuilt when stale
  secrets     how a job receives its secrets (never on a command line, in a conf or a log)
  session     the one SparkSession factory for jobs and tests
"""
