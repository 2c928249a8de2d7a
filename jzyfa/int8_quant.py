"""precision="int8"'s quantization: smoothed keys, INT8 Q and K with one scale per block of tokens,
V in e4m3 (SageAttention's recipe; docs/int8.md).

Keys are smoothed first: each (batch, KV head)'s mean key over its sequence is subtracted. Softmax
is unchanged (q . mean is the same for every key of a row), but the keys' common offset (outlier
channels with one sign for every token) no longer sets their INT8 scale. The log-sum-exp drops by
softmax_scale * q . mean, which `lse_shift` gives back. Q and K are then rounded to INT8
(symmetric, round to nearest even, clipped to +-127) with one float32 scale per block of tokens and
head: x ~= x_i8 * scale. A key block of the kernel (128 keys) holds exactly one K scale, so the scale
product of a (query row, key block) folds into the one FFMA that computes each probability's code.

Everything runs as device ops on float32 values; nothing waits on the host.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jzyfa.quantize import fp8_quantize, hadamard_rotate

INT8_MAX = 127
# Tokens per Q and per K scale, per head: tools/int8_block_sim.py compares 64, 128, 256 and per
# token (docs/int8.md). K's block is the kernel's key block, so one K scale covers a key block.
INT8_BLOCK = 128
# Keys per partial sum of the key mean in the device quantization (ffi/int8_quantize.h: its workspace
# holds one row of sums per chunk).
KEY_MEAN_CHUNK = 512


class Int8Inputs(NamedTuple):
    """What the INT8 kernel takes, from 16-bit q, k, v ([B, S, H, D]).

    q8 int8 [B, Sq, Hq, D], q_scale float32 [B, Hq, ceil(Sq / block)]; k8 int8 [B, Sk, Hkv, D],
    k_scale float32 [B, Hkv, ceil(Sk / block)]: q ~= q8 * q_scale of the token's block and head.
    v8 float8_e4m3fn [B, Sk, Hkv, Dv], descale_v float32 [B, Hkv] (a power of two).
    key_mean float32 [B, Hkv, D]: the mean key subtracted before quantizing (before any rotation).
    """

    q8: jax.Array
    k8: jax.Array
    v8: jax.Array
    q_scale: jax.Array
    k_scale: jax.Array
    descale_v: jax.Array
    key_mean: jax.Array


def _valid_keys(seq: int, lengths: jax.Array | None) -> jax.Array | None:
    """bool [B, S, 1, 1]: whether token t of batch row b is one of its lengths[b] valid tokens."""
    if lengths is None:
        return None
    return (jnp.arange(seq)[None, :] < jnp.clip(lengths, 0, seq)[:, None])[:, :, None, None]


def smooth_keys(k: jax.Array, seqlens_k: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(k - mean, mean) in float32: mean [B, Hkv, D] over each batch row's (first seqlens_k[b]) keys.

    Padded keys are left out of the mean and come back as zeros.
    """
    kf = k.astype(jnp.float32)
    valid = _valid_keys(k.shape[1], seqlens_k)
    if valid is None:
        mean = jnp.sum(kf, axis=1) / max(k.shape[1], 1)  # no keys: mean 0
        return kf - mean[:, None], mean
    count = jnp.maximum(jnp.sum(valid, axis=1), 1)  # [B, 1, 1]
    mean = jnp.sum(jnp.where(valid, kf, 0.0), axis=1) / count
    return jnp.where(valid, kf - mean[:, None], 0.0), mean


