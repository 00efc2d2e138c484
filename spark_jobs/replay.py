"""spark-submit entry point of the quarantine replay job: parameters and main in cdc_lakehouse.jobs.replay."""

from cdc_lakehouse.jobs.registry import run_job

if __name__ == "__main__":
    raise SystemExit(run_job("replay"))
