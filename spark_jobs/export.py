"""spark-submit entry point: serving export (logic in cdc_lakehouse.serving.run; arguments in cdc_lakehouse.jobs)."""

from cdc_lakehouse.jobs import main_export

if __name__ == "__main__":
    raise SystemExit(main_export())
