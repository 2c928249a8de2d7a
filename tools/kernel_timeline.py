"""Where a key block's time goes in the Hopper kernels' consumer loops.

Needs a measuring build with the timeline compiled in (tools/measure/timeline.h, the interface in
ffi/kernel_timeline.cuh), on a Hopper GPU:

    JZYFA_MEASURE=timeline pip install --no-build-isolation --no-deps .
    python tools/kernel_timeline.py --dtype fp8 --batch 1 --seq 32768

Runs one causal call (after a warm-up), reads the SM-clock timestamps that thread 0 of each
consumer warpgroup of the first CTAs wrote at fixed points of each key-block iteration and of each
tile, and prints the median cycles between consecutive points, next to the tensor-core cycles one
block needs, and what each tile costs outside its key-block loop (block 0, the epilogue, the wait
for the next tile: what short sequences pay per key block).
tools/gpu_session.sh runs it through JZYFA_TIMELINE_RUNS.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
from collections.abc import Sequence

import numpy as np

# ffi/kernel_timeline.cuh: TimelineLayout, TimelineEvent and TileEvent, in order.
CTAS, CONSUMERS, ITERATIONS, EVENTS = 4, 2, 2048, 9
TILES, TILE_EVENTS = 512, 8
ITERATION_SLOTS = CTAS * CONSUMERS * ITERATIONS * EVENTS
TILE_SLOTS = CTAS * CONSUMERS * TILES * TILE_EVENTS
# The phases of a tile outside its key-block loop, and the loop (kTileStart .. kTileEnd), and the
# wait from one tile's end to the next one's start (the next tile's index and Q).
TILE_PHASES = (
    "block 0: wait for K",  # kTileStart -> kFirstKeys
    "block 0: turn, issue Q K^T",  # -> kFirstIssued
    "block 0: plan the tile, wait for S",  # -> kFirstScores
    "block 0: softmax",  # -> kFirstSoftmax
    "blocks 1.. and the last P V",  # -> kLastOutput (the iterations)
    "merge O's copy",  # -> kEpilogueStart (FP8; 16-bit: nothing)
    "epilogue",  # -> kTileEnd
)
TILE_WAIT = "wait for the next tile"  # kTileEnd of one tile -> kTileStart of the next
LOOP = TILE_PHASES[4]
# The phase that ends at event e + 1. A kernel may leave an event out (its stamps stay 0): the two
# phases around it then count as one (MERGED names it, else the names joined by " + ").
PHASES = (
    "wait for K",  # kIterationStart -> kKeysReady
    "wait for the wgmma turn",  # -> kTurnHeld
    "issue Q K^T, P V (+ promotion)",  # -> kIssued
    "wait for S",  # -> kScoresLanded
    "softmax: row max, r",  # -> kReferenceKnown (FP8 only)
    "softmax: codes",  # -> kSoftmaxDone
    "wait for P V",  # -> kOutputLanded
    "rescale, bookkeeping",  # -> kIterationEnd
)
MERGED = {("softmax: row max, r", "softmax: codes"): "softmax"}
ISSUE = "issue Q K^T, P V (+ promotion)"
# Dense tensor-core FLOPs per SM per clock on Hopper (H100/H200 SXM datasheet rates / 132 SMs / clock).
FLOPS_PER_CLOCK = {"fp8": 8192, "bf16": 4096}


def tensor_cycles_per_block(dtype: str, head_dim: int = 128, rows: int = 64, keys: int = 128) -> float:
    """Tensor-core cycles of one consumer's Q K^T and P V for one key block (FP8: P V is N = 136)."""
    value_cols = head_dim + 8 if dtype == "fp8" else head_dim
    flops = 2 * rows * keys * head_dim + 2 * rows * keys * value_cols
    return flops / FLOPS_PER_CLOCK[dtype]


