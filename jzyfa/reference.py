"""Exact attention in pure JAX: the CPU lowering of the kernels, the "xla" path, and the backward.

Inputs are upcast to float32 and the softmax and both products run in float32 at full precision, so
this is the yardstick the kernels are measured against (up to the final cast to the input dtype).

The backward (`attention_bwd_reference`) works from the forward's residuals as the backward kernels do:
P = exp(scale * q k^T - lse), dP = dO V^T, dS = P (dP - delta) with delta = rowsum(dO * O) (minus the
lse's own cotangent), dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO; no forward is recomputed.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jzyfa._validation import NO_WINDOW, Window, mask_window

_HIGHEST = lax.Precision.HIGHEST


def window_visible(query_pos: jax.Array, key_idx: jax.Array, window: Window) -> jax.Array:
    """Whether a query at (bottom-right aligned) position query_pos sees key key_idx; broadcasts.

    The window (left, right) admits keys query_pos - left <= j <= query_pos + right; -1 leaves that
    side unbounded.
    """
    left, right = window
    visible = jnp.ones(jnp.broadcast_shapes(jnp.shape(query_pos), jnp.shape(key_idx)), bool)
    if left >= 0:
        visible &= key_idx >= query_pos - left
    if right >= 0:
        visible &= key_idx <= query_pos + right
    return visible


def window_mask(seq_q: int, seq_k: int, window: Window) -> jax.Array:
    """[seq_q, seq_k]: query i, at position i + seq_k - seq_q, sees key j (bottom-right alignment)."""
    rows = jnp.arange(seq_q)[:, None] + (seq_k - seq_q)
    return window_visible(rows, jnp.arange(seq_k)[None, :], window)


def causal_mask(seq_q: int, seq_k: int) -> jax.Array:
    """Bottom-right aligned mask, [seq_q, seq_k]: query i sees key j iff j <= i + seq_k - seq_q."""
    return window_mask(seq_q, seq_k, (-1, 0))


def masked_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    softmax_scale: float,
    softcap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The shared core: q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv] -> (out, lse).

    mask: None, or bool broadcastable to [B, 1, 1, Sq, Sk] (True where a query sees a key). out is
    [B, Sq, Hq, Dv] in q's dtype; lse float32 [B, Hq, Sq]. Rows that see no key give 0 and -inf.
    softcap: None, or c > 0 capping each scaled score s to c * tanh(s / c) (Gemma 2).
    """
    batch, seq_q, heads_q, head_dim = q.shape
    heads_kv, value_dim = k.shape[2], v.shape[3]
    group = heads_q // heads_kv

    # Query heads sharing a KV head are grouped instead of repeating K and V.
    qf = q.astype(jnp.float32).reshape(batch, seq_q, heads_kv, group, head_dim)
    kf = k.astype(jnp.float32)
    vf = v.astype(jnp.float32)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qf, kf, precision=_HIGHEST) * softmax_scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf)

    # initial=-inf: a row over zero keys (seq_k = 0) is a row that sees no key, not an error.
    row_max = jnp.max(scores, axis=-1, keepdims=True, initial=-jnp.inf)
    # Fully masked rows have max -inf; shifting by 0 keeps exp(-inf) = 0 instead of NaN. The shift
    # cancels mathematically, so it carries no gradient.
    row_max = lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    probs = jnp.exp(scores - row_max)
    row_sum = jnp.sum(probs, axis=-1, keepdims=True)
    seen = row_sum > 0
    safe_sum = jnp.where(seen, row_sum, 1.0)

    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs / safe_sum, vf, precision=_HIGHEST)
    lse = jnp.where(seen, row_max + jnp.log(safe_sum), -jnp.inf)
    out = out.reshape(batch, seq_q, heads_q, value_dim).astype(q.dtype)
    return out, lse.reshape(batch, heads_q, seq_q)


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: Window | None = None,
    softcap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Returns (out, lse) for q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv].

    Hq is a multiple of Hkv: query head h attends with key/value head h // (Hq // Hkv). out is
    [B, Sq, Hq, Dv] in q's dtype; lse is float32 [B, Hq, Sq], natural log. `causal` and `window`
    mask as in `jzyfa.flash_attention` (bottom-right alignment; causal sets the window's right bound
    to 0). Rows that see no key give out = 0 and lse = -inf. softmax_scale defaults to 1/sqrt(D).
    softcap: None, or c > 0 capping each scaled score s to c * tanh(s / c) before the softmax.
    """
    softmax_scale, window, rows, mask = _call_setup(q, k, causal, softmax_scale, window)
    if mask is not False:
        return masked_attention(q, k, v, mask, softmax_scale, softcap)
    return _attention_by_query_chunks(q, k, v, window, softmax_scale, rows, softcap)


# Score entries (float32) one step of the reference may hold: 2^28 = 1 GiB. Larger problems run over
# chunks of query rows, each rematerialized in the backward pass, so neither direction ever holds the
# whole B x H x Sq x Sk matrix (a 16-head 32K x 32K problem would need 64 GiB).
CHUNK_SCORE_ENTRIES = 2**28


def _call_setup(q, k, causal: bool, softmax_scale, window):
    """(scale, the effective window, query rows per chunk, the mask of a one-chunk call): the mask is
    False when the call runs over several chunks (each builds its own), else None or [Sq, Sk]."""
    (batch, seq_q, heads_q, head_dim), seq_k = q.shape, k.shape[1]
    softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    window = mask_window(causal, window)
    rows = _rows_per_chunk(batch, heads_q, seq_q, seq_k)
    if rows is not seq_q and rows < seq_q:  # `is`: symbolic sizes take one chunk (_rows_per_chunk)
        return softmax_scale, window, rows, False
    return softmax_scale, window, rows, None if window == NO_WINDOW else window_mask(seq_q, seq_k, window)


def _rows_per_chunk(batch: int, heads_q: int, seq_q: int, seq_k: int) -> int:
    """Query rows per chunk; all of them (one chunk) for symbolic sizes (jax.export), whose chunk
    count cannot be decided when tracing."""
    if any(jax.export.is_symbolic_dim(size) for size in (batch, heads_q, seq_q, seq_k)):
        return seq_q
    per_row = max(1, batch * heads_q * seq_k)
    return max(1, min(seq_q, CHUNK_SCORE_ENTRIES // per_row))


def _attention_by_query_chunks(q, k, v, window: Window, softmax_scale: float, rows: int, softcap=None):
    """attention_reference over chunks of `rows` query rows (lax.map; each chunk checkpointed).

    Every row sees the same keys in the same order as in one call, so the chunks compute exactly
    what masked_attention computes for those rows, up to float32 summation order inside XLA's dots.
    """
    batch, seq_q, heads_q, head_dim = q.shape
    seq_k = k.shape[1]
    count = -(-seq_q // rows)
    padded = jnp.pad(q, ((0, 0), (0, count * rows - seq_q), (0, 0), (0, 0)))
    chunks = jnp.moveaxis(padded.reshape(batch, count, rows, heads_q, head_dim), 1, 0)

    @jax.checkpoint
    def one_chunk(args):
        index, q_chunk = args
        # Bottom-right alignment: query i sits at key position i + Sk - Sq (padded rows see garbage
        # masks; they are cut off below).
        query_pos = index * rows + jnp.arange(rows)[:, None] + (seq_k - seq_q)
        mask = None if window == NO_WINDOW else window_visible(query_pos, jnp.arange(seq_k)[None, :], window)
        return masked_attention(q_chunk, k, v, mask, softmax_scale, softcap)

    out, lse = lax.map(one_chunk, (jnp.arange(count), chunks))
    # out [count, B, rows, Hq, Dv] -> [B, Sq, Hq, Dv]; lse [count, B, Hq, rows] -> [B, Hq, Sq]
    out = jnp.moveaxis(out, 0, 1).reshape(batch, count * rows, heads_q, -1)[:, :seq_q]
    lse = jnp.moveaxis(lse, 0, 2).reshape(batch, heads_q, count * rows)[..., :seq_q]
    return out, lse


def masked_attention_bwd(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    dout: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    mask: jax.Array | None,
    softmax_scale: float,
    softcap: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The backward's core: (dq, dk, dv) in float32 from the residuals of `masked_attention`.

    q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv], dout [B, Sq, Hq, Dv]; lse and delta float32
    [B, Hq, Sq]; mask and softcap as in `masked_attention`. Rows with lse = -inf (they saw no key)
    contribute nothing and get dq = 0. dk and dv sum over the query heads that share a KV head.
    """
    batch, seq_q, heads_q, head_dim = q.shape
    heads_kv, value_dim = k.shape[2], v.shape[3]
    group = heads_q // heads_kv
    qf = q.astype(jnp.float32).reshape(batch, seq_q, heads_kv, group, head_dim)
    dof = dout.astype(jnp.float32).reshape(batch, seq_q, heads_kv, group, value_dim)
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    rows = lambda x: x.reshape(batch, heads_kv, group, seq_q, 1)  # [B, Hq, Sq] -> the scores' rows

    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qf, kf, precision=_HIGHEST) * softmax_scale
    if softcap is not None:  # scores c tanh(s / c), whose derivative in s is 1 - tanh^2
        capped = jnp.tanh(scores / softcap)
        scores = softcap * capped
    # exp(s - (-inf)) would be inf: rows that saw no key subtract +inf instead and get p = 0.
    lse_rows = rows(lse)
    probs = jnp.exp(scores - jnp.where(jnp.isfinite(lse_rows), lse_rows, jnp.inf))
    if mask is not None:
        probs = jnp.where(mask, probs, 0.0)
    dv = jnp.einsum("bhgqk,bqhgd->bkhd", probs, dof, precision=_HIGHEST)
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", dof, vf, precision=_HIGHEST)
    ds = probs * (dp - rows(delta))
    if softcap is not None:
        ds = ds * (1.0 - capped * capped)
    dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, kf, precision=_HIGHEST) * softmax_scale
    dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, qf, precision=_HIGHEST) * softmax_scale
    return dq.reshape(batch, seq_q, heads_q, head_dim), dk, dv


