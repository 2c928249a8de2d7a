"""jzyfa.flash_attention_varlen on CPU: packed sequences of unequal (and zero) lengths against
per-sequence attention, traced offsets, gradients and argument errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_varlen_f64

import jzyfa


def offsets(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed_qkv(rng, lengths_q, lengths_k, *, heads_q=4, heads_kv=2, head_dim=32, head_dim_v=None, dtype):
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    q = rng.standard_normal((sum(lengths_q), heads_q, head_dim))
    k = rng.standard_normal((sum(lengths_k), heads_kv, head_dim))
    v = rng.standard_normal((sum(lengths_k), heads_kv, head_dim_v))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def varlen(max_q, max_k, **options):
    """jitted flash_attention_varlen with the offsets as traced arguments; returns (out, lse)."""
    call = functools.partial(jzyfa.flash_attention_varlen, return_lse=True, **options)
    return jax.jit(lambda q, k, v, cu_q, cu_k: call(q, k, v, cu_q, cu_k, max_q, max_k))


# (query lengths, key lengths): truly unequal, with empty sequences on either side.
PACKINGS = [
    ([5, 17, 1, 30], [5, 17, 1, 30]),
    ([3, 0, 9, 12], [7, 4, 0, 40]),  # a sequence with no queries; one with queries and no keys
    ([1, 1, 1], [64, 1, 33]),  # decode-like
    ([20, 65], [10, 65]),  # more queries than keys in the first: its first rows see none if causal
]


@pytest.mark.parametrize("lengths_q,lengths_k", PACKINGS)
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, (6, 6))])
def test_matches_float64_per_sequence(rng, lengths_q, lengths_k, causal, window):
    q, k, v = packed_qkv(rng, lengths_q, lengths_k, dtype=jnp.float32)
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    out, lse = varlen(max(lengths_q), max(lengths_k), causal=causal, window=window)(q, k, v, cu_q, cu_k)
    assert out.shape == q.shape and lse.shape == (4, sum(lengths_q))  # lse [heads, total_q]
    want_out, want_lse = naive_varlen_f64(q, k, v, cu_q, cu_k, causal=causal, window=window)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(out, want_out, atol=2e-5)
    seen = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[seen], want_lse[seen], atol=2e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_equals_flash_attention_per_sequence_with_gqa_and_mla(rng, dtype):
    lengths_q, lengths_k = [7, 40, 0, 3], [7, 50, 2, 0]
    q, k, v = packed_qkv(
        rng, lengths_q, lengths_k, heads_q=8, heads_kv=1, head_dim=96, head_dim_v=32, dtype=dtype
    )
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    out, lse = varlen(48, 64, causal=True, softmax_scale=0.15)(q, k, v, cu_q, cu_k)
    assert out.shape == (sum(lengths_q), 8, 32) and out.dtype == dtype
    for s in range(len(lengths_q)):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        want_out, want_lse = jzyfa.flash_attention(
            q[None, rows], k[None, keys], v[None, keys], causal=True, softmax_scale=0.15, return_lse=True
        )
        atol = 2e-2 if dtype == jnp.bfloat16 else 2e-6
        np.testing.assert_allclose(
            np.asarray(out[rows], np.float32), np.asarray(want_out[0], np.float32), atol=atol
        )
        np.testing.assert_allclose(lse[:, rows], want_lse[0], atol=2e-5)
    # The sequence with two queries' worth of nothing: no keys at all.
    assert np.all(np.asarray(out[cu_q[3] :], np.float32) == 0) and np.all(np.isneginf(lse[:, cu_q[3] :]))


def test_offsets_are_traced_one_program_serves_every_packing(rng):
    traces = []

    def call(q, k, v, cu_q, cu_k):
        traces.append(1)
        return jzyfa.flash_attention_varlen(q, k, v, cu_q, cu_k, 32, 32, causal=True, return_lse=True)

    fn = jax.jit(call)
    q, k, v = packed_qkv(rng, [40], [40], dtype=jnp.float32)
    for lengths in ([10, 30], [32, 8], [0, 32], [20, 20]):
        cu = jnp.asarray(offsets(lengths))
        out, lse = fn(q, k, v, cu, cu)
        want_out, want_lse = naive_varlen_f64(q, k, v, cu, cu, causal=True)
        np.testing.assert_allclose(out, want_out, atol=2e-5)
        np.testing.assert_allclose(lse, want_lse, atol=2e-5)
    assert len(traces) == 1
    # Abstract offsets trace too: nothing reads their values on the host.
    spec = jax.ShapeDtypeStruct((3,), jnp.int32)
    jax.make_jaxpr(call)(q, k, v, spec, spec)


def test_tokens_past_the_last_sequence_give_zero_and_minus_inf(rng):
    q, k, v = packed_qkv(rng, [12], [10], dtype=jnp.float32)  # 12 query tokens, 7 in use
    out, lse = varlen(5, 6)(q, k, v, offsets([2, 5]), offsets([4, 6]))
    assert np.all(np.asarray(out[7:]) == 0) and np.all(np.isneginf(lse[:, 7:]))
    assert np.all(np.isfinite(lse[:, :7]))


def test_no_keys_in_the_whole_batch(rng):
    # Found by hypothesis: with no key tokens at all there is nothing to gather from.
    q, k, v = packed_qkv(rng, [2, 3], [0, 0], dtype=jnp.float32)
    out, lse = varlen(3, 1, causal=True)(q, k, v, offsets([2, 3]), offsets([0, 0]))
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(lse))


def test_gradients_equal_per_sequence_gradients(rng):
    lengths_q, lengths_k = [6, 0, 11], [9, 3, 11]
    q, k, v = packed_qkv(rng, lengths_q, lengths_k, dtype=jnp.float32)
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    weights = jnp.asarray(rng.standard_normal(q.shape[:2] + v.shape[2:]), jnp.float32)

    def packed_loss(q, k, v):
        out = jzyfa.flash_attention_varlen(q, k, v, cu_q, cu_k, 11, 11, causal=True, window=(4, 0))
        return jnp.sum(out * weights)

    def per_sequence_loss(q, k, v):
        total = 0.0
        for s in range(3):
            rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
            out = jzyfa.flash_attention(
                q[None, rows], k[None, keys], v[None, keys], causal=True, window=(4, 0)
            )
            total += jnp.sum(out[0] * weights[rows])
        return total

    grads = jax.jit(jax.grad(packed_loss, argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(per_sequence_loss, argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(grads, want):
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(g, w, atol=1e-5)


def test_kernel_refuses_a_varlen_configuration_the_plan_lacks(rng):
    # A 16-bit head dim pair that no kernel has (jzyfa.plan.KERNELS); the default and "xla" paths serve it.
    q, k, v = packed_qkv(rng, [4], [4], head_dim=96, dtype=jnp.bfloat16)
    cu = offsets([4])
    with pytest.raises(
        ValueError,
        match=r"implementation='kernel' cannot serve this call: the 16-bit \(bf16, f16\) kernels take head dims .*got 96/96",
    ):
        jzyfa.flash_attention_varlen(q, k, v, cu, cu, 4, 4, implementation="kernel")
    want = jzyfa.flash_attention_varlen(q, k, v, cu, cu, 4, 4, implementation="xla")
    for implementation in (None, "xla"):
        out = jzyfa.flash_attention_varlen(q, k, v, cu, cu, 4, 4, implementation=implementation)
        assert out.shape == q.shape
        np.testing.assert_array_equal(out, want)


# --- argument errors, raised while tracing -----------------------------------------------------


def spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


GOOD = dict(
    q=spec((10, 4, 64)),
    k=spec((12, 2, 64)),
    v=spec((12, 2, 64)),
    cu_q=spec((3,), jnp.int32),
    cu_k=spec((3,), jnp.int32),
)

BAD_CALLS = [
    # (arguments to replace, static options, error type, message pattern)
    (dict(q=spec((1, 10, 4, 64))), {}, ValueError, r"q must have rank 3 \[total_tokens, heads, head_dim\]"),
    (dict(v=spec((11, 2, 64))), {}, ValueError, r"k and v must have the same \[total_k, kv_heads\]"),
    (dict(k=spec((12, 2, 32))), {}, ValueError, "same head_dim, got 64 and 32"),
    (dict(k=spec((12, 3, 64)), v=spec((12, 3, 64))), {}, ValueError, r"q's heads \(4\) must be a multiple"),
    (
        {n: spec(GOOD[n].shape[:2] + (96,), jnp.float8_e4m3fn) for n in "qkv"},
        {},
        ValueError,
        "flash_attention_varlen takes FP8 inputs with one head_dim of 64, 128 or 256 for q, k and v, got 96",
    ),
    (dict(cu_q=spec((3,), jnp.uint32)), {}, TypeError, "cu_seqlens_q must be int32, got uint32"),
    (dict(cu_k=spec((3, 1), jnp.int32)), {}, ValueError, r"cu_seqlens_k must have shape \[num_seqs \+ 1\]"),
    (dict(cu_k=spec((1,), jnp.int32)), {}, ValueError, "num_seqs >= 1"),
    (dict(cu_k=spec((4,), jnp.int32)), {}, ValueError, "the same number of sequences"),
    (dict(cu_q=[0, 4, 10]), {}, TypeError, "cu_seqlens_q must be an int32 array, got list"),
    (
        dict(cu_q=np.array([0, 6, 4], np.int32)),
        {},
        ValueError,
        "cu_seqlens_q must be non-negative, never decrease",
    ),
    (dict(cu_k=np.array([0, 6, 13], np.int32)), {}, ValueError, "end at most at the 12 packed tokens"),
    (
        dict(cu_q=np.array([0, 9, 10], np.int32)),
        {},
        ValueError,
        r"max_seqlen_q \(8\) is shorter than .* \(9\)",
    ),
    ({}, dict(max_seqlen_q=0), ValueError, "max_seqlen_q must be >= 1, got 0"),
    ({}, dict(max_seqlen_k=8.0), TypeError, "max_seqlen_k must be a static Python int, got float"),
    ({}, dict(max_seqlen_k=True), TypeError, "max_seqlen_k must be a static Python int, got bool"),
    ({}, dict(causal=None), TypeError, "causal must be a bool"),
    ({}, dict(window=(1, -3)), ValueError, "window's right bound must be >= 0, or -1"),
    ({}, dict(implementation="pallas"), ValueError, "implementation must be one of"),
]


@pytest.mark.parametrize("arrays,options,error,message", BAD_CALLS)
def test_bad_arguments_fail_while_tracing(arrays, options, error, message):
    args = dict(GOOD, **arrays)
    options = dict(dict(max_seqlen_q=8, max_seqlen_k=8), **options)
    host = {n: args.pop(n) for n in list(args) if not isinstance(args[n], jax.ShapeDtypeStruct)}

    def call(**traced):
        named = dict(traced, **host)
        return jzyfa.flash_attention_varlen(
            named["q"],
            named["k"],
            named["v"],
            named["cu_q"],
            named["cu_k"],
            options.pop("max_seqlen_q"),
            options.pop("max_seqlen_k"),
            **options,
        )

    with pytest.raises(error, match=message):
        jax.eval_shape(lambda traced: call(**traced), args)


def test_traced_max_seqlen_is_refused(rng):
    q, k, v = packed_qkv(rng, [4], [4], dtype=jnp.float32)
    cu = offsets([4])
    with pytest.raises(TypeError, match="max_seqlen_q must be a static Python int"):
        jax.jit(lambda m: jzyfa.flash_attention_varlen(q, k, v, cu, cu, m, 4))(4)
