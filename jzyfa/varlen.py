"""Attention over packed variable-length batches in pure JAX, with no host reads of the offsets.

Sequences are packed along one token axis, `[total_tokens, heads, head_dim]`, and delimited by
int32 cumulative offsets `cu_seqlens` `[num_seqs + 1]` (sequence s holds tokens
`cu_seqlens[s] : cu_seqlens[s + 1]`), as in flash-attention's varlen functions. The offsets stay on
the device: each sequence is gathered into a `[num_seqs, max_seqlen]` slot (rows past its end are
masked), attended by the dense reference core, and every packed token gathers its row back through
a `searchsorted` of its index. So the whole computation traces with dynamic offsets (one compiled
program serves every packing with the same totals and maxima) and differentiates like the dense one.

Memory: the float32 scores take `num_seqs * heads_q * max_seqlen_q * max_seqlen_k * 4` bytes.

Maxima that are too small. `max_seqlen_q`/`max_seqlen_k` size the slots, and traced offsets cannot be
checked against them at trace time. The reference stays exact regardless: where a sequence may be
longer than a maximum (the maxima are below the packed totals), a `lax.cond` on the device-side
`lengths_fit` takes the slots when every sequence fits and otherwise attends the whole packed buffer
by a segment mask, `max_seqlen_q` query tokens at a time (`_whole_buffer_attention`: no maxima needed,
slower; its memory per block is `max_seqlen_q * total_k * heads_q * 4` bytes). The kernels need the
maxima; their callers poison the results instead (`poison_unless`, jzyfa.api).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jzyfa._validation import Window
from jzyfa.plan import surely
from jzyfa.quantize import dequantize_varlen
from jzyfa.reference import masked_attention, masked_attention_bwd, window_visible


def _pad(x: jax.Array, starts: jax.Array, max_len: int) -> jax.Array:
    """[total, H, D] -> [num_seqs, max_len, H, D]: row t of slot s is token starts[s] + t.

    Rows past a sequence's end hold the next sequence's tokens (or zeros past the packed end); they
    are masked as keys and dropped as queries.
    """
    if x.shape[0] == 0:  # nothing packed (every sequence empty): take() cannot gather from it
        return jnp.zeros((starts.shape[0], max_len) + x.shape[1:], x.dtype)
    index = starts[:, None] + jnp.arange(max_len, dtype=starts.dtype)[None, :]
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def token_slots(cu_seqlens: jax.Array, total: int, max_len: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For each packed token: its sequence, its position in it, and whether it belongs to one.

    Tokens past cu_seqlens[-1] (padding at the end of the packed buffer) belong to none. Empty
    sequences are skipped: a token's sequence is the last one starting at or before it.
    """
    num_seqs = cu_seqlens.shape[0] - 1
    tokens = jnp.arange(total, dtype=cu_seqlens.dtype)
    seq = jnp.searchsorted(cu_seqlens, tokens, side="right").astype(cu_seqlens.dtype) - 1
    in_range = (seq >= 0) & (seq < num_seqs)
    seq = jnp.clip(seq, 0, num_seqs - 1)
    pos = tokens - cu_seqlens[seq]
    valid = in_range & (pos < cu_seqlens[seq + 1] - cu_seqlens[seq]) & (pos < max_len)
    return seq, jnp.clip(pos, 0, max_len - 1), valid


def _slot_visibility(cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, window: Window):
    """[num_seqs, max_q, max_k]: which key of its slot each query row of a slot sees (bottom-right
    alignment per sequence; keys past the sequence's end are never seen)."""
    lens_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    lens_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    query_pos = jnp.arange(max_seqlen_q)[None, :, None] + (lens_k - lens_q)[:, None, None]
    key_idx = jnp.arange(max_seqlen_k)[None, None, :]
    return window_visible(query_pos, key_idx, window) & (key_idx < lens_k[:, None, None])


def longest_sequences(cu_seqlens_q, cu_seqlens_k) -> tuple[jax.Array, jax.Array]:
    """The longest query and key sequence's lengths, on the device (0 for no sequences)."""
    longest = lambda cu: jnp.max(cu[1:] - cu[:-1], initial=0)
    return longest(cu_seqlens_q), longest(cu_seqlens_k)


