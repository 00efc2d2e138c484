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
# Spark tasks go to one long-lived job server (README, "Performance"); AIRFLOW_SPARK=submit
# makes them start a spark-submit each instead.
if [ "${AIRFLOW_SPARK:-server}" = server ]; then
  python -m cdc_lakehouse.runtime.server start >/dev/null
  CDC_SPARK_SERVER="$(python -c 'from cdc_lakehouse.runtime.server import default_socket; print(default_socket())')"
  export CDC_SPARK_SERVER
  trap 'python -m cdc_lakehouse.runtime.server stop' EXIT
  echo "[airflow] Spark tasks run on the job server at $CDC_SPARK_SERVER (log: its folder's server.log)"
fi
echo "[airflow] UI at http://localhost:${AIRFLOW__API__PORT:-8080} (Ctrl-C stops scheduler and UI)"
airflow standalone
