# `make repro` runs the pipeline, `make test` the tests; both set up .venv first.
VENV   ?= .venv
PYTHON ?= python3
TORCH  ?= torch==2.13.0
BIN    := $(CURDIR)/$(VENV)/bin
export PATH := $(BIN):$(PATH)

.PHONY: repro test ui reference bench bench-scale lock preset docs

$(VENV)/.installed: pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -c requirements.lock -e '.[test,docs,hf]'
	touch $@

# Ends with the verdict: whether this run reproduced the committed reference of its recipe.
repro: $(VENV)/.installed
	dvc repro
	@transformer verdict

test: $(VENV)/.installed
	python -m pytest -q -n auto --dist loadfile

# The runs table of params.yaml's experiment: a run per training, its evaluations nested under it.
UI_HOST ?= 127.0.0.1
UI_PORT ?= 5000
ui: $(VENV)/.installed
	@MLFLOW_TRACKING_URI=sqlite:///$(CURDIR)/mlflow.db python -c 'from transformer.tracking import runs_table_url; \
	print("runs table:", runs_table_url("params.yaml", "http://$(UI_HOST):$(UI_PORT)"))'
	mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --host $(UI_HOST) --port $(UI_PORT)

# The documentation site on http://$(DOCS_ADDR), rebuilt on every edit. The annotated model's page
# (docs/annotated.md and its figures) is written by running docs/annotated.py, again when it or the package changes.
DOCS_ADDR ?= 127.0.0.1:8000
export NO_MKDOCS_2_WARNING := 1
docs: $(VENV)/.installed docs/annotated.md
	mkdocs serve --dev-addr $(DOCS_ADDR)

docs/annotated.md: docs/annotated.py docs/tools/render.py $(shell find transformer -name '*.py') | $(VENV)/.installed
	python docs/tools/render.py

# Makes the finished run in this checkout its recipe's committed reference (bench/reference.py).
reference: $(VENV)/.installed
	python -m bench.reference

bench: $(VENV)/.installed
	python -m bench.bench

# The data path at WMT14 scale (4.5M pairs, about 6 GB of disk); PAIRS=200000 for a smaller run.
PAIRS ?= 4500000
bench-scale: $(VENV)/.installed
	python -m bench.scale --pairs $(PAIRS)

# Switch recipe: make preset P=multi30k_en_de (see params/; P=multi30k_de_en is the default).
# It builds params.yaml from the default and the preset and swaps the run records (dvc.lock,
# metrics, plots) through params/runs/; FORCE=1 drops edits params.yaml has beyond its preset.
preset: $(VENV)/.installed
	python -m transformer.presets $(P) $(if $(FORCE),--force)

# Re-pin the environment from the current venv (torch is pinned above, by TORCH).
lock:
	$(BIN)/python -m pip freeze --exclude-editable | grep -v -E '^(torch|reproducible-transformer)[=@ ]' > requirements.lock && echo "$(TORCH)" >> requirements.lock
