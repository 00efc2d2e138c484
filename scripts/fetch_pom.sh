#!/usr/bin/env bash
# Resolves one of devstack's POMs (a server the tests run: devstack/<name>.pom.xml) with Maven's
# own client into .cache/<name> (or $2), transitive dependencies included.
#   scripts/fetch_pom.sh rest-catalog     Apache Iceberg's REST catalog server
#   scripts/fetch_pom.sh debezium-connect Kafka (broker and Connect) with Debezium's connector
# A stamp of the POM's checksum makes a re-run a no-op; a changed POM refills the folder.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
NAME="$1"
POM="$ROOT/devstack/$NAME.pom.xml"
DIR="${2:-$ROOT/.cache/$NAME}"
log() { echo "[$NAME] $*"; }
command -v mvn >/dev/null 2>&1 || { echo "[$NAME] Maven (mvn) is needed: apt-get install maven" >&2; exit 1; }

want="$(sha256sum "$POM" | cut -d' ' -f1)"
if [[ "$(cat "$DIR/.stamp" 2>/dev/null)" != "$want" ]]; then
  rm -rf "$DIR" && mkdir -p "$DIR"
  log "resolving $(basename "$POM") with Maven"
  if ! mvn -B -ntp -Dstyle.color=never -f "$POM" dependency:copy-dependencies \
       -DoutputDirectory="$DIR" -DincludeScope=runtime > "$DIR/mvn.log" 2>&1; then
    grep -E "ERROR|Could not" "$DIR/mvn.log" | head -20 >&2
    echo "[$NAME] Maven could not resolve $(basename "$POM") (above)" >&2; exit 1
  fi
  "$ROOT/scripts/link_m2.sh" "$DIR"
  echo "$want" > "$DIR/.stamp"
fi
log "$(ls "$DIR"/*.jar | wc -l) jar(s) in $DIR"
