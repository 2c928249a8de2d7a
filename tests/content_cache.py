"""Results of slow CPU references (the FP8 emulation, float64 attention) kept per input content, so that
a test run under both FP8 V layouts (the `fp8_v_layout` fixture; conftest's `rng` draws the same inputs
for both) computes its references once. The key is the arguments' bytes, shapes and dtypes, and the
other arguments' repr: equal inputs, not the same objects."""

from __future__ import annotations

import functools
import hashlib

import numpy as np


def content_key(*args, **kwargs) -> str:
    """A digest of the arguments: arrays (NumPy or JAX) by dtype, shape and bytes, tuples and lists of
    them item by item, keywords by name and value, anything else by repr."""
    digest = hashlib.sha1()

    def add(value) -> None:
        if hasattr(value, "shape") and hasattr(value, "dtype"):
            array = np.ascontiguousarray(np.asarray(value))
            digest.update(f"{array.dtype}{array.shape}".encode())
            digest.update(array.view(np.uint8).tobytes())
        elif isinstance(value, (tuple, list)):
            digest.update(b"(")
            for item in value:
                add(item)
            digest.update(b")")
        else:
            digest.update(repr(value).encode())
        digest.update(b"|")

    add(args)
    for name, value in sorted(kwargs.items()):
        digest.update(name.encode())
        add(value)
    return digest.hexdigest()


def cached_by_content(fn):
    """fn, computed once per distinct argument content in this process."""
    results: dict[str, object] = {}

    @functools.wraps(fn)
    def cached(*args, **kwargs):
        key = content_key(*args, **kwargs)
        if key not in results:
            results[key] = fn(*args, **kwargs)
        return results[key]

    cached.cache = results
    return cached
