#!/usr/bin/env bash
# One-command setup on a Debian-like machine with Python 3.11 and Java 17:
#   system packages (apt), a virtualenv with the pinned requirements, Spark's jars from Maven
#   Central (requirements-jvm.txt), the --py-files zip and the local stack's folders. Re-running
#   is quick and changes nothing.
# Options: CDC_SKIP_APT=1 (packages managed elsewhere), CDC_WITH_BROWSER=0 (no Chromium).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
log() { echo "[setup] $*"; }

# --- system packages ---------------------------------------------------------------
APT_PKGS=(postgresql-15 redis-server unzip curl zip)
command -v java >/dev/null 2>&1 || APT_PKGS+=(openjdk-17-jre-headless)
command -v mvn >/dev/null 2>&1 || APT_PKGS+=(maven)
[[ "${CDC_WITH_BROWSER:-1}" == "1" ]] && APT_PKGS+=(chromium)
if [[ "${CDC_SKIP_APT:-0}" != "1" ]]; then
  missing=()
  for p in "${APT_PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if ((${#missing[@]})); then
    SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
    log "apt: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
      || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; }
  else
    log "apt: all present"
  fi
fi

# --- Python --------------------------------------------------------------------------
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if ! command -v uv >/dev/null 2>&1; then
  "$PY" -m pip install -q uv 2>/dev/null || true
fi
stamp=".venv/.cdc-requirements.sha"
# "compiled": a venv installed before its files were compiled at install is installed again once.
want="$( (cat requirements.txt requirements-dev.txt requirements.lock; echo compiled) | sha256sum | cut -d' ' -f1)"
# A first install takes a 2.4 GB venv. pyspark comes as a source archive, and building its wheel
# leaves 1.9 GB of scratch in uv's cache (two source trees and the wheel, measured on 4.1.3), so it
# is installed first and alone and its scratch freed before the rest arrives: the install then
# peaks near 2.5 GB, not 4.3 GB. With less free than that, a warning says why a full disk may stop
# the install (os error 28). Only a warning: a CI run was refused here on a machine whose `df` said
# 3 GB, and df can be wrong where quotas or overlays sit under the checkout.
need_mb=2800
free_mb() { df -Pk "$1" 2>/dev/null | awk 'NR==2 {print int($4 / 1024)}'; }
log "disk: $(free_mb "$ROOT") MB free"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  log "venv: up to date"
else
  uv_cache="${UV_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/uv}"
  mkdir -p "$uv_cache"
  for d in "$ROOT" "$uv_cache"; do
    f="$(free_mb "$d")"
    if [[ -n "$f" && "$f" -lt "$need_mb" ]]; then
      echo "[setup] warning: ${f} MB free on the disk of $d; installing the venv needs about ${need_mb} MB." >&2
      echo "[setup] fix, if it stops with os error 28: free space there, or point UV_CACHE_DIR (uv's cache) at a disk with room." >&2
    fi
  done
  pyspark_pin="$(grep -E '^pyspark==' requirements.lock)"
  if command -v uv >/dev/null 2>&1; then
    [[ -x .venv/bin/python ]] || uv venv -q --seed --python "$PY" .venv
    # Compiled at install (pip does so by default, uv does not): where PYTHONDONTWRITEBYTECODE is
    # set, as on these machines, every process compiled what it imported from source again,
    # 1.6 s more to import Airflow and 1.1 s more for pyspark with the package (#56).
    VIRTUAL_ENV="$ROOT/.venv" uv pip install -q --compile-bytecode "$pyspark_pin" -c requirements.lock
    # The venv's files are hard links into the cache (or copies); either way they stay.
    uv cache clean -q pyspark
    VIRTUAL_ENV="$ROOT/.venv" uv pip install -q --compile-bytecode -r requirements.txt -r requirements-dev.txt -c requirements.lock
  else
    [[ -x .venv/bin/python ]] || "$PY" -m venv .venv
    .venv/bin/pip install -q --no-cache-dir "$pyspark_pin" -c requirements.lock
    .venv/bin/pip install -q -r requirements.txt -r requirements-dev.txt -c requirements.lock
  fi
  echo "$want" > "$stamp"
  log "venv: installed from requirements.lock"
fi

# --- jars, package, local folders ---------------------------------------------------------
scripts/fetch_jars.sh | sed 's/^/[setup] /'
PYTHONPATH="$ROOT/plugins" .venv/bin/python -m cdc_lakehouse.runtime.packaging >/dev/null
mkdir -p .local
log "done"
