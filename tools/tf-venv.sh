#!/usr/bin/env bash
# Create (or reuse) the separate TensorFlow virtualenv used by fastload's TFRecord interop tests.
#
# TensorFlow pins its own protobuf/numpy ranges, so it lives in its own virtualenv, `.venv-tf` at
# the repository root, never in the main `.venv`. The tests (tests/formats/test_tfrecord.py, marked
# `tensorflow`) run small scripts under this venv's python through a subprocess.
#
# Usage:  tools/tf-venv.sh            # creates/updates .venv-tf, prints its python path last
# Env:    PYTHON=python3.11           interpreter to build the venv from (default: python3.11,
#                                     falling back to python3 if that is 3.11+)
#         TF_VENV=path                where to put the venv (default: <repo>/.venv-tf)
#         TF_PACKAGE=tensorflow-cpu==2.21.0   the pinned TensorFlow requirement
#
# Idempotent: when the venv already imports the pinned TensorFlow version it does nothing but
# print the python path. On success it touches <venv>/.installed (the Makefile's stamp). Exit status is non-zero when TensorFlow cannot be installed or imported.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${TF_VENV:-$repo/.venv-tf}"
package="${TF_PACKAGE:-tensorflow-cpu==2.21.0}"
want_version="${package##*==}"

pick_python() {
  if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; return; fi
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1 &&
      "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
      echo "$candidate"; return
    fi
  done
  echo "tf-venv.sh: no python >= 3.10 found; set PYTHON=/path/to/python3.11" >&2
  exit 1
}

check() {
  "$venv/bin/python" - "$want_version" <<'PY' >/dev/null 2>&1
import os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf
want = sys.argv[1]
sys.exit(0 if want == "" or tf.__version__ == want else 1)
PY
}

if [[ -x "$venv/bin/python" ]] && check; then
  echo "tf-venv.sh: $venv already has $package" >&2
else
  py="$(pick_python)"
  if [[ ! -x "$venv/bin/python" ]]; then
    echo "tf-venv.sh: creating $venv with $py" >&2
    "$py" -m venv "$venv"
  fi
  "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
  echo "tf-venv.sh: installing $package into $venv (large download, a few minutes)" >&2
  "$venv/bin/python" -m pip install --quiet "$package" >&2
  if ! check; then
    echo "tf-venv.sh: $venv/bin/python cannot import $package after installing it" >&2
    exit 1
  fi
fi
touch "$venv/.installed"
echo "$venv/bin/python"