def int8_quantize(x: jax.Array, block: int = INT8_BLOCK) -> tuple[jax.Array, jax.Array]:
    """(x_i8 int8 [B, S, H, D], scale float32 [B, H, ceil(S / block)]) with x ~= x_i8 * scale.

    scale = amax / 127 over each block of `block` tokens of one head (1 where the block is all zero),
    x_i8 = clip(round(x * (127 / amax)), -127, 127), round to nearest even (cvt.rni). The last block
    may be partial.
    """
    if int(block) != block or block < 1:
        raise ValueError(f"block must be a positive integer, got {block}")
    if x.ndim != 4:
        raise ValueError(f"x must be [B, S, H, D], got shape {x.shape}")
    batch, seq, heads, dim = x.shape
    blocks = -(-seq // block)
    xf = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, blocks * block - seq), (0, 0), (0, 0)))
    xf = xf.reshape(batch, blocks, block, heads, dim)
    amax = jnp.max(jnp.abs(xf), axis=(2, 4), initial=0.0)  # [B, blocks, H]; initial: no tokens
    nonzero = amax > 0
    inverse = jnp.where(nonzero, INT8_MAX / jnp.where(nonzero, amax, 1.0), 1.0)
    scale = jnp.where(nonzero, amax / INT8_MAX, 1.0)
    x8 = jnp.clip(jnp.round(xf * inverse[:, :, None, :, None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return x8.reshape(batch, blocks * block, heads, dim)[:, :seq], jnp.swapaxes(scale, 1, 2)


def per_token(scale: jax.Array, seq: int, block: int = INT8_BLOCK) -> jax.Array:
    """A [B, H, blocks] scale of `block`-token blocks as float32 [B, H, seq]: each token its block's."""
    return jnp.repeat(scale, block, axis=2, total_repeat_length=scale.shape[2] * block)[:, :, :seq]


def int8_dequantize(x8: jax.Array, scale: jax.Array, block: int = INT8_BLOCK) -> jax.Array:
    """float32 values of int8 x8 [B, S, H, D] with its [B, H, blocks] scales (`int8_quantize`)."""
    return x8.astype(jnp.float32) * jnp.swapaxes(per_token(scale, x8.shape[1], block), 1, 2)[..., None]


def zero_padding(x: jax.Array, lengths: jax.Array | None) -> jax.Array:
    """x [B, S, H, D] with tokens past each batch row's length zeroed: they must not set a scale."""
    valid = _valid_keys(x.shape[1], lengths)
    return x if valid is None else jnp.where(valid, x, jnp.zeros((), x.dtype))


def int8_quantize_qkv(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    rotate: bool = False,
    seqlens_q: jax.Array | None = None,
    seqlens_k: jax.Array | None = None,
    block: int = INT8_BLOCK,
    q_block: int | None = None,
) -> Int8Inputs:
    """precision="int8"'s inputs: smooth k, optionally Hadamard-rotate q and k (seed 0, as
    precision="fp8" does), INT8 q and k per block of tokens and head, v to e4m3 per (batch, KV head).
    seqlens_q, seqlens_k: right-padded batch rows; padded tokens are zeroed first. block: tokens per
    scale of k (the kernel's key block) and, unless q_block is given, of q (q_block=1: per query row)."""
    smoothed, mean = smooth_keys(k, seqlens_k)
    qf = zero_padding(q.astype(jnp.float32), seqlens_q)
    if rotate:  # in float32: the smoothed keys are not rounded back to 16 bits
        qf, smoothed = hadamard_rotate(qf, smoothed)
    q8, q_scale = int8_quantize(qf, block if q_block is None else q_block)
    k8, k_scale = int8_quantize(smoothed, block)
    v8, descale_v = fp8_quantize(zero_padding(v, seqlens_k), "head")
    return Int8Inputs(q8, k8, v8, q_scale, k_scale, descale_v, mean)


def lse_shift(q: jax.Array, key_mean: jax.Array, softmax_scale: float) -> jax.Array:
    """softmax_scale * q . mean as float32 [B, Hq, Sq]: the LSE of the unsmoothed keys minus that of the
    smoothed ones (query head h uses KV head h // (Hq / Hkv))."""
    batch, seq, heads_q, dim = q.shape
    heads_kv = key_mean.shape[1]
    qf = q.astype(jnp.float32).reshape(batch, seq, heads_kv, heads_q // heads_kv, dim)
    dot = jnp.einsum("bskgd,bkd->bkgs", qf, key_mean, precision=jax.lax.Precision.HIGHEST)
    return dot.reshape(batch, heads_q, seq) * jnp.float32(softmax_scale)
