# fastload developer commands. Each target creates or updates the virtualenv itself.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: demo test lint bench ceph-up ceph-down clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned so pip takes the CPU wheel (an unpinned torch pulls a multi-GB CUDA build).
	$(PY) -m pip install --quiet 'torch==2.13.0'
	$(PY) -m pip install --quiet -e '.[dev,dali,s3]'
	touch $(STAMP)

## demo: convert a generated sample corpus and train a few steps on it (local storage)
demo: $(STAMP)
	$(PY) -m fastload.demo

TF_STAMP = .venv-tf/.installed

$(TF_STAMP): tools/tf-venv.sh
	tools/tf-venv.sh

## test: install what the tests need (Debian's Ceph packages, a TensorFlow venv for interop tests),
## lint, type-check and run the whole test suite (it starts a throw-away local Ceph cluster)
test: $(STAMP) $(TF_STAMP)
	tools/system-deps.sh
	$(VENV)/bin/ruff check fastload tests benchmarks tools
	$(VENV)/bin/ruff format --check fastload tests benchmarks tools
	$(VENV)/bin/mypy
	$(PY) -m pytest tests

lint: $(STAMP)
	$(VENV)/bin/ruff check fastload tests benchmarks tools
	$(VENV)/bin/ruff format --check fastload tests benchmarks tools
	$(VENV)/bin/mypy

## bench: run the benchmarks side by side with the peers (see benchmarks/README.md)
bench: $(STAMP)
	$(PY) -m benchmarks.run

ceph-up:
	tools/ceph-up.sh

ceph-down:
	tools/ceph-down.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis demo-output
