#!/usr/bin/env bash
# Megatron-Bridge (the NeMo Framework's LLM side) in a venv of its own:
#
#   scripts/make_bridge_venv.sh [DIR]      # default DIR: .venv-bridge in the repository root
#
# then the Megatron-Bridge tests (tests/test_megatron_bridge*.py) and autocompress_nemo/models/bridge.py
# use DIR/bin/python ($ACN_BRIDGE_PYTHON, else .venv-bridge/bin/python). Measured: ~5 min on 2 shared
# cores (most of it torch), ~6 GB. CI (.ci/run) does not build it: the tests skip, saying why.
#
# Why a venv of its own: megatron-bridge 0.6.2 requires transformers>=5.8,<=5.12.1 and the project
# runs on transformers 5.24 (in the project's venv `import megatron.bridge` fails with
# "No module named transformers.modeling_attn_mask_utils").
# Why --no-deps: its declared dependencies pull wandb, mlflow, comet-ml, flashinfer (+cubin),
# timm, open-clip-torch, qwen-vl-utils, nvidia-resiliency-ext, fast-hadamard-transform,
# flash-linear-attention and megatron-core[dev,mlm]; none of them is imported by `import
# megatron.bridge`, AutoBridge, the GPT / Llama-Nemotron / Nemotron-H bridges or the checkpoint
# loader. What the imports need is listed in IMPORT_DEPS below (measured: each one was added
# after the import failed without it). transformer-engine is never installed (it breaks
# `import megatron.core` on a machine without CUDA); megatron.bridge 0.6.2 imports it at
# peft/lora_layers.py:20, so models/bridge.py imports it with an import-only stand-in.
# nvidia-resiliency-ext is left out: the only version PyPI has for this platform, 0.4.1, has no
# __version__ and breaks `import megatron.core` 0.19.2 (dist_checkpointing/strategies/nvrx.py:85);
# without it the training loops (training/pretrain.py:19) do not import, conversion and checkpoint
# loading do. torch comes from constraints.txt (the wheel the project's venv already uses).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/.venv-bridge}"
BRIDGE_VERSION="${BRIDGE_VERSION:-0.6.2}"
# inside megatron-bridge 0.6.2's range (>=5.8,<=5.12.1), the newest it allows
TRANSFORMERS_VERSION="${TRANSFORMERS_VERSION:-5.12.1}"
IMPORT_DEPS=(
  "megatron-core>=0.19,<0.20"      # the project's megatron-core (bridge 0.6.2 asks for [dev,mlm] extras: not imported)
  "transformers==$TRANSFORMERS_VERSION"
  diffusers                          # megatron/bridge/__init__.py imports megatron.bridge.diffusion.models
  accelerate peft datasets           # transformers integrations and bridge.peft / data imported by models
  einops omegaconf "hydra-core>=1.3.4,<1.4" rich pyyaml regex six tqdm safetensors typing-extensions
  psutil                             # megatron-core dist_checkpointing (torch_dist) on save
  gguf                               # transformers' gguf_file= loader (the SmolLM2 GGUF as a parent)
  sentencepiece tokenizers
  pillow                             # VLM bridges import PIL at module level
  tensorboard
  nvidia-modelopt                    # megatron/bridge/training/checkpointing.py imports modelopt.torch.opt (and KD: modelopt.torch.distill)
  megatron-energon                   # megatron/bridge/training/model_load_save.py -> data/energon imports megatron.energon
)

# `import megatron.bridge` fails without Transformer Engine (megatron/bridge/peft/lora_layers.py:20);
# autocompress_nemo.models.bridge.import_bridge() imports it with an import-only stand-in
check() {
  PYTHONPATH="$ROOT" "$1" - <<'PY'
from autocompress_nemo.models.bridge import import_bridge
v = import_bridge()["versions"]
import megatron.bridge.training.model_load_save  # noqa: F401,E402  (the checkpoint loader)
from megatron.bridge import AutoBridge  # noqa: F401,E402
print("[bridge] " + ", ".join(f"{k} {x}" for k, x in v.items()))
PY
}
if [[ -x "$DIR/bin/python" ]] && "$DIR/bin/python" -c 'import importlib.util as u, sys; sys.exit(0 if u.find_spec("megatron.bridge") else 1)' >/dev/null 2>&1; then
  echo "[bridge] $DIR already has megatron-bridge"
  check "$DIR/bin/python"
  exit 0
fi
find_python() {
  local prefix
  if command -v pyenv >/dev/null 2>&1; then
    for full in 3.12.1 $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)' | sort -rV); do
      prefix="$(pyenv prefix "$full" 2>/dev/null || true)"
      [[ -n "$prefix" && -x "$prefix/bin/python3.12" ]] && { echo "$prefix/bin/python3.12"; return 0; }
    done
  fi
  command -v python3.12 >/dev/null 2>&1 && { command -v python3.12; return 0; }
  return 1
}
PY="$(find_python)" || { echo "error: no Python 3.12 for megatron-bridge (it requires >=3.12,<3.13)" >&2; exit 1; }
start=$(date +%s)
echo "[bridge] creating $DIR with $PY"
"$PY" -m venv "$DIR"
VPY="$DIR/bin/python"
"$VPY" -m pip install --quiet --upgrade pip wheel setuptools
cd "$ROOT"
"$VPY" -m pip install --quiet -c constraints.txt torch
"$VPY" -m pip install --quiet -c constraints.txt "${IMPORT_DEPS[@]}"
"$VPY" -m pip install --quiet --no-deps "megatron-bridge==$BRIDGE_VERSION"
# mamba-ssm's Python code for the Nemotron-H bridge (no CUDA build; as in .ci/run)
MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE \
  "$VPY" -m pip install --quiet --no-deps --no-build-isolation mamba-ssm==2.3.2.post1
# the project is not installed here: its code runs in this venv with PYTHONPATH=<repo> (the
# project's transformers cap is not this venv's)
check "$VPY"
echo "[bridge] installed in $(( $(date +%s) - start )) s"
