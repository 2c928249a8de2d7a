"""Test helpers: random attention inputs and a naive float64 NumPy attention to check against."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def random_qkv(
    rng: np.random.Generator,
    *,
    batch: int = 1,
    seq_q: int,
    seq_k: int | None = None,
    heads_q: int = 2,
    heads_kv: int | None = None,
    head_dim: int = 64,
    dtype=jnp.bfloat16,
):
    """Standard-normal q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D] as JAX arrays of `dtype`."""
    seq_k = seq_q if seq_k is None else seq_k
    heads_kv = heads_q if heads_kv is None else heads_kv
    q = rng.standard_normal((batch, seq_q, heads_q, head_dim))
    k = rng.standard_normal((batch, seq_k, heads_kv, head_dim))
    v = rng.standard_normal((batch, seq_k, heads_kv, head_dim))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def naive_attention_f64(q, k, v, *, causal: bool, softmax_scale: float | None = None):
    """Attention in float64 with explicit loops over batch and heads; returns (out, lse) as NumPy.

    Bottom-right causal alignment; rows that see no key give out = 0 and lse = -inf.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, seq_q, heads_q, head_dim = q.shape
    seq_k, heads_kv = k.shape[1], k.shape[2]
    scale = 1 / np.sqrt(head_dim) if softmax_scale is None else softmax_scale
    out = np.zeros(q.shape)
    lse = np.full((batch, heads_q, seq_q), -np.inf)
    for b in range(batch):
        for h in range(heads_q):
            kv_head = h // (heads_q // heads_kv)
            for i in range(seq_q):
                visible = np.arange(seq_k) <= i + seq_k - seq_q if causal else np.ones(seq_k, bool)
                if not visible.any():
                    continue
                scores = k[b, visible, kv_head] @ q[b, i, h] * scale
                weights = np.exp(scores - scores.max())
                out[b, i, h] = weights @ v[b, visible, kv_head] / weights.sum()
                lse[b, h, i] = scores.max() + np.log(weights.sum())
    return out, lse
