"""Stage 2, capture: committed transactions from an endpoint's replication slot -> landing files.

Runs on the Airflow worker (one bounded run per endpoint and interval; no Spark).

  events     pgoutput messages -> landing events: relations with lake types, row values, schema diffs
  positions  where a run starts (attempt records, keepalive advances) and confirming the slot
  capture_run  one bounded capture run: preflight, stream, files, manifest, then the slot
  stream     the streaming half of a run: the slot's messages up to the run's bound -> staged files
  streamed   transactions the server streams before their commit: spooled, landed at the commit
"""
