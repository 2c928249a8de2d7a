#!/usr/bin/env bash
# Sets up jzyfa on a fresh machine and runs the tests or the main example.
#
#   bash tools/bootstrap.sh test      # CPU tests everywhere; GPU tests too on a Hopper GPU
#   bash tools/bootstrap.sh example   # examples/prefill.py (pure-JAX on CPU, the kernel on Hopper)
#
# It makes a virtual environment in .venv (Python 3.12 or newer: jax 0.11 needs it), installs
# the dependencies, builds the extension with the local CUDA toolkit (nvcc) when there is one,
# and installs jzyfa into the environment. Without nvcc it installs the pure-JAX package.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-test}

find_python() {
  for py in "${JZYFA_PYTHON:-}" python3.13 python3.12 /root/.pyenv/versions/3.12*/bin/python3 python3; do
    [ -n "$py" ] && command -v "$py" >/dev/null 2>&1 || continue
    if "$py" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then echo "$py"; return; fi
  done
  command -v python3
}

VENV=${JZYFA_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$(find_python)" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q -r requirements-dev.txt

if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDACXX=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
  export JZYFA_EXPECT_EXTENSION=1
else
  echo "bootstrap: no nvcc found: installing the pure-JAX package (no kernels)" >&2
  export JZYFA_SKIP_CUDA=ON JZYFA_SKIP_NVCC=1
fi
"$PY" -m pip install -q --no-build-isolation --no-deps .

case "$what" in
  # -P: import the installed jzyfa (with its extension), not the source tree.
  test) exec "$PY" -P -m pytest -q tests "${@:2}" ;;
  example) exec "$PY" -P examples/prefill.py "${@:2}" ;;
  *) echo "usage: $0 test|example" >&2; exit 2 ;;
esac
