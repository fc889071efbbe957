#!/usr/bin/env bash
# Build the Gluon kernels for sm_90 with the Triton the GPU machine runs (3.6), on this CPU:
# Gluon's lowering differs between versions (session 28: a form Triton 3.9 built, 3.6 could not
# lower), and the sm_90 builds need no GPU. Downloads the Triton wheel (~190 MB) into a folder
# used only for these tests.
#   scripts/check_device_triton.sh [triton version, default 3.6.0] [target dir]
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-3.6.0}"
target="${2:-/tmp/chordq-triton-$version}"
if [ ! -e "$target/triton/__init__.py" ]; then
  python3 -m pip install -q --no-deps --target "$target" "triton==$version"
fi
PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest -q -p no:cacheprovider \
  tests/test_kernels_gluon.py tests/test_kernels_gluon_prefill.py -k "sm90_build"
