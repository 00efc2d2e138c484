#!/usr/bin/env bash
# Puts the jars Spark needs into .cache/jars (git-ignored):
#   iceberg-spark-runtime-3.5_2.12-<ver>.jar  (+ a relocated Jackson jar on the offline route)
#   postgresql-<ver>.jar                      (JDBC driver: Iceberg JDBC catalog and bootstrap reads)
#   S3 (CDC_WITH_S3=1, the default):
#     iceberg-aws-sdk2.jar   AWS SDK v2 for Iceberg's S3FileIO (the warehouse on s3://)
#     hadoop-aws.jar + aws-sdk-v1-s3a.jar   Hadoop S3A (Spark reading landing Parquet on s3://)
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
# Scratch space on the project's disk, not /tmp: the offline route unpacks a 190 MB SDK
# bundle, and a small /tmp (tmpfs on some CI machines) ran out of space mid-setup.
export TMPDIR="${CDC_SETUP_TMPDIR:-$ROOT/.cache/tmp}"
mkdir -p "$TMPDIR"

log() { echo "[jars] $*"; }

maven_get() {  # maven_get URL DEST: true when downloaded
  curl -fsSL --connect-timeout 5 -m 300 -o "$2.part" "$1" 2>/dev/null && mv "$2.part" "$2" && return 0
  rm -f "$2.part"; return 1
}

PYPI_CACHE="${CDC_PYPI_JAR_CACHE:-$ROOT/.cache/pypi-jars}"
PYPI_INDEX="${PIP_INDEX_URL:-https://pypi.org/simple}"

pypi_get() {  # pypi_get NAME VERSION KIND(whl|tar.gz): the downloaded file's path (cached)
  # The file is fetched straight from the index (sha256 checked), not with `pip download`:
  # pip unpacks an sdist to read its metadata, which for sagemaker_pyspark means ~400 MB
  # of scratch space for a file we only open with tar.
  local name="$1" ver="$2" kind="$3" file url sha hit
  file="$(echo "$name" | tr '.-' '__')-$ver"
  mkdir -p "$PYPI_CACHE"
  hit="$(ls "$PYPI_CACHE/$file"*".$kind" 2>/dev/null | head -1 || true)"
  if [[ -z "$hit" ]]; then
    url="$(curl -fsSL --retry 3 -m 60 "$PYPI_INDEX/$(echo "$name" | tr '_.' '--')/" \
           | grep -o 'href="[^"]*"' | sed 's/^href="//; s/"$//; s/&amp;/\&/g' \
           | grep -iE "/${file}(-[^/]*)?\.${kind//./\\.}#" | head -1)"
    [[ -n "$url" ]] || { echo "[jars] $name $ver ($kind) not found on $PYPI_INDEX" >&2; return 1; }
    sha=""; [[ "$url" == *"#sha256="* ]] && sha="${url##*#sha256=}"
    url="${url%%#*}"
    hit="$PYPI_CACHE/$(basename "$url")"
    curl -fsSL --retry 3 -m 900 -o "$hit.part" "$url"
    if [[ -n "$sha" ]] && ! echo "$sha  $hit.part" | sha256sum -c --quiet -; then
      rm -f "$hit.part"; echo "[jars] $url: sha256 mismatch" >&2; return 1
    fi
    mv "$hit.part" "$hit"
  fi
  echo "$hit"
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
  # Downloaded, not installed: the wheel is only a carrier for the jar.
  whl="$(pypi_get snowpark_connect_deps_iceberg 1.0.3 whl)"
  unzip -qo -j "$whl" "snowpark_connect_deps_iceberg/jars/iceberg-spark-runtime-3.5_2.12-1.10.2.jar" -d "$tmp"
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
# --- S3: AWS SDK v2 for Iceberg's S3FileIO, Hadoop S3A for plain Parquet ------------------
# Iceberg's runtime jar already holds org.apache.iceberg.aws.s3.S3FileIO; it needs the AWS SDK v2.
# Maven route: iceberg-aws-bundle + hadoop-aws 3.3.4 (pyspark's Hadoop) + aws-java-sdk-bundle.
# Offline route (no Maven Central): the SDKs ship inside two PyPI packages (see
# ../shared/notes/toolchain.md): sagemaker-feature-store-pyspark holds SDK v2 relocated under
# smfs.shaded.*, put back under software.amazon.awssdk with jarjar; sagemaker_pyspark holds
# hadoop-aws 3.3.1 and the SDK v1 bundle, trimmed to the services S3A links against.
SDK2_JAR="$JARS/iceberg-aws-sdk2.jar"
S3A_JAR="$JARS/hadoop-aws.jar"
SDK1_JAR="$JARS/aws-sdk-v1-s3a.jar"
build_sdk2_offline() {
  local whl work
  whl="$(pypi_get sagemaker_feature_store_pyspark 2.2.2 whl)"
  work="$(mktemp -d)"
  unzip -qo -j "$whl" 'feature_store_pyspark/jars/sagemaker-feature-store-spark-sdk-3.5.jar' -d "$work"
  mkdir "$work/x"
  # Only the SDK core, the s3/sts/kms clients, their HTTP clients and the reactive-streams API.
  (cd "$work/x" && unzip -qo ../sagemaker-feature-store-spark-sdk-3.5.jar \
     'smfs/shaded/software/amazon/awssdk/*' 'smfs/shaded/org/apache/hc/*' 'smfs/shaded/org/apache/commons/*' \
     'software/amazon/eventstream/*' 'org/reactivestreams/*' \
   && find smfs/shaded/software/amazon/awssdk/services -mindepth 1 -maxdepth 1 -type d \
        ! -name s3 ! -name sts ! -name kms -exec rm -rf {} + \
   && zip -qr ../sdk2-relocated.jar .)
  echo 'rule smfs.shaded.software.amazon.awssdk.** software.amazon.awssdk.@1' > "$work/rules.txt"
  java -jar /usr/share/java/jarjar.jar process "$work/rules.txt" "$work/sdk2-relocated.jar" "$SDK2_JAR.part"
  mv "$SDK2_JAR.part" "$SDK2_JAR"
  rm -rf "$work"
}

build_s3a_offline() {
  local sdist work
  sdist="$(pypi_get sagemaker_pyspark 1.4.5 tar.gz)"
  work="$(mktemp -d)"
  tar -xzf "$sdist" -C "$work" --wildcards '*/deps/jars/hadoop-aws-3.3.1.jar' '*/deps/jars/aws-java-sdk-bundle-1.11.901.jar'
  cp "$work"/*/deps/jars/hadoop-aws-3.3.1.jar "$S3A_JAR.part"
  mkdir "$work/x"
  # S3A 3.3 links against s3, sts, kms and dynamodbv2 (S3Guard); the rest of the 190 MB goes.
  (cd "$work/x" && unzip -qo "$work"/*/deps/jars/aws-java-sdk-bundle-1.11.901.jar -x 'models/*' \
   && find com/amazonaws/services -mindepth 1 -maxdepth 1 -type d \
        ! -name s3 ! -name securitytoken ! -name kms ! -name dynamodbv2 -exec rm -rf {} + \
   && zip -qr ../sdk1.jar .)
  mv "$work/sdk1.jar" "$SDK1_JAR"
  mv "$S3A_JAR.part" "$S3A_JAR"
  rm -rf "$work"
}

