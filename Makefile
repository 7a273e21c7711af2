# The README's two commands, on a fresh machine with only Python 3 and make:
#   make serve    the HTTP server on the default model, http://127.0.0.1:8000
#   make test     the test suite
# Both create .venv and install into it once (again only when pyproject.toml or the install
# script change). Options: make serve PORT=8080 HOST=0.0.0.0 MODEL=path/to/model ARGS="..."
# (more `flashserve serve` options); make test ARGS="tests/test_server.py -x" (pytest arguments;
# TEST_WORKERS=0 runs them in this process, without pytest-xdist's workers).

PYTHON ?= python3
VENV ?= .venv
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?=
ARGS ?=
# pytest-xdist workers of `make test`: two keep a 2-core machine (CI's) busy while one test
# waits on a server or a subprocess. Each worker takes whole files (--dist loadfile), so a
# file's module fixtures (a server, a model, an sm_90 compile) are built once a run; xdist's
# loadgroup cannot group with pytest 9.2 (it renames item._nodeid, which 9.2 no longer reads)
TEST_WORKERS ?= 2

BIN := $(VENV)/bin
INSTALL := PIP="$(BIN)/python -m pip" sh docker/install.sh --editable

.PHONY: serve test test-gpu

serve: $(VENV)/.installed
	$(BIN)/flashserve serve --host $(HOST) --port $(PORT) $(if $(MODEL),--model $(MODEL)) $(ARGS)

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(ARGS)

# the CUDA-only tests (skipped by `make test` on a machine without a GPU)
test-gpu: $(VENV)/.installed-test
	$(BIN)/python -m pytest -m gpu $(ARGS)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml docker/install.sh | $(BIN)/python
	$(INSTALL)
	touch $@

# the test install is a superset of the plain one: it stamps both
$(VENV)/.installed-test: pyproject.toml docker/install.sh | $(BIN)/python
	$(INSTALL) test
	touch $@ $(VENV)/.installed
