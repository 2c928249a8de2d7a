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


def naive_attention_f64(q, k, v, *, causal: bool, softmax_scale: float | None = None, window=None):
    """Attention in float64, one score matrix per batch row and head; returns (out, lse) as NumPy.

    q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv] (Dv may differ: MLA). Bottom-right
    causal alignment and windows as `visible_f64` spells them out; rows that see no key give
    out = 0 and lse = -inf.
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
            scores = np.where(visible, q[b, :, h] @ k[b, :, kv_head].T * scale, -np.inf)[seen]
            row_max = scores.max(axis=1, keepdims=True, initial=-np.inf)
            weights = np.exp(scores - row_max)
            out[b, seen, h] = weights @ v[b, :, kv_head] / weights.sum(axis=1, keepdims=True)
            lse[b, h, seen] = row_max[:, 0] + np.log(weights.sum(axis=1))
    return out, lse


def naive_varlen_f64(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal: bool, softmax_scale=None, window=None):
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
        )
        out[rows], lse[:, rows] = o[0], l[0]
    return out, lse
