"""Test helpers: random attention inputs and a naive float64 NumPy attention to check against."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jzyfa.quantize import fp8_quantize


def random_qkv(
    rng: np.random.Generator,
    *,
    batch: int = 1,
    seq_q: int,
    seq_k: int | None = None,
    heads_q: int = 2,
    heads_kv: int | None = None,
    head_dim: int = 64,
    head_dim_v: int | None = None,
    dtype=jnp.bfloat16,
):
    """Standard-normal q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv] as JAX arrays of `dtype`."""
    seq_k = seq_q if seq_k is None else seq_k
    heads_kv = heads_q if heads_kv is None else heads_kv
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    q = rng.standard_normal((batch, seq_q, heads_q, head_dim))
    k = rng.standard_normal((batch, seq_k, heads_kv, head_dim))
    v = rng.standard_normal((batch, seq_k, heads_kv, head_dim_v))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def random_fp8_qkv(
    rng: np.random.Generator,
    *,
    batch: int = 1,
    seq_q: int,
    seq_k: int | None = None,
    heads_q: int = 2,
    heads_kv: int | None = None,
    head_dim: int = 128,
    granularity: str = "tensor",
):
    """random_qkv's inputs (float32) through `jzyfa.fp8_quantize`: ((q8, k8, v8), (dq, dk, dv)).

    granularity="head" gives [B, Hkv] descales (q's shared by each KV head's query group).
    """
    heads_kv = heads_q if heads_kv is None else heads_kv
    q, k, v = random_qkv(
        rng, batch=batch, seq_q=seq_q, seq_k=seq_k, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
        dtype=jnp.float32,
    )  # fmt: skip
    q8, dq = fp8_quantize(q, granularity, kv_heads=heads_kv if granularity == "head" else None)
    k8, dk = fp8_quantize(k, granularity)
    v8, dv = fp8_quantize(v, granularity)
    return (q8, k8, v8), (dq, dk, dv)


def offsets(lengths) -> np.ndarray:
    """cu_seqlens int32 [len(lengths) + 1] of sequences of these lengths."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def random_fp8_packed(
    rng: np.random.Generator,
    lengths_q,
    lengths_k,
    *,
    heads_q: int = 4,
    heads_kv: int = 2,
    pad_q: int = 0,
    per_head: bool = False,
    head_dim: int = 128,
):
    """Packed e4m3 q [total_q + pad_q, Hq, D], k, v [total_k, Hkv, D] (D = head_dim) of standard-normal values
    quantized with power-of-two descales: ((q8, k8, v8), (dq, dk, dv), cu_q, cu_k). Descales are
    float32 scalars, or [num_seqs, Hkv] (per_head: a different power of two per sequence and KV head,
    q's shared by each KV head's query group); pad_q tokens past cu_seqlens_q[-1] belong to no sequence.
    """
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    num_seqs = len(lengths_q)

    def quantize(total, heads, cu, descale):
        x = rng.standard_normal((total, heads, head_dim))
        if descale.ndim == 2:  # per token: its sequence's (the last one's past the end)
            seq = np.clip(np.searchsorted(cu, np.arange(total), side="right") - 1, 0, num_seqs - 1)
            scale = np.repeat(descale[seq], heads // descale.shape[1], axis=1)[:, :, None]
        else:
            scale = descale
        return jnp.asarray(x / scale, jnp.float8_e4m3fn)

    if per_head:
        descales = [2.0 ** rng.integers(-3, 2, (num_seqs, heads_kv)).astype(np.float32) for _ in range(3)]
    else:
        descales = [np.float32(d) for d in (0.5, 0.25, 1.0)]
    q8 = quantize(int(cu_q[-1]) + pad_q, heads_q, cu_q, np.asarray(descales[0]))
    k8 = quantize(int(cu_k[-1]), heads_kv, cu_k, np.asarray(descales[1]))
    v8 = quantize(int(cu_k[-1]), heads_kv, cu_k, np.asarray(descales[2]))
    return (q8, k8, v8), tuple(jnp.asarray(d, jnp.float32) for d in descales), cu_q, cu_k


def dequantized_f64(x8, descale, cu) -> np.ndarray:
    """Packed e4m3 values times their sequence's descale (random_fp8_packed's layout), float64."""
    x = np.asarray(x8.astype(jnp.float32), np.float64)
    descale = np.asarray(descale, np.float64)
    if descale.ndim < 2:
        return x * descale
    seq = np.clip(np.searchsorted(cu, np.arange(x.shape[0]), side="right") - 1, 0, len(cu) - 2)
    return x * np.repeat(descale[seq], x.shape[1] // descale.shape[1], axis=1)[:, :, None]


def visible_f64(seq_q: int, seq_k: int, *, causal: bool, window=None) -> np.ndarray:
    """[seq_q, seq_k] bool from the definition: query i sits at p = i + seq_k - seq_q and sees key j
    iff p - left <= j <= p + right (-1: unbounded); causal sets right to 0."""
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0
    p = np.arange(seq_q)[:, None] + seq_k - seq_q
    j = np.arange(seq_k)[None, :]
    too_far_left = (j < p - left) if left >= 0 else np.zeros((seq_q, seq_k), bool)
    too_far_right = (j > p + right) if right >= 0 else np.zeros((seq_q, seq_k), bool)
    return ~(too_far_left | too_far_right)


def naive_attention_f64(q, k, v, *, causal: bool, softmax_scale: float | None = None, window=None, softcap=None):
    """Attention in float64, one score matrix per batch row and head; returns (out, lse) as NumPy.

    q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv] (Dv may differ: MLA). Bottom-right
    causal alignment and windows as `visible_f64` spells them out; rows that see no key give
    out = 0 and lse = -inf. softcap c: scaled scores s become c tanh(s / c).
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, seq_q, heads_q, head_dim = q.shape
    seq_k, heads_kv = k.shape[1], k.shape[2]
    scale = 1 / np.sqrt(head_dim) if softmax_scale is None else softmax_scale
    visible = visible_f64(seq_q, seq_k, causal=causal, window=window)
    out = np.zeros((batch, seq_q, heads_q, v.shape[3]))
    lse = np.full((batch, heads_q, seq_q), -np.inf)
    seen = visible.any(axis=1)
    for b in range(batch):
        for h in range(heads_q):
            kv_head = h // (heads_q // heads_kv)
            scores = _capped(q[b, :, h] @ k[b, :, kv_head].T * scale, softcap)
            scores = np.where(visible, scores, -np.inf)[seen]
            row_max = scores.max(axis=1, keepdims=True, initial=-np.inf)
            weights = np.exp(scores - row_max)
            out[b, seen, h] = weights @ v[b, :, kv_head] / weights.sum(axis=1, keepdims=True)
            lse[b, h, seen] = row_max[:, 0] + np.log(weights.sum(axis=1))
    return out, lse


def _capped(scores, softcap):
    return scores if softcap is None else softcap * np.tanh(scores / softcap)


def naive_varlen_f64(
    q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal: bool, softmax_scale=None, window=None, softcap=None
):
    """Packed attention, one `naive_attention_f64` per sequence: (out [total_q, Hq, Dv], lse [Hq, total_q]).

    Tokens outside every sequence give out = 0 and lse = -inf.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    cu_q, cu_k = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
    out = np.zeros(q.shape[:2] + v.shape[2:])
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for s in range(len(cu_q) - 1):
        rows = slice(cu_q[s], cu_q[s + 1])
        keys = slice(cu_k[s], cu_k[s + 1])
        if cu_q[s + 1] == cu_q[s]:
            continue
        o, l = naive_attention_f64(
            q[None, rows],
            k[None, keys],
            v[None, keys],
            causal=causal,
            softmax_scale=softmax_scale,
            window=window,
            softcap=softcap,
        )
        out[rows], lse[:, rows] = o[0], l[0]
    return out, lse


def naive_attention_grads_f64(
    q, k, v, dout, dlse=None, *, causal: bool, softmax_scale=None, window=None, softcap=None
):
    """Gradients of sum(out * dout) + sum(lse * dlse) in float64 from the definition, one score matrix per
    batch row and head: (dq, dk, dv) as NumPy. Shapes and softcap as `naive_attention_f64`; dout like
    out, dlse like lse (None: zero). Rows that see no key contribute nothing."""
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    batch, seq_q, heads_q, head_dim = q.shape
    seq_k, heads_kv = k.shape[1], k.shape[2]
    dlse = np.zeros((batch, heads_q, seq_q)) if dlse is None else np.asarray(dlse, np.float64)
    scale = 1 / np.sqrt(head_dim) if softmax_scale is None else softmax_scale
    visible = visible_f64(seq_q, seq_k, causal=causal, window=window)
    seen = visible.any(axis=1)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b in range(batch):
        for h in range(heads_q):
            kv = h // (heads_q // heads_kv)
            raw = (q[b, :, h] @ k[b, :, kv].T * scale)[seen]
            scores = np.where(visible[seen], _capped(raw, softcap), -np.inf)
            # d capped / d raw = 1 - tanh^2 (1 without a softcap)
            cap_slope = 1.0 if softcap is None else 1.0 - np.tanh(raw / softcap) ** 2
            probs = np.exp(scores - scores.max(axis=1, keepdims=True))
            probs /= probs.sum(axis=1, keepdims=True)  # d lse / d score = probs; d out / d probs = v
            d_out, keys, values = dout[b, seen, h], k[b, :, kv], v[b, :, kv]
            d_probs = d_out @ values.T
            d_scores = cap_slope * probs * (
                d_probs - (d_probs * probs).sum(axis=1, keepdims=True) + dlse[b, h, seen][:, None]
            )
            dq[b, seen, h] = d_scores @ keys * scale
            dk[b, :, kv] += d_scores.T @ q[b, seen, h] * scale
            dv[b, :, kv] += probs.T @ d_out
    return dq, dk, dv


def relative_l2(x, ref) -> float:
    """||x - ref|| / ||ref|| in float64."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))
