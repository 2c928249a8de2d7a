"""The 16-bit kernel's wide head dims on a Hopper GPU under sliding windows (dense) and over varlen batches
(plain and windowed): head dim 256 (64-key blocks) and MLA's (q/k 192, v 128), against float64 attention
and the pure-JAX path. Skips without a Hopper GPU and the extension.

These are the plan's 16-bit rows at head dims (256, 256) and (192, 128) with a "window" mask or a
"varlen" layout (jzyfa.plan.KERNELS). The checks call implementation="kernel", so that a call the kernel
cannot serve fails instead of falling back. Every check runs the kernel into output buffers filled with NaN
beforehand (donated buffers XLA aliases to the custom call's results), so a row the kernel fails to write
shows up as NaN; rows that see no key must give O = 0 and LSE = -inf. Tolerances are
tests/test_kernel_gpu.py's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64, naive_varlen_f64
from gpu_utils import kernel_call, requires_hopper
from test_kernel_gpu import LSE_TOLERANCE, O_TOLERANCE, relative_l2

import jzyfa

pytestmark = [pytest.mark.gpu, requires_hopper]

HEAD_DIMS = {"hd256": (256, 256), "mla": (192, 128)}  # (q/k, v)
# (left, right): a one-sided window at the key-block sizes (64 at hd256, 128 for MLA), a two-sided one
# wider than a block, and a right-only one.
WINDOWS = [(128, 0), (300, 64), (-1, 100)]
# (seq_q, seq_k): equal, more keys, more queries (rows left of every key under a window).
LENGTHS = [(1000, 1000), (129, 700), (700, 129)]
# Packed batches: (query lengths, key lengths, tokens past cu_seqlens_q[-1]); lengths 1, 65, 129 and 300,
# an empty query sequence with keys and one with no keys.
PACKINGS = [
    ([1, 65, 129, 300, 0, 40], [1, 65, 300, 129, 7, 0], 5),
    ([300, 0, 129], [129, 64, 300], 0),
]


@pytest.fixture(params=list(HEAD_DIMS))
def head_dims(request) -> tuple[int, int]:
    return HEAD_DIMS[request.param]


def run_poisoned(attention, varlen: bool, inputs: tuple, out_shape, lse_shape):
    """attention(*inputs) -> (out, lse) under jit, writing into NaN-filled donated buffers: (out, lse) as
    float32 NumPy arrays, after checking that the custom call (dense or varlen) ran in place and left
    no NaN."""

    def call(*args):
        return attention(*args[:-2])  # the poisoned buffers are donated: they become the results

    poison = (jnp.full(out_shape, jnp.nan, inputs[0].dtype), jnp.full(lse_shape, jnp.nan, jnp.float32))
    fn = jax.jit(call, donate_argnums=(len(inputs), len(inputs) + 1), keep_unused=True)
    hlo = fn.lower(*inputs, *poison).compile().as_text()
    assert f"varlen = {str(varlen).lower()}" in kernel_call(hlo)
    assert "input_output_alias" in hlo and " copy(" not in hlo
    out, lse = fn(*inputs, *poison)
    out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
    assert not np.isnan(out).any(), "the kernel left elements of O unwritten (NaN poison)"
    assert not np.isnan(lse).any(), "the kernel left LSE entries unwritten (NaN poison)"
    return out, lse


def check_against(out, lse, want_out, want_lse, ref_out, ref_lse, seen_rows_of_out):
    """O and LSE against float64 (rows with no key: O = 0, LSE = -inf) and the pure-JAX path."""
    seen = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(lse), seen, "rows with no visible key must give LSE = -inf")
    assert np.all(np.isneginf(lse[~seen]))
    assert np.all(out[~seen_rows_of_out(seen)] == 0), "rows with no visible key must give O = 0"
    assert relative_l2(out, want_out) < O_TOLERANCE
    if seen.any():
        assert relative_l2(lse[seen], want_lse[seen]) < LSE_TOLERANCE
    assert relative_l2(out, np.asarray(ref_out, np.float32)) < O_TOLERANCE
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(np.asarray(ref_lse)))


def check_dense(rng, head_dims, sq, sk, window, *, causal=False, batch=2, hq=4, hkv=2, dtype=jnp.bfloat16):
    qk, dv = head_dims
    shapes = [(batch, sq, hq, qk), (batch, sk, hkv, qk), (batch, sk, hkv, dv)]
    q, k, v = (jnp.asarray(rng.standard_normal(s, np.float32), dtype) for s in shapes)
    kwargs = {"causal": causal, "window": window, "return_lse": True}

    def attention(q, k, v):
        return jzyfa.flash_attention(q, k, v, implementation="kernel", **kwargs)

    out, lse = run_poisoned(attention, False, (q, k, v), (batch, sq, hq, dv), (batch, hq, sq))
    want_out, want_lse = naive_attention_f64(
        *(np.asarray(x, np.float32) for x in (q, k, v)), causal=causal, window=window
    )
    ref_out, ref_lse = jzyfa.flash_attention(q, k, v, implementation="xla", **kwargs)
    check_against(out, lse, want_out, want_lse, ref_out, ref_lse, lambda seen: np.swapaxes(seen, 1, 2))
    return out, lse


def offsets(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def check_varlen(rng, head_dims, lengths_q, lengths_k, pad_q, *, causal=False, window=None, hq=4, hkv=2,
                 dtype=jnp.bfloat16):  # fmt: skip
    qk, dv = head_dims
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    total_q, total_k = int(cu_q[-1]) + pad_q, int(cu_k[-1])
    shapes = [(total_q, hq, qk), (total_k, hkv, qk), (total_k, hkv, dv)]
    q, k, v = (jnp.asarray(rng.standard_normal(s, np.float32), dtype) for s in shapes)
    max_q, max_k = max(lengths_q), max(lengths_k)
    kwargs = {"causal": causal, "window": window, "return_lse": True}

    def attention(q, k, v, cu_q, cu_k):
        return jzyfa.flash_attention_varlen(
            q, k, v, cu_q, cu_k, max_q, max_k, implementation="kernel", **kwargs
        )

    inputs = (q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k))
    out, lse = run_poisoned(attention, True, inputs, (total_q, hq, dv), (hq, total_q))
    f32 = [np.asarray(x, np.float32) for x in (q, k, v)]
    want_out, want_lse = naive_varlen_f64(*f32, cu_q, cu_k, causal=causal, window=window)
    ref_out, ref_lse = jzyfa.flash_attention_varlen(
        q, k, v, cu_q, cu_k, max_q, max_k, implementation="xla", **kwargs
    )
    check_against(out, lse, want_out, want_lse, ref_out, ref_lse, lambda seen: seen.T)
    if pad_q:
        assert not out[-pad_q:].any() and np.isneginf(lse[:, -pad_q:]).all()
    return out, lse


# ---- dense sliding windows


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("sq, sk", LENGTHS)
def test_dense_windows_match_float64(rng, head_dims, window, sq, sk):
    check_dense(rng, head_dims, sq, sk, window)


def test_dense_rows_with_empty_windows(rng, head_dims):
    """(0, 0) with more queries than keys: the first seq_q - seq_k rows sit left of every key; causal with
    (3, 0) and Sq > Sk likewise."""
    check_dense(rng, head_dims, 500, 129, (0, 0))
    check_dense(rng, head_dims, 300, 100, (3, 0), causal=True)


def test_dense_f16_and_gqa(rng, head_dims):
    check_dense(rng, head_dims, 333, 555, (200, 17), dtype=jnp.float16)
    check_dense(rng, head_dims, 300, 300, (64, 64), batch=1, hq=8, hkv=1)  # MQA


def test_dense_bitwise_reruns(head_dims):
    """The same inputs twice (the same seed): bitwise the same results."""
    runs = [check_dense(np.random.default_rng(0), head_dims, 600, 800, (255, 17), batch=1) for _ in range(2)]
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


# ---- varlen batches


@pytest.mark.parametrize(
    "causal, window", [(False, None), (True, None), *((False, w) for w in WINDOWS)], ids=str
)
def test_varlen_matches_float64(rng, head_dims, causal, window):
    lengths_q, lengths_k, pad_q = PACKINGS[0]
    check_varlen(rng, head_dims, lengths_q, lengths_k, pad_q, causal=causal, window=window)


def test_varlen_more_queries_than_keys(rng, head_dims):
    """Sq > Sk sequences: causal rows left of every key, and a window's."""
    lengths_q, lengths_k, pad_q = PACKINGS[1]
    check_varlen(rng, head_dims, lengths_q, lengths_k, pad_q, causal=True)
    check_varlen(rng, head_dims, lengths_q, lengths_k, pad_q, window=(0, 0))


def test_varlen_f16_gqa_and_bitwise_reruns(rng, head_dims):
    lengths_q, lengths_k, pad_q = PACKINGS[0]
    check_varlen(rng, head_dims, lengths_q, lengths_k, pad_q, causal=True, dtype=jnp.float16)
    runs = [
        check_varlen(
            np.random.default_rng(3), head_dims, lengths_q, lengths_k, pad_q, window=(128, 0), hq=8, hkv=1
        )
        for _ in range(2)
    ]
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
