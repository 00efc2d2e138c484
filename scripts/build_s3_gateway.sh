#!/usr/bin/env bash
# Builds the real S3-compatible server the tests run against (devstack.localstack.LocalS3Gateway):
# Versity's S3 gateway (versitygw, Apache-2.0), from the Go module proxy, into .cache/bin. Its
# posix backend keeps each object as a plain file, so a test can age one (orphan-file cleanup
# removes only files older than a day). A re-run with the binary present does nothing. Needs Go
# 1.21 or newer (`make test` runs this; the demo does not need it): versitygw asks for Go 1.25,
# which Go's toolchain switch (GOTOOLCHAIN=auto) fetches from the Go module proxy when older.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VERSION="v1.8.0"
BIN="$ROOT/.cache/bin"
log() { echo "[s3-gateway] $*"; }
if [[ -x "$BIN/versitygw" ]] && [[ "$(cat "$BIN/versitygw.version" 2>/dev/null)" == "$VERSION" ]]; then
  log "versitygw $VERSION in $BIN"; exit 0
fi
command -v go >/dev/null 2>&1 || { log "Go 1.21+ is needed to build the tests' S3 server (https://go.dev/dl; Debian 12's golang-go is 1.19)" >&2; exit 1; }
mkdir -p "$BIN"
log "building versitygw $VERSION with $(go version | cut -d' ' -f3) (about 3 minutes, once)"
# Its modules, the Go toolchain it asks for and the build cache (760 MB) live in a scratch folder
# removed after the build: the binary is all the tests need, and a CI machine had 3 GB free.
scratch="$(mktemp -d)"
trap 'chmod -R u+w "$scratch" 2>/dev/null; rm -rf "$scratch"' EXIT
GOMODCACHE="$scratch/mod" GOCACHE="$scratch/build" GOPATH="$scratch/path" GOTOOLCHAIN=auto GOBIN="$BIN" \
  GOFLAGS=-trimpath nice -n 10 go install "github.com/versity/versitygw/cmd/versitygw@$VERSION"
echo "$VERSION" > "$BIN/versitygw.version"
log "versitygw $VERSION in $BIN"
