#!/usr/bin/env bash
# Resolves requirements-jvm.txt with Maven's own client into .cache/jars (or CDC_JARS_DIR):
# one `mvn dependency:copy-dependencies` over a generated POM, each artifact without its
# transitive dependencies. Maven goes through whatever mirror ~/.m2/settings.xml names and checks
# the checksums; its local repository (~/.m2) is the cache, so a re-run downloads nothing.
# CDC_WITH_S3=0 leaves out the lines marked `s3:`. Jars of the list that are no longer on it are
# removed from the folder, so the folder is exactly the list.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
JARS="${CDC_JARS_DIR:-$ROOT/.cache/jars}"
LIST="${CDC_JVM_REQUIREMENTS:-$ROOT/requirements-jvm.txt}"
log() { echo "[jars] $*"; }
command -v mvn >/dev/null 2>&1 || { echo "[jars] Maven (mvn) is needed: apt-get install maven" >&2; exit 1; }

coords=()
while read -r line; do
  line="${line%%#*}"; line="$(echo "$line" | xargs)"
  [[ -z "$line" ]] && continue
  if [[ "$line" == s3:* ]]; then
    [[ "${CDC_WITH_S3:-1}" == "1" ]] || continue
    line="$(echo "${line#s3:}" | xargs)"
  fi
  coords+=("$line")
done < "$LIST"

mkdir -p "$JARS"
want=()
for c in "${coords[@]}"; do IFS=: read -r _ a v <<<"$c"; want+=("$a-$v.jar"); done
missing=0
for j in "${want[@]}"; do [[ -s "$JARS/$j" ]] || missing=1; done
if ((missing)); then
  work="$(mktemp -d)"
  {
    echo '<project xmlns="http://maven.apache.org/POM/4.0.0"><modelVersion>4.0.0</modelVersion>'
    echo '<groupId>cdc-lakehouse</groupId><artifactId>spark-jars</artifactId><version>0</version><dependencies>'
    for c in "${coords[@]}"; do
      IFS=: read -r g a v <<<"$c"
      echo "<dependency><groupId>$g</groupId><artifactId>$a</artifactId><version>$v</version>"
      echo '<exclusions><exclusion><groupId>*</groupId><artifactId>*</artifactId></exclusion></exclusions></dependency>'
    done
    echo '</dependencies></project>'
  } > "$work/pom.xml"
  log "resolving ${#coords[@]} artifact(s) from $(basename "$LIST") with Maven"
  if ! mvn -B -ntp -Dstyle.color=never -f "$work/pom.xml" dependency:copy-dependencies \
       -DoutputDirectory="$JARS" -DincludeScope=runtime > "$work/mvn.log" 2>&1; then
    grep -E "ERROR|Could not" "$work/mvn.log" | head -20 >&2; rm -rf "$work"
    echo "[jars] Maven could not resolve $(basename "$LIST") (above)" >&2; exit 1
  fi
  rm -rf "$work"
  "$ROOT/scripts/link_m2.sh" "$JARS"
fi
# The folder holds exactly the list (older versions and jars of other routes go).
for f in "$JARS"/*.jar; do
  [[ -e "$f" ]] || continue
  keep=0; for j in "${want[@]}"; do [[ "$(basename "$f")" == "$j" ]] && keep=1; done
  ((keep)) || { rm -f "$f"; log "removed $(basename "$f") (not in $(basename "$LIST"))"; }
done
log "$(ls "$JARS"/*.jar | wc -l) jar(s) in $JARS"
