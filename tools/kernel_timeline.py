"""Where a key block's time goes in the Hopper kernels' consumer loops.

Needs a build with the timeline compiled in (ffi/kernel_timeline.cuh), on a Hopper GPU:

    CUDAFLAGS=-DJZYFA_TIMELINE=1 pip install --no-build-isolation --no-deps .
    python tools/kernel_timeline.py --dtype fp8 --batch 1 --seq 32768

Runs one causal call (after a warm-up), reads the SM-clock timestamps that thread 0 of each
consumer warpgroup of the first CTAs wrote at fixed points of each key-block iteration, and prints
the median cycles between consecutive points, next to the tensor-core cycles one block needs.
tools/gpu_session.sh runs it through JZYFA_TIMELINE_RUNS.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

import numpy as np

# ffi/kernel_timeline.cuh: TimelineLayout and TimelineEvent, in order.
CTAS, CONSUMERS, ITERATIONS, EVENTS = 4, 2, 2048, 8
PHASES = (
    "wait for K",  # kIterationStart -> kKeysReady
    "wait for the wgmma turn",  # -> kTurnHeld
    "issue Q K^T, P V (+ promotion)",  # -> kIssued
    "wait for S",  # -> kScoresLanded
    "softmax",  # -> kSoftmaxDone
    "wait for P V",  # -> kOutputLanded
    "rescale, bookkeeping",  # -> kIterationEnd
)
# Dense tensor-core FLOPs per SM per clock on Hopper (H100/H200 SXM datasheet rates / 132 SMs / clock).
FLOPS_PER_CLOCK = {"fp8": 8192, "bf16": 4096}


def tensor_cycles_per_block(dtype: str, head_dim: int = 128, rows: int = 64, keys: int = 128) -> float:
    """Tensor-core cycles of one consumer's Q K^T and P V for one key block (FP8: P V is N = 136)."""
    value_cols = head_dim + 8 if dtype == "fp8" else head_dim
    flops = 2 * rows * keys * head_dim + 2 * rows * keys * value_cols
    return flops / FLOPS_PER_CLOCK[dtype]


def summarize(stamps: np.ndarray) -> dict:
    """Median, mean and 90th percentile of the cycles per phase over the recorded iterations of every
    (CTA, consumer).

    stamps: uint64 [CTAS, CONSUMERS, ITERATIONS, EVENTS]; rows of zeros were not recorded. The period
    is start-to-start of consecutive iterations of one consumer inside a tile (gaps longer than 4x
    the median period, tile boundaries, are counted apart as `tile_gaps`).
    """
    phases: list[list[float]] = [[] for _ in PHASES]
    periods: list[float] = []
    for cta in range(stamps.shape[0]):
        for consumer in range(stamps.shape[1]):
            rows = stamps[cta, consumer].astype(np.int64)
            rows = rows[np.all(rows > 0, axis=1)]
            if len(rows) == 0:
                continue
            steps = np.diff(rows, axis=1)
            for p in range(len(PHASES)):
                phases[p].extend(steps[:, p].tolist())
            periods.extend(np.diff(rows[:, 0]).tolist())
    if not periods:
        raise ValueError("no complete iterations recorded (too few key blocks per tile, or no CTA ran)")
    periods_arr = np.asarray(periods, np.float64)
    typical = float(np.median(periods_arr))
    in_tile = periods_arr[periods_arr <= 4 * typical]
    # Medians hide skewed phases (a wait that is short in most blocks and long in a few): the mean
    # and the 90th percentile say how much time a phase really takes.
    return {
        "iterations": len(phases[0]),
        "phases": {name: float(np.median(v)) for name, v in zip(PHASES, phases)},
        "means": {name: float(np.mean(v)) for name, v in zip(PHASES, phases)},
        "p90": {name: float(np.percentile(v, 90)) for name, v in zip(PHASES, phases)},
        "period": float(np.median(in_tile)),
        "tile_gaps": int(np.sum(periods_arr > 4 * typical)),
    }


def format_summary(summary: dict, dtype: str) -> str:
    tensor = tensor_cycles_per_block(dtype)
    lines = [
        f"{summary['iterations']} iterations recorded; cycles per phase (one consumer, one key block):",
        f"  {'phase':34s} {'median':>8s} {'mean':>8s} {'p90':>8s}",
    ]
    lines += [
        f"  {name:34s} {cycles:8.0f} {summary['means'][name]:8.0f} {summary['p90'][name]:8.0f}"
        for name, cycles in summary["phases"].items()
    ]
    lines.append(f"  {'period (start to start), median':34s} {summary['period']:8.0f}")
    lines.append(
        f"tensor-core cycles per block: {tensor:.0f} per consumer, {2 * tensor:.0f} for both; "
        f"tensor busy ~{min(1.0, 2 * tensor / summary['period']):.0%} of the period"
    )
    return "\n".join(lines)


def run(dtype: str, batch: int, seq: int, heads: int) -> np.ndarray:
    import jax
    import jax.numpy as jnp

    import jzyfa

    ffi = importlib.import_module("jzyfa._jzyfa_ffi")
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((batch, seq, heads, 128)), jnp.bfloat16) for _ in range(3))
    kwargs = {}
    if dtype == "fp8":
        (q, dq), (k, dk), (v, dv) = (jzyfa.fp8_quantize(x) for x in (q, k, v))
        kwargs = {"descale_q": dq, "descale_k": dk, "descale_v": dv}
    call = jax.jit(
        lambda q, k, v: jzyfa.flash_attention(q, k, v, causal=True, implementation="kernel", **kwargs)
    )
    kernel = "fp8" if dtype == "fp8" else "16bit"
    jax.block_until_ready(call(q, k, v))  # compile, warm up
    ffi.kernel_timeline(kernel)  # discard the warm-up's stamps
    jax.block_until_ready(call(q, k, v))
    raw = ffi.kernel_timeline(kernel)
    return np.frombuffer(raw, np.uint64).reshape(CTAS, CONSUMERS, ITERATIONS, EVENTS)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("fp8", "bf16"), default="fp8")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    args = parser.parse_args(argv)
    print(f"{args.dtype}, causal, batch {args.batch}, {args.seq} tokens, {args.heads} heads, head dim 128")
    print(format_summary(summarize(run(args.dtype, args.batch, args.seq, args.heads)), args.dtype))


if __name__ == "__main__":
    main()
