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
    except Exception as e:  # noqa: BLE001 - any failure here only disables the kernel path; record it.
        return f"registering the FFI targets of {EXTENSION_MODULE} failed ({type(e).__name__}: {e})"
    return None


def extension_loaded() -> bool:
    """True when the extension imported and its FFI targets were registered for CUDA.

    Loads the extension on first use. A process that runs a deserialized `jax.export` artifact
    without calling `flash_attention` should call this first, so the FFI targets are registered.
    """
    return load_error() is None


def handler_calls() -> int:
    """How many times the FFI handler `jzyfa_attention_fwd` has executed in this process.

    Counts every execution on every device and call site (failed ones too). Under XLA command buffers
    (CUDA graphs) the handler runs when a graph is recorded or updated, and not when it is replayed,
    so the difference of two readings tells how many calls ran the handler. Raises RuntimeError when
    the extension is not loaded (no extension built, or one built before the counter existed).
    """
    if (reason := load_error()) is not None:
        raise RuntimeError(f"jzyfa's handler-call counter is unavailable: {reason}")
    module = importlib.import_module(EXTENSION_MODULE)
    counter = getattr(module, "handler_calls", None)
    if counter is None:
        raise RuntimeError(
            f"jzyfa's handler-call counter is unavailable: {EXTENSION_MODULE} has no handler_calls() "
            "(it was built from older sources; rebuild the extension)"
        )
    return int(counter())


def fp8_default_key_block(head_dim: int) -> int:
    """The FP8 kernel's keys per block at this q/k head dim unless a wider block applies: 128, or 64 at
    head dim 256 (ffi/tile_size.h's Fp8DefaultBlockN, whose O accumulator leaves room for no more)."""
    return 64 if head_dim == 256 else 128


def fp8_key_block(
    *, v_transposed: bool, head_dim: int, causal: bool, window: tuple[int, int], seq_q: int, seq_k: int
) -> int:
    """Keys per block of the FP8 kernel that a call with these properties runs now: 128 (64 at head dim
    256), or 192 for the unwindowed head-dim-128 kernel with V^T from memory when its rows see many keys
    (the launch's rule; `jzyfa.plan.fp8_key_block` adds the JZYFA_FP8_KEY_BLOCK override). `window` as
    the FP8 primitive passes it ((-1, -1): none; see `jzyfa._validation.mask_window`).
    `fp8_default_key_block` without the extension, or with one built before the function existed."""
    if load_error() is not None:
        return fp8_default_key_block(head_dim)
    module = importlib.import_module(EXTENSION_MODULE)
    key_block = getattr(module, "fp8_key_block", None)
    if key_block is None:
        return fp8_default_key_block(head_dim)
    return int(
        key_block(
            v_transposed=bool(v_transposed),
            head_dim=int(head_dim),
            causal=bool(causal),
            window_left=int(window[0]),
            window_right=int(window[1]),
            seqlen_q=int(seq_q),
            seqlen_k=int(seq_k),
        )
    )
