#!/usr/bin/env python3
"""Writes random LoRA adapters for a dummy model, in PEFT's format, for the real-vLLM tests.

Usage: make-lora-adapters.py MODEL_DIR OUT_DIR NAME [NAME ...]

For each NAME, OUT_DIR/NAME/ gets an `adapter_config.json` (peft LORA, rank 8, alpha 16, target
q_proj and v_proj) and an `adapter_model.safetensors` with one `lora_A` / `lora_B` pair per target
module per layer, shaped from MODEL_DIR/config.json (a Llama-shaped config: hidden_size,
num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim). The weights are random
(seeded by the adapter's name, so a re-run writes the same bytes) and small: the dummy model's output
is noise anyway; what the tests need is that vLLM loads the adapter and keys its KV blocks by it.
Run with the vLLM venv's python (torch and safetensors are there); nothing is downloaded.
Idempotent: a re-run writes the same bytes (the seed is the name), so it is cheap to run always.
"""

import hashlib
import json
import os
import sys

import torch
from safetensors.torch import save_file

RANK = 8
ALPHA = 16
TARGETS = ("q_proj", "v_proj")


def shapes(config):
    """(module, in_features, out_features) of each target module of one layer."""
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    return [("q_proj", hidden, heads * head_dim), ("v_proj", hidden, kv_heads * head_dim)]


def adapter(config, name):
    """The adapter's tensors, PEFT-named, from a generator seeded by the name."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, fan_in, fan_out in shapes(config):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = torch.randn(RANK, fan_in, generator=gen) * 0.02
            b = torch.randn(fan_out, RANK, generator=gen) * 0.02
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16).contiguous()
    return tensors


def main(argv):
    if len(argv) < 4:
        print(__doc__, file=sys.stderr)
        return 2
    model_dir, out_dir, names = argv[1], argv[2], argv[3:]
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": os.path.abspath(model_dir),
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    text = json.dumps(peft_config, indent=2) + "\n"
    for name in names:
        d = os.path.join(out_dir, name)
        os.makedirs(d, exist_ok=True)
        save_file(adapter(config, name), os.path.join(d, "adapter_model.safetensors"))
        with open(os.path.join(d, "adapter_config.json"), "w") as f:
            f.write(text)
        print(f"make-lora-adapters: wrote {d}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
