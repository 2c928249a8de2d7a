"""How the FP8 kernel reads V: transposed, keys permuted inside each 32-key group.

FP8 `wgmma` (m64nNk32, e4m3) takes both operands K-major: for O += P V the reduction runs over keys,
so V must sit in shared memory with keys contiguous, i.e. as V^T [head_dim, keys]. Either the kernel
takes V as it is ([B, Sk, Hkv, 128], or packed [total_k, Hkv, 128]) and builds each 128-key tile of V^T
in shared memory after its TMA load (ffi/fp8_value_transpose.cuh; tests/test_fp8_value_transpose.py
simulates it against `fp8_value_operand` below, the layout's definition), or a layout kernel writes
`fp8_value_operand(v)` to device memory first and the kernel loads its tiles (long calls:
jzyfa/plan.py, `fp8_value_layout`; packed varlen batches by default, through
`fp8_varlen_value_operand` below: `fp8_varlen_value_layout`). The kernel also
feeds P from registers without moving a byte between lanes: the f32 accumulator of S = Q K^T gives a
thread, for each row it owns, the key pairs {2t, 2t+1} of every 8-key chunk (t = lane % 4), while the
8-bit A operand wants four consecutive k's {4t .. 4t+3} per 32-bit register. Rather than shuffling P,
the kernel packs what it holds and lets V's keys follow: register byte e of the A fragment for
logical k is the probability of key `physical_key(k)`, so V^T's column k must hold key
`physical_key(k)`. A permutation inside a sum of products changes nothing: P V is unchanged.

Layouts assumed (PTX ISA, "wgmma register fragments"), for one warp's 16 rows, g = lane / 4,
t = lane % 4:
- f32 accumulator of m64nN: d[4c + 0, 1] = row g, columns 8c + 2t + {0, 1};
  d[4c + 2, 3] = row g + 8, the same columns.
- 8-bit A of m64k32: register 0 = row g, k = 4t + {0..3} (byte e = k 4t + e); register 1 = row g + 8,
  the same k; registers 2 and 3 = rows g and g + 8, k = 16 + 4t + {0..3}.
So register 0 packs d[0], d[1] of chunk 0 and d[0], d[1] of chunk 1 (keys 2t, 2t+1, 8+2t, 9+2t),
register 2 the same of chunks 2 and 3 (keys 16 + ...), registers 1 and 3 the d[2], d[3] values.
`tests/test_fp8_layout.py` checks this bookkeeping by simulating the fragments in NumPy.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

KEY_GROUP = 32  # the k of one FP8 wgmma: the permutation repeats every 32 keys


def physical_key(k):
    """The key (0..31, inside its group) whose probability sits at logical k of the A fragment.

    Integer arithmetic only, so k may be a NumPy or a JAX array (traced functions must build the
    permutation from iota rather than capture it: `custom_partitioning` refuses constants).
    """
    high, rest = k // 16, k % 16
    quad, byte = rest // 4, rest % 4  # quad: t, the lane within the 4-lane row group
    return 16 * high + 8 * (byte // 2) + 2 * quad + byte % 2


KEY_PERMUTATION = physical_key(np.arange(KEY_GROUP))


def _key_permutation() -> jax.Array:
    """KEY_PERMUTATION as JAX ops, for traced code."""
    return physical_key(jnp.arange(KEY_GROUP, dtype=jnp.int32))


def padded_keys(seq_k: int) -> int:
    """Key count of the kernel's V^T: a whole number of 32-key groups."""
    return -(-seq_k // KEY_GROUP) * KEY_GROUP


def fp8_value_operand(v: jax.Array) -> jax.Array:
    """V [B, Sk, Hkv, D] (e4m3) as the FP8 kernel reads it: [B, Hkv, D, Sk'] with Sk' = Sk rounded up
    to 32, zero keys appended, and keys permuted inside each group of 32 (column k of group g holds
    key 32 g + physical_key(k)).

    The definition of the layout each V^T tile has in the kernel's shared memory (a tile is 128 of these
    columns; keys past Sk are zeros there too: TMA's fill of rows past the tensor's end, or the appended
    zeros here). One XLA transpose-gather over V (its bytes once); the appended keys are masked in the
    kernel (their probability is 0), and zeros keep 0 * V finite. The "transposed" FP8 path binds
    `primitives.fp8_value_operand_p`, which on CUDA runs a kernel of ours (ffi/fp8_value_operand.cu,
    bitwise this function) and lowers to this function everywhere else.
    """
    if v.ndim != 4:
        raise ValueError(f"v must be [batch, seq_k, heads_kv, head_dim], got shape {v.shape}")
    batch, seq_k, heads_kv, head_dim = v.shape
    pad = padded_keys(seq_k) - seq_k
    if pad:
        v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
    groups = v.reshape(batch, -1, KEY_GROUP, heads_kv, head_dim)
    permuted = jnp.take(groups, _key_permutation(), axis=2)
    # [B, G, 32, Hkv, D] -> [B, Hkv, D, G, 32] -> [B, Hkv, D, Sk']
    return permuted.transpose(0, 3, 4, 1, 2).reshape(batch, heads_kv, head_dim, -1)


def value_from_operand(vt: jax.Array, seq_k: int) -> jax.Array:
    """The inverse of `fp8_value_operand` (for tests and debugging): back to [B, Sk, Hkv, D]."""
    batch, heads_kv, head_dim, padded = vt.shape
    groups = vt.reshape(batch, heads_kv, head_dim, padded // KEY_GROUP, KEY_GROUP)
    restored = jnp.take(groups, jnp.argsort(_key_permutation()), axis=4)
    return restored.transpose(0, 3, 4, 1, 2).reshape(batch, padded, heads_kv, head_dim)[:, :seq_k]


# Packed variable-length batches (`flash_attention_varlen` with e4m3 inputs), "transposed" source (the
# default: jzyfa/plan.py, `fp8_varlen_value_layout`). The kernel's key blocks start at each sequence's first key, so
# each sequence's V^T must start on a 32-key group of its own: sequence s's keys start at column
# roundup32(cu_seqlens_k[s]) + 32 s. These ranges never overlap (the next one starts at least 32 columns
# past cu_seqlens_k[s + 1] - 1 + 32 s, this one ends before it), need no prefix sum, and the columns
# between them are zeros (finite, so that a key past a sequence's end, whose probability is 0, adds
# 0 * 0 to O). The "staged" source needs none of this: the kernel takes the packed V as it is.


def varlen_padded_keys(total_k: int, num_seqs: int) -> int:
    """Key columns of the varlen V^T: every sequence's columns with room for its 32-column offsets."""
    return padded_keys(total_k) + KEY_GROUP * (num_seqs + 1)


def varlen_value_columns(cu_seqlens_k: jax.Array) -> jax.Array:
    """The V^T column of each sequence's first key, [num_seqs] (the kernel's Fp8VarlenValueColumn)."""
    starts = cu_seqlens_k[:-1]
    return -(-starts // KEY_GROUP) * KEY_GROUP + KEY_GROUP * jnp.arange(starts.shape[0], dtype=starts.dtype)


def varlen_value_tokens(cu_seqlens_k: jax.Array, total_k: int) -> jax.Array:
    """The packed token each column of the varlen V^T holds before the 32-key permutation, [W]: sequence
    s's key j at column `varlen_value_columns(...)[s] + j`; total_k (past the end: a zero) elsewhere."""
    num_seqs = cu_seqlens_k.shape[0] - 1
    starts = varlen_value_columns(cu_seqlens_k)
    column = jnp.arange(varlen_padded_keys(total_k, num_seqs), dtype=jnp.int32)
    seq = jnp.searchsorted(starts, column, side="right").astype(jnp.int32) - 1  # the column's sequence
    in_seq = jnp.clip(seq, 0, num_seqs - 1)
    key = column - starts[in_seq]
    valid = (seq >= 0) & (key < cu_seqlens_k[in_seq + 1] - cu_seqlens_k[in_seq])
    return jnp.where(valid, cu_seqlens_k[in_seq] + key, total_k)


def fp8_varlen_value_operand(
    v: jax.Array, cu_seqlens_k: jax.Array, value_operand: Callable = fp8_value_operand
) -> jax.Array:
    """Packed V [total_k, Hkv, D] (e4m3) as the varlen FP8 kernel reads it with v_transposed: [Hkv, D, W],
    W = `varlen_padded_keys(total_k, num_seqs)`, sequence s's keys from column `varlen_value_columns(...)[s]`
    on, permuted inside each 32-key group as `fp8_value_operand` does, zeros elsewhere.

    Two steps: a gather of whole token rows into the sequences' columns (each starts on a 32-key group),
    then the dense layout (`value_operand`: `fp8_value_operand`, or on CUDA its kernel, bitwise the same)
    of that as one batch of W keys, whose 32-key groups then never straddle two sequences. cu_seqlens_k
    may be traced (it must be non-decreasing, as everywhere).
    """
    if v.ndim != 3:
        raise ValueError(f"v must be packed [total_k, heads_kv, head_dim], got shape {v.shape}")
    tokens = varlen_value_tokens(jnp.asarray(cu_seqlens_k, jnp.int32), v.shape[0])
    rows = jnp.take(v, tokens, axis=0, mode="fill", fill_value=0)  # [W, Hkv, D]
    return value_operand(rows[None])[0]


def varlen_value_from_operand(vt: jax.Array, cu_seqlens_k: jax.Array, total_k: int) -> jax.Array:
    """The inverse of `fp8_varlen_value_operand` (for tests and debugging): back to [total_k, Hkv, D]."""
    rows = value_from_operand(vt[None], vt.shape[2])[0]  # [W, Hkv, D], columns un-permuted
    tokens = varlen_value_tokens(jnp.asarray(cu_seqlens_k, jnp.int32), total_k)
    # Each token sits in exactly one column; scatter the columns back (the zero columns point past the end).
    out = jnp.zeros((total_k,) + rows.shape[1:], vt.dtype)
    return out.at[tokens].set(rows, mode="drop")
