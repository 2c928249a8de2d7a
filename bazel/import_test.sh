#!/bin/sh
# Smoke test of the Bazel-built extension (target //:import_test): load the
# shared object with the configured interpreter and check that it hands out the
# FFI handler capsule. Loads it by path, so jax need not be importable here.
# Usage: import_test.sh PYTHON EXTENSION_SO
set -eu
exec "$1" - "$2" <<'PY'
import importlib.machinery
import importlib.util
import sys

path = sys.argv[1]
loader = importlib.machinery.ExtensionFileLoader("_jzyfa_ffi", path)
spec = importlib.util.spec_from_file_location("_jzyfa_ffi", path, loader=loader)
module = importlib.util.module_from_spec(spec)
loader.exec_module(module)
targets = module.registrations()
assert isinstance(targets, dict), type(targets)
capsule = targets.get("jzyfa_attention_fwd")
assert type(capsule).__name__ == "PyCapsule", targets
print("ok:", path, sorted(targets))
PY
