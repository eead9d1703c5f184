#!/usr/bin/env bash
# Installs NVIDIA's aiperf (PyPI, pinned) into the project-local .tools/aiperf/ (its own venv), for
# `make bench-aiperf`: the field's own load generator as an independent client of the gateway.
# Idempotent: a stamp file records the pin, and a second run with the same pin does nothing.
# About 1.2 GB installed on the first run (transformers, pandas, ...).
# Prints the path of the `aiperf` executable on stdout when done; progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS="${KVMESH_TOOLS:-$PWD/.tools}"
DIR="$TOOLS/aiperf"
VENV="$DIR/venv"
PIN="aiperf==0.13.0"

say() { printf 'setup-aiperf: %s\n' "$*" >&2; }

stamp="$DIR/.installed"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$PIN" ]; then
  mkdir -p "$DIR"
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV"
    python3 -m venv "$VENV"
  fi
  say "installing $PIN"
  "$VENV/bin/pip" install --disable-pip-version-check --progress-bar off "$PIN" 2>&1 \
    | grep --line-buffered -E '^(Collecting|Installing|Successfully)' >&2 || true
  "$VENV/bin/aiperf" --version >/dev/null 2>&1 || "$VENV/bin/aiperf" --help >/dev/null || { say "aiperf did not install"; exit 1; }
  printf '%s' "$PIN" > "$stamp"
fi
printf '%s\n' "$VENV/bin/aiperf"
