"""Timing the backward: `python -m jzyfa.bench --direction fwd,bwd,fwd+bwd`.

Each peer's forward function becomes, per direction:
- "fwd": itself, O from (q, k, v);
- "fwd+bwd": (q, k, v, dout) -> (dq, dk, dv): the forward and `jax.vjp`'s pullback in one program, what
  a training step runs;
- "bwd": (pullback, dout) -> (dq, dk, dv): the pullback alone, its residuals (whatever the peer's
  forward saved: jzyfa q, k, v, out and lse) made by one untimed forward per input set.
dout is a fixed standard-normal cotangent per input set. FLOPs: 2.5x the forward's for "bwd" (five
products of the forward's size: S, dP, dV, dK, dQ, counting S once) and 3.5x for "fwd+bwd", the FA3 and
cuDNN convention. Gradients are checked against float64 ones (`gradient_reference`) on a few (batch,
KV head) groups: dq of each query head of the group, dk and dv of the KV head summed over the group.

Only JAX peers on 16-bit inputs are differentiated here; the others say why not (`no_backward`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jzyfa.bench import float64
from jzyfa.bench.problem import Problem

DIRECTIONS = ("fwd", "bwd", "fwd+bwd")
# FLOPs of a direction as a multiple of the forward's.
FLOP_FACTORS = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
# float64 reference FLOPs spent on gradients per problem (a group costs 2.5x its forward per query head).
_GRAD_REF_FLOP_BUDGET = 4e11


def parse_directions(text: str) -> list[str]:
    """'fwd,bwd' -> ['fwd', 'bwd']; a ValueError naming --direction for anything else."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in DIRECTIONS]
    if unknown or not names:
        raise ValueError(f"--direction: unknown {unknown or text!r}; known: {', '.join(DIRECTIONS)}")
    return list(dict.fromkeys(names))


def no_backward_reason(peer, problem: Problem) -> str | None:
    """Why this peer's gradients are not timed here, or None."""
    if peer.framework != "jax":
        return "backward timed for JAX peers only (PyTorch autograd is not wired into the benchmark)"
    if peer.precision == "fp8":
        return "FP8 calls are not differentiable"
    if problem.varlen:
        return "backward of packed (varlen) batches: the gradient check covers dense batches only"
    return getattr(peer, "no_backward", None)


def cotangent(problem: Problem, index: int, seed: int) -> jax.Array:
    """The dout of input set `index`: standard normal in the run's dtype, out's shape."""
    key = jax.random.fold_in(jax.random.key(seed), 1_000_003 + index)
    return jax.random.normal(key, problem.out_shape, jnp.float32).astype(problem.jnp_dtype)


def timed_call(forward: Callable, args: Sequence[tuple], douts: Sequence[jax.Array], direction: str):
    """(fn, argument sets) that time `direction` of `forward(q, k, v)`; fn returns (dq, dk, dv) for the
    backward directions."""
    if direction == "fwd":
        return forward, list(args)

    def forward_and_backward(q, k, v, dout):
        _, pullback = jax.vjp(forward, q, k, v)
        return pullback(dout)

    if direction == "fwd+bwd":
        return forward_and_backward, [(*a, d) for a, d in zip(args, douts)]
    make_pullback = jax.jit(lambda q, k, v: jax.vjp(forward, q, k, v)[1])
    pullbacks = [jax.block_until_ready(make_pullback(*a)) for a in args]
    return (lambda pullback, dout: pullback(dout)), list(zip(pullbacks, douts))


def compile_stats(fn: Callable, args: tuple) -> tuple[int | None, float]:
    """What XLA holds for one call of jit(fn) on args (arguments, results and temporaries; None where the
    backend reports no memory analysis), and the seconds lowering and compiling it took: a first call's
    compile. JAX's in-memory caches are cleared first: a program compiled before (the correctness
    check's call) would otherwise come from them in about a millisecond. (A persistent compilation
    cache, where one is configured, is not cleared.)"""
    jax.clear_caches()
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    if memory is None:
        return None, seconds
    return int(memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes), seconds


# ----------------------------------------------------------------------------------------------
# float64 gradients


