# One entry point for people and CI. `make test` bootstraps .venv from this repo's files.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

export RAY_USAGE_STATS_ENABLED=0
export TOKENIZERS_PARALLELISM=false

.PHONY: install test serve loadtest bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

serve: $(STAMP)
	$(BIN)/serve run serve_config.yaml

bench: $(STAMP)
	$(BIN)/python -m loadtests.bench_engine --quick

clean:
	rm -rf $(VENV) .pytest_cache
