"""Merging attention results computed over disjoint key ranges, using their log-sum-exps."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def merge_attention_states(
    out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Combines two partial attentions over disjoint key sets into attention over their union.

    out_*: [B, Sq, H, D]; lse_*: float32 [B, H, Sq], natural log, -inf where a row saw no key.
    Returns (out, lse) in out_a's dtype and float32; a row that saw no key in either part gives
    out = 0 and lse = -inf.
    """
    lse_max = jnp.maximum(lse_a, lse_b)
    shift = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
    weight_a = jnp.exp(lse_a - shift)  # 0 where a part saw no key
    weight_b = jnp.exp(lse_b - shift)
    total = weight_a + weight_b
    seen = total > 0
    safe_total = jnp.where(seen, total, 1.0)

    def per_row(weight: jax.Array) -> jax.Array:  # [B, H, Sq] -> [B, Sq, H, 1], out's layout
        return jnp.swapaxes(weight / safe_total, 1, 2)[..., None]

    out = per_row(weight_a) * out_a.astype(jnp.float32) + per_row(weight_b) * out_b.astype(jnp.float32)
    lse = jnp.where(seen, shift + jnp.log(safe_total), -jnp.inf)
    return out.astype(out_a.dtype), lse


def add_attention_sinks(out: jax.Array, lse: jax.Array, sinks: jax.Array, *, packed: bool = False):
    """Attention with a sink logit per query head (gpt-oss): each row's softmax also spans one more
    logit, `sinks[h]`, whose value is zero. That is a merge with a part that saw one key: the row's
    weight becomes exp(lse - logaddexp(lse, sink)) and its lse logaddexp(lse, sink), exact, so any
    kernel serves sinks and gradients reach them (and the kernel's lse) through these two formulas.

    Dense: out [B, Sq, H, D], lse [B, H, Sq]; packed: out [T, H, D], lse [H, T]; sinks [H]. Rows that
    saw no key give out = 0 and lse = sink.
    """
    sink = sinks.astype(jnp.float32)[:, None]  # [H, 1]: broadcasts over lse's last (row) axis
    new_lse = jnp.logaddexp(lse, sink)
    weight = jnp.exp(lse - new_lse)  # exp(-inf) = 0 where the row saw no key
    weight = weight.T if packed else jnp.swapaxes(weight, 1, 2)  # out's layout, [..., rows, H]
    return (out.astype(jnp.float32) * weight[..., None]).astype(out.dtype), new_lse
