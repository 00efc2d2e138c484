#!/usr/bin/env bash
# Trino, a second engine that reads the lake in the tests (tests/integration/test_rest_catalog.py):
# its server from Maven Central with Maven's own client, the small `trino-server-core` archive
# plus the Iceberg connector's plugin archive (540 MB against the full server's 821 MB), into
# .cache/trino (or CDC_TRINO_DIR). Plugins other than Iceberg are dropped. A stamp of the version
# makes a re-run a no-op. Trino 476 needs Java 24 or newer: the script names the JDK it finds.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VERSION=476
DIR="${CDC_TRINO_DIR:-$ROOT/.cache/trino}"
log() { echo "[trino] $*"; }
command -v mvn >/dev/null 2>&1 || { echo "[trino] Maven (mvn) is needed: apt-get install maven" >&2; exit 1; }

get() {  # group:artifact:version:type into Maven's local repository, unpacked from there
  if ! mvn -B -ntp -q -Dstyle.color=never org.apache.maven.plugins:maven-dependency-plugin:3.8.1:get \
       -Dtransitive=false -Dartifact="$1" >> "$DIR/mvn.log" 2>&1; then
    grep -E "ERROR|Could not" "$DIR/mvn.log" | head -20 >&2
    echo "[trino] Maven could not fetch $1 (above)" >&2; exit 1
  fi
}

if [[ "$(cat "$DIR/.stamp" 2>/dev/null)" != "$VERSION" ]]; then
  rm -rf "$DIR" && mkdir -p "$DIR"
  log "fetching trino-server-core $VERSION and its Iceberg plugin with Maven"
  get "io.trino:trino-server-core:$VERSION:tar.gz"
  get "io.trino:trino-iceberg:$VERSION:zip"
  repo="$(mvn -B -q -Dstyle.color=never help:evaluate -Dexpression=settings.localRepository -DforceStdout 2>/dev/null || true)"
  [[ -d "$repo" ]] || repo="$HOME/.m2/repository"
  m2="$repo/io/trino"
  tar xzf "$m2/trino-server-core/$VERSION/trino-server-core-$VERSION.tar.gz" -C "$DIR"
  mv "$DIR/trino-server-core-$VERSION" "$DIR/server"
  rm -rf "$DIR/server/plugin" && mkdir -p "$DIR/server/plugin"
  python3 -m zipfile -e "$m2/trino-iceberg/$VERSION/trino-iceberg-$VERSION.zip" "$DIR/server/plugin"
  mv "$DIR/server/plugin/trino-iceberg-$VERSION" "$DIR/server/plugin/iceberg"
  chmod +x "$DIR"/server/bin/launcher "$DIR"/server/bin/linux-*/launcher 2>/dev/null || true
  # Unpacked, the archives are not needed again (the stamp keeps a re-run from fetching them);
  # kept, they were another 540 MB on the disk.
  rm -rf "$m2/trino-server-core/$VERSION" "$m2/trino-iceberg/$VERSION"
  echo "$VERSION" > "$DIR/.stamp"
fi

java_home=""
for j in "${CDC_TRINO_JAVA_HOME:-}" /usr/lib/jvm/*; do
  [[ -n "$j" && -x "$j/bin/java" ]] || continue
  v="$("$j/bin/java" -XshowSettings:properties -version 2>&1 | sed -n 's/^ *java.specification.version = //p')"
  if [[ "${v%%.*}" -ge 24 ]]; then java_home="$j"; break; fi
done
if [[ -z "$java_home" ]]; then
  echo "[trino] Trino $VERSION needs Java 24 or newer: none in /usr/lib/jvm; install one (for example" \
       "a Temurin 25 JDK) and set CDC_TRINO_JAVA_HOME to it" >&2
  exit 1
fi
echo "$java_home" > "$DIR/java_home"
log "trino $VERSION in $DIR/server; Java: $java_home"
