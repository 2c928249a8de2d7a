"""tools/kernel_timeline.py's summary of the kernels' consumer-loop timestamps (synthetic stamps);
the extension's reader refuses clearly when the timeline is not compiled in."""

import importlib
import importlib.util
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def timeline():
    spec = importlib.util.spec_from_file_location("kernel_timeline", REPO / "tools" / "kernel_timeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def synthetic(timeline, steps, iterations, tile_gap_every=0, offsets=(0, 0)):
    """Stamps whose phases last `steps` cycles, iterations back to back (plus a long gap every
    `tile_gap_every` iterations), for CTA 0 and 1, both consumers (consumer c starting offsets[c]
    cycles later); the rest unrecorded (zeros). With one step fewer than phases, the FP8-only event
    kReferenceKnown (5) stays unrecorded, as in the 16-bit kernel."""
    stamps = np.zeros((timeline.CTAS, timeline.CONSUMERS, timeline.ITERATIONS, timeline.EVENTS), np.uint64)
    events = list(range(timeline.EVENTS))
    if len(steps) == timeline.EVENTS - 2:
        events.remove(5)
    assert len(steps) == len(events) - 1
    for cta in range(2):
        for consumer in range(2):
            t = 1000 + 7 * cta + offsets[consumer]
            for i in range(iterations):
                if tile_gap_every and i and i % tile_gap_every == 0:
                    t += 100_000
                row = np.cumsum([t, *steps])
                stamps[cta, consumer, i, events] = row
                t = int(row[-1]) + 5  # the next iteration starts 5 cycles after this one ends
    return stamps


def test_summary_recovers_the_phases(timeline):
    steps = [10, 20, 300, 40, 200, 300, 60, 70]  # FP8: the softmax in two parts
    summary = timeline.summarize(synthetic(timeline, steps, iterations=50, tile_gap_every=10))
    assert summary["iterations"] == 4 * 50
    assert list(summary["phases"].values()) == steps
    assert list(summary["phases"]) == list(timeline.PHASES)
    assert summary["period"] == sum(steps) + 5
    assert summary["tile_gaps"] == 4 * 4  # iterations 10, 20, 30, 40 of each (CTA, consumer)
    text = timeline.format_summary(summary, "fp8")
    assert "softmax: row max, r" in text and "528 per consumer" in text


def test_an_event_the_kernel_leaves_out_merges_its_phases(timeline):
    steps = [10, 20, 300, 40, 500, 60, 70]  # 16-bit: no kReferenceKnown stamp
    summary = timeline.summarize(synthetic(timeline, steps, iterations=20))
    assert list(summary["phases"].values()) == steps
    assert list(summary["phases"])[4] == "softmax"
    assert timeline.phase_names([0, 1, 3]) == ["wait for K", "wait for the wgmma turn + " + timeline.ISSUE]


def test_summary_shows_skewed_phases(timeline):
    # A wait that is 10 cycles in 9 blocks of 10 and 1000 in the tenth: the median hides it, the mean
    # and the 90th percentile show it.
    stamps = synthetic(timeline, [10, 20, 300, 40, 500, 10, 70], iterations=100)
    for i in range(9, 100, 10):
        stamps[:2, :, i, 7:] += np.uint64(990)  # P V lands 990 cycles later in every tenth block
    summary = timeline.summarize(stamps)
    name = "wait for P V"
    assert summary["phases"][name] == 10
    assert summary["means"][name] == pytest.approx(109)
    assert 10 <= summary["p90"][name] <= 1000
    assert "mean" in timeline.format_summary(summary, "bf16")


def test_concurrency_counts_the_cycles_of_each_pair_of_phases(timeline):
    a = (np.array([0, 10, 20]), ["x", "y"])
    b = (np.array([5, 15, 25]), ["y", "x"])
    # Both record from 5 to 20: (x, y) 5..10, (y, y) 10..15, (y, x) 15..20.
    assert timeline.concurrency(a, b) == {("x", "y"): 5.0, ("y", "y"): 5.0, ("y", "x"): 5.0}


def test_consumers_in_step_never_issue_alone(timeline):
    steps = [10, 20, 300, 40, 200, 300, 60, 70]
    summary = timeline.summarize(synthetic(timeline, steps, iterations=30))
    period = sum(steps) + 5
    assert summary["both_softmax"] == pytest.approx(500 * 30 / (30 * period - 5))
    assert summary["one_issues"] == 0
    assert summary["none_issues"] == pytest.approx(1 - 300 * 30 / (30 * period - 5))
    # Half a period apart, one consumer issues while the other does not.
    shifted = timeline.summarize(synthetic(timeline, steps, iterations=30, offsets=(0, period // 2)))
    assert shifted["one_issues"] > 0.5
    assert shifted["both_softmax"] < summary["both_softmax"]


def test_summary_without_iterations_says_so(timeline):
    empty = np.zeros((timeline.CTAS, timeline.CONSUMERS, timeline.ITERATIONS, timeline.EVENTS), np.uint64)
    with pytest.raises(ValueError, match="no complete iterations"):
        timeline.summarize(empty)


def test_tensor_cycles(timeline):
    # FP8: m64 x 128 keys x 128 (Q K^T) + m64 x 136 x 128 keys (P V with the row-sum columns), 8192/clk.
    assert timeline.tensor_cycles_per_block("fp8") == 528
    assert timeline.tensor_cycles_per_block("bf16") == 1024


def test_extension_reader_needs_the_timeline_build():
    try:
        ffi = importlib.import_module("jzyfa._jzyfa_ffi")
    except ImportError:
        pytest.skip("the jzyfa extension is not built here")
    with pytest.raises(ValueError, match="'fp8' or '16bit'"):
        ffi.kernel_timeline("bf16")
    try:
        raw = ffi.kernel_timeline("fp8")
    except RuntimeError as e:
        assert "JZYFA_TIMELINE" in str(e)
    else:  # a timeline build: the whole array, zeroed after reading
        assert len(raw) == 4 * 2 * 2048 * 8 * 8
