#!/usr/bin/env bash
# Airflow on SQLite for the local stack: database, pools, parsed DAGs. Idempotent.
set -euo pipefail
mkdir -p "$AIRFLOW_HOME"
airflow db migrate >"$AIRFLOW_HOME/db-migrate.log" 2>&1 || { tail -20 "$AIRFLOW_HOME/db-migrate.log"; exit 1; }
python -m cdc_lakehouse.cli pools > "$AIRFLOW_HOME/pools.json"
airflow pools import "$AIRFLOW_HOME/pools.json" >/dev/null 2>&1
airflow dags reserialize >/dev/null 2>&1 || true
echo "[airflow] home $AIRFLOW_HOME: database migrated, $(python -c 'import json,sys;print(len(json.load(open(sys.argv[1]))))' "$AIRFLOW_HOME/pools.json") pools"
