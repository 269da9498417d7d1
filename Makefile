# `make repro` runs the pipeline, `make test` the tests; both set up .venv first.
VENV   ?= .venv
PYTHON ?= python3
TORCH  ?= torch==2.13.0
BIN    := $(CURDIR)/$(VENV)/bin
export PATH := $(BIN):$(PATH)

.PHONY: repro test ui bench lock preset

$(VENV)/.installed: pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -c requirements.lock -e '.[test]'
	touch $@

repro: $(VENV)/.installed
	dvc repro

test: $(VENV)/.installed
	python -m pytest -q

ui: $(VENV)/.installed
	mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --host 127.0.0.1 --port 5000

bench: $(VENV)/.installed
	python bench/bench.py

# Switch recipe: make preset P=multi30k_en_de (see params/).
preset:
	cp params/$(P).yaml params.yaml

# Re-pin the environment from the current venv (torch is pinned above, by TORCH).
lock:
	$(BIN)/python -m pip freeze --exclude-editable | grep -v -E '^(torch|reproducible-transformer)[=@ ]' > requirements.lock && echo "$(TORCH)" >> requirements.lock
