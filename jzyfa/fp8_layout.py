"""How the FP8 kernel reads V: transposed, keys permuted inside each 32-key group.

FP8 `wgmma` (m64nNk32, e4m3) takes both operands K-major: for O += P V the reduction runs over keys,
so V must sit in shared memory with keys contiguous, i.e. as V^T [head_dim, keys]. Either the kernel
takes V as it is ([B, Sk, Hkv, 128], or packed [total_k, Hkv, 128]) and builds each 128-key tile of V^T
in shared memory after its TMA load (ffi/fp8_value_transpose.cuh; tests/test_fp8_value_transpose.py
simulates it against `fp8_value_operand` below, the layout's definition), or a layout kernel writes
`fp8_value_operand(v)` to device memory first and the kernel loads its tiles (long calls:
jzyfa/fp8_primitive.py, `fp8_value_layout`). The kernel also
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
    `fp8_primitive.fp8_value_operand_p`, which on CUDA runs a kernel of ours (ffi/fp8_value_operand.cu,
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
