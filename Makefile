# Two commands on a fresh clone: `make demo` and `make test`. Both build .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test browser lab bench lint layers conformance clean labextension labextension-dev test-extension

$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m notebook_accel.demo notebooks/quickstart.ipynb

test: $(STAMP) browser labextension-dev test-extension layers
	$(BIN)/python -m pytest -q tests

# accelerate 1.15.0's own distributed test scripts, from its downloaded wheel, run unchanged against
# notebook_accel on 2 and 4 ranks (tests/conformance/). tests/test_conformance.py runs the same in `make test`.
conformance: $(STAMP)
	$(BIN)/python tests/conformance/run.py

# The layer map of ARCHITECTURE.md, as import-linter contracts in pyproject.toml.
layers: $(STAMP)
	$(BIN)/lint-imports

# The JupyterLab extension: TypeScript in extension/, built (node + npm) into notebook_accel/labextension/.
extension/node_modules/.installed: extension/package.json extension/package-lock.json
	cd extension && npm ci --no-audit --no-fund --loglevel=error
	touch $@

labextension: $(STAMP) extension/node_modules/.installed
	cd extension && PATH=$(CURDIR)/$(BIN):$$PATH npm run --silent build

# The editable install builds nothing (tools/labextension_build.py), and may have copied an older
# build: link this one where JupyterLab looks, so a rebuild shows without reinstalling.
labextension-dev: labextension
	mkdir -p $(VENV)/share/jupyter/labextensions
	rm -rf $(VENV)/share/jupyter/labextensions/notebook-accel-labextension
	ln -sfn $(CURDIR)/notebook_accel/labextension $(VENV)/share/jupyter/labextensions/notebook-accel-labextension

test-extension: extension/node_modules/.installed
	cd extension && npm test --silent

# The browser tests drive Debian's Chromium through Playwright; no browser is ever downloaded. Installs
# it once (as root, as CI runs); a no-op when it is there.
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "make browser: installing Debian's chromium for the browser tests"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -qq && apt-get install -y -qq chromium >/dev/null; \
	else \
		echo "make browser: the browser tests need /usr/bin/chromium; run: sudo apt-get install -y chromium"; \
		exit 1; \
	fi

lint: $(STAMP)
	$(BIN)/ruff check notebook_accel tests benchmarks tools

lab: $(STAMP) labextension-dev
	$(BIN)/jupyter lab --notebook-dir notebooks

# Benchmarks run in their own venv: accelerate 1.15.0 and ipyparallel 9.2.0 are installed only there, to
# measure against.
BENCH_VENV := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed

$(BENCH_STAMP): pyproject.toml requirements-dev.txt Makefile
	test -x $(BENCH_VENV)/bin/python || $(PY) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install -q -r requirements-dev.txt accelerate==1.15.0 ipyparallel==9.2.0
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BENCH_VENV)/bin/python benchmarks/launch.py
	$(BENCH_VENV)/bin/python benchmarks/step_overhead.py
	$(BENCH_VENV)/bin/python benchmarks/offload.py
	$(BENCH_VENV)/bin/python benchmarks/session.py
	$(BENCH_VENV)/bin/python benchmarks/fsdp.py

clean:
	rm -rf $(VENV) $(BENCH_VENV) .venv-binder build dist *.egg-info extension/node_modules extension/lib \
		extension/test-build notebook_accel/labextension
