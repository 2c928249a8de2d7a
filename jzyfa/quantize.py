"""FP8 (e4m3) quantization with power-of-two descales, and the Hadamard rotation that precedes it.

Everything runs as device ops: descales are computed and stay on the device, so quantizing inside a
jitted step never waits on the host.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
GRANULARITIES = ("tensor", "head")


def power_of_two_descale(amax: jax.Array) -> jax.Array:
    """Smallest power of two d with amax / d <= FP8_MAX; 1 where amax is 0."""
    # frexp is exact: ratio = mantissa * 2^exponent with mantissa in [0.5, 1), so 2^exponent >= ratio,
    # and 2^(exponent - 1) suffices when the ratio is itself a power of two (mantissa 0.5).
    mantissa, exponent = jnp.frexp(amax / FP8_MAX)
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)
    return jnp.where(amax > 0, jnp.ldexp(jnp.float32(1), exponent), 1.0).astype(jnp.float32)


def _group_heads(x: jax.Array, kv_heads: int | None) -> jax.Array:
    """[B, S, H, D] -> [B, S, G, H/G, D], G = kv_heads (or H): heads sharing one descale grouped."""
    batch, seq, heads, head_dim = x.shape
    groups = heads if kv_heads is None else kv_heads
    if heads % groups:
        raise ValueError(f"kv_heads={kv_heads} must divide the {heads} heads of x")
    return x.reshape(batch, seq, groups, heads // groups, head_dim)


def fp8_quantize(
    x: jax.Array, granularity: str = "tensor", *, kv_heads: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """Returns (x_fp8, descale) with x ~= x_fp8.astype(float32) * descale.

    granularity="tensor": one float32 descale, shape ().
    granularity="head": x is [B, S, H, D] and descale is [B, H]. For a GQA query, pass
    kv_heads=Hkv to share one descale per KV group, giving the [B, Hkv] descale_q that
    `flash_attention` takes (query head h belongs to group h // (H // Hkv)).
    Descales are powers of two, so scaling is exact and only the e4m3 rounding loses precision.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    xf = jnp.asarray(x).astype(jnp.float32)
    if granularity == "tensor":
        if kv_heads is not None:
            raise ValueError('kv_heads applies only to granularity="head"')
        descale = power_of_two_descale(jnp.max(jnp.abs(xf)))
        scaled = xf / descale
    else:
        if xf.ndim != 4:
            raise ValueError(f'granularity="head" needs x of rank 4 [B, S, H, D], got shape {xf.shape}')
        grouped = _group_heads(xf, kv_heads)
        # initial=0: no tokens (seq 0) is amax 0, descale 1
        descale = power_of_two_descale(jnp.max(jnp.abs(grouped), axis=(1, 3, 4), initial=0.0))
        scaled = (grouped / descale[:, None, :, None, None]).reshape(xf.shape)
    # amax / descale <= FP8_MAX already; the clip only guards against NaN from an e4m3fn overflow.
    return jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE), descale


def dequantize(x_fp8: jax.Array, descale: jax.Array) -> jax.Array:
    """float32 values of x_fp8 [B, S, H, D] scaled by a descale of shape (), (1,) or [B, G], G | H.

    A [B, G] descale applies to heads in G consecutive groups (head h uses descale[:, h // (H // G)]).
    """
    xf = x_fp8.astype(jnp.float32)
    descale = jnp.asarray(descale, jnp.float32)
    if descale.ndim < 2:
        return xf * descale.reshape(())
    grouped = _group_heads(xf, descale.shape[1])
    return (grouped * descale[:, None, :, None, None]).reshape(xf.shape)


def dequantize_varlen(x_fp8: jax.Array, descale: jax.Array, cu_seqlens: jax.Array) -> jax.Array:
    """float32 values of packed x_fp8 [total, H, D] scaled by a descale of shape (), (1,) or [num_seqs, G],
    G | H: token t of sequence s takes descale[s] (tokens of no sequence take the nearest sequence's)."""
    descale = jnp.asarray(descale, jnp.float32)
    if descale.ndim < 2:
        return x_fp8.astype(jnp.float32) * descale.reshape(())
    num_seqs = cu_seqlens.shape[0] - 1
    tokens = jnp.arange(x_fp8.shape[0], dtype=cu_seqlens.dtype)
    seq = jnp.clip(jnp.searchsorted(cu_seqlens, tokens, side="right") - 1, 0, num_seqs - 1)
    # Each token as a batch of one: dequantize's [B, G] descales are then per token.
    return dequantize(x_fp8[:, None], descale[seq])[:, 0]


def hadamard_matrix(n: int) -> np.ndarray:
    """Normalised Sylvester Hadamard matrix of order n (a power of two): orthogonal, entries +-1/sqrt(n)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"the Hadamard order must be a power of two, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def _traced_hadamard_matrix(n: int) -> jax.Array:
    """`hadamard_matrix(n)` in float32 (the same values), built from iotas rather than captured as a
    constant: the primitives trace the rotation inside custom_partitioning, which takes no constants.
    Sylvester's entry (i, j) is (-1)^popcount(i & j)."""
    hadamard_matrix(n)  # checks n
    rows, cols = (jax.lax.broadcasted_iota(jnp.int32, (n, n), axis) for axis in (0, 1))
    odd = jax.lax.population_count(rows & cols) & 1
    return jnp.where(odd == 1, -1.0, 1.0).astype(jnp.float32) * np.float32(1 / np.sqrt(n))


def rotation_signs(head_dim: int, key: jax.Array | int | None = None) -> jax.Array:
    """The random signs of `hadamard_rotate`'s rotation, float32 [head_dim] of +-1 (key None: seed 0)."""
    if key is None or isinstance(key, int):
        key = jax.random.key(0 if key is None else key)
    return jax.random.rademacher(key, (head_dim,), jnp.float32)


def hadamard_rotate(
    q: jax.Array, k: jax.Array, key: jax.Array | int | None = None
) -> tuple[jax.Array, jax.Array]:
    """Rotates the head_dim of q and k by one random orthogonal matrix R = diag(signs) @ H.

    q k^T is unchanged (R R^T = I), while outliers in a few channels are spread over all of them,
    which lowers FP8 quantization error. key: a PRNG key or an int seed (None means seed 0); the
    same key gives the same rotation. Outputs keep the input dtypes.
    """
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim:
        raise ValueError(f"q and k must share head_dim, got {head_dim} and {k.shape[-1]}")
    rotation = rotation_signs(head_dim, key)[:, None] * _traced_hadamard_matrix(head_dim)

    def rotate(x: jax.Array) -> jax.Array:
        return jnp.matmul(x.astype(jnp.float32), rotation, precision=jax.lax.Precision.HIGHEST).astype(
            x.dtype
        )

    return rotate(q), rotate(k)
