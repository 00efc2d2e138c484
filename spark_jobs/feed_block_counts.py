"""spark-submit entry point: the demo feed consumer (logic in cdc_lakehouse.feed.consumer)."""

from cdc_lakehouse.feed.consumer import main

if __name__ == "__main__":
    raise SystemExit(main())
