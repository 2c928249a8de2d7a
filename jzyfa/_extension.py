"""Loading the compiled extension and registering its XLA FFI handlers with JAX.

The extension (`jzyfa._jzyfa_ffi`) is optional: a machine without it, or without a GPU, must still
import jzyfa and run the pure-JAX path. Loading happens once, on first need, and a failure is recorded
so that `implementation="kernel"` can say why the kernel is unavailable.
"""

from __future__ import annotations

import functools
import importlib

import jax

EXTENSION_MODULE = "jzyfa._jzyfa_ffi"


@functools.cache
def load_error() -> str | None:
    """Loads and registers the extension once; returns None on success, else the reason it failed."""
    try:
        module = importlib.import_module(EXTENSION_MODULE)
    except ImportError as e:
        return f"the extension {EXTENSION_MODULE} could not be imported ({e})"
    try:
        for name, capsule in module.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    except Exception as e:  # Any failure here only disables the kernel path; record it.
        return f"registering the FFI targets of {EXTENSION_MODULE} failed ({type(e).__name__}: {e})"
    return None


def extension_loaded() -> bool:
    """True when the extension imported and its FFI targets were registered for CUDA.

    Loads the extension on first use. A process that runs a deserialized `jax.export` artifact
    without calling `flash_attention` should call this first, so the FFI targets are registered.
    """
    return load_error() is None
