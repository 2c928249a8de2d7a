"""Dense batches with per-sequence lengths (right padding) on the packed (varlen) layout.

A padded dense call, q [B, Sq, H, D] whose sequence b holds seqlens_q[b] valid rows and
seqlens_k[b] valid keys, is the same buffer seen as a packed batch of 2B sequences: sequence b's
valid tokens, then its padding as a sequence of its own (so the offsets stay contiguous, which is all
the packed layout asks). The varlen kernels (and the packed reference) then see each real sequence's
keys only, with the mask bottom-right aligned per sequence; the padding sequences' rows are computed and
dropped: padded query rows give out = 0 and lse = -inf. Nothing is copied: the reshapes are free, and
the lengths stay on the device.

Used by the primitives' per-shard calls (forward and backward) and by the pure-JAX path, so every path
masks alike. The padding's own work is wasted; a kernel that takes the lengths would skip it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def packed_offsets(seqlens: jax.Array, padded_len: int) -> jax.Array:
    """int32 [2B + 1] offsets of the packed view of a [B, padded_len] batch whose rows hold seqlens[b]
    valid tokens (clipped to [0, padded_len]): each row's valid tokens, then its padding."""
    lengths = jnp.clip(seqlens.astype(jnp.int32), 0, padded_len)
    starts = jnp.arange(lengths.shape[0], dtype=jnp.int32) * padded_len
    bounds = jnp.stack([starts, starts + lengths], axis=1).reshape(-1)
    # jnp.full, not a literal array: the primitives trace this inside custom_partitioning, which takes
    # no captured constants.
    return jnp.concatenate([bounds, jnp.full((1,), lengths.shape[0] * padded_len, jnp.int32)])


def pack(x: jax.Array) -> jax.Array:
    """[B, S, ...] -> [B * S, ...]."""
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def per_sequence(d: jax.Array) -> jax.Array:
    """A per-batch-row descale or scale ([B, Hkv], INT8's [B, H, blocks]) as the packed batch's [2B, ...]:
    the padding sequence takes its row's."""
    return jnp.repeat(d, 2, axis=0)


def rows_to_packed(x: jax.Array) -> jax.Array:
    """lse-like [B, H, S] -> the packed layout's [H, B * S]."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[1], -1)


def unpack_results(out: jax.Array, lse: jax.Array, batch: int, seqlens_q: jax.Array):
    """Packed (out [B * Sq, H, Dv], lse [H, B * Sq]) -> dense (out [B, Sq, H, Dv], lse [B, H, Sq]), rows
    past a sequence's length set to out = 0 and lse = -inf."""
    out = out.reshape((batch, -1) + out.shape[1:])
    lse = jnp.swapaxes(lse.reshape(lse.shape[0], batch, -1), 0, 1)
    valid = jnp.arange(out.shape[1])[None, :] < jnp.clip(seqlens_q, 0, out.shape[1])[:, None]  # [B, Sq]
    out = jnp.where(valid[:, :, None, None], out, jnp.zeros((), out.dtype))
    return out, jnp.where(valid[:, None, :], lse, -jnp.inf)


# attend_packed(q, k, v, cu_q, cu_k, *descales) -> (out, lse) of the packed batch; max lengths (Sq, Sk).
PackedAttend = Callable[..., tuple[jax.Array, jax.Array]]


def attention(attend_packed: PackedAttend, q, k, v, seqlens_q, seqlens_k, *descales):
    """A padded dense call through a packed one; descales and scales ([B, ...] or scalars) follow their
    rows."""
    batch, seq_q, seq_k = q.shape[0], q.shape[1], k.shape[1]
    cu_q, cu_k = packed_offsets(seqlens_q, seq_q), packed_offsets(seqlens_k, seq_k)
    descales = [per_sequence(d) if d.ndim >= 2 else d for d in descales]
    out, lse = attend_packed(pack(q), pack(k), pack(v), cu_q, cu_k, *descales)
    return unpack_results(out, lse, batch, seqlens_q)


def backward(backward_packed: Callable, q, k, v, dout, lse, delta, seqlens_q, seqlens_k):
    """(dq, dk, dv) of a padded dense call through the packed backward(q, k, v, dout, lse, delta, cu_q,
    cu_k). lse is -inf on padded rows (the forward's), so they contribute nothing."""
    cu_q, cu_k = packed_offsets(seqlens_q, q.shape[1]), packed_offsets(seqlens_k, k.shape[1])
    grads = backward_packed(
        pack(q), pack(k), pack(v), pack(dout), rows_to_packed(lse), rows_to_packed(delta), cu_q, cu_k
    )
    return tuple(g.reshape(x.shape) for g, x in zip(grads, (q, k, v)))
