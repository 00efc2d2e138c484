# Environment of the embedded local stack. Sourced by the Makefile's targets:
#   . scripts/env.sh
# Everything here can be overridden by exporting the variable first.
_root="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)"
export CDC_ROOT="${CDC_ROOT:-$_root}"
export CDC_LOCAL_DIR="${CDC_LOCAL_DIR:-$CDC_ROOT/.local}"
export CDC_LOCAL_PG_PORT="${CDC_LOCAL_PG_PORT:-55432}"
# The private local cluster's password: generated once into a git-ignored file, which stays
# the source of truth (the cluster was initialised with it). Real deployments keep
# credentials in Airflow connections or a secrets backend.
if [ ! -s "$CDC_LOCAL_DIR/.pg-password" ]; then
  mkdir -p "$CDC_LOCAL_DIR"
  (umask 077; if [ -n "${CDC_LOCAL_PG_PASSWORD:-}" ]; then printf '%s' "$CDC_LOCAL_PG_PASSWORD"; \
   else od -An -N12 -tx1 /dev/urandom | tr -d ' \n'; fi > "$CDC_LOCAL_DIR/.pg-password")
fi
CDC_LOCAL_PG_PASSWORD="$(cat "$CDC_LOCAL_DIR/.pg-password")"
export CDC_LOCAL_PG_PASSWORD
export PATH="$CDC_ROOT/.venv/bin:$PATH"
# plugins/ holds the shipped package; the repository root holds the development stack (devstack/).
export PYTHONPATH="$CDC_ROOT/plugins:$CDC_ROOT${PYTHONPATH:+:$PYTHONPATH}"

# Airflow on SQLite, DAGs and plugins from this repository.
export AIRFLOW_HOME="${AIRFLOW_HOME:-$CDC_LOCAL_DIR/airflow}"
export AIRFLOW__CORE__DAGS_FOLDER="$CDC_ROOT/dags"
export AIRFLOW__CORE__PLUGINS_FOLDER="$CDC_ROOT/plugins"
export AIRFLOW__CORE__LOAD_EXAMPLES=False
export AIRFLOW__CORE__UNIT_TEST_MODE="${AIRFLOW__CORE__UNIT_TEST_MODE:-False}"
export AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION="${AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION:-True}"
export AIRFLOW__API__PORT="${AIRFLOW__API__PORT:-8080}"
export AIRFLOW__LOGGING__LOGGING_LEVEL="${AIRFLOW__LOGGING__LOGGING_LEVEL:-INFO}"
export CDC_TABLES_DIR="${CDC_TABLES_DIR:-$CDC_ROOT/include/tables}"

# Connections, from the environment (Airflow reads AIRFLOW_CONN_<ID>).
_pg="127.0.0.1:$CDC_LOCAL_PG_PORT"
export AIRFLOW_CONN_CDC_SOURCE_LOCAL="${AIRFLOW_CONN_CDC_SOURCE_LOCAL:-postgresql://postgres:$CDC_LOCAL_PG_PASSWORD@$_pg/notion}"
# The serving export's local default store (redis-server, started with PostgreSQL by make pg-start).
export CDC_LOCAL_REDIS_PORT="${CDC_LOCAL_REDIS_PORT:-56379}"
export AIRFLOW_CONN_CDC_REDIS="${AIRFLOW_CONN_CDC_REDIS:-redis://127.0.0.1:$CDC_LOCAL_REDIS_PORT/0}"
# Spark: the local stack's Spark Connect server (devstack.localstack, started by make pg-start).
export CDC_LOCAL_SPARK_PORT="${CDC_LOCAL_SPARK_PORT:-15002}"
export CDC_LOCAL_SPARK_UI_PORT="${CDC_LOCAL_SPARK_UI_PORT:-4040}"
# Its clients send the token it writes at each start (runtime.connect_auth); its UI is off unless
# CDC_LOCAL_SPARK_UI=on (every local user can read its pages).
export CDC_SPARK_CONNECT_TOKEN_FILE="${CDC_SPARK_CONNECT_TOKEN_FILE:-$CDC_LOCAL_DIR/spark-connect/token}"
export AIRFLOW_CONN_SPARK_DEFAULT="${AIRFLOW_CONN_SPARK_DEFAULT:-{\"conn_type\": \"spark_connect\", \"host\": \"127.0.0.1\", \"port\": $CDC_LOCAL_SPARK_PORT\}}"
export AIRFLOW_CONN_CDC_LAKE="${AIRFLOW_CONN_CDC_LAKE:-{\"conn_type\": \"generic\", \"host\": \"127.0.0.1\", \"port\": $CDC_LOCAL_PG_PORT, \"schema\": \"lake_catalog\", \"login\": \"postgres\", \"password\": \"$CDC_LOCAL_PG_PASSWORD\", \"extra\": {\"catalog_type\": \"jdbc\", \"warehouse\": \"file://$CDC_LOCAL_DIR/warehouse\", \"landing_uri\": \"file://$CDC_LOCAL_DIR/landing\"\}\}}"

# The same lake for code that runs outside Airflow (Spark jobs started by hand, benchmarks).
export CDC_CATALOG_TYPE=jdbc
export CDC_CATALOG_URI="postgresql://postgres@$_pg/lake_catalog"
export CDC_CATALOG_PASSWORD="$CDC_LOCAL_PG_PASSWORD"
export CDC_WAREHOUSE="file://$CDC_LOCAL_DIR/warehouse"
export CDC_LANDING_URI="file://$CDC_LOCAL_DIR/landing"
export CDC_SPARK_REMOTE="${CDC_SPARK_REMOTE:-sc://127.0.0.1:$CDC_LOCAL_SPARK_PORT}"
unset _root _pg
export SPARK_LOCAL_IP="${SPARK_LOCAL_IP:-127.0.0.1}"
export PYARROW_IGNORE_TIMEZONE=1
