"""Results of slow CPU references (the FP8 emulation, float64 attention) kept per input content, so that
a test run under both FP8 V layouts (the `fp8_v_layout` fixture; conftest's `rng` draws the same inputs
for both) computes its references once. The key is the arguments' bytes, shapes and dtypes, and the
other arguments' repr: equal inputs, not the same objects."""

from __future__ import annotations

import functools
import hashlib

import numpy as np


def content_key(*args, **kwargs) -> str:
    """A digest of the arguments: arrays (NumPy or JAX) by dtype, shape and bytes, the rest by repr."""
    digest = hashlib.sha1()
    for value in (*args, *sorted(kwargs.items())):
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
            digest.update(value[0].encode())  # a keyword's name
            value = value[1]
        if hasattr(value, "shape") and hasattr(value, "dtype"):
            array = np.asarray(value)
            digest.update(f"{array.dtype}{array.shape}".encode())
            digest.update(np.ascontiguousarray(array).view(np.uint8).tobytes())
        elif isinstance(value, (tuple, list)) and any(hasattr(v, "shape") for v in value):
            digest.update(content_key(*value).encode())
        else:
            digest.update(repr(value).encode())
        digest.update(b"|")
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
