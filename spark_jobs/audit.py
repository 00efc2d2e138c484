"""spark-submit entry point: audit (logic in cdc_lakehouse.audit.run; arguments in cdc_lakehouse.jobs)."""

from cdc_lakehouse.jobs import main_audit

if __name__ == "__main__":
    raise SystemExit(main_audit())
