"""The 16-bit kernel over packed variable-length batches, on the GPU, against float64 attention per
sequence and the pure-JAX varlen path. Skips without a Hopper GPU and the extension.

The varlen kernel (the plan's 16-bit "varlen" rows) is the default path for `flash_attention_varlen`
(implementation=None). The checks call implementation="kernel", so that a call the kernel cannot serve
fails instead of falling back. Every check runs the kernel into output buffers filled with NaN beforehand
(donated buffers XLA aliases to the custom call's results), so a token the kernel fails to write,
inside a sequence or past the last one, shows up as NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_varlen_f64
from gpu_utils import assert_bitwise_reruns, ffi_attention, kernel_call, requires_hopper

import jzyfa

pytestmark = [pytest.mark.gpu, requires_hopper]

O_TOLERANCE = 1e-2  # relative L2 error of O for 16-bit inputs, as tests/test_kernel_gpu.py
LSE_TOLERANCE = 1e-4


def offsets(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def relative_l2(x, ref):
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def packed(rng, total_q, total_k, heads_q, heads_kv, head_dim, dtype):
    q = rng.standard_normal((total_q, heads_q, head_dim), np.float32)
    k = rng.standard_normal((total_k, heads_kv, head_dim), np.float32)
    v = rng.standard_normal((total_k, heads_kv, head_dim), np.float32)
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def run_kernel_poisoned(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale=None):
    """The kernel writing into NaN-filled buffers: (out, lse) as float32 NumPy arrays."""

    def call(q, k, v, cu_q, cu_k, out_poison, lse_poison):
        del out_poison, lse_poison  # donated: their buffers become the results
        return jzyfa.flash_attention_varlen(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_q,
            max_k,
            causal=causal,
            softmax_scale=scale,
            return_lse=True,
            implementation="kernel",
        )

    out_poison = jnp.full(q.shape, jnp.nan, q.dtype)
    lse_poison = jnp.full((q.shape[1], q.shape[0]), jnp.nan, jnp.float32)
    args = (q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), out_poison, lse_poison)
    fn = jax.jit(call, donate_argnums=(5, 6), keep_unused=True)
    hlo = fn.lower(*args).compile().as_text()
    call_line = kernel_call(hlo)  # the one jzyfa_attention_fwd custom call
    assert "varlen = true" in call_line and f"max_seqlen_q = {max_q} : i64" in call_line, call_line
    # The poison only proves something if the kernel writes straight into the donated buffers.
    assert "input_output_alias" in hlo and " copy(" not in hlo, hlo
    out, lse = fn(*args)
    return np.asarray(out.astype(jnp.float32)), np.asarray(lse)


def check(rng, lengths_q, lengths_k, *, heads_q, heads_kv, head_dim, dtype, causal, pad_q=0, scale=None):
    """Kernel vs float64 per sequence and vs the pure-JAX path; pad_q tokens follow the last sequence."""
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    q, k, v = packed(rng, cu_q[-1] + pad_q, max(cu_k[-1], 1), heads_q, heads_kv, head_dim, dtype)
    max_q, max_k = max(max(lengths_q), 1), max(max(lengths_k), 1)
    out, lse = run_kernel_poisoned(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale)
    assert not np.isnan(out).any(), "the kernel left elements of O unwritten (NaN poison)"
    assert not np.isnan(lse).any(), "the kernel left LSE entries unwritten (NaN poison)"

    f32 = [np.asarray(x, np.float32) for x in (q, k, v)]
    want_out, want_lse = naive_varlen_f64(*f32, cu_q, cu_k, causal=causal, softmax_scale=scale)
    seen = np.isfinite(want_lse)  # [heads, total_q]
    np.testing.assert_array_equal(np.isfinite(lse), seen, "rows with no visible key must give LSE = -inf")
    assert np.all(np.isneginf(lse[~seen])), "rows with no visible key must give LSE = -inf"
    assert np.all(out[~seen.T] == 0), (
        "rows with no visible key (and tokens past the last sequence) give O = 0"
    )
    assert relative_l2(out, want_out) < O_TOLERANCE
    if seen.any():
        assert relative_l2(lse[seen], want_lse[seen]) < LSE_TOLERANCE

    ref_out, ref_lse = jax.jit(
        lambda *a: jzyfa.flash_attention_varlen(
            *a, max_q, max_k, causal=causal, softmax_scale=scale, return_lse=True, implementation="xla"
        )
    )(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k))
    assert relative_l2(out, np.asarray(ref_out, np.float32)) < O_TOLERANCE
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(np.asarray(ref_lse)))
    return q, k, v, cu_q, cu_k, max_q, max_k


# (query lengths, key lengths, tokens past the last sequence): truly unequal, empty on either side,
# length 1, lengths off multiples of 128 and across several query tiles, Sk != Sq per sequence.
PACKINGS = [
    ([1], [1], 0),
    ([5, 0, 17, 1, 130], [5, 3, 0, 30, 130], 0),
    ([300, 129, 1, 0, 255], [100, 700, 1, 64, 255], 7),  # Sq > Sk: first rows see no key if causal
    ([1, 1, 1, 1], [513, 1, 128, 257], 0),  # decode-like
    ([0, 0, 1000], [10, 0, 1000], 200),  # a long sequence after two empty ones; a long tail
    ([128, 256, 127], [128, 256, 129], 0),
    ([3, 5], [3, 9], 300),  # a tail longer than a query tile's rows x m_tiles: its rows repeat
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths_q, lengths_k, pad_q", PACKINGS)
def test_matches_float64_and_the_reference(rng, dtype, head_dim, causal, lengths_q, lengths_k, pad_q):
    check(
        rng,
        lengths_q,
        lengths_k,
        heads_q=4,
        heads_kv=2,
        head_dim=head_dim,
        dtype=dtype,
        causal=causal,
        pad_q=pad_q,
    )


@pytest.mark.parametrize("heads_q, heads_kv", [(8, 1), (6, 3), (3, 3)])
def test_gqa_and_mqa(rng, heads_q, heads_kv):
    check(
        rng,
        [70, 0, 200],
        [90, 5, 200],
        heads_q=heads_q,
        heads_kv=heads_kv,
        head_dim=128,
        dtype=jnp.bfloat16,
        causal=True,
    )


def test_custom_scale_and_large_scores(rng):
    check(
        rng,
        [300, 40],
        [280, 41],
        heads_q=2,
        heads_kv=2,
        head_dim=128,
        dtype=jnp.bfloat16,
        causal=True,
        scale=0.3,
    )


def test_max_seqlen_above_the_longest_sequence(rng):
    """max_seqlen_q / _k larger than every sequence: more (empty) tiles, the same result."""
    lengths_q, lengths_k = [50, 3], [60, 10]
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    q, k, v = packed(rng, 53, 70, 4, 4, 64, jnp.float16)
    out, lse = run_kernel_poisoned(q, k, v, cu_q, cu_k, 600, 700, causal=True)
    want_out, want_lse = naive_varlen_f64(
        *(np.asarray(x, np.float32) for x in (q, k, v)), cu_q, cu_k, causal=True
    )
    assert relative_l2(out, want_out) < O_TOLERANCE
    seen = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(lse), seen)
    assert relative_l2(lse[seen], want_lse[seen]) < LSE_TOLERANCE


@pytest.mark.parametrize("causal", [False, True])
def test_tokens_of_no_sequence_get_zeros(rng, causal):
    """Tokens before cu_seqlens_q[0] and past cu_seqlens_q[-1] (and keys outside every sequence):
    O = 0 and LSE = -inf there, as on the pure-JAX path."""
    cu_q = np.asarray([5, 12, 12, 140], np.int32)
    cu_k = np.asarray([2, 30, 31, 100], np.int32)
    q, k, v = packed(rng, 150, 120, 4, 2, 128, jnp.bfloat16)
    out, lse = run_kernel_poisoned(q, k, v, cu_q, cu_k, 128, 69, causal=causal)
    want_out, want_lse = naive_varlen_f64(
        *(np.asarray(x, np.float32) for x in (q, k, v)), cu_q, cu_k, causal=causal
    )
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    for rows in (slice(0, 5), slice(140, 150)):
        assert np.all(out[rows] == 0) and np.all(np.isneginf(lse[:, rows]))
    assert relative_l2(out, want_out) < O_TOLERANCE
    seen = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(lse), seen)
    assert relative_l2(lse[seen], want_lse[seen]) < LSE_TOLERANCE


def test_deterministic_across_launches(rng):
    """Bitwise-identical O and LSE over 50 launches, with other GPU work in between."""
    lengths_q, lengths_k = [700, 0, 33, 1000, 1], [900, 20, 33, 1000, 300]
    cu_q, cu_k = jnp.asarray(offsets(lengths_q)), jnp.asarray(offsets(lengths_k))
    q, k, v = packed(rng, sum(lengths_q) + 5, sum(lengths_k), 8, 2, 128, jnp.bfloat16)
    fn = jax.jit(
        lambda *a: jzyfa.flash_attention_varlen(
            *a, 1000, 1000, causal=True, return_lse=True, implementation="kernel"
        )
    )
    assert_bitwise_reruns(fn, (q, k, v, cu_q, cu_k), reruns=50)


def test_offsets_are_traced_one_program_serves_every_packing(rng):
    """One compiled program, different offsets on the device: each result is right."""
    q, k, v = packed(rng, 400, 400, 4, 2, 64, jnp.bfloat16)
    fn = jax.jit(
        lambda *a: jzyfa.flash_attention_varlen(
            *a, 300, 300, causal=True, return_lse=True, implementation="kernel"
        )
    )
    for lengths in ([100, 300], [300, 0, 100], [1, 1, 398 - 98, 98]):
        cu = offsets(lengths)
        out, _ = fn(q, k, v, jnp.asarray(cu), jnp.asarray(cu))
        want, _ = naive_varlen_f64(*(np.asarray(x, np.float32) for x in (q, k, v)), cu, cu, causal=True)
        assert relative_l2(np.asarray(out, np.float32), want) < O_TOLERANCE, lengths


def test_handler_rejects_unsupported_head_dim():
    """The FFI handler itself answers InvalidArgument, not a crash, for what it cannot run (the
    jzyfa_attention_fwd contract with the varlen operands: gpu_utils.ffi_attention)."""
    q = jnp.ones((8, 1, 96), jnp.bfloat16)
    cu = jnp.asarray([0, 8], jnp.int32)
    with pytest.raises(
        Exception, match="head_dim must be 64, 128 or 256 for the jzyfa varlen kernel .* got 96"
    ):
        jax.block_until_ready(ffi_attention(q, q, q, cu_seqlens=(cu, cu), max_seqlens=(8, 8), causal=True))
