# fastload developer commands. Each target creates or updates the virtualenv itself.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

# torch is pinned (2.13.0). PyPI's build of it carries CUDA: a 527 MB wheel plus ~2.1 GB of NVIDIA
# libraries (~4.4 GB installed), and it runs on a machine without a GPU. A CPU-only machine can take
# PyTorch's own small CPU build instead: `make demo TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu`
# (the same for `make test`). Empty: PyPI.
TORCH_INDEX_URL ?=
TORCH_PIP_ARGS   = $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL),)

.PHONY: demo test lint bench ceph-up ceph-down clean

$(STAMP): pyproject.toml setup.py fastload/loader/images/_jpegroi.c
	# Debian packages first: the native JPEG region decoder (setup.py) builds against them.
	tools/system-deps.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIP_ARGS) 'torch==2.13.0'
	$(PY) -m pip install --quiet -e '.[dev,dali,s3]'
	touch $(STAMP)

# The demo needs fastload's runtime dependencies only (no extras: no DALI, boto3, pyarrow, mypy,
# pytest), so it gets its own virtualenv (~4.6 GB with PyPI's torch, ~0.9 GB with the CPU build; ~1 GB
# less than $(VENV)) and leaves `make test`'s
# $(VENV) alone. Its stamp has its own name, so `make demo DEMO_VENV=.venv` can reuse a development
# venv that already holds everything (both installs then find nothing to do) without marking it
# complete for `test`. --no-compile: pip byte-compiling all of torch is most of the install time
# (~50 s of ~60 s); Python compiles the modules the demo imports on its first start instead (~7 s).
# The venv's own pip is recent enough (PEP 660 editable installs need pip >= 21.3).
DEMO_VENV  ?= .venv-demo
DEMO_PY     = $(DEMO_VENV)/bin/python
DEMO_PIP    = $(DEMO_PY) -m pip install --no-compile --disable-pip-version-check
DEMO_STAMP  = $(DEMO_VENV)/.demo-installed

$(DEMO_STAMP): pyproject.toml
	@echo "demo: creating the virtualenv $(DEMO_VENV)"
	$(PYTHON) -m venv $(DEMO_VENV)
	@echo "demo: installing torch 2.13.0 and its dependencies ($(if $(TORCH_INDEX_URL),from $(TORCH_INDEX_URL),PyPI's build with CUDA: ~2.6 GB to download, ~4.4 GB installed; it runs on the CPU))"
	$(DEMO_PIP) $(TORCH_PIP_ARGS) 'torch==2.13.0'
	@echo "demo: installing fastload and its runtime dependencies (numpy, pillow, lmdb, ...: ~100 MB installed)"
	$(DEMO_PIP) -e .
	touch $(DEMO_STAMP)

## demo: convert a generated sample corpus, verify it, train a few steps and resume (local storage)
demo: $(DEMO_STAMP)
	@echo "demo: running python -m fastload.demo (the first run after an install also compiles the bytecode of the torch modules it imports, ~7 s)"
	$(DEMO_PY) -m fastload.demo

TF_STAMP = .venv-tf/.installed

$(TF_STAMP): tools/tf-venv.sh
	tools/tf-venv.sh

## lint: ruff (lint and format check) over the code and tests, mypy (strict) over the package
lint: $(STAMP)
	$(VENV)/bin/ruff check fastload tests benchmarks tools
	$(VENV)/bin/ruff format --check fastload tests benchmarks tools
	$(VENV)/bin/mypy

## test: install what the tests need (Debian's Ceph packages, a TensorFlow venv for interop tests),
## lint and type-check (`lint`), then run the whole test suite (it starts a throw-away local Ceph
## cluster)
test: lint $(TF_STAMP)
	tools/system-deps.sh
	$(PY) -m pytest tests

## bench: run the benchmarks side by side with the peers (see benchmarks/README.md)
bench: $(STAMP)
	$(PY) -m benchmarks.run

ceph-up:
	tools/ceph-up.sh

ceph-down:
	tools/ceph-down.sh

.PHONY: hdfs-up hdfs-down
## hdfs-up / hdfs-down: a local HDFS (Hadoop's MiniDFSCluster; needs Java and Maven), see tools/hdfs-up.sh
hdfs-up:
	tools/hdfs-up.sh

hdfs-down:
	tools/hdfs-down.sh

clean:
	rm -rf $(VENV) $(DEMO_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis demo-output
