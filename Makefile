# The two commands a newcomer needs: `make demo` (a local 4-node testnet) and `make test`.
# Both create or reuse .venv by themselves.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
NODES  ?= 4

.PHONY: demo test lint bench venv clean

venv: $(VENV)/.installed

# torch comes from the local CPU wheel first, so nothing below can pull a CUDA build.
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

demo: venv
	$(BIN)/node testnet up --nodes $(NODES)

test: venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: venv
	$(BIN)/node bench all

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