def lengths_fit(cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int) -> jax.Array:
    """bool scalar, on the device: every sequence holds at most max_seqlen_q queries and max_seqlen_k
    keys."""
    longest_q, longest_k = longest_sequences(cu_seqlens_q, cu_seqlens_k)
    return (longest_q <= max_seqlen_q) & (longest_k <= max_seqlen_k)


def maxima_cover(q, k, max_seqlen_q: int, max_seqlen_k: int) -> bool:
    """Whether the maxima cover any sequence the packed buffers can hold (no sequence is longer than
    its buffer), so that `lengths_fit` holds whatever the offsets."""
    return surely(lambda: max_seqlen_q >= q.shape[0] and max_seqlen_k >= k.shape[0])


def _query_block(q, max_seqlen_q: int) -> int:
    """Query tokens per block of the whole-buffer computation: max_seqlen_q, or all of them if fewer."""
    return max(q.shape[0], 1) if surely(lambda: q.shape[0] < max_seqlen_q) else max_seqlen_q


def poison_unless(fits: jax.Array, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    """The arrays where `fits`, else NaN everywhere: a call the kernels cannot compute (a sequence
    longer than its max_seqlen) fails loudly instead of returning a plausible wrong result."""
    return tuple(jnp.where(fits, x, jnp.array(jnp.nan, x.dtype)) for x in arrays)


def _token_positions(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int):
    """Per packed token, with no maxima: (query sequence, bottom-right aligned position, valid) of each
    query token and (sequence, position, valid) of each key token."""
    seq_q, pos_q, valid_q = token_slots(cu_seqlens_q, total_q, max(total_q, 1))
    seq_k, pos_k, valid_k = token_slots(cu_seqlens_k, total_k, max(total_k, 1))
    lens_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    lens_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    return (seq_q, pos_q + (lens_k - lens_q)[seq_q], valid_q), (seq_k, pos_k, valid_k)


def _query_blocks(block: int, *xs: jax.Array) -> list[jax.Array]:
    """Each x [total_q, ...] as [blocks, block, ...], zero-padded (padding rows are invalid)."""
    blocks = -(-xs[0].shape[0] // block)
    pad = lambda x: jnp.pad(x, [(0, blocks * block - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
    return [pad(x).reshape((blocks, block) + x.shape[1:]) for x in xs]


def _block_visibility(query_rows, key_tokens, window: Window) -> jax.Array:
    """[block, total_k]: which key token each query row of a block sees."""
    (seq_q, pos_q, valid_q), (seq_k, pos_k, valid_k) = query_rows, key_tokens
    same = valid_q[:, None] & valid_k[None, :] & (seq_q[:, None] == seq_k[None, :])
    return same & window_visible(pos_q[:, None], pos_k[None, :], window)


def _whole_buffer_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, block, window, softmax_scale, softcap):
    """`varlen_attention_reference` with no maxima: each block of `block` query tokens attends every
    key token of the packed buffer through a segment mask (rematerialized under autodiff)."""
    rows, keys = _token_positions(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])

    @jax.checkpoint
    def attend(args):
        q_block, *query_rows = args
        visible = _block_visibility(query_rows, keys, window)
        out, lse = masked_attention(
            q_block[None], k[None], v[None], visible[None, None, None], softmax_scale, softcap
        )
        return out[0], lse[0]

    out, lse = lax.map(attend, _query_blocks(block, q, *rows))  # [blocks, block, Hq, Dv], [blocks, Hq, block]
    total_q = q.shape[0]
    out = out.reshape((-1,) + out.shape[2:])[:total_q]
    lse = jnp.swapaxes(lse, 0, 1).reshape(lse.shape[1], -1)[:, :total_q]
    return out, lse


def _covering(slots, whole, q, k, max_seqlen_q, max_seqlen_k, trust_maxima, *operands):
    """slots(*operands) where the maxima surely cover every sequence, else a device-side choice: the
    slots when every sequence fits, the whole-buffer computation otherwise."""
    cu_seqlens_q, cu_seqlens_k = operands[-2:]
    if trust_maxima or q.shape[0] == 0 or maxima_cover(q, k, max_seqlen_q, max_seqlen_k):
        return slots(*operands)
    fits = lengths_fit(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return lax.cond(fits, slots, whole, *operands)


def varlen_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    window: Window,
    softmax_scale: float,
    softcap: float | None = None,
    trust_maxima: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """(out [total_q, Hq, Dv] in q's dtype, lse float32 [Hq, total_q]) for packed q, k, v.

    `window` is the effective (left, right) mask, applied per sequence with bottom-right alignment:
    query t of a sequence with lengths (len_q, len_k) sits at position t + len_k - len_q. Queries
    that see no key (e.g. of a sequence with no keys) and tokens outside every sequence give out = 0
    and lse = -inf. Exact whatever the maxima (see the module docstring); `trust_maxima`: the caller
    guarantees every sequence fits them (padded batches), which skips the device-side choice.
    """
    options = {"window": window, "softmax_scale": softmax_scale, "softcap": softcap}
    slots = functools.partial(
        _slot_attention, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **options
    )
    whole = functools.partial(_whole_buffer_attention, block=_query_block(q, max_seqlen_q), **options)
    return _covering(
        slots, whole, q, k, max_seqlen_q, max_seqlen_k, trust_maxima, q, k, v, cu_seqlens_q, cu_seqlens_k
    )


def _slot_attention(
    q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, window, softmax_scale, softcap
):
    """`varlen_attention_reference` on [num_seqs, max_seqlen] slots: every sequence must fit them."""
    starts_q, starts_k = cu_seqlens_q[:-1], cu_seqlens_k[:-1]
    visible = _slot_visibility(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window)
    out_pad, lse_pad = masked_attention(
        _pad(q, starts_q, max_seqlen_q),
        _pad(k, starts_k, max_seqlen_k),
        _pad(v, starts_k, max_seqlen_k),
        visible[:, None, None],  # [num_seqs, 1 (kv heads), 1 (group), max_q, max_k]
        softmax_scale,
        softcap,
    )

    return _unslot(out_pad, lse_pad, cu_seqlens_q, q.shape[0], max_seqlen_q)


def _unslot(out_pad, lse_pad, cu_seqlens_q, total_q: int, max_seqlen_q: int):
    """Slotted (out [num_seqs, max_q, Hq, Dv], lse [num_seqs, Hq, max_q]) -> packed (out [total_q, Hq, Dv],
    lse [Hq, total_q]); tokens of no sequence give out = 0 and lse = -inf."""
    seq, pos, valid = token_slots(cu_seqlens_q, total_q, max_seqlen_q)
    out = jnp.where(valid[:, None, None], out_pad[seq, pos], 0).astype(out_pad.dtype)
    lse = jnp.where(valid[:, None], lse_pad[seq, :, pos], -jnp.inf)
    return out, lse.T


def through_slots(attend_padded, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int):
    """A packed call through a right-padded dense one: attend_padded(q, k, v, seqlens_q, seqlens_k) takes
    [num_seqs, max_seqlen, H, D] slots and returns (out [num_seqs, max_q, Hq, Dv], lse [num_seqs, Hq,
    max_q]); the result is packed like `varlen_attention_reference`'s."""
    slots = [_pad(x, cu[:-1], n) for x, cu, n in ((q, cu_seqlens_q, max_seqlen_q), (k, cu_seqlens_k, max_seqlen_k),
                                                   (v, cu_seqlens_k, max_seqlen_k))]  # fmt: skip
    lengths = [cu[1:] - cu[:-1] for cu in (cu_seqlens_q, cu_seqlens_k)]
    out_pad, lse_pad = attend_padded(*slots, *lengths)
    return _unslot(out_pad, lse_pad, cu_seqlens_q, q.shape[0], max_seqlen_q)


def fp8_varlen_attention_reference(
    q8: jax.Array,
    k8: jax.Array,
    v8: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    descales: tuple[jax.Array, jax.Array, jax.Array],
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    window: Window,
    softmax_scale: float,
    softcap: float | None = None,
    trust_maxima: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The FP8 (e4m3) varlen call's pure-JAX path: q, k and v dequantized (descales of shape (), (1,) or
    [num_seqs, Hkv]), exact attention as `varlen_attention_reference`, out in bf16."""
    dequantized = [
        dequantize_varlen(x, d, cu)
        for x, d, cu in zip((q8, k8, v8), descales, (cu_seqlens_q, cu_seqlens_k, cu_seqlens_k))
    ]
    out, lse = varlen_attention_reference(
        *dequantized,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        window=window,
        softmax_scale=softmax_scale,
        softcap=softcap,
        trust_maxima=trust_maxima,
    )
    return out.astype(jnp.bfloat16), lse


def varlen_attention_bwd_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    dout: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    window: Window,
    softmax_scale: float,
    softcap: float | None = None,
    trust_maxima: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv) in the dtypes of q, k, v for a packed call of `varlen_attention_reference`, from its
    residuals: dout [total_q, Hq, Dv], lse and delta float32 [Hq, total_q] (`attention_delta`). Tokens
    outside every sequence get zero gradients. Exact whatever the maxima, as the forward."""
    options = {"window": window, "softmax_scale": softmax_scale, "softcap": softcap}
    slots = functools.partial(
        _slot_attention_bwd, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **options
    )
    whole = functools.partial(_whole_buffer_attention_bwd, block=_query_block(q, max_seqlen_q), **options)
    operands = (q, k, v, dout, lse, delta, cu_seqlens_q, cu_seqlens_k)
    return _covering(slots, whole, q, k, max_seqlen_q, max_seqlen_k, trust_maxima, *operands)


def _whole_buffer_attention_bwd(
    q, k, v, dout, lse, delta, cu_seqlens_q, cu_seqlens_k, *, block, window, softmax_scale, softcap
):
    """`varlen_attention_bwd_reference` with no maxima, a block of query tokens at a time (dk and dv
    accumulate in float32)."""
    rows, keys = _token_positions(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])

    def step(acc, args):
        q_block, dout_block, lse_block, delta_block, *query_rows = args
        visible = _block_visibility(query_rows, keys, window)
        per_row = lambda x: x.T[None]  # [block, Hq] -> [1, Hq, block]
        dq, dk, dv = masked_attention_bwd(q_block[None], k[None], v[None], dout_block[None], per_row(lse_block),
                                          per_row(delta_block), visible[None, None, None], softmax_scale,
                                          softcap)  # fmt: skip
        return (acc[0] + dk[0], acc[1] + dv[0]), dq[0]

    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    (dk, dv), dq = lax.scan(step, zeros, _query_blocks(block, q, dout, lse.T, delta.T, *rows))
    dq = dq.reshape((-1,) + dq.shape[2:])[: q.shape[0]]
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _slot_attention_bwd(
    q,
    k,
    v,
    dout,
    lse,
    delta,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    max_seqlen_q,
    max_seqlen_k,
    window,
    softmax_scale,
    softcap,
):
    """`varlen_attention_bwd_reference` on [num_seqs, max_seqlen] slots: every sequence must fit them."""
    starts_q, starts_k = cu_seqlens_q[:-1], cu_seqlens_k[:-1]
    lens_q = cu_seqlens_q[1:] - starts_q
    # Slot rows past a sequence's end hold the next sequence's tokens: they must not reach dk and dv.
    rows_valid = jnp.arange(max_seqlen_q)[None, :, None] < lens_q[:, None, None]
    visible = _slot_visibility(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window) & rows_valid
    per_row = lambda x: jnp.swapaxes(_pad(x.T, starts_q, max_seqlen_q), 1, 2)  # [Hq, Tq] -> [N, Hq, max_q]
    dq_pad, dk_pad, dv_pad = masked_attention_bwd(
        _pad(q, starts_q, max_seqlen_q),
        _pad(k, starts_k, max_seqlen_k),
        _pad(v, starts_k, max_seqlen_k),
        _pad(dout, starts_q, max_seqlen_q),
        per_row(lse),
        per_row(delta),
        visible[:, None, None],
        softmax_scale,
        softcap,
    )

    def unpad(grad_pad, cu_seqlens, total, max_len, like):
        seq, pos, valid = token_slots(cu_seqlens, total, max_len)
        return jnp.where(valid[:, None, None], grad_pad[seq, pos], 0).astype(like.dtype)

    return (
        unpad(dq_pad, cu_seqlens_q, q.shape[0], max_seqlen_q, q),
        unpad(dk_pad, cu_seqlens_k, k.shape[0], max_seqlen_k, k),
        unpad(dv_pad, cu_seqlens_k, v.shape[0], max_seqlen_k, v),
    )
