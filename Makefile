# Every target that runs code depends on the virtual environment, so a fresh clone needs no other step.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[runtime,test]'
	@touch $(STAMP)

demo: setup
	$(BIN)/optpipe demo
	$(BIN)/python -m optpipe.cli.train_demo --devices 4 --steps 5

test: setup
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
