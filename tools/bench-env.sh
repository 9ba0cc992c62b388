#!/usr/bin/env bash
# Build (or check) `.venv-bench`: the virtualenv in which the benchmark peers run.
#
# The peers (litdata, mosaicml-streaming, FFCV) must not live in fastload's `.venv`: their declared
# dependencies pull a CUDA torchvision that replaces the pinned CPU torch 2.13.0 and then fails
# (`operator torchvision::nms does not exist`), mosaicml-streaming pins numpy<2.2, and FFCV needs a
# C++ build against Debian's libturbojpeg and OpenCV. So this script builds a separate venv that
#
#   * reuses the main venv's site-packages through a `.pth` file (torch, numpy, fastload itself,
#     boto3, ... are the very same files: the peers are measured on the same torch as fastload);
#   * installs every peer and each dependency it really needs at import/run time with --no-deps,
#     at pinned versions, so pip can never replace or shadow torch or numpy;
#   * puts stand-in `torchvision` and `transformers` packages on its path (mosaicml-streaming
#     imports a handful of names from them at import time; nothing measured uses them). They have
#     no dist-info on purpose: litdata asks importlib.metadata whether torchvision is installed and
#     must keep hearing "no", or it would route image decoding through torchvision.io;
#   * builds FFCV 1.0.2 from its PyPI sdist (needs `libturbojpeg0-dev libopencv-dev pkg-config`; run
#     as root, or with sudo available, the script apt-get installs them when missing), with numba
#     and opencv-python-headless (a NumPy-2 build) next to it.
#
# Usage:  tools/bench-env.sh [--no-ffcv] [--force]
#           --no-ffcv   skip FFCV (and its apt packages / C++ build); bench_ffcv then reports a skip
#           --force     reinstall every pinned package (FFCV too), whatever the stamp says
# Env:    BENCH_VENV=path     where to build (default: <repo>/.venv-bench; the benchmarks look there)
#         MAIN_VENV=path      the venv whose site-packages are shared (default: <repo>/.venv)
#         PYTHON=python3.11   interpreter for a new venv (default: the main venv's base interpreter)
#         PIP_ARGS="..."      extra arguments for every pip install (e.g. an index URL)
#
# Idempotent: the stamp `<venv>/.bench-env` holds a hash of the pinned package list and the FFCV
# choice; when it matches and every import check passes the script only prints what is there.
# On success the last line of stdout is the venv's python. Exit status is non-zero, with the
# reason on stderr, when anything cannot be installed or imported, or when torch in either venv
# is not the main venv's torch afterwards.
set -euo pipefail

# --- pinned versions (change here; the stamp hash covers this block) --------------------------
LITDATA_PKGS=(litdata==0.2.76 lightning-utilities==0.15.3 tifffile==2026.3.3
  requests==2.34.2 certifi==2026.10.19.post1 charset-normalizer==3.5.3)
STREAMING_PKGS=(mosaicml-streaming==0.13.0 catalogue==2.0.10 xxhash==4.1.0 zstd==1.5.7.2
  brotli==1.2.1 python-snappy==0.7.3 cramjam==2.14.0)
FFCV_PKGS=(numba==0.68.1 llvmlite==0.50.0 opencv-python-headless==4.12.0.88)
FFCV_SDIST=ffcv==1.0.2
APT_PKGS=(libturbojpeg0-dev libopencv-dev pkg-config g++)
# -----------------------------------------------------------------------------------------------

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${BENCH_VENV:-$repo/.venv-bench}"
main_venv="${MAIN_VENV:-$repo/.venv}"
with_ffcv=1
force=0
for arg in "$@"; do
  case "$arg" in
    --no-ffcv) with_ffcv=0 ;;
    --force) force=1 ;;
    -h | --help) sed -n '2,33p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench-env.sh: unknown argument $arg (try --help)" >&2; exit 2 ;;
  esac
done

t_start=$SECONDS
say() { echo "bench-env: $*" >&2; }
die() { echo "bench-env: ERROR: $*" >&2; exit 1; }
step() { # step NAME CMD...: run a step, report its duration
  local name="$1" t0=$SECONDS
  shift
  say "$name ..."
  "$@" || die "$name failed (see the output above)"
  say "$name done in $((SECONDS - t0)) s"
}

