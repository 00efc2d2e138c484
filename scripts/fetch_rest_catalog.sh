#!/usr/bin/env bash
# Resolves devstack/rest-catalog.pom.xml (Apache Iceberg's REST catalog server) with Maven's own
# client into .cache/rest-catalog (or CDC_REST_CATALOG_DIR), transitive dependencies included.
# A stamp of the POM's checksum makes a re-run a no-op; a changed POM refills the folder.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
POM="$ROOT/devstack/rest-catalog.pom.xml"
DIR="${CDC_REST_CATALOG_DIR:-$ROOT/.cache/rest-catalog}"
log() { echo "[rest-catalog] $*"; }
command -v mvn >/dev/null 2>&1 || { echo "[rest-catalog] Maven (mvn) is needed: apt-get install maven" >&2; exit 1; }

want="$(sha256sum "$POM" | cut -d' ' -f1)"
if [[ "$(cat "$DIR/.stamp" 2>/dev/null)" != "$want" ]]; then
  rm -rf "$DIR" && mkdir -p "$DIR"
  log "resolving $(basename "$POM") with Maven"
  if ! mvn -B -ntp -Dstyle.color=never -f "$POM" dependency:copy-dependencies \
       -DoutputDirectory="$DIR" -DincludeScope=runtime > "$DIR/mvn.log" 2>&1; then
    grep -E "ERROR|Could not" "$DIR/mvn.log" | head -20 >&2
    echo "[rest-catalog] Maven could not resolve $(basename "$POM") (above)" >&2; exit 1
  fi
  echo "$want" > "$DIR/.stamp"
fi
log "$(ls "$DIR"/*.jar | wc -l) jar(s) in $DIR"
