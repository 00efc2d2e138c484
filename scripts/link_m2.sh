#!/usr/bin/env bash
# Replaces the jars of a folder that Maven copied out of its local repository (~/.m2) with hard
# links to them, when both are on one disk: the servers' jars would otherwise be on the disk twice
# (about 250 MB; a CI machine had 3 GB free).
#   scripts/link_m2.sh DIR
set -euo pipefail
DIR="$1"
REPO="$HOME/.m2/repository"
[[ -d "$DIR" && -d "$REPO" ]] || exit 0
[[ "$(stat -c %d "$DIR")" == "$(stat -c %d "$REPO")" ]] || exit 0
declare -A in_repo
while IFS= read -r -d '' f; do in_repo["$(basename "$f")"]="$f"; done < <(find "$REPO" -name '*.jar' -print0)
for f in "$DIR"/*.jar; do
  src="${in_repo[$(basename "$f")]:-}"
  if [[ -n "$src" ]] && cmp -s "$src" "$f"; then ln -f "$src" "$f"; fi
done
