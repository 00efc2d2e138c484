#!/usr/bin/env bash
# Airflow on SQLite for the local stack: database, pools, parsed DAGs. Idempotent.
# devstack.airflow_init runs the three `airflow` commands in one process.
set -euo pipefail
# devstack/ sits at the repository root, outside plugins/: callers (the tests among them) may set
# PYTHONPATH to plugins/ only.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$AIRFLOW_HOME"
log="$AIRFLOW_HOME/airflow-init.log"
python -m devstack.airflow_init >"$log" 2>&1 || { tail -20 "$log"; exit 1; }
tail -1 "$log"