def marked_events(stamps: np.ndarray) -> list[int]:
    """The events this kernel records (some stamp nonzero), in order."""
    return [e for e in range(stamps.shape[-1]) if np.any(stamps[..., e] > 0)]


def phase_names(events: Sequence[int]) -> list[str]:
    """One name per phase between consecutive recorded events."""
    names = []
    for begin, end in itertools.pairwise(events):
        parts = tuple(PHASES[begin:end])
        names.append(MERGED.get(parts, " + ".join(parts)))
    return names


def _consumer_intervals(rows: np.ndarray, names: Sequence[str]) -> tuple[np.ndarray, list[str]]:
    """Boundaries and labels of one consumer's recorded time: the phases of each iteration and the
    time between iterations ("between blocks": block 0's softmax, tile changes)."""
    bounds, labels = [], []
    for i, row in enumerate(rows):
        if i > 0:
            bounds.append(rows[i - 1, -1])
            labels.append("between blocks")
        for j, name in enumerate(names):
            bounds.append(row[j])
            labels.append(name)
    bounds.append(rows[-1, -1])
    return np.asarray(bounds, np.int64), labels


def concurrency(a: tuple[np.ndarray, list[str]], b: tuple[np.ndarray, list[str]]) -> dict:
    """Cycles the two consumers of one CTA spend in each pair of phases, over the time both record.

    a, b: (boundaries, labels) from _consumer_intervals; both on the same SM clock."""
    (ta, la), (tb, lb) = a, b
    start, stop = max(ta[0], tb[0]), min(ta[-1], tb[-1])
    points = np.unique(np.concatenate([ta, tb, [start, stop]]))
    points = points[(points >= start) & (points <= stop)]
    shares: dict[tuple[str, str], float] = {}
    for t0, t1 in itertools.pairwise(points):
        ia = int(np.searchsorted(ta, t0, side="right")) - 1
        ib = int(np.searchsorted(tb, t0, side="right")) - 1
        key = (la[ia], lb[ib])
        shares[key] = shares.get(key, 0.0) + float(t1 - t0)
    return shares


def summarize(stamps: np.ndarray) -> dict:
    """Median, mean and 90th percentile of the cycles per phase over the recorded iterations of every
    (CTA, consumer), and how the two consumers' phases overlap.

    stamps: uint64 [CTAS, CONSUMERS, ITERATIONS, EVENTS]; rows of zeros were not recorded, events no
    row records are left out. The period is start-to-start of consecutive iterations of one consumer
    inside a tile (gaps longer than 4x the median period, tile boundaries, are counted apart as
    `tile_gaps`).
    """
    events = marked_events(stamps)
    if len(events) < 2:
        raise ValueError("no complete iterations recorded (too few key blocks per tile, or no CTA ran)")
    names = phase_names(events)
    phases: list[list[float]] = [[] for _ in names]
    periods: list[float] = []
    pair_cycles: dict[tuple[str, str], float] = {}
    for cta in range(stamps.shape[0]):
        intervals = []
        for consumer in range(stamps.shape[1]):
            rows = stamps[cta, consumer][:, events].astype(np.int64)
            rows = rows[np.all(rows > 0, axis=1)]
            if len(rows) == 0:
                continue
            steps = np.diff(rows, axis=1)
            for p in range(len(names)):
                phases[p].extend(steps[:, p].tolist())
            periods.extend(np.diff(rows[:, 0]).tolist())
            intervals.append(_consumer_intervals(rows, names))
        if len(intervals) == 2:
            for key, cycles in concurrency(*intervals).items():
                pair_cycles[key] = pair_cycles.get(key, 0.0) + cycles
    if not periods:
        raise ValueError("no complete iterations recorded (too few key blocks per tile, or no CTA ran)")
    periods_arr = np.asarray(periods, np.float64)
    typical = float(np.median(periods_arr))
    in_tile = periods_arr[periods_arr <= 4 * typical]
    total = sum(pair_cycles.values())

    def share(test) -> float:
        return sum(c for (x, y), c in pair_cycles.items() if test(x, y)) / total if total else float("nan")

    def softmax(name: str) -> bool:
        return name.startswith("softmax")

    # Medians hide skewed phases (a wait that is short in most blocks and long in a few): the mean
    # and the 90th percentile say how much time a phase really takes.
    return {
        "iterations": len(phases[0]),
        "phases": {name: float(np.median(v)) for name, v in zip(names, phases)},
        "means": {name: float(np.mean(v)) for name, v in zip(names, phases)},
        "p90": {name: float(np.percentile(v, 90)) for name, v in zip(names, phases)},
        "period": float(np.median(in_tile)),
        "tile_gaps": int(np.sum(periods_arr > 4 * typical)),
        # Shares of the time both consumers of a CTA record (nan when no CTA recorded both).
        "both_softmax": share(lambda x, y: softmax(x) and softmax(y)),
        "one_issues": share(lambda x, y: (x == ISSUE) != (y == ISSUE)),
        "none_issues": share(lambda x, y: x != ISSUE and y != ISSUE),
    }


