"""Attention sinks (one logit per query head, gpt-oss): exact on top of any path's (out, lse), against an
oracle that appends the sink as one more score column, forward and gradients (the sinks' too)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import offsets, random_qkv, relative_l2, visible_f64

import jzyfa

pytestmark = pytest.mark.usefixtures("cpu_backend")  # 16-bit calls bind the primitive, as on a GPU


def sink_attention_oracle(q, k, v, sinks, *, causal: bool):
    """Attention whose softmax also spans a zero-valued key with logit sinks[h], in float32 JAX (so it
    differentiates): the sink as one more column of the scores, dropped after the softmax."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    batch, seq_q, heads_q, head_dim = q.shape
    seq_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / np.sqrt(head_dim)
    if causal:
        scores = jnp.where(visible_f64(seq_q, seq_k, causal=True), scores, -jnp.inf)
    sink_column = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None, None], (batch, heads_q, seq_q, 1))
    probs = jax.nn.softmax(jnp.concatenate([scores, sink_column], axis=-1), axis=-1)[..., :seq_k]
    lse = jax.nn.logsumexp(jnp.concatenate([scores, sink_column], axis=-1), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision="highest"), lse


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("seq_q,seq_k", [(24, 40), (40, 24)])  # the second has rows that see no key
def test_sinks_match_the_oracle(rng, dtype, seq_q, seq_k):
    q, k, v = random_qkv(rng, batch=2, seq_q=seq_q, seq_k=seq_k, heads_q=4, heads_kv=2, dtype=dtype)
    sinks = jnp.asarray(rng.standard_normal(4) * 2, jnp.float32)
    out, lse = jzyfa.flash_attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    want_out, want_lse = sink_attention_oracle(q, k, v, sinks, causal=True)
    assert out.dtype == dtype
    assert relative_l2(out, want_out) < (1e-6 if dtype == jnp.float32 else 1e-2)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    if seq_q > seq_k:  # rows that see no key: out 0, lse the sink
        np.testing.assert_array_equal(np.asarray(out[:, : seq_q - seq_k], np.float32), 0)
        np.testing.assert_allclose(lse[:, :, 0], jnp.broadcast_to(sinks, (2, 4)), rtol=1e-6)


def test_sinks_gradients_match_the_oracle(rng):
    q, k, v = random_qkv(rng, batch=1, seq_q=24, seq_k=40, heads_q=4, heads_kv=2, dtype=jnp.bfloat16)
    sinks = jnp.asarray(rng.standard_normal(4), jnp.float32)
    weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def loss(attention, q, k, v, sinks):
        return jnp.sum(attention(q, k, v, sinks).astype(jnp.float32) * weights)

    ours = lambda q, k, v, s: jzyfa.flash_attention(q, k, v, causal=True, sinks=s)
    theirs = lambda q, k, v, s: sink_attention_oracle(q, k, v, s, causal=True)[0]
    assert "jzyfa_attention_bwd" in str(
        jax.make_jaxpr(jax.grad(functools.partial(loss, ours)))(q, k, v, sinks)
    )
    got = jax.grad(functools.partial(loss, ours), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    want = jax.grad(functools.partial(loss, theirs), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for g, w in zip(got, want):
        assert relative_l2(g, w) < 1e-2


def test_sinks_of_a_packed_batch_are_per_sequence_sinks(rng):
    lengths = [9, 0, 14, 5]
    cu = jnp.asarray(offsets(lengths), jnp.int32)
    q = jnp.asarray(rng.standard_normal((28, 4, 64)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((28, 2, 64)), jnp.float32)
    sinks = jnp.asarray(rng.standard_normal(4), jnp.float32)
    out, lse = jzyfa.flash_attention_varlen(
        q, kv, kv, cu, cu, 14, 14, causal=True, sinks=sinks, return_lse=True
    )
    start = 0
    for length in lengths:
        rows = slice(start, start + length)
        if length:
            want_out, want_lse = sink_attention_oracle(
                q[None, rows], kv[None, rows], kv[None, rows], sinks, causal=True
            )
            np.testing.assert_allclose(out[rows], want_out[0], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(lse[:, rows], want_lse[0], rtol=1e-5, atol=1e-5)
        start += length


@pytest.mark.parametrize(
    "sinks,error,message",
    [
        (np.zeros(3, np.float32), ValueError, r"sinks must have shape \[heads_q\] = \(4,\)"),
        (np.zeros(4, np.int32), TypeError, "sinks must be a floating array, got int32"),
        ([0.0] * 4, TypeError, "sinks must be None or an array"),
    ],
)
def test_sinks_errors_name_the_argument(rng, sinks, error, message):
    q, k, v = random_qkv(rng, seq_q=8, heads_q=4)
    with pytest.raises(error, match=message):
        jzyfa.flash_attention(q, k, v, sinks=sinks)
