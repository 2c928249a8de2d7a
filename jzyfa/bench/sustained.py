"""`--sustained SECONDS`: each implementation's throughput when it runs back to back for SECONDS.

The normal rows time short loops after a short warm-up, so a GPU that lowers its clock once it
heats up (or reaches its power limit) shows its boost clock there. Here every implementation that
ran a problem runs bursts of SECONDS of wall time each (the jitted call in a loop, waiting for the
device only at the end of the burst), in two passes, interleaved (A, B, A, B), so that no
implementation always follows a cool-down; the better pass is reported. TFLOP/s come from wall
time (calls over the burst's seconds, dispatch included); the SM clock and board power are the
medians sampled during that burst (None where they cannot be read, on CPUs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from jzyfa.bench import timing as _timing

PASSES = 2
LABEL = "sustained"


class Entry(NamedTuple):
    """One measured row and what runs it: the timed callable, its argument sets, the sync, and the
    warm-up's estimate of one call's seconds."""

    row: dict[str, Any]
    fn: Callable
    args: Sequence[tuple]
    sync: Callable[[Any], Any]
    per_call_s: float


def sustained_rows(
    entries: Sequence[Entry], seconds: float, monitor: _timing.ClockMonitor
) -> list[dict[str, Any]]:
    """A "<impl> sustained" row per entry (same problem keys as its row), the better of PASSES passes."""
    passes: list[list[dict[str, Any]]] = [[] for _ in entries]
    for _ in range(PASSES):
        for index, entry in enumerate(entries):
            calls, elapsed, clock = _timing.sustained_burst(
                entry.fn,
                entry.args,
                seconds=seconds,
                per_call_s=entry.per_call_s,
                monitor=monitor,
                sync=entry.sync,
            )
            passes[index].append(
                {
                    "calls": calls,
                    "seconds": elapsed,
                    "calls_per_s": calls / elapsed,
                    "tflops": entry.row["flops"] * calls / elapsed / 1e12,
                    "sm_clock_mhz": clock.median_mhz,
                    "board_power_w": clock.median_watts,
                }
            )
    return [_row(entry.row, runs, seconds) for entry, runs in zip(entries, passes)]


def _row(row: dict[str, Any], runs: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    best = max(runs, key=lambda r: r["calls_per_s"])
    return {
        **row,
        "impl": f"{row['impl']} {LABEL}",
        "timing_source": LABEL,
        "median_ms": 1e3 / best["calls_per_s"],
        "tflops": best["tflops"],
        "sm_clock_mhz": best["sm_clock_mhz"],
        "board_power_w": best["board_power_w"],
        "kernel": None,
        "wall": None,
        "wall_tflops": best["tflops"],
        "sustained": {"seconds": seconds, "passes": runs},
    }