def summarize_tiles(tiles: np.ndarray) -> dict:
    """Per-tile phases outside the key-block loop, over the recorded tiles with at least one key block.

    tiles: uint64 [CTAS, CONSUMERS, TILES, TILE_EVENTS]; rows of zeros were not recorded (tiles with no
    key block record only their start and end). Returns the tile count, the median and mean cycles of
    each phase (TILE_PHASES, and TILE_WAIT between consecutive tiles of one consumer), and `outside`:
    the mean cycles a tile spends outside its loop (all phases but LOOP, the wait included) and their
    share of the recorded time; and `span`, the median over the recorded consumers of the cycles from
    their first tile's start to their last tile's end (against the kernel's time at the SM clock, what
    the launch costs outside the tiles: ramp-up and tail)."""
    phases: dict[str, list[float]] = {name: [] for name in (*TILE_PHASES, TILE_WAIT)}
    spans = []
    for cta in range(tiles.shape[0]):
        for consumer in range(tiles.shape[1]):
            rows = tiles[cta, consumer].astype(np.int64)
            started = rows[rows[:, 0] > 0]
            if len(started) and started[-1, -1] > 0:
                spans.append(float(started[-1, -1] - started[0, 0]))
            if len(started) > 1:
                waits = started[1:, 0] - started[:-1, -1]
                phases[TILE_WAIT].extend(waits[started[:-1, -1] > 0].tolist())
            full = started[np.all(started > 0, axis=1)]
            for p, name in enumerate(TILE_PHASES):
                phases[name].extend(np.diff(full, axis=1)[:, p].tolist())
    count = len(phases[TILE_PHASES[0]])
    if count == 0:
        return {"tiles": 0}
    means = {name: float(np.mean(v)) if v else 0.0 for name, v in phases.items()}
    outside = sum(c for name, c in means.items() if name != LOOP)
    loop_share = means[LOOP] / (means[LOOP] + outside) if means[LOOP] + outside else float("nan")
    return {
        "tiles": count,
        "phases": {name: float(np.median(v)) if v else 0.0 for name, v in phases.items()},
        "means": means,
        "outside": outside,
        "outside_share": 1.0 - loop_share,
        "span": float(np.median(spans)) if spans else 0.0,
    }


