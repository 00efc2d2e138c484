#!/usr/bin/env bash
# Airflow on SQLite for the local stack: database, pools, parsed DAGs. Idempotent.
# cdc_lakehouse.dev.airflow_init runs the three `airflow` commands in one process.
set -euo pipefail
mkdir -p "$AIRFLOW_HOME"
log="$AIRFLOW_HOME/airflow-init.log"
python -m cdc_lakehouse.dev.airflow_init >"$log" 2>&1 || { tail -20 "$log"; exit 1; }
tail -1 "$log"
