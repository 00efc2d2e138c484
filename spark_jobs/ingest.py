"""spark-submit entry point of the ingest job: parameters and main in cdc_lakehouse.jobs.ingest."""

from cdc_lakehouse.jobs.registry import run_job

if __name__ == "__main__":
    raise SystemExit(run_job("ingest"))