def format_tiles(tiles: dict) -> str:
    if not tiles["tiles"]:
        return "no tile with a key block recorded"
    lines = [
        f"{tiles['tiles']} tiles recorded; cycles per tile (one consumer):",
        f"  {'phase':34s} {'median':>8s} {'mean':>8s}",
    ]
    lines += [
        f"  {name:34s} {tiles['phases'][name]:8.0f} {tiles['means'][name]:8.0f}"
        for name in (*TILE_PHASES, TILE_WAIT)
    ]
    lines.append(
        f"outside the key-block loop: {tiles['outside']:.0f} cycles per tile (mean), "
        f"{tiles['outside_share']:.0%} of a tile's time"
    )
    lines.append(
        f"first tile's start to last tile's end: {tiles['span']:.0f} cycles (median over the consumers; "
        "the kernel's time minus this at the SM clock is what the launch costs outside the tiles)"
    )
    return "\n".join(lines)


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
        f"both consumers in a softmax phase {summary['both_softmax']:.0%} of the time; one issuing its "
        f"GEMMs {summary['one_issues']:.0%}, neither {summary['none_issues']:.0%}"
    )
    lines.append(
        f"tensor-core cycles per block: {tensor:.0f} per consumer, {2 * tensor:.0f} for both; "
        f"tensor busy ~{min(1.0, 2 * tensor / summary['period']):.0%} of the period"
    )
    return "\n".join(lines)


def split_stamps(raw: bytes) -> tuple[np.ndarray, np.ndarray]:
    """The extension's array as (iteration stamps [CTAS, CONSUMERS, ITERATIONS, EVENTS], tile stamps
    [CTAS, CONSUMERS, TILES, TILE_EVENTS])."""
    flat = np.frombuffer(raw, np.uint64)
    if flat.size != ITERATION_SLOTS + TILE_SLOTS:
        raise ValueError(f"expected {ITERATION_SLOTS + TILE_SLOTS} stamps, got {flat.size}: rebuild jzyfa")
    iterations = flat[:ITERATION_SLOTS].reshape(CTAS, CONSUMERS, ITERATIONS, EVENTS)
    return iterations, flat[ITERATION_SLOTS:].reshape(CTAS, CONSUMERS, TILES, TILE_EVENTS)


def run(dtype: str, batch: int, seq: int, heads: int) -> tuple[np.ndarray, np.ndarray]:
    import jax
    from profile_call import kernel_call  # tools/, next to this file

    ffi = importlib.import_module("jzyfa._jzyfa_ffi")
    call, inputs = kernel_call(dtype, batch, seq, heads)
    kernel = "fp8" if dtype == "fp8" else "16bit"
    jax.block_until_ready(call(*inputs))  # compile, warm up
    ffi.kernel_timeline(kernel)  # discard the warm-up's stamps
    jax.block_until_ready(call(*inputs))
    return split_stamps(ffi.kernel_timeline(kernel))


def dump_stamps(folder: str, args: argparse.Namespace, iterations: np.ndarray, tiles: np.ndarray) -> str:
    """The raw stamps as an .npz in `folder`, named by the call and the installed jzyfa's folder."""
    import os

    jzyfa = importlib.import_module("jzyfa")
    site = os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(jzyfa.__file__))))
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"timeline_{args.dtype}_{args.batch}x{args.seq}_{site}.npz")
    np.savez_compressed(path, iterations=iterations, tiles=tiles)
    return path


def main(argv: Sequence[str] | None = None) -> None:
    from profile_call import add_call_arguments

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_call_arguments(parser, default_seq=32768)
    parser.add_argument(
        "--dump_dir",
        help="Also write the raw stamps (iterations, tiles) to DIR/timeline_<dtype>_<B>x<S>_<site>.npz, "
        "<site> the folder jzyfa is installed in (so that two builds' runs, A/B, keep apart).",
    )
    args = parser.parse_args(argv)
    print(f"{args.dtype}, causal, batch {args.batch}, {args.seq} tokens, {args.heads} heads, head dim 128")
    iterations, tiles = run(args.dtype, args.batch, args.seq, args.heads)
    if args.dump_dir:
        print("stamps written to", dump_stamps(args.dump_dir, args, iterations, tiles))
    try:
        print(format_summary(summarize(iterations), args.dtype))
    except ValueError as e:  # tiles of one key block (short sequences) have no iterations
        print(e)
    print(format_tiles(summarize_tiles(tiles)))


if __name__ == "__main__":
    main()
