"""The public API's newer paths on the H200, against float64: gradients through the backward primitive
lowered for CUDA, right-padded batches on the packed kernels, sinks on the kernel's (out, lse), and
precision="fp8" quantizing in the call."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64, naive_attention_grads_f64, random_qkv, relative_l2
from gpu_utils import requires_hopper

import jzyfa

pytestmark = [pytest.mark.gpu, requires_hopper]


@pytest.mark.parametrize("seq_q,seq_k,heads_kv", [(1000, 1000, 2), (300, 1100, 1), (1100, 300, 4)])
def test_grad_on_the_gpu_matches_float64(rng, seq_q, seq_k, heads_kv):
    q, k, v = random_qkv(rng, seq_q=seq_q, seq_k=seq_k, heads_q=4, heads_kv=heads_kv, head_dim=128)
    dout = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    dlse = jnp.asarray(rng.standard_normal((1, 4, seq_q)), jnp.float32)

    def loss(q, k, v):
        out, lse = jzyfa.flash_attention(q, k, v, causal=True, return_lse=True, implementation="kernel")
        return jnp.sum(out.astype(jnp.float32) * dout) + jnp.sum(
            jnp.where(jnp.isfinite(lse), lse, 0.0) * dlse
        )

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    exact = naive_attention_grads_f64(q, k, v, dout, dlse, causal=True)
    for g, want in zip(grads, exact):
        assert g.dtype == jnp.bfloat16
        assert relative_l2(g, want) < 2e-2


def test_padded_batch_on_the_packed_kernels(rng):
    q, k, v = random_qkv(rng, batch=3, seq_q=700, seq_k=900, heads_q=8, heads_kv=2, head_dim=128)
    lengths_q, lengths_k = [700, 0, 333], [900, 50, 129]
    call = functools.partial(jzyfa.flash_attention, causal=True, return_lse=True, implementation="kernel")
    out, lse = jax.jit(call)(q, k, v, seqlens_q=jnp.asarray(lengths_q), seqlens_k=jnp.asarray(lengths_k))
    for b, (len_q, len_k) in enumerate(zip(lengths_q, lengths_k)):
        if len_q:
            want_out, want_lse = naive_attention_f64(
                q[b : b + 1, :len_q], k[b : b + 1, :len_k], v[b : b + 1, :len_k], causal=True
            )
            assert relative_l2(out[b, :len_q], want_out[0]) < 1e-2
            seen = np.isfinite(want_lse[0])
            np.testing.assert_allclose(
                np.asarray(lse[b, :, :len_q])[seen], want_lse[0][seen], rtol=1e-4, atol=1e-4
            )
        np.testing.assert_array_equal(np.asarray(out[b, len_q:], np.float32), 0)
        assert np.all(np.isneginf(np.asarray(lse[b, :, len_q:])))


def test_sinks_on_the_kernel(rng):
    q, k, v = random_qkv(rng, batch=2, seq_q=512, seq_k=512, heads_q=4, heads_kv=2, head_dim=128)
    sinks = jnp.asarray(rng.standard_normal(4) * 3, jnp.float32)
    out, lse = jzyfa.flash_attention(
        q, k, v, causal=True, sinks=sinks, return_lse=True, implementation="kernel"
    )
    plain_out, plain_lse = naive_attention_f64(q, k, v, causal=True)
    sink = np.asarray(sinks, np.float64)[None, :, None]
    want_lse = np.logaddexp(plain_lse, sink)
    want_out = plain_out * np.swapaxes(np.exp(plain_lse - want_lse), 1, 2)[..., None]
    assert relative_l2(out, want_out) < 1e-2
    np.testing.assert_allclose(lse, want_lse, rtol=1e-4, atol=1e-4)


def test_fp8_precision_on_the_kernel(rng):
    q, k, v = random_qkv(rng, batch=2, seq_q=1024, seq_k=1024, heads_q=8, heads_kv=2, head_dim=128)
    out = jax.jit(
        functools.partial(jzyfa.flash_attention, causal=True, precision="fp8", implementation="kernel")
    )(q, k, v)
    assert out.dtype == jnp.bfloat16
    want, _ = naive_attention_f64(q, k, v, causal=True)
    assert relative_l2(out, want) < 0.08
