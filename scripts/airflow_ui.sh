#!/usr/bin/env bash
# Airflow's web UI, scheduler, DAG processor and triggerer on the local demo (`make airflow`).
# The demo's ingest, audit and maintenance DAGs are unpaused so scheduled runs appear by
# themselves; run `make demo` once first so the tables are bootstrapped.
set -euo pipefail
# Local demo only: every visitor is an admin, so there is no generated password to look up.
export AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS="${AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS:-True}"
export AIRFLOW__CORE__AUTH_MANAGER="${AIRFLOW__CORE__AUTH_MANAGER:-airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager}"
airflow dags reserialize >/dev/null 2>&1
for dag in $(airflow dags list -o plain 2>/dev/null | awk '{print $1}' | grep -E '^cdc_(ingest|audit|maintenance|derived)'); do
  airflow dags unpause "$dag" >/dev/null 2>&1 || true
done
# Spark tasks are clients of the local stack's Spark Connect server (make pg-start starts it;
# spark_default in scripts/env.sh). AIRFLOW_SPARK=submit makes them start a spark-submit each.
if [ "${AIRFLOW_SPARK:-connect}" = submit ]; then
  export AIRFLOW_CONN_SPARK_DEFAULT='{"conn_type": "spark", "host": "local[*]"}'
  echo "[airflow] Spark tasks run by spark-submit (local master)"
else
  echo "[airflow] Spark tasks run on Spark Connect at $CDC_SPARK_REMOTE"
fi
echo "[airflow] UI at http://localhost:${AIRFLOW__API__PORT:-8080} (Ctrl-C stops scheduler and UI)"
airflow standalone
