#!/usr/bin/env bash
# Prints one line naming what a jzyfa build is made from: a hash of a source tree's build inputs
# (ffi/, jzyfa/, asm/ (the PTX generator), CMakeLists.txt, pyproject.toml; caches and built libraries
# left out) and the build variables (CUDAFLAGS, JZYFA_MEASURE). tools/gpu_session.sh writes it beside the extension it
# installs (jzyfa-source.txt); tools/real_model_session.sh reuses an installed extension only where
# that file matches its own tree, so a warm machine's build of another tree is never measured.
#
#   bash tools/source_stamp.sh [TREE]      (TREE default: this checkout)
set -euo pipefail
TREE=${1:-$(cd "$(dirname "$0")/.." && pwd)}
cd "$TREE"
hash=$(find ffi jzyfa asm CMakeLists.txt pyproject.toml -type f ! -path '*/__pycache__/*' ! -name '*.pyc' \
  ! -name '*.so' -print0 | LC_ALL=C sort -z | xargs -0 sha1sum | sha1sum | cut -c1-16)
echo "sources $hash CUDAFLAGS=${CUDAFLAGS:-} JZYFA_MEASURE=${JZYFA_MEASURE:-}"
