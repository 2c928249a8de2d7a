"""The 16-bit kernel's sliding windows on the GPU (dense and varlen), against float64 attention and the
pure-JAX path. Skips without a Hopper GPU and the extension.

The windowed kernels (the plan's 16-bit "window" rows at head dims 64 and 128) are the default path for
sliding windows (implementation=None). The checks call implementation="kernel", so that a call the
kernel cannot serve fails instead of falling back. Every check runs the kernel into output buffers
filled with NaN beforehand (donated buffers XLA aliases to the custom call's results), so a row the
kernel fails to write shows up as NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64, naive_varlen_f64
from gpu_utils import kernel_call, requires_hopper
from hlo_utils import window_attributes

import jzyfa

pytestmark = [pytest.mark.gpu, requires_hopper]

O_TOLERANCE = 1e-2  # relative L2 error of O for 16-bit inputs, as tests/test_kernel_gpu.py
LSE_TOLERANCE = 1e-4

# (left, right): one key, the diagonal's neighbours, windows at and across the 128-key block size, two-
# sided, one-sided either way, and (0, -1): every key from the diagonal on.
WINDOWS = [(0, 0), (1, 0), (127, 0), (128, 0), (255, 0), (64, 64), (-1, 5), (300, -1), (0, -1)]
# (seq_q, seq_k): equal, more keys, more queries, lengths off multiples of 128, one query.
LENGTHS = [(1000, 1000), (129, 1000), (1000, 129), (63, 63), (1, 4097), (4097, 4097), (257, 1)]


def relative_l2(x, ref):
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def run_dense_poisoned(q, k, v, *, causal=False, window=None, scale=None):
    """The kernel writing into NaN-filled buffers: (out, lse) as float32 NumPy arrays, and the HLO."""

    def call(q, k, v, out_poison, lse_poison):
        del out_poison, lse_poison  # donated: their buffers become the results
        return jzyfa.flash_attention(
            q,
            k,
            v,
            causal=causal,
            window=window,
            softmax_scale=scale,
            return_lse=True,
            implementation="kernel",
        )

    b, sq, hq, _ = q.shape
    out_poison = jnp.full(q.shape, jnp.nan, q.dtype)
    lse_poison = jnp.full((b, hq, sq), jnp.nan, jnp.float32)
    fn = jax.jit(call, donate_argnums=(3, 4), keep_unused=True)
    hlo = fn.lower(q, k, v, out_poison, lse_poison).compile().as_text()
    assert "varlen = false" in kernel_call(hlo)
    assert "input_output_alias" in hlo and " copy(" not in hlo, hlo
    out, lse = fn(q, k, v, out_poison, lse_poison)
    return np.asarray(out.astype(jnp.float32)), np.asarray(lse), hlo


def random_dense(rng, batch, sq, sk, hq, hkv, d, dtype):
    shapes = [(batch, sq, hq, d), (batch, sk, hkv, d), (batch, sk, hkv, d)]
    return tuple(jnp.asarray(rng.standard_normal(s, np.float32), dtype) for s in shapes)


def check_dense(rng, sq, sk, window, *, causal=False, batch=2, hq=4, hkv=2, d=128, dtype=jnp.bfloat16):
    q, k, v = random_dense(rng, batch, sq, sk, hq, hkv, d, dtype)
    out, lse, _ = run_dense_poisoned(q, k, v, causal=causal, window=window)
    assert not np.isnan(out).any(), "the kernel left elements of O unwritten (NaN poison)"
    assert not np.isnan(lse).any(), "the kernel left LSE entries unwritten (NaN poison)"
    f32 = [np.asarray(x, np.float32) for x in (q, k, v)]
    want_out, want_lse = naive_attention_f64(*f32, causal=causal, window=window)
    seen = np.isfinite(want_lse)  # [B, H, Sq]
    np.testing.assert_array_equal(np.isfinite(lse), seen, "rows with no visible key must give LSE = -inf")
    assert np.all(np.isneginf(lse[~seen]))
    assert np.all(out[~np.swapaxes(seen, 1, 2)] == 0), "rows with no visible key give O = 0"
    assert relative_l2(out, want_out) < O_TOLERANCE
    if seen.any():
        assert relative_l2(lse[seen], want_lse[seen]) < LSE_TOLERANCE
    ref_out, ref_lse = jzyfa.flash_attention(
        q, k, v, causal=causal, window=window, return_lse=True, implementation="xla"
    )
    assert relative_l2(out, np.asarray(ref_out, np.float32)) < O_TOLERANCE
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(np.asarray(ref_lse)))
    return q, k, v


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("sq, sk", LENGTHS)
def test_dense_windows_match_float64(rng, window, sq, sk):
    check_dense(rng, sq, sk, window, batch=1 if max(sq, sk) > 2000 else 2)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [(127, 0), (64, 64), (0, -1)])
def test_dense_dtypes_head_dims_and_gqa(rng, dtype, head_dim, window):
    check_dense(rng, 700, 900, window, hq=8, hkv=1, d=head_dim, dtype=dtype)  # MQA
    check_dense(rng, 300, 300, window, hq=6, hkv=3, d=head_dim, dtype=dtype)


def test_rows_with_empty_windows(rng):
    """(0, 0) with more queries than keys: the first seq_q - seq_k rows sit left of every key and see
    none; (3, 0) with causal, Sq > Sk, likewise; and a window whose right bound ends before the keys."""
    check_dense(rng, 1000, 129, (0, 0))
    check_dense(rng, 600, 200, (3, 0), causal=True)
    check_dense(rng, 300, 40, (5, 2))


def test_causal_with_window_and_windows_that_are_causal(rng):
    """causal=True sets the right bound to 0; (huge, 0) is plain causal and runs the plain kernel."""
    q, k, v = check_dense(rng, 500, 700, (200, 9), causal=True)
    _, _, hlo = run_dense_poisoned(q, k, v, window=(100000, 0))
    call = kernel_call(hlo)
    assert "causal=true" in call.replace(" ", "") and window_attributes(call) == (-1, -1)


def test_bitwise_reruns(rng):
    q, k, v = random_dense(rng, 2, 1500, 1700, 8, 2, 128, jnp.bfloat16)
    first = run_dense_poisoned(q, k, v, window=(255, 17))[:2]
    for _ in range(3):
        again = run_dense_poisoned(q, k, v, window=(255, 17))[:2]
        np.testing.assert_array_equal(first[0], again[0])
        np.testing.assert_array_equal(first[1], again[1])


# ---- varlen


def offsets(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def check_varlen(rng, lengths_q, lengths_k, window, *, pad_q=0, hq=4, hkv=2, d=64, dtype=jnp.bfloat16):
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    total_q, total_k = int(cu_q[-1]) + pad_q, max(int(cu_k[-1]), 1)
    shapes = [(total_q, hq, d), (total_k, hkv, d), (total_k, hkv, d)]
    q, k, v = (jnp.asarray(rng.standard_normal(s, np.float32), dtype) for s in shapes)
    max_q, max_k = max(max(lengths_q), 1), max(max(lengths_k), 1)

    def call(q, k, v, cu_q, cu_k, out_poison, lse_poison):
        del out_poison, lse_poison
        return jzyfa.flash_attention_varlen(
            q, k, v, cu_q, cu_k, max_q, max_k, window=window, return_lse=True, implementation="kernel"
        )

    args = (
        q,
        k,
        v,
        jnp.asarray(cu_q),
        jnp.asarray(cu_k),
        jnp.full(q.shape, jnp.nan, q.dtype),
        jnp.full((hq, total_q), jnp.nan, jnp.float32),
    )
    fn = jax.jit(call, donate_argnums=(5, 6), keep_unused=True)
    hlo = fn.lower(*args).compile().as_text()
    assert "varlen = true" in kernel_call(hlo)
    assert "input_output_alias" in hlo and " copy(" not in hlo
    out, lse = fn(*args)
    out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
    assert not np.isnan(out).any() and not np.isnan(lse).any(), "NaN poison left: rows unwritten"
    f32 = [np.asarray(x, np.float32) for x in (q, k, v)]
    want_out, want_lse = naive_varlen_f64(*f32, cu_q, cu_k, causal=False, window=window)
    seen = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(lse), seen)
    assert np.all(out[~seen.T] == 0)
    assert relative_l2(out, want_out) < O_TOLERANCE
    if seen.any():
        assert relative_l2(lse[seen], want_lse[seen]) < LSE_TOLERANCE
    ref_out, _ = jzyfa.flash_attention_varlen(
        q, k, v, cu_q, cu_k, max_q, max_k, window=window, return_lse=True, implementation="xla"
    )
    assert relative_l2(out, np.asarray(ref_out, np.float32)) < O_TOLERANCE
    return out, lse


VARLEN_PACKINGS = [
    ([5, 0, 17, 1, 130], [5, 3, 0, 30, 130], 0),
    ([300, 129, 1, 0, 255], [100, 700, 1, 64, 255], 7),  # Sq > Sk: rows left of every key
    ([1, 1, 1, 1], [513, 1, 128, 257], 0),
    ([0, 0, 1000], [10, 0, 1000], 200),
    ([63, 4097], [63, 4097], 0),
]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("lengths_q, lengths_k, pad_q", VARLEN_PACKINGS)
def test_varlen_windows_match_float64(rng, window, lengths_q, lengths_k, pad_q):
    check_varlen(rng, lengths_q, lengths_k, window, pad_q=pad_q)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_dtypes_head_dims_gqa_and_bitwise_reruns(rng, dtype, head_dim):
    lengths_q, lengths_k = [129, 700, 3], [1000, 650, 3]
    check_varlen(rng, lengths_q, lengths_k, (128, 0), pad_q=5, hq=8, hkv=2, d=head_dim, dtype=dtype)
    # The same inputs twice (the same seed): bitwise the same results.
    runs = [
        check_varlen(
            np.random.default_rng(7), lengths_q, lengths_k, (64, 64), hq=8, hkv=2, d=head_dim, dtype=dtype
        )
        for _ in range(2)
    ]
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
