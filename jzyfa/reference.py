"""Exact attention in pure JAX: the CPU lowering of the kernel, the "xla" path, and the backward.

Inputs are upcast to float32 and the softmax and both products run in float32 at full precision, so
this is the yardstick the kernels are measured against (up to the final cast to the input dtype).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

_HIGHEST = lax.Precision.HIGHEST


def causal_mask(seq_q: int, seq_k: int) -> jax.Array:
    """Bottom-right aligned mask, [seq_q, seq_k]: query i sees key j iff j <= i + seq_k - seq_q."""
    rows = jnp.arange(seq_q)[:, None]
    cols = jnp.arange(seq_k)[None, :]
    return cols <= rows + (seq_k - seq_q)


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Returns (out, lse) for q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D], Hq a multiple of Hkv.

    out has q's shape and dtype; lse is float32 [B, Hq, Sq], natural log. Query head h attends with
    key/value head h // (Hq // Hkv). Rows that see no key give out = 0 and lse = -inf.
    """
    batch, seq_q, heads_q, head_dim = q.shape
    seq_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)

    # Query heads sharing a KV head are grouped instead of repeating K and V.
    qf = q.astype(jnp.float32).reshape(batch, seq_q, heads_kv, group, head_dim)
    kf = k.astype(jnp.float32)
    vf = v.astype(jnp.float32)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qf, kf, precision=_HIGHEST) * softmax_scale
    if causal:
        scores = jnp.where(causal_mask(seq_q, seq_k), scores, -jnp.inf)

    row_max = jnp.max(scores, axis=-1, keepdims=True)
    # Fully masked rows have max -inf; shifting by 0 keeps exp(-inf) = 0 instead of NaN. The shift
    # cancels mathematically, so it carries no gradient.
    row_max = lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    probs = jnp.exp(scores - row_max)
    row_sum = jnp.sum(probs, axis=-1, keepdims=True)
    seen = row_sum > 0
    safe_sum = jnp.where(seen, row_sum, 1.0)

    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs / safe_sum, vf, precision=_HIGHEST)
    lse = jnp.where(seen, row_max + jnp.log(safe_sum), -jnp.inf)
    out = out.reshape(batch, seq_q, heads_q, head_dim).astype(q.dtype)
    return out, lse.reshape(batch, heads_q, seq_q)
