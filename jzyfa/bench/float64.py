"""The bench's float64 reference: attention of one head in float64 over blocks of query rows, taken on
a few (batch, query head) pairs of the unquantized inputs, and the error of an output against it.

`python -m jzyfa.bench` checks every timed output against it; `jzyfa.bench.accuracy` reports O's and
the LSE's errors against it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

ROWS_BUDGET = 2**22  # float64 score entries per block of query rows (32 MB)


# ----------------------------------------------------------------------------------------------
# The float64 reference


def attention_float64(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    causal: bool,
    *,
    window: tuple[int, int] | None = None,
    return_lse: bool = False,
    softcap: float | None = None,
    sink: float | None = None,
):
    """Attention of one head in float64: q [Sq, D], k and v [Sk, D] -> out [Sq, D] (and lse [Sq]).
    softcap c: scaled scores s become c tanh(s / c) before the mask. sink: one more logit in every row's
    softmax denominator, with no value (gpt-oss): out times e^(lse - lse'), lse' = logaddexp(lse, sink).

    window: None (the mask is causal or none), or a (left, right) mask with causal already folded in
    (`jzyfa.bench.problem.mask_window`; `causal` is then not read): query i, at position
    p = i + Sk - Sq, sees key j iff p - left <= j <= p + right (-1: unbounded on that side). Causal
    is (-1, 0), bottom-right aligned. Runs over blocks of query rows so long sequences fit in
    memory, each block multiplying only the key range its rows can see. Rows that see no key give
    out 0 and lse -inf.
    """
    left, right = window if window is not None else ((-1, 0) if causal else (-1, -1))
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    seq_q, seq_k = q.shape[0], k.shape[0]
    offset = seq_k - seq_q  # row i sits at position i + offset
    out = np.zeros((seq_q, v.shape[1]), np.float64)
    lse = np.full(seq_q, -np.inf)
    rows_per_block = max(1, min(seq_q, ROWS_BUDGET // max(seq_k, 1)))
    for start in range(0, seq_q, rows_per_block):
        stop = min(seq_q, start + rows_per_block)
        first = max(0, start + offset - left) if left >= 0 else 0
        end = min(seq_k, stop + offset + right) if right >= 0 else seq_k  # exclusive
        if end <= first:
            continue
        scores = capped((q[start:stop] @ k[first:end].T) * scale, softcap)
        if left >= 0 or right >= 0:
            position = np.arange(start, stop)[:, None] + offset
            keys = np.arange(first, end)[None, :]
            visible = np.ones(scores.shape, bool)
            if left >= 0:
                visible &= keys >= position - left
            if right >= 0:
                visible &= keys <= position + right
            scores = np.where(visible, scores, -np.inf)
        row_max = scores.max(axis=1, keepdims=True)
        seen = np.isfinite(row_max)
        probs = np.exp(scores - np.where(seen, row_max, 0.0))
        row_sum = probs.sum(axis=1, keepdims=True)
        out[start:stop] = np.where(seen, (probs @ v[first:end]) / np.where(seen, row_sum, 1.0), 0.0)
        lse[start:stop] = np.where(seen, row_max + np.log(np.where(seen, row_sum, 1.0)), -np.inf)[:, 0]
    if sink is not None:
        with_sink = np.logaddexp(lse, sink)
        out *= np.exp(lse - with_sink)[:, None]  # exp(-inf) = 0 for rows that saw no key
        lse = with_sink
    return (out, lse) if return_lse else out


def capped(scores: np.ndarray, softcap: float | None) -> np.ndarray:
    """Scaled scores capped to c tanh(s / c) (softcap c; None: as they are)."""
    return scores if softcap is None else softcap * np.tanh(scores / softcap)


def take_pairs(x, batches: np.ndarray, heads: np.ndarray) -> np.ndarray:
    """x[b, :, h, :] for each (b, h) pair of x [B, S, H, D] (JAX or NumPy), as float64 [P, S, D]."""
    if isinstance(x, np.ndarray):
        return np.asarray(x[batches, :, heads, :], np.float64)
    return np.asarray(jax.device_get(x[batches, :, heads, :]), np.float64)


def take_lse_pairs(lse, batches: np.ndarray, heads: np.ndarray) -> np.ndarray:
    """lse[b, h, :] for each pair of lse [B, H, S], as float64 [P, S]."""
    if isinstance(lse, np.ndarray):
        return np.asarray(lse[batches, heads, :], np.float64)
    return np.asarray(jax.device_get(lse[batches, heads, :]), np.float64)


@dataclasses.dataclass
class Reference:
    """float64 attention on (batch, query head) pairs of the unquantized inputs."""

    batches: np.ndarray
    heads: np.ndarray
    out: np.ndarray  # float64 [P, Sq, Dv]
    lse: np.ndarray | None  # float64 [P, Sq]; None where only O is checked
    seconds: float


def reference_on_pairs(
    q, k, v, pairs: Sequence[tuple[int, int]], *, scale: float, causal: bool, window=None, softcap=None,
    sinks=None,
) -> Reference:  # fmt: skip
    """The float64 reference (O and LSE) for query heads `pairs` = [(batch, head), ...] of q
    [B, Sq, Hq, D], k and v [B, Sk, Hkv, D] (GQA-aware); `window` as `attention_float64` takes it;
    sinks: None or one sink logit per query head."""
    start = time.perf_counter()
    batches = np.array([b for b, _ in pairs], dtype=np.int64)
    heads = np.array([h for _, h in pairs], dtype=np.int64)
    group = q.shape[2] // k.shape[2]
    qs = take_pairs(q, batches, heads)
    ks = take_pairs(k, batches, heads // group)
    vs = take_pairs(v, batches, heads // group)
    head_sinks = [None if sinks is None else sinks[h] for h in heads]
    options = {"window": window, "return_lse": True, "softcap": softcap}
    results = [
        attention_float64(qs[i], ks[i], vs[i], scale, causal, sink=head_sinks[i], **options)
        for i in range(len(pairs))
    ]
    out = np.stack([o for o, _ in results]) if results else np.zeros((0, q.shape[1], v.shape[3]))
    lse = np.stack([s for _, s in results]) if results else np.zeros((0, q.shape[1]))
    return Reference(batches, heads, out, lse, time.perf_counter() - start)


def spread(total: int, count: int) -> list[int]:
    """`count` indices spread evenly over range(total), first and last included (0: all)."""
    n = total if count == 0 else min(count, total)
    return sorted({round(i * (total - 1) / max(1, n - 1)) for i in range(n)})


def spread_pairs(batch: int, heads: int, count: int) -> list[tuple[int, int]]:
    """`count` (batch, head) pairs spread evenly over the flattened batch*heads index (0: all)."""
    return [(i // heads, i % heads) for i in spread(batch * heads, count)]


# ----------------------------------------------------------------------------------------------
# Metrics


def error_metrics(out: np.ndarray, ref_out: np.ndarray, lse=None, ref_lse=None) -> dict[str, Any]:
    """Relative L2 and max abs error of O (and of the LSE, where given) against the reference.

    LSE: rows where both are -inf (no visible key) are left out; a row where only one is finite
    makes the LSE errors infinite.
    """
    out = np.asarray(out, np.float64)
    diff = out - ref_out
    ref_norm = float(np.linalg.norm(ref_out))
    diff_norm = float(np.linalg.norm(diff))
    metrics: dict[str, Any] = {
        "o_rel_l2": diff_norm / ref_norm if ref_norm > 0 else diff_norm,
        "o_max_abs": float(np.max(np.abs(diff))) if diff.size else 0.0,
        "finite": bool(np.all(np.isfinite(out))),
        "lse_rel_l2": None,
        "lse_max_abs": None,
    }
    if lse is not None:
        lse = np.asarray(lse, np.float64)
        both_empty = np.isneginf(lse) & np.isneginf(ref_lse)
        if np.any(np.isfinite(lse) != np.isfinite(ref_lse)) or np.any(np.isnan(lse)):
            metrics.update(lse_rel_l2=math.inf, lse_max_abs=math.inf)
        else:
            keep = ~both_empty
            lse_diff = lse[keep] - ref_lse[keep]
            ref_lse_norm = float(np.linalg.norm(ref_lse[keep]))
            lse_diff_norm = float(np.linalg.norm(lse_diff))
            metrics["lse_rel_l2"] = lse_diff_norm / ref_lse_norm if ref_lse_norm > 0 else lse_diff_norm
            metrics["lse_max_abs"] = float(np.max(np.abs(lse_diff))) if lse_diff.size else 0.0
    return metrics