# --- the main venv --------------------------------------------------------------------------
main_py="$main_venv/bin/python"
[[ -x "$main_py" ]] || die "$main_py not found: build the main venv first (make test / make demo)"
main_site="$("$main_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
main_torch="$("$main_py" -c 'import torch; print(torch.__version__)' 2>/dev/null)" ||
  die "$main_py cannot import torch; the bench venv shares the main venv's torch"
main_pyver="$("$main_py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
say "main venv $main_venv: python $main_pyver, torch $main_torch"

spec_hash="$(printf '%s\n' "${LITDATA_PKGS[@]}" "${STREAMING_PKGS[@]}" "ffcv=$with_ffcv" \
  "${FFCV_PKGS[@]}" "$FFCV_SDIST" "$main_site" | sha256sum | cut -c1-16)"
stamp="$venv/.bench-env"

# --- the import check: every peer imports, torch is the main venv's --------------------------
verify() {
  "$venv/bin/python" - "$main_torch" "$main_site" "$with_ffcv" <<'PY'
import importlib, os, sys
want_torch, main_site, with_ffcv = sys.argv[1], os.path.realpath(sys.argv[2]), sys.argv[3] == "1"
import torch
here = os.path.realpath(torch.__file__)
if torch.__version__ != want_torch or not here.startswith(main_site):
    sys.exit(f"torch {torch.__version__} from {here}, expected {want_torch} from {main_site}")
mods = ["numpy", "fastload", "litdata", "streaming"] + (["ffcv", "ffcv.loader", "numba", "cv2"] if with_ffcv else [])
for name in mods:
    try:
        mod = importlib.import_module(name)
    except Exception as exc:  # report every kind of import failure the same way
        sys.exit(f"import {name} failed: {type(exc).__name__}: {exc}")
    print(f"  {name:10s} {getattr(mod, '__version__', '')}", file=sys.stderr)
print(f"  torch      {torch.__version__} (shared from {main_site})", file=sys.stderr)
PY
}

if [[ $force == 0 && -f "$stamp" && "$(cat "$stamp")" == "$spec_hash" ]] && verify; then
  say "$venv is complete (stamp $spec_hash); nothing to do"
  echo "$venv/bin/python"
  exit 0
fi

# --- system packages for FFCV -----------------------------------------------------------------
if [[ $with_ffcv == 1 ]]; then
  missing=()
  for p in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    command -v apt-get >/dev/null 2>&1 ||
      die "FFCV needs ${missing[*]} (or their equivalents: OpenCV 4 and libjpeg-turbo with pkg-config files); no apt-get here. Install them or pass --no-ffcv"
    sudo=""
    if [[ "$(id -u)" != 0 ]]; then
      command -v sudo >/dev/null 2>&1 ||
        die "FFCV needs the Debian packages ${missing[*]}: run this script as root, install them, or pass --no-ffcv"
      sudo=sudo
    fi
    apt_install() {
      $sudo apt-get update -qq &&
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
          "${missing[@]}" >/dev/null
    }
    step "apt-get install ${missing[*]}" apt_install
  else
    say "system packages present: ${APT_PKGS[*]}"
  fi
  for pc in libturbojpeg opencv4; do
    pkg-config --exists "$pc" || die "pkg-config cannot find $pc although the packages are installed"
  done
fi

# --- the venv ---------------------------------------------------------------------------------
if [[ ! -x "$venv/bin/python" ]]; then
  py="${PYTHON:-$("$main_py" -c 'import sys; print(sys._base_executable)')}"
  step "create $venv with $py" "$py" -m venv "$venv"
else
  say "reusing $venv"
fi
bench_pyver="$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[[ "$bench_pyver" == "$main_pyver" ]] ||
  die "$venv is python $bench_pyver but $main_venv is $main_pyver; remove $venv or set PYTHON=python$main_pyver"
bench_site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

# The main venv's site-packages go after this venv's own (site appends .pth entries), so the
# stand-ins and peer pins here win while torch/numpy/fastload come from the main venv.
echo "$main_site" >"$bench_site/zz-main.pth"
say "shared $main_site through $bench_site/zz-main.pth"

