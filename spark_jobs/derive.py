"""spark-submit entry point: derive (logic in cdc_lakehouse.derived.run; arguments in cdc_lakehouse.jobs)."""

from cdc_lakehouse.jobs import main_derive

if __name__ == "__main__":
    raise SystemExit(main_derive())
