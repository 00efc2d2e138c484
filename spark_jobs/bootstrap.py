"""spark-submit entry point: bootstrap (logic in cdc_lakehouse.bootstrap.snapshot; arguments in cdc_lakehouse.jobs)."""

from cdc_lakehouse.jobs import main_bootstrap

if __name__ == "__main__":
    raise SystemExit(main_bootstrap())
