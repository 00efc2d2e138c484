"""spark-submit entry point: ingest (logic in cdc_lakehouse.ingest.run; arguments in cdc_lakehouse.jobs)."""

from cdc_lakehouse.jobs import main_ingest

if __name__ == "__main__":
    raise SystemExit(main_ingest())
