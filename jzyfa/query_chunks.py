"""Attention of one chunk of queries whose place in the whole query sequence is known statically.

The kernel's causal mask is aligned bottom-right (query i sees key j iff j <= i + Sk - Sq), so a chunk
of queries attends correctly to the whole key sequence when it is given exactly the key prefix its
last row sees: the kernel then puts the chunk's rows at the right offset. Sharded prefill (the
partition callback in `jzyfa.sharding`) and context parallelism (`jzyfa.context_parallel`) both build
on this.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jzyfa._validation import Window

# attend(q, k, v, causal) -> (out like q, lse float32 [B, Hq, Sq]); bottom-right causal alignment.
AttendFn = Callable[[jax.Array, jax.Array, jax.Array, bool], tuple[jax.Array, jax.Array]]


def no_keys_seen(q: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """What attention gives rows that see no key: out = 0 (with v's head dim) and lse = -inf."""
    # Built from q (not jnp.full) so that inside shard_map both vary over the mesh like q does.
    lse = jnp.swapaxes(jnp.zeros_like(q[..., 0], dtype=jnp.float32), 1, 2) - jnp.inf
    zero_row = jnp.zeros_like(q[..., :1])
    return jnp.broadcast_to(zero_row, q.shape[:-1] + v.shape[-1:]), lse


def visible_key_prefix(chunk_start: int, chunk_len: int, seq_q: int, seq_k: int) -> int:
    """How many leading keys the last row of a causal query chunk sees (<= 0: none at all)."""
    return chunk_start + chunk_len + seq_k - seq_q


def attend_query_chunk(
    attend: AttendFn,
    q_chunk: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    chunk_start: int,
    seq_q: int,
    causal: bool,
) -> tuple[jax.Array, jax.Array]:
    """Attention of queries [chunk_start, chunk_start + len) of a seq_q-long sequence to all of k, v.

    Causal: keys past the chunk's visible prefix are never read, which is also the work saved.
    """
    if not causal:
        return attend(q_chunk, k, v, False)
    visible = min(visible_key_prefix(chunk_start, q_chunk.shape[1], seq_q, k.shape[1]), k.shape[1])
    if visible <= 0:
        return no_keys_seen(q_chunk, v)
    return attend(q_chunk, k[:, :visible], v[:, :visible], True)


# attend_window(q, k, v, window) -> (out, lse): attention under the sliding window (left, right), bottom-right
# aligned, -1 unbounded (`jzyfa.flash_attention`'s convention).
WindowAttendFn = Callable[[jax.Array, jax.Array, jax.Array, Window], tuple[jax.Array, jax.Array]]


def window_key_range(chunk_start: int, chunk_len: int, seq_q: int, seq_k: int, window: Window):
    """(begin, end, local_window): the keys a query chunk's rows see under `window`, and the window that,
    applied to the chunk and keys [begin, end) alone, masks as `window` does on the whole sequence.

    Bottom-right alignment puts the chunk's rows at the right positions only when the keys end where
    the causal prefix would (end = chunk_start + chunk_len + seq_k - seq_q); when they end elsewhere,
    the bounds shift by the difference. end <= begin: the chunk sees no key.
    """
    left, right = window
    offset = seq_k - seq_q  # row i sits at position i + offset
    begin = 0 if left < 0 else max(0, chunk_start + offset - left)
    end = seq_k if right < 0 else min(seq_k, chunk_start + chunk_len + offset + right)
    # Keys [begin, end) taken as a whole sequence put local row r at r + (end - begin) - chunk_len, i.e.
    # (relative to key `begin`) global position chunk_start + r + offset + shift: the bounds move by
    # shift, which is >= 0 (end <= seq_k only where right >= seq_q - chunk_start - chunk_len, so the
    # right bound stays >= 0).
    shift = end - (chunk_start + chunk_len + offset)
    local = (left + shift if left >= 0 else -1, right - shift if right >= 0 else -1)
    return begin, end, local


def attend_window_chunk(
    attend: WindowAttendFn,
    q_chunk: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    chunk_start: int,
    seq_q: int,
    window: Window,
) -> tuple[jax.Array, jax.Array]:
    """Attention of queries [chunk_start, chunk_start + len) of a seq_q-long sequence to all of k, v under
    `window`: only the keys the chunk's window reaches are read."""
    begin, end, local = window_key_range(chunk_start, q_chunk.shape[1], seq_q, k.shape[1], window)
    if end <= begin:
        return no_keys_seen(q_chunk, v)
    return attend(q_chunk, k[:, begin:end], v[:, begin:end], local)
