# Two commands on a fresh clone: `make demo` and `make test`. Both build .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-py312 browser lab bench lint layers conformance clean labextension labextension-dev test-extension

$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m notebook_accel.demo notebooks/quickstart.ipynb

# The 3.12 venv (mostly a 3 GB download) builds in the background while the main suite runs; its
# smoke tests run after the suite. Either failing fails `make test`.
test: $(STAMP) browser labextension-dev test-extension layers
	$(MAKE) --no-print-directory $(STAMP312) > $(VENV312).log 2>&1 & builder=$$!; \
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not alone and not ray" --durations=25 tests; suite=$$?; \
	$(BIN)/python -m pytest -q -m "alone or ray" tests || suite=1; \
	if ! wait $$builder; then cat $(VENV312).log; echo "make test: building $(VENV312) failed (its log is above)"; exit 1; fi; \
	$(MAKE) --no-print-directory test-py312 && exit $$suite

# The inner loop: the unit tier (tests/tiers.py: no process, no kernel) and a smoke set of real
# launches: fork and spawn on 2 ranks, one session cell, one of accelerate's scripts on 2 ranks.
SMOKE := "tests/test_launcher.py::test_results_are_indexed_by_local_rank[fork-2]" \
	"tests/test_launcher.py::test_results_are_indexed_by_local_rank[spawn-2]" \
	"tests/test_session.py::test_state_lives_across_cells[fork]" \
	"tests/test_conformance.py::test_accelerate_script_passes[test_ops-2]"

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m unit tests
	$(BIN)/python -m pytest -q $(SMOKE)

# Python 3.12 (Colab's and Kaggle's) beside the dev venv's 3.11: a smoke subset (a fork and a spawn
# launch, the %%accelerate magic in a kernel, the quickstart notebook). No CPU torch wheel for cp312
# lies on this machine kind: PyPI's CUDA build comes instead (4.7 GB; 2 to 6 min, by load, once per venv).
PY312 ?= $(firstword $(wildcard /root/.pyenv/versions/3.12*/bin/python3.12) python3.12)
VENV312 := .venv-py312
STAMP312 := $(VENV312)/.installed
SMOKE312 := "tests/test_launcher.py::test_results_are_indexed_by_local_rank[fork-2]" \
	"tests/test_launcher.py::test_results_are_indexed_by_local_rank[spawn-2]" \
	tests/test_magics.py::test_cell_runs_on_two_ranks_with_the_notebook_globals \
	tests/test_magics.py::test_spawn_cell_uses_a_class_from_an_earlier_cell \
	tests/test_quickstart_notebook.py

$(STAMP312): pyproject.toml requirements-dev.txt Makefile
	@$(PY312) -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' || \
		{ echo "make test-py312: no Python 3.12 at PY312=$(PY312); run: make test PY312=/path/to/python3.12"; exit 1; }
	test -x $(VENV312)/bin/python || $(PY312) -m venv $(VENV312)
	$(VENV312)/bin/python -m pip install -q --upgrade pip
	$(VENV312)/bin/python -m pip install -q torch==2.13.0 -e . pytest pytest-timeout nbclient nbformat matplotlib
	touch $(STAMP312)

test-py312: $(STAMP312)
	$(VENV312)/bin/python -m pytest -q $(SMOKE312)

# accelerate 1.15.0's own tests run unchanged against notebook_accel (tests/conformance/): its distributed
# test scripts (from its wheel) on 2 and 4 ranks, and its unit tests (from its sdist).
# tests/test_conformance.py runs the same in `make test`.
conformance: $(STAMP)
	$(BIN)/python tests/conformance/run.py
	$(BIN)/python tests/conformance/units.py

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

# Benchmarks run in their own venv: accelerate 1.15.0, ipyparallel 9.2.0 and Ray Train (ray[train] 2.60.0,
# for TorchTrainer) are installed only there, to measure against.
BENCH_VENV := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed

$(BENCH_STAMP): pyproject.toml requirements-dev.txt Makefile
	test -x $(BENCH_VENV)/bin/python || $(PY) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install -q -r requirements-dev.txt accelerate==1.15.0 ipyparallel==9.2.0 \
		"ray[train]==2.60.0"
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BENCH_VENV)/bin/python benchmarks/launch.py
	$(BENCH_VENV)/bin/python benchmarks/step_overhead.py
	$(BENCH_VENV)/bin/python benchmarks/offload.py
	$(BENCH_VENV)/bin/python benchmarks/prefetch.py
	$(BENCH_VENV)/bin/python benchmarks/session.py
	$(BENCH_VENV)/bin/python benchmarks/fsdp.py
	$(BENCH_VENV)/bin/python benchmarks/ray_engine.py

clean:
	rm -rf $(VENV) $(BENCH_VENV) $(VENV312) $(VENV312).log .venv-binder build dist *.egg-info extension/node_modules extension/lib \
		extension/test-build notebook_accel/labextension