write_stubs() {
  local tv="$bench_site/torchvision" tf="$bench_site/transformers"
  mkdir -p "$tv/transforms" "$tf/models/auto"
  cat >"$tv/__init__.py" <<'PY'
"""Stand-in written by tools/bench-env.sh: the benchmark peers import torchvision, nothing measured uses it.

The real torchvision wheels on PyPI are CUDA builds that replace the CPU torch; see BENCHMARKS.md.
"""
PY
  cat >"$tv/datasets.py" <<'PY'
"""Names mosaicml-streaming imports at import time (stand-in, never instantiated by the benchmarks)."""


class VisionDataset:
    """Stand-in base class."""


class CIFAR10(VisionDataset):
    """Stand-in."""
PY
  echo '"""Stand-in package."""' >"$tv/transforms/__init__.py"
  cat >"$tv/transforms/functional.py" <<'PY'
"""Stand-in for torchvision.transforms.functional."""


def to_tensor(pic: object) -> object:
    """Not available in the benchmark environment."""
    raise NotImplementedError("torchvision is a stand-in in .venv-bench (tools/bench-env.sh)")
PY
  cat >"$tf/__init__.py" <<'PY'
"""Stand-in written by tools/bench-env.sh: mosaicml-streaming imports a few names at import time."""
PY
  cat >"$tf/feature_extraction_utils.py" <<'PY'
"""Stand-in."""


class BatchFeature(dict):  # type: ignore[type-arg]
    """Stand-in: a dict, as far as isinstance checks go."""
PY
  cat >"$tf/tokenization_utils_base.py" <<'PY'
"""Stand-in."""


class BatchEncoding(dict):  # type: ignore[type-arg]
    """Stand-in: a dict, as far as isinstance checks go."""
PY
  echo '"""Stand-in package."""' >"$tf/models/__init__.py"
  echo '"""Stand-in package."""' >"$tf/models/auto/__init__.py"
  cat >"$tf/models/auto/tokenization_auto.py" <<'PY'
"""Stand-in."""


class AutoTokenizer:
    """Stand-in: the benchmarks never tokenize."""
PY
  # A real torchvision/transformers dist-info would make litdata believe torchvision works.
  rm -rf "$bench_site"/torchvision-*.dist-info "$bench_site"/transformers-*.dist-info
}
write_stubs # not through step: set -e must stop at the first file that cannot be written
say "wrote stand-in torchvision and transformers packages into $bench_site"

pip_install() { # pip_install PKG...: --no-deps so nothing can replace torch or numpy
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps $reinstall \
    ${PIP_ARGS:-} "$@"
}
reinstall=""
if [[ $force == 1 ]]; then reinstall="--force-reinstall"; fi

step "pip install litdata + deps (--no-deps)" pip_install "${LITDATA_PKGS[@]}"
step "pip install mosaicml-streaming + deps (--no-deps)" pip_install "${STREAMING_PKGS[@]}"
if [[ $with_ffcv == 1 ]]; then
  step "pip install FFCV's runtime deps (--no-deps)" pip_install "${FFCV_PKGS[@]}"
  ffcv_have="$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("ffcv"))' 2>/dev/null || true)"
  if [[ $force == 0 && "$ffcv_have" == "${FFCV_SDIST##*==}" ]] &&
    "$venv/bin/python" -c 'import ffcv._libffcv' 2>/dev/null; then
    say "$FFCV_SDIST already built"
  else
    inc="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
    [[ -f "$inc/Python.h" ]] ||
      die "building FFCV needs Python.h, not found in $inc: install python$bench_pyver-dev (Debian) or use a python built with its headers"
    # setup.py only needs setuptools and a C++ compiler; no build isolation, so the build sees the
    # same interpreter and nothing is downloaded besides the sdist.
    step "build $FFCV_SDIST from source (C++ extension against OpenCV + libturbojpeg)" \
      pip_install --no-build-isolation --no-binary ffcv "$FFCV_SDIST"
  fi
fi

step "import check" verify
main_torch_after="$("$main_py" -c 'import torch; print(torch.__version__)')"
[[ "$main_torch_after" == "$main_torch" ]] ||
  die "the main venv's torch changed from $main_torch to $main_torch_after"
echo "$spec_hash" >"$stamp"
say "$venv ready in $((SECONDS - t_start)) s (torch $main_torch in both venvs; stamp $stamp)"
echo "$venv/bin/python"
