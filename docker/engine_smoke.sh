#!/usr/bin/env bash
# Smoke test of a serving image: run an engine worker's `version` task through the worker protocol
# (the way costs/engines/worker.py calls it) and print the response; exit non-zero when it fails.
#
#   bash docker/engine_smoke.sh autocompress_nemo/costs/engines/workers/trtllm_worker.py [PYTHON]
set -euo pipefail
WORKER="${1:?usage: engine_smoke.sh WORKER.py [PYTHON]}"
PY="${2:-python3}"
DIR="$(mktemp -d)"
trap 'rm -rf "$DIR"' EXIT
echo '{"protocol": 1, "task": "version"}' >"$DIR/request.json"
rc=0
"$PY" "$WORKER" "$DIR/request.json" "$DIR/response.json" 2>"$DIR/stderr" || rc=$?
if [[ -f "$DIR/response.json" ]]; then
  cat "$DIR/response.json"
  echo
else
  echo "no response from $WORKER (exit $rc); its stderr:" >&2
  tail -n 40 "$DIR/stderr" >&2
fi
exit "$rc"
