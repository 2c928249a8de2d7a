"""jzyfa.attention_reference and merge_attention_states against a naive float64 attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64, random_qkv

import jzyfa
from jzyfa import reference as reference_module
from jzyfa.reference import attention_reference

# Jitted: one compilation per shape instead of one per operation.
reference = jax.jit(jzyfa.attention_reference, static_argnames=("causal", "softmax_scale"))
merge = jax.jit(jzyfa.merge_attention_states)

CASES = [
    # seq_q, seq_k, heads_q, heads_kv, head_dim
    (1, 1, 2, 2, 64),
    (127, 127, 2, 1, 64),
    (129, 129, 4, 2, 128),
    (1, 129, 4, 1, 64),  # decode-like: one query sees every key
    (129, 127, 2, 2, 64),  # more queries than keys: the first rows see no key when causal
    (33, 127, 6, 2, 128),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_q,seq_k,heads_q,heads_kv,head_dim", CASES)
def test_matches_float64(rng, seq_q, seq_k, heads_q, heads_kv, head_dim, causal):
    q, k, v = random_qkv(
        rng,
        batch=2,
        seq_q=seq_q,
        seq_k=seq_k,
        heads_q=heads_q,
        heads_kv=heads_kv,
        head_dim=head_dim,
        dtype=jnp.float32,
    )
    out, lse = reference(q, k, v, causal=causal)
    want_out, want_lse = naive_attention_f64(q, k, v, causal=causal)
    np.testing.assert_allclose(out, want_out, atol=2e-5)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5)
    assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
    assert lse.shape == (2, heads_q, seq_q)


def test_rows_without_keys_give_zero_and_minus_inf(rng):
    q, k, v = random_qkv(rng, seq_q=8, seq_k=3)
    out, lse = reference(q, k, v, causal=True)
    # Bottom-right alignment: query i sees keys j <= i - 5, so rows 0..4 see nothing.
    assert np.all(np.asarray(out[:, :5]) == 0)
    assert np.all(np.isneginf(lse[:, :, :5]))
    assert np.all(np.isfinite(lse[:, :, 5:]))
    assert not np.isnan(np.asarray(out, np.float32)).any()


def test_bf16_output_dtype_and_custom_scale(rng):
    q, k, v = random_qkv(rng, seq_q=17, seq_k=17, heads_q=4, heads_kv=2)
    out, lse = reference(q, k, v, causal=True, softmax_scale=0.3)
    want_out, want_lse = naive_attention_f64(q, k, v, causal=True, softmax_scale=0.3)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float64), want_out, atol=1e-2)
    np.testing.assert_allclose(lse, want_lse, atol=1e-5)


def test_gradients_are_finite_with_masked_rows(rng):
    q, k, v = random_qkv(rng, seq_q=6, seq_k=4, dtype=jnp.float32)

    def loss(q, k, v):
        out, lse = jzyfa.attention_reference(q, k, v, causal=True)
        return jnp.sum(out**2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    for g in jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v):
        assert np.isfinite(np.asarray(g)).all()


@pytest.mark.parametrize("causal,split", [(False, 1), (False, 40), (True, 16), (True, 17)])
def test_merging_key_ranges_equals_whole(rng, causal, split):
    # Chunked prefill: 48 new queries over 16 cached keys and their own 48 keys. With causal=True,
    # keys [0, 17) are visible to every query (j <= i + 16), so the prefix part is non-causal; the
    # suffix part ends at the last key, so its bottom-right alignment equals the whole call's.
    # split=17 leaves query 0 no key in the suffix (lse -inf there), which merging must absorb.
    q, k, v = random_qkv(rng, batch=2, seq_q=48, seq_k=64, heads_q=4, heads_kv=2, dtype=jnp.float32)
    whole_out, whole_lse = reference(q, k, v, causal=causal)
    out_a, lse_a = reference(q, k[:, :split], v[:, :split], causal=False)
    out_b, lse_b = reference(q, k[:, split:], v[:, split:], causal=causal)
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    np.testing.assert_allclose(out, whole_out, atol=2e-6)
    np.testing.assert_allclose(lse, whole_lse, atol=2e-6)


def test_merging_rows_without_keys(rng):
    out_a = jnp.asarray(rng.standard_normal((1, 3, 1, 8)), jnp.float32)
    out_b = jnp.zeros((1, 3, 1, 8), jnp.float32)
    lse_a = jnp.array([[[0.5, -jnp.inf, -jnp.inf]]])
    lse_b = jnp.array([[[-jnp.inf, 1.0, -jnp.inf]]])
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    np.testing.assert_array_equal(lse, [[[0.5, 1.0, -np.inf]]])
    np.testing.assert_array_equal(out[:, 0], out_a[:, 0])  # only part a saw keys
    np.testing.assert_array_equal(out[:, 1:], 0)


@pytest.mark.parametrize(
    "batch, seq_q, seq_k, heads_q, heads_kv, causal, window",
    [
        (2, 300, 300, 4, 2, True, None),
        (1, 77, 333, 2, 1, False, (16, 3)),
        (1, 200, 64, 2, 2, True, None),  # rows that see no key
        (2, 257, 513, 4, 4, False, None),
        (1, 129, 129, 2, 2, False, (0, 0)),
    ],
)
def test_query_chunks_match_one_call(
    rng, monkeypatch, batch, seq_q, seq_k, heads_q, heads_kv, causal, window
):
    """Past CHUNK_SCORE_ENTRIES the reference runs over query chunks (forward and rematerialized
    backward); results and gradients match the one-call path to float32 rounding."""
    q, k, v = random_qkv(rng, batch=batch, seq_q=seq_q, seq_k=seq_k, heads_q=heads_q, heads_kv=heads_kv,
                         head_dim=32, dtype=jnp.float32)  # fmt: skip

    def run(q, k, v):
        return attention_reference(q, k, v, causal=causal, window=window)

    def loss(q, k, v):
        return run(q, k, v)[0].sum()

    whole, whole_grads = run(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    monkeypatch.setattr(
        reference_module, "CHUNK_SCORE_ENTRIES", batch * heads_q * seq_k * 7
    )  # 7 rows per chunk
    chunked, chunked_grads = run(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(chunked[0], whole[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.isinf(chunked[1]), np.isinf(whole[1]))
    np.testing.assert_allclose(chunked[1], whole[1], rtol=1e-5, atol=1e-5)
    for a, b in zip(chunked_grads, whole_grads):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_long_sequences_do_not_hold_every_score():
    """16 heads x 32K x 32K causal: the scores alone are 64 GiB; the chunked reference compiles to a
    few GiB of temporaries forward and backward (nothing runs)."""
    spec = jax.ShapeDtypeStruct((1, 32768, 16, 128), jnp.bfloat16)

    def forward(q, k, v):
        return attention_reference(q, k, v, causal=True)

    def grads(q, k, v):
        return jax.grad(lambda *x: forward(*x)[0].astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)

    for fn, limit_gib in ((forward, 4), (grads, 8)):
        memory = jax.jit(fn).lower(spec, spec, spec).compile().memory_analysis()
        if memory is None:
            pytest.skip("this backend reports no memory analysis")
        assert memory.temp_size_in_bytes < limit_gib * 2**30, (fn.__name__, memory.temp_size_in_bytes / 2**30)
