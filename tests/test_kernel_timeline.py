"""tools/kernel_timeline.py's summary of the kernels' consumer-loop timestamps (synthetic stamps);
the extension's reader refuses clearly when the timeline is not compiled in."""

import importlib
import re
import sys

import numpy as np
import pytest
from repo_tools import REPO, load_tool


def timeline_module():
    return load_tool("kernel_timeline")


@pytest.fixture(scope="module")
def timeline():
    return timeline_module()


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
        assert "JZYFA_MEASURE=timeline" in str(e)
    else:  # a timeline build: the whole array (iterations, then tiles), zeroed after reading
        assert len(raw) == 8 * (timeline_module().ITERATION_SLOTS + timeline_module().TILE_SLOTS)


def synthetic_tiles(timeline, steps, wait, tiles, empty_every=0):
    """Tile stamps whose phases last `steps` cycles and `wait` cycles apart, for CTA 0, both consumers;
    every `empty_every`-th tile has no key block (only its start and end recorded)."""
    stamps = np.zeros((timeline.CTAS, timeline.CONSUMERS, timeline.TILES, timeline.TILE_EVENTS), np.uint64)
    for consumer in range(2):
        t = 500 + consumer
        for i in range(tiles):
            row = np.cumsum([t, *steps])
            if empty_every and i % empty_every == empty_every - 1:
                stamps[0, consumer, i, [0, timeline.TILE_EVENTS - 1]] = [t, t + 50]
                t += 50 + wait
            else:
                stamps[0, consumer, i] = row
                t = int(row[-1]) + wait
    return stamps


def test_tile_summary_recovers_the_phases_outside_the_loop(timeline):
    steps = [100, 150, 50, 1200, 20_000, 200, 500]
    tiles = timeline.summarize_tiles(synthetic_tiles(timeline, steps, wait=400, tiles=30, empty_every=10))
    assert tiles["tiles"] == 2 * 27  # the empty tiles have no block 0
    assert [tiles["phases"][name] for name in timeline.TILE_PHASES] == steps
    assert tiles["phases"][timeline.TILE_WAIT] == 400
    assert tiles["outside"] == pytest.approx(sum(steps) - 20_000 + 400)
    assert tiles["outside_share"] == pytest.approx(2600 / (2600 + 20_000))
    # 27 full tiles and 3 empty ones (50 cycles), each followed by a 400-cycle wait but the last.
    assert tiles["span"] == 27 * sum(steps) + 3 * 50 + 29 * 400
    text = timeline.format_tiles(tiles)
    assert "outside the key-block loop: 2600 cycles per tile" in text and "merge O's copy" in text


def test_tile_summary_without_tiles_says_so(timeline):
    empty = np.zeros((timeline.CTAS, timeline.CONSUMERS, timeline.TILES, timeline.TILE_EVENTS), np.uint64)
    assert timeline.summarize_tiles(empty) == {"tiles": 0}
    assert "no tile" in timeline.format_tiles({"tiles": 0})


def test_the_extension_array_splits_into_iterations_and_tiles(timeline):
    flat = np.arange(timeline.ITERATION_SLOTS + timeline.TILE_SLOTS, dtype=np.uint64)
    iterations, tiles = timeline.split_stamps(flat.tobytes())
    assert iterations.shape == (timeline.CTAS, timeline.CONSUMERS, timeline.ITERATIONS, timeline.EVENTS)
    assert tiles.shape == (timeline.CTAS, timeline.CONSUMERS, timeline.TILES, timeline.TILE_EVENTS)
    assert tiles.flat[0] == timeline.ITERATION_SLOTS
    with pytest.raises(ValueError, match="rebuild"):
        timeline.split_stamps(flat[:-1].tobytes())


def test_the_tool_matches_the_kernel_header(timeline):
    header = (REPO / "ffi" / "kernel_timeline.cuh").read_text()
    for name, value in [("kCtas", timeline.CTAS), ("kConsumers", timeline.CONSUMERS),
                        ("kIterations", timeline.ITERATIONS), ("kEvents", timeline.EVENTS),
                        ("kTiles", timeline.TILES), ("kTileEvents", timeline.TILE_EVENTS)]:  # fmt: skip
        assert f"static constexpr int {name} = {value};" in header, name
    assert len(re.findall(r"^  k\w+ = \d+,", header, re.MULTILINE)) == timeline.EVENTS + timeline.TILE_EVENTS


def test_dump_stamps_names_the_call_and_the_build(timeline, tmp_path, monkeypatch):
    """--dump_dir: the raw stamps round-trip through the .npz, named by the call and the folder jzyfa is
    installed in (two builds of an A/B run write apart)."""
    import argparse
    import types

    site = tmp_path / "jzyfa-site-b"
    fake = types.ModuleType("jzyfa")
    fake.__file__ = str(site / "jzyfa" / "__init__.py")
    monkeypatch.setitem(sys.modules, "jzyfa", fake)
    rng = np.random.default_rng(0)
    shape = (timeline.CTAS, timeline.CONSUMERS)
    iterations = rng.integers(1, 2**40, (*shape, 4, timeline.EVENTS), dtype=np.uint64)
    tiles = rng.integers(1, 2**40, (*shape, 3, timeline.TILE_EVENTS), dtype=np.uint64)
    args = argparse.Namespace(dtype="fp8", batch=4, seq=4096)
    path = timeline.dump_stamps(str(tmp_path / "out"), args, iterations, tiles)
    assert path == str(tmp_path / "out" / "timeline_fp8_4x4096_jzyfa-site-b.npz")
    saved = np.load(path)
    np.testing.assert_array_equal(saved["iterations"], iterations)
    np.testing.assert_array_equal(saved["tiles"], tiles)
