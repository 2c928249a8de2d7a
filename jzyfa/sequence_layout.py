"""Orders of a sequence split over n context-parallel shards, and converting between them.

"contiguous": shard i holds chunk i of n equal chunks. Under a causal mask the last shard then does n
times the first one's work.
"balanced": the sequence is cut into 2n chunks and shard i holds chunks i and 2n-1-i, so every shard
does the same causal work (an early and a late chunk). A model that runs context parallel keeps its
activations in this order from the embedding on, and gives RoPE the matching positions
(`balanced_positions`); attention is the only place where the order matters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

LAYOUTS = ("balanced", "contiguous")


def chunks_per_shard(layout: str) -> int:
    return 2 if layout == "balanced" else 1


def shard_chunks(shard, num_shards: int, layout: str) -> tuple:
    """Chunk indices (in sequence order) that shard `shard` holds, in the order it holds them.

    `shard` may be a Python int or a traced index; chunks are of size seq / (num_shards *
    chunks_per_shard(layout)).
    """
    if layout == "balanced":
        return (shard, 2 * num_shards - 1 - shard)
    return (shard,)


def balanced_chunk_order(num_shards: int) -> np.ndarray:
    """Chunk indices in balanced layout order: [0, 2n-1, 1, 2n-2, ..., n-1, n]."""
    return np.array([c for shard in range(num_shards) for c in shard_chunks(shard, num_shards, "balanced")])


def _reorder_chunks(x: jax.Array, order: np.ndarray, axis: int) -> jax.Array:
    chunks = jnp.split(x, len(order), axis=axis)
    return jnp.concatenate([chunks[i] for i in order], axis=axis)


def _check_divisible(x: jax.Array, num_shards: int, axis: int) -> None:
    if x.shape[axis] % (2 * num_shards):
        raise ValueError(
            f"the balanced layout cuts the sequence into 2 * {num_shards} equal chunks; "
            f"length {x.shape[axis]} (axis {axis}) is not a multiple of {2 * num_shards}"
        )


def to_balanced_layout(x: jax.Array, num_shards: int, *, axis: int = 1) -> jax.Array:
    """Reorders x's sequence axis (in natural order) into the balanced layout for num_shards."""
    _check_divisible(x, num_shards, axis)
    return _reorder_chunks(x, balanced_chunk_order(num_shards), axis)


def from_balanced_layout(x: jax.Array, num_shards: int, *, axis: int = 1) -> jax.Array:
    """Inverse of `to_balanced_layout`: back to natural sequence order."""
    _check_divisible(x, num_shards, axis)
    return _reorder_chunks(x, np.argsort(balanced_chunk_order(num_shards)), axis)


def balanced_positions(seq_len: int, num_shards: int) -> np.ndarray:
    """Token positions in balanced layout order, e.g. for RoPE in a context-parallel model."""
    return np.asarray(to_balanced_layout(np.arange(seq_len)[None], num_shards)[0])