def attention_grads_float64(q, k, v, dout, scale: float, *, window: tuple[int, int], softcap=None, sink=None):
    """(dq, dk, dv) of one query head in float64: q [Sq, D], k [Sk, D], v [Sk, Dv], dout [Sq, Dv], the mask
    a (left, right) window with causal folded in (-1: unbounded), bottom-right aligned; softcap and sink
    as `float64.attention_float64` takes them (a sink: P from the lse with it, delta from its out).
    Blocks of query rows bound the memory, as there."""
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    out, lse = float64.attention_float64(
        q, k, v, scale, False, window=window, return_lse=True, softcap=softcap, sink=sink
    )
    left, right = window
    seq_q, seq_k = q.shape[0], k.shape[0]
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    rows_per_block = max(1, min(seq_q, float64.ROWS_BUDGET // max(seq_k, 1)))
    position = np.arange(seq_q) + seq_k - seq_q
    keys = np.arange(seq_k)[None, :]
    for start in range(0, seq_q, rows_per_block):
        rows = slice(start, min(seq_q, start + rows_per_block))
        seen = np.isfinite(lse[rows])[:, None]
        visible = np.ones((rows.stop - start, seq_k), bool)
        if left >= 0:
            visible &= keys >= position[rows, None] - left
        if right >= 0:
            visible &= keys <= position[rows, None] + right
        raw = q[rows] @ k.T * scale
        logits = float64.capped(raw, softcap) - np.where(seen, lse[rows, None], 0.0)
        probs = np.where(visible & seen, np.exp(np.minimum(logits, 0.0)), 0.0)
        dv += probs.T @ dout[rows]
        d_probs = dout[rows] @ v.T
        d_scores = probs * (d_probs - (dout[rows] * out[rows]).sum(axis=1, keepdims=True))
        if softcap is not None:  # the cap's slope, 1 - tanh^2
            d_scores *= 1.0 - np.tanh(raw / softcap) ** 2
        dq[rows] = d_scores @ k * scale
        dk += d_scores.T @ q[rows] * scale
    return dq, dk, dv


@dataclasses.dataclass
class GradientReference:
    """float64 gradients on (batch, KV head) groups of one input set with its dout."""

    groups: list[tuple[int, int]]  # (batch, kv head)
    dq: np.ndarray  # [G, group, Sq, D]
    dk: np.ndarray  # [G, Sk, D]
    dv: np.ndarray  # [G, Sk, Dv]
    seconds: float


def gradient_groups(problem: Problem, requested: int) -> list[tuple[int, int]]:
    """(batch, KV head) groups to check, spread over batch * heads_kv; as many as the budget allows
    (1 to 4) for `requested` < 0, all for 0."""
    total = problem.batch * problem.heads_kv
    count = requested
    if requested < 0:
        group = problem.heads_q // problem.heads_kv
        per_group = 2.5 * group * problem.flops / max(1, problem.batch * problem.heads_q)
        count = min(total, max(1, min(4, int(_GRAD_REF_FLOP_BUDGET // max(per_group, 1.0)))))
    return [(i // problem.heads_kv, i % problem.heads_kv) for i in float64.spread(total, count)]


def gradient_reference(problem: Problem, q, k, v, dout, requested: int) -> GradientReference:
    start = time.perf_counter()
    groups = gradient_groups(problem, requested)
    group = problem.heads_q // problem.heads_kv
    window = problem.mask
    dqs, dks, dvs = [], [], []
    for batch, kv_head in groups:
        keys = np.asarray(jax.device_get(k[batch, :, kv_head]), np.float64)
        values = np.asarray(jax.device_get(v[batch, :, kv_head]), np.float64)
        dq_heads, dk, dv = [], 0.0, 0.0
        for head in range(kv_head * group, (kv_head + 1) * group):
            grads = attention_grads_float64(
                jax.device_get(q[batch, :, head]),
                keys,
                values,
                jax.device_get(dout[batch, :, head]),
                problem.softmax_scale,
                window=window,
                softcap=problem.softcap,
                sink=problem.sink(head),
            )
            dq_heads.append(grads[0])
            dk, dv = dk + grads[1], dv + grads[2]
        dqs.append(np.stack(dq_heads))
        dks.append(dk)
        dvs.append(dv)
    return GradientReference(groups, np.stack(dqs), np.stack(dks), np.stack(dvs), time.perf_counter() - start)


def gradient_error(grads, ref: GradientReference, heads_q: int, heads_kv: int) -> dict[str, float]:
    """The largest relative L2 error of dq, dk, dv (each over the checked groups), its max abs error, and
    whether everything was finite."""
    dq, dk, dv = grads
    group = heads_q // heads_kv
    batches = np.array([b for b, _ in ref.groups])
    kv_heads = np.array([h for _, h in ref.groups])
    query_heads = kv_heads[:, None] * group + np.arange(group)[None, :]
    got = {
        "dq": np.asarray(jax.device_get(dq[batches[:, None], :, query_heads]), np.float64),
        "dk": float64.take_pairs(dk, batches, kv_heads),
        "dv": float64.take_pairs(dv, batches, kv_heads),
    }
    want = {"dq": ref.dq, "dk": ref.dk, "dv": ref.dv}
    errors = {name: float64.error_metrics(got[name], want[name]) for name in got}
    return {
        "rel_l2": max(e["o_rel_l2"] for e in errors.values()),
        "max_abs": max(e["o_max_abs"] for e in errors.values()),
        "finite": all(e["finite"] for e in errors.values()),
        **{f"{name}_rel_l2": e["o_rel_l2"] for name, e in errors.items()},
    }
