"""tests/content_cache.py: references computed once per input content, never reused for other inputs."""

import jax.numpy as jnp
import numpy as np
from content_cache import cached_by_content, content_key


def test_equal_content_hits_and_any_difference_misses():
    calls = []

    @cached_by_content
    def reference(x, descales, *, causal):
        calls.append(1)
        return float(np.sum(np.asarray(x, np.float64))) + causal

    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    d = (jnp.ones(()), jnp.full((2,), 0.5))
    first = reference(x, d, causal=True)
    assert reference(x.copy(), (jnp.ones(()), jnp.full((2,), 0.5)), causal=True) == first  # equal content
    assert len(calls) == 1
    reference(x, d, causal=False)  # another keyword
    changed = x.copy()
    changed[2, 3] += 1
    reference(changed, d, causal=True)  # one element
    reference(x.reshape(4, 3), d, causal=True)  # same bytes, another shape
    reference(x.astype(np.float64), d, causal=True)  # another dtype
    reference(x, (jnp.ones(()), jnp.full((2,), 0.25)), causal=True)  # a descale inside a tuple
    assert len(calls) == 6


def test_keys_name_the_keywords():
    assert content_key(1, causal=True) != content_key(1, window=True)


def test_the_fp8_emulation_runs_once_per_input():
    """The GPU tests' emulation (test_fp8_kernel_gpu.emulated_on_cpu) is cached: a second call with equal
    inputs (the other V layout's) returns the first call's read-only results; other flags, or other key
    blocks (the kernel's, which emulated_on_cpu asks for), compute anew."""
    import test_fp8_kernel_gpu as gpu_tests
    from attention_oracle import random_fp8_qkv

    rng = np.random.default_rng(0)
    qkv, descales = random_fp8_qkv(rng, batch=1, seq_q=48, seq_k=48, heads_q=2, heads_kv=1)
    cache = gpu_tests._emulated_on_cpu.cache
    before = len(cache)
    first = gpu_tests.emulated_on_cpu(*qkv, descales, causal=True, lean_p=True)
    again = gpu_tests.emulated_on_cpu(*(jnp.array(x) for x in qkv), descales, causal=True, lean_p=True)
    assert again is first and len(cache) == before + 1
    assert not any(array.flags.writeable for array in first)
    exact = gpu_tests.emulated_on_cpu(*qkv, descales, causal=True, lean_p=False)
    assert exact is not first and len(cache) == before + 2
    common = dict(causal=True, lean_p=True, window=None, softmax_scale=None)
    assert gpu_tests._emulated_on_cpu(*qkv, descales, **common, block_n=128) is first  # no kernel here: 128
    wide = gpu_tests._emulated_on_cpu(*qkv, descales, **common, block_n=192)
    assert wide is not first and len(cache) == before + 3
