"""spark-submit entry point: maintenance (logic in cdc_lakehouse.maintenance; arguments in cdc_lakehouse.jobs)."""

from cdc_lakehouse.jobs import main_maintenance

if __name__ == "__main__":
    raise SystemExit(main_maintenance())
