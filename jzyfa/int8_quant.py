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

from jzyfa.quantize import FP8_DTYPE, FP8_MAX, fp8_quantize, hadamard_rotate, power_of_two_descale
from jzyfa.varlen import token_slots

INT8_MAX = 127
# Tokens per Q and per K scale, per head: tools/int8_block_sim.py compares 64, 128, 256 and per
# token (docs/int8.md). K's block is the kernel's key block, so one K scale covers a key block.
INT8_BLOCK = 128
# Keys per partial sum of the key mean in the device quantization (ffi/int8_quantize.h: its workspace
# holds one row of sums per chunk).
KEY_MEAN_CHUNK = 512
# Tokens per partial sum of the key mean in the XLA ops (`smooth_keys`, `int8_quantize_packed`).
KEY_SUM_BLOCK = 128


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


def _blocked_sum(x: jax.Array) -> jax.Array:
    """The sum over axis 1 of x [B, S, ...] as the packed quantization sums a sequence: each block of
    KEY_SUM_BLOCK tokens, then the blocks, each a reduction of its own (deterministic on every backend;
    `int8_quantize_packed` sums the same way without scatter-adds, whose order a GPU does not fix)."""
    blocks = -(-x.shape[1] // KEY_SUM_BLOCK)
    padded = jnp.pad(x, ((0, 0), (0, blocks * KEY_SUM_BLOCK - x.shape[1])) + ((0, 0),) * (x.ndim - 2))
    per_block = jnp.sum(padded.reshape((x.shape[0], blocks, KEY_SUM_BLOCK) + x.shape[2:]), axis=2)
    return jnp.sum(per_block, axis=1)


def smooth_keys(k: jax.Array, seqlens_k: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(k - mean, mean) in float32: mean [B, Hkv, D] over each batch row's (first seqlens_k[b]) keys.

    Padded keys are left out of the mean and come back as zeros.
    """
    kf = k.astype(jnp.float32)
    valid = _valid_keys(k.shape[1], seqlens_k)
    if valid is None:
        mean = _blocked_sum(kf) / max(k.shape[1], 1)  # no keys: mean 0
        return kf - mean[:, None], mean
    count = jnp.maximum(jnp.sum(valid, axis=1), 1)  # [B, 1, 1]
    mean = _blocked_sum(jnp.where(valid, kf, 0.0)) / count
    return jnp.where(valid, kf - mean[:, None], 0.0), mean


def _inverse_and_scale(amax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(127 / amax, amax / 127) of a block's maximum magnitude; (1, 1) for an all-zero block."""
    nonzero = amax > 0
    return jnp.where(nonzero, INT8_MAX / jnp.where(nonzero, amax, 1.0), 1.0), jnp.where(nonzero, amax / INT8_MAX, 1.0)


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
    inverse, scale = _inverse_and_scale(amax)
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


def _block_max(x: jax.Array, segments: jax.Array, num_segments: int) -> jax.Array:
    """float32 [num_segments, H]: max |x| over the tokens of each segment and the head dim of packed x
    [T, H, D]; 0 for a segment without tokens."""
    amax = jax.ops.segment_max(jnp.max(jnp.abs(x), axis=2), segments, num_segments=num_segments)
    return jnp.maximum(amax, 0.0)  # segment_max gives -inf to an empty segment


def _int8_quantize_blocks(x, seq, pos, valid, num_seqs: int, max_len: int, block: int):
    """Packed float32 x [T, H, D] (tokens of no sequence zeroed) to (int8 codes, scale float32 [num_seqs,
    H, ceil(max_len / block)]): `int8_quantize` with each sequence's blocks from its first token."""
    blocks = -(-max_len // block)
    # Each token's (sequence, block) segment; tokens of no sequence go to a last one, dropped.
    segments = jnp.where(valid, seq * blocks + pos // block, num_seqs * blocks)
    inverse, scale = _inverse_and_scale(_block_max(x, segments, num_seqs * blocks + 1))
    scale = scale[:-1]
    x8 = jnp.clip(jnp.round(x * inverse[segments][:, :, None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return x8, jnp.swapaxes(scale.reshape(num_seqs, blocks, -1), 1, 2)


def _sequence_sums(x: jax.Array, cu_seqlens: jax.Array, max_len: int) -> jax.Array:
    """float32 [num_seqs, H, D]: the sum of each sequence's tokens (its first max_len) of packed x [T, H, D]
    (tokens of no sequence zeroed), as `_blocked_sum` sums a batch row: per block of KEY_SUM_BLOCK tokens
    from the sequence's first, then over its blocks. The blocks are gathered into a compact [blocks,
    KEY_SUM_BLOCK, H, D] (at most T / KEY_SUM_BLOCK + num_seqs of them), so both sums are plain
    reductions: no scatter-add, whose order a GPU does not fix."""
    num_seqs, total, block = cu_seqlens.shape[0] - 1, x.shape[0], KEY_SUM_BLOCK
    lengths = jnp.clip(cu_seqlens[1:] - cu_seqlens[:-1], 0, max_len)
    counts = -(-lengths // block)  # blocks per sequence
    ends = jnp.cumsum(counts)
    firsts = ends - counts  # each sequence's first compact block
    capacity = -(-total // block) + num_seqs  # sum of ceil(len / block) over offsets that fit the buffer
    compact = jnp.arange(capacity, dtype=cu_seqlens.dtype)
    seq = jnp.clip(jnp.searchsorted(ends, compact, side="right"), 0, num_seqs - 1)
    start = (compact - firsts[seq]) * block  # the block's first position in its sequence
    rows = jnp.arange(block, dtype=cu_seqlens.dtype)
    valid = (compact < ends[-1])[:, None] & (rows[None, :] < (lengths[seq] - start)[:, None])
    tokens = jnp.where(valid, cu_seqlens[seq][:, None] + start[:, None] + rows[None, :], total)
    block_sums = jnp.sum(jnp.take(x, tokens, axis=0, mode="fill", fill_value=0), axis=1)  # [capacity, H, D]
    blocks = -(-max_len // block)
    index = firsts[:, None] + jnp.arange(blocks, dtype=cu_seqlens.dtype)[None, :]
    index = jnp.where(jnp.arange(blocks)[None, :] < counts[:, None], index, capacity)
    return jnp.sum(jnp.take(block_sums, index, axis=0, mode="fill", fill_value=0), axis=1)


def int8_quantize_packed(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    rotate: bool = False,
    block: int = INT8_BLOCK,
) -> Int8Inputs:
    """`int8_quantize_qkv` of a packed batch (q [Tq, Hq, D], k and v [Tk, Hkv, D] with int32
    cu_seqlens [num_seqs + 1]) on the packed tokens, as the INT8 varlen kernel takes it: each
    sequence's keys smoothed by its own mean, its scale blocks counted from its first token. Codes stay
    packed; q_scale [num_seqs, Hq, ceil(max_seqlen_q / block)], k_scale [num_seqs, Hkv,
    ceil(max_seqlen_k / block)], descale_v [num_seqs, Hkv], key_mean [num_seqs, Hkv, D]. Tokens of no
    sequence (and past max_seqlen, which the caller must not pass) get zero codes and set no scale. The
    values are the dense quantization's of each sequence alone (`_sequence_sums` sums its keys as
    `_blocked_sum` does). Deterministic: maxima and gathers, no scatter-add."""
    num_seqs = cu_seqlens_q.shape[0] - 1
    seq_q, pos_q, valid_q = token_slots(cu_seqlens_q, q.shape[0], max_seqlen_q)
    seq_k, pos_k, valid_k = token_slots(cu_seqlens_k, k.shape[0], max_seqlen_k)
    kept = lambda x, valid: jnp.where(valid[:, None, None], x.astype(jnp.float32), 0.0)
    kf = kept(k, valid_k)
    count = jnp.clip(cu_seqlens_k[1:] - cu_seqlens_k[:-1], 0, max_seqlen_k)  # each sequence's valid keys
    mean = _sequence_sums(kf, cu_seqlens_k, max_seqlen_k) / jnp.maximum(count, 1)[:, None, None]
    smoothed = jnp.where(valid_k[:, None, None], kf - mean[seq_k], 0.0)
    qf = kept(q, valid_q)
    if rotate:  # in float32, as int8_quantize_qkv
        qf, smoothed = hadamard_rotate(qf, smoothed)
    q8, q_scale = _int8_quantize_blocks(qf, seq_q, pos_q, valid_q, num_seqs, max_seqlen_q, block)
    k8, k_scale = _int8_quantize_blocks(smoothed, seq_k, pos_k, valid_k, num_seqs, max_seqlen_k, block)
    # v: one power-of-two descale per (sequence, KV head), as fp8_quantize(..., "head") per slot.
    vf = kept(v, valid_k)
    descale_v = power_of_two_descale(_block_max(vf, jnp.where(valid_k, seq_k, num_seqs), num_seqs + 1)[:-1])
    v8 = jnp.clip(vf / descale_v[seq_k][:, :, None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return Int8Inputs(q8, k8, v8, q_scale, k_scale, descale_v, mean)


def lse_shift_packed(q: jax.Array, key_mean: jax.Array, cu_seqlens_q: jax.Array, softmax_scale: float) -> jax.Array:
    """`lse_shift` of a packed batch: float32 [Hq, Tq], token t of sequence s shifted by softmax_scale *
    q_t . key_mean[s] (tokens of no sequence by any sequence's: their LSE is -inf)."""
    total, heads_q, dim = q.shape
    heads_kv = key_mean.shape[1]
    seq, _, _ = token_slots(cu_seqlens_q, total, max(total, 1))
    qf = q.astype(jnp.float32).reshape(total, heads_kv, heads_q // heads_kv, dim)
    dot = jnp.einsum("tkgd,tkd->kgt", qf, key_mean[seq], precision=jax.lax.Precision.HIGHEST)
    return dot.reshape(heads_q, total) * jnp.float32(softmax_scale)
