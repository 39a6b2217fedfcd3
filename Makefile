# The two commands a newcomer needs: `make demo` (a local 4-node testnet) and `make test`.
# Both create or reuse .venv by themselves.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
NODES  ?= 4

.PHONY: demo test test-fast lint bench bench-gpu venv clean

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

# Two workers: one runs every test that starts node processes, one after the other (two
# at once on 2 cores failed); the other runs the in-process tests beside it
# (tests/conftest.py groups them).
test: venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=15

# The edit loop: everything but the tests that start node processes (marked slow) and the
# js-libp2p interop test, on 2 workers (a file per worker, tests/conftest.py); about a minute.
test-fast: venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup -m "not slow and not interop"

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: venv
	$(BIN)/node bench all

# On a machine with a CUDA GPU, with the machine's own CUDA build of torch (not the venv's
# CPU wheel): the trainer bench on CUDA, the CUDA tests, a join's compile (about 4 min).
bench-gpu:
	bash testnet/bench/gpu_checks.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
