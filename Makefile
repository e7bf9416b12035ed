# Two commands on a fresh clone: `make demo` and `make test`. Both build .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lab bench lint clean

$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m notebook_accel.demo notebooks/quickstart.ipynb

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check notebook_accel tests benchmarks

lab: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir notebooks

# The benchmark environment adds accelerate 1.15.0, only to measure against it.
bench: $(STAMP)
	$(BIN)/python -m pip install -q accelerate==1.15.0
	$(BIN)/python benchmarks/launch.py

clean:
	rm -rf $(VENV) build dist *.egg-info
