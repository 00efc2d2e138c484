"""spark-submit entry point of the history job: parameters and main in cdc_lakehouse.jobs.history."""

from cdc_lakehouse.jobs.registry import run_job

if __name__ == "__main__":
    raise SystemExit(run_job("history"))