def attention_bwd_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    dout: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: Window | None = None,
    softcap: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv) in the dtypes of q, k, v, from the residuals of `attention_reference`.

    dout is the cotangent of out [B, Sq, Hq, Dv]; lse the forward's float32 [B, Hq, Sq]; delta float32
    [B, Hq, Sq] is rowsum(dout * out) minus the cotangent of lse (`attention_delta`). Masks and softcap
    as in `attention_reference`. Past CHUNK_SCORE_ENTRIES it runs over chunks of query rows, accumulating dk
    and dv in float32 in chunk order, so it never holds the whole score matrix.
    """
    softmax_scale, window, rows, mask = _call_setup(q, k, causal, softmax_scale, window)
    if mask is not False:
        grads = masked_attention_bwd(q, k, v, dout, lse, delta, mask, softmax_scale, softcap)
    else:
        grads = _attention_bwd_by_query_chunks(q, k, v, dout, lse, delta, window, softmax_scale, rows, softcap)
    return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))


def _attention_bwd_by_query_chunks(
    q, k, v, dout, lse, delta, window: Window, softmax_scale: float, rows: int, softcap=None
):
    """masked_attention_bwd over chunks of `rows` query rows (lax.scan, dk and dv carried in float32)."""
    seq_q, seq_k = q.shape[1], k.shape[1]
    count = -(-seq_q // rows)
    pad_rows = count * rows - seq_q

    def chunks(x, axis, fill=0.0):  # the seq_q axis split into [count, ..., rows, ...], count leading
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, pad_rows)
        x = jnp.pad(x, widths, constant_values=fill)
        x = x.reshape(x.shape[:axis] + (count, rows) + x.shape[axis + 1 :])
        return jnp.moveaxis(x, axis, 0)

    # Padded rows get lse = -inf: they contribute nothing (and their dq is cut off below).
    xs = (jnp.arange(count), chunks(q, 1), chunks(dout, 1), chunks(lse, 2, -jnp.inf), chunks(delta, 2))

    def one_chunk(carry, x):
        dk, dv = carry
        index, q_chunk, dout_chunk, lse_chunk, delta_chunk = x
        query_pos = index * rows + jnp.arange(rows)[:, None] + (seq_k - seq_q)
        mask = None if window == NO_WINDOW else window_visible(query_pos, jnp.arange(seq_k)[None, :], window)
        dq_chunk, dk_chunk, dv_chunk = masked_attention_bwd(
            q_chunk, k, v, dout_chunk, lse_chunk, delta_chunk, mask, softmax_scale, softcap
        )
        return (dk + dk_chunk, dv + dv_chunk), dq_chunk

    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    (dk, dv), dq = lax.scan(one_chunk, zeros, xs)
    dq = jnp.moveaxis(dq, 0, 1).reshape((q.shape[0], count * rows) + q.shape[2:])[:, :seq_q]
    return dq, dk, dv


def attention_delta(out: jax.Array, dout: jax.Array, dlse: jax.Array, *, varlen: bool = False) -> jax.Array:
    """The backward's per-row term: rowsum(dout * out) in float32, minus lse's cotangent (d lse / d s is
    the row's probabilities, so it enters dS exactly as -delta does). Dense: out, dout [B, Sq, Hq, Dv] ->
    [B, Hq, Sq]; varlen: [Tq, Hq, Dv] -> [Hq, Tq]; dlse has that shape."""
    spec = "thd,thd->ht" if varlen else "bqhd,bqhd->bhq"
    rowsum = jnp.einsum(spec, out.astype(jnp.float32), dout.astype(jnp.float32), precision=_HIGHEST)
    return rowsum - dlse.astype(jnp.float32)