if [[ "${CDC_WITH_S3:-1}" == "1" ]]; then
  if [[ -s "$SDK2_JAR" ]]; then
    log "s3: cached $(basename "$SDK2_JAR")"
  elif maven_get "$MAVEN/org/apache/iceberg/iceberg-aws-bundle/$ICEBERG_VERSION/iceberg-aws-bundle-$ICEBERG_VERSION.jar" "$SDK2_JAR"; then
    log "s3: iceberg-aws-bundle from Maven Central"
  else
    log "s3: Maven Central unreachable; AWS SDK v2 from PyPI sagemaker-feature-store-pyspark + jarjar"
    build_sdk2_offline
  fi
  if [[ -s "$S3A_JAR" && -s "$SDK1_JAR" ]]; then
    log "s3: cached $(basename "$S3A_JAR") + $(basename "$SDK1_JAR")"
  elif maven_get "$MAVEN/org/apache/hadoop/hadoop-aws/3.3.4/hadoop-aws-3.3.4.jar" "$S3A_JAR" \
       && maven_get "$MAVEN/com/amazonaws/aws-java-sdk-bundle/1.12.262/aws-java-sdk-bundle-1.12.262.jar" "$SDK1_JAR"; then
    log "s3: hadoop-aws + aws-java-sdk-bundle from Maven Central"
  else
    log "s3: hadoop-aws 3.3.1 + trimmed AWS SDK v1 bundle from PyPI sagemaker_pyspark"
    rm -f "$S3A_JAR" "$SDK1_JAR"
    build_s3a_offline
  fi
fi
ls -1 "$JARS"
