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
