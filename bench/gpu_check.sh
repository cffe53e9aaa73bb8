#!/usr/bin/env bash
# GPU smoke check, for a machine with one (or more) NVIDIA GPUs; under 10 minutes on one H100/H200.
#
#   bash bench/gpu_check.sh            # from the repository root
#
# Prints one JSON line per check ({"check", "status": pass|fail|skip, "seconds", "detail"}) and a
# final {"check": "summary", ...} line; exits 1 when any check failed, 0 otherwise. Without CUDA
# (no nvidia-smi, or torch sees no GPU) it prints one "skip" line and exits 0.
#
# Checks, in order (each under its own time limit, so the whole stays under 10 minutes):
#   nvidia-smi          the driver sees the GPU(s)
#   te_layer_spec       Megatron model built with the Transformer Engine layer spec, logits vs the CPU reference
#   nccl_tp2            the same model at TP=2 over NCCL (skipped with a message on one GPU)
#   pipeline_<engine>_<model>   the whole pipeline (profile .. export, search=quick distill=quick) on
#                       tiny_llama and tiny_hybrid with the tiny_trtllm_gpu / tiny_vllm_gpu targets
#                       (conf/target/), the engine worker under the engine's own interpreter
#   bridge_recovery_recipe   recovery distillation as a Megatron-Bridge recipe (models/bridge_recipe.py):
#                       a heterogeneous student checkpoint written by the project, the parent as teacher,
#                       16 steps of Megatron-Bridge's distill loop under torchrun (1 GPU), checkpoint saved.
#                       Written against megatron-bridge 0.6.2; untested on a GPU so far (docs/nemo.md)
#
# Environment:
#   PY                  the project's interpreter (default .venv/bin/python, else python3)
#   ACN_TRTLLM_PYTHON   interpreter with tensorrt_llm (default: PY when it imports tensorrt_llm)
#   ACN_VLLM_PYTHON     interpreter with a CUDA vllm  (default: PY when it imports vllm)
#                       an engine found in neither is a "skip" with the reason, not a pass
#   GPU_CHECK_DIR       where run directories and logs go (default: a new temporary directory)
#   GPU_CHECK_PIPELINE_S  time limit of one pipeline run in seconds (default 105)
#   ACN_BRIDGE_PYTHON   interpreter with megatron.bridge and Transformer Engine (default: PY when it
#                       imports megatron.bridge, e.g. the NeMo Framework container); none: a "skip"
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
if [[ -z "${PY:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT="${GPU_CHECK_DIR:-$(mktemp -d -t acn-gpu-check.XXXXXX)}"
mkdir -p "$OUT"
PIPELINE_S="${GPU_CHECK_PIPELINE_S:-105}"
FAILED=()
PASSED=0
SKIPPED=0

# json_str TEXT: TEXT as a JSON string (bash only: the check must report even where no python runs)
json_str() {
  local s="$1"
  s=${s//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//$'\n'/\\n}
  s=${s//$'\r'/\\r}
  s=${s//$'\t'/\\t}
  printf '"%s"' "$s"
}

# emit CHECK STATUS SECONDS DETAIL: one JSON line
emit() {
  printf '{"check": %s, "status": %s, "seconds": %s, "detail": %s}\n' \
    "$(json_str "$1")" "$(json_str "$2")" "$3" "$(json_str "$4")"
  case "$2" in
    pass) PASSED=$((PASSED + 1)) ;;
    skip) SKIPPED=$((SKIPPED + 1)) ;;
    *) FAILED+=("$1") ;;
  esac
}

# last lines of a log, on one line, for a detail field
tail_of() { tail -n "${2:-5}" "$1" 2>/dev/null | tr '\n' ' ' | tr -d '\000-\010\013\014\016-\037' | cut -c1-1500; }

# run CHECK LIMIT_S LOG -- COMMAND...: pass on exit 0; fail (with the log's tail) otherwise
run_check() {
  local name="$1" limit="$2" log="$3"
  shift 4
  local t0=$SECONDS rc=0
  timeout --kill-after=15 "$limit" "$@" >"$log" 2>&1 || rc=$?
  local dt=$((SECONDS - t0))
  if [[ $rc -eq 0 ]]; then
    emit "$name" pass "$dt" "$(tail_of "$log" 2)"
  elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
    emit "$name" fail "$dt" "timed out after ${limit} s; log $log: $(tail_of "$log")"
  else
    emit "$name" fail "$dt" "exit $rc; log $log: $(tail_of "$log")"
  fi
}

# --- no CUDA: a clean skip --------------------------------------------------------------------
if ! command -v nvidia-smi >/dev/null 2>&1; then
  emit cuda skip 0 "no nvidia-smi on PATH: no NVIDIA driver on this machine; nothing to check"
  echo "gpu_check: skipped (no CUDA on this machine)"
  exit 0
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  emit cuda skip 0 "torch.cuda.is_available() is False under $PY (CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES-}'); nothing to check"
  echo "gpu_check: skipped (no CUDA device visible to torch)"
  exit 0
fi

# --- driver -----------------------------------------------------------------------------------
run_check nvidia-smi 20 "$OUT/nvidia-smi.log" -- \
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')

# --- Transformer Engine layer spec ------------------------------------------------------------
if "$PY" -c 'import transformer_engine.pytorch' >/dev/null 2>&1; then
  run_check te_layer_spec 120 "$OUT/te.log" -- "$PY" bench/gpu_check_probe.py te
else
  emit te_layer_spec fail 0 "transformer_engine.pytorch does not import under $PY (the training image has it: Dockerfile)"
fi

# --- NCCL, TP=2 -------------------------------------------------------------------------------
if [[ "$NGPU" -ge 2 ]]; then
  run_check nccl_tp2 120 "$OUT/nccl.log" -- \
    "$PY" -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node=2 bench/gpu_check_probe.py nccl
else
  emit nccl_tp2 skip 0 "one GPU ($NGPU visible): TP=2 over NCCL needs two"
fi

# --- the pipeline end to end in each engine ---------------------------------------------------
engine_python() { # ENGINE MODULE ENVVAR -> the interpreter that imports MODULE, or nothing
  local given="${!3:-}"
  if [[ -n "$given" ]]; then echo "$given"; return; fi
  if "$PY" -c "import $2" >/dev/null 2>&1; then echo "$PY"; fi
}
for spec in "trtllm tensorrt_llm ACN_TRTLLM_PYTHON" "vllm vllm ACN_VLLM_PYTHON"; do
  read -r engine module var <<<"$spec"
  epy="$(engine_python "$engine" "$module" "$var")"
  for model in tiny_llama tiny_hybrid; do
    name="pipeline_${engine}_${model}"
    if [[ -z "$epy" ]]; then
      emit "$name" skip 0 "no interpreter with $module: set $var=/path/to/venv/bin/python (docs/engines.md)"
      continue
    fi
    run_check "$name" "$PIPELINE_S" "$OUT/$name.log" -- \
      "$PY" -m autocompress_nemo.search "model=$model" "+target=tiny_${engine}_gpu" search=quick distill=quick \
      "target.engine.python=$epy" "run_dir=$OUT/runs/$name"
  done
done

# --- recovery distillation as a Megatron-Bridge recipe ----------------------------------------
bpy="${ACN_BRIDGE_PYTHON:-}"
if [[ -z "$bpy" ]] && "$PY" -c 'import megatron.bridge' >/dev/null 2>&1; then bpy="$PY"; fi
if [[ -z "$bpy" ]]; then
  emit bridge_recovery_recipe skip 0 "no interpreter with megatron.bridge: set ACN_BRIDGE_PYTHON (the NeMo Framework container's python; docs/nemo.md)"
elif ! "$bpy" -c 'import transformer_engine.pytorch' >/dev/null 2>&1; then
  emit bridge_recovery_recipe fail 0 "$bpy has megatron.bridge but no transformer_engine.pytorch (megatron.bridge 0.6.2 needs it on GPU)"
else
  BR="$OUT/bridge"
  run_check bridge_recovery_recipe 240 "$OUT/bridge.log" -- bash -c "
    set -e
    ACN_BRIDGE_PYTHON='$bpy' '$PY' bench/gpu_check_bridge.py '$BR'
    PYTHONPATH=\"\$PWD\" '$bpy' -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node=1 \
      -m autocompress_nemo.models.bridge_recipe --config '$BR/inputs.json' --out '$BR/recipe.yaml' --run
    ls -d '$BR'/bridge_distill/checkpoints/iter_* >/dev/null
    echo 'Megatron-Bridge distill ran and saved a checkpoint'"
fi

# --- summary ----------------------------------------------------------------------------------
failed=""
for f in "${FAILED[@]}"; do failed+="${failed:+, }$(json_str "$f")"; done
printf '{"check": "summary", "status": %s, "passed": %d, "skipped": %d, "failed": [%s], "logs": %s}\n' \
  "$(json_str "$([[ ${#FAILED[@]} -gt 0 ]] && echo fail || echo pass)")" "$PASSED" "$SKIPPED" "$failed" "$(json_str "$OUT")"
if [[ ${#FAILED[@]} -gt 0 ]]; then
  echo "gpu_check: FAILED: ${FAILED[*]} (logs in $OUT)" >&2
  exit 1
fi
echo "gpu_check: all checks passed or skipped (logs in $OUT)"
