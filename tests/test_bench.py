"""`python -m jzyfa.bench`: FLOP counting, the float64 reference, the timers, a smoke run."""

import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from attention_oracle import naive_attention_f64, random_qkv

import jzyfa
from jzyfa import _timing
from jzyfa import bench

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ON_GPU = jax.default_backend() == "gpu"


# ---- FLOPs


def brute_force_pairs(seq_q, seq_k, causal):
    rows = np.arange(seq_q)[:, None]
    cols = np.arange(seq_k)[None, :]
    return int(np.sum(cols <= rows + seq_k - seq_q)) if causal else seq_q * seq_k


@pytest.mark.parametrize("seq_q,seq_k", [(1, 1), (7, 7), (1, 9), (5, 12), (12, 5), (64, 16)])
@pytest.mark.parametrize("causal", [False, True])
def test_visible_pairs_match_the_mask(seq_q, seq_k, causal):
    assert bench.visible_pairs(seq_q, seq_k, causal) == brute_force_pairs(seq_q, seq_k, causal)


def test_flops_standard_shapes():
    full = 4 * 16 * 16 * 1024 * 1024 * 128
    assert bench.attention_flops(16, 1024, 1024, 16, 128, causal=False) == full
    # Causal squares count half (the FA3 / cuDNN convention), not the S(S+1)/2 pairs computed.
    assert bench.attention_flops(16, 1024, 1024, 16, 128, causal=True) == full / 2
    # Every standard shape has B * S = 16K, so FLOPs grow with S.
    for batch, seq in [(8, 2048), (4, 4096), (2, 8192), (1, 16384)]:
        ratio = bench.attention_flops(batch, seq, seq, 16, 128, True) / (full / 2)
        assert ratio == seq // 1024


def test_flops_causal_rectangles_count_visible_pairs():
    # One query sees every key (decode); a chunk of 1024 queries after 1024 keys of context.
    assert bench.attention_flops(1, 1, 4096, 8, 128, True) == 4 * 8 * 4096 * 128
    pairs = 1024 * 1024 + 1024 * 1025 // 2
    assert bench.attention_flops(2, 1024, 2048, 8, 64, True) == 4 * 2 * 8 * 64 * pairs


def test_parse_shapes():
    assert bench.parse_shapes(bench.STANDARD_SHAPES) == [
        (16, 1024, 1024), (8, 2048, 2048), (4, 4096, 4096), (2, 8192, 8192), (1, 16384, 16384)]
    assert bench.parse_shapes(" 1x512x4096 ,2X64,") == [(1, 512, 4096), (2, 64, 64)]
    for bad in ["", "16", "16x", "0x128", "1x2x3x4", "ax128"]:
        with pytest.raises(ValueError, match="--shapes"):
            bench.parse_shapes(bad)


# ---- Reference and error


@pytest.mark.parametrize("seq_q,seq_k", [(37, 37), (5, 61), (61, 5)])
@pytest.mark.parametrize("causal", [False, True])
def test_float64_reference_matches_the_oracle(rng, seq_q, seq_k, causal):
    q, k, v = (rng.standard_normal((s, 16)) for s in (seq_q, seq_k, seq_k))
    expected, _ = naive_attention_f64(q[None, :, None], k[None, :, None], v[None, :, None],
                                      causal=causal, softmax_scale=0.3)
    got = bench.attention_float64(q, k, v, 0.3, causal)
    np.testing.assert_allclose(got, expected[0, :, 0], rtol=1e-12, atol=1e-12)


def test_float64_reference_long_sequence_uses_blocks(rng):
    # 2**22 // seq_k rows per block: several blocks here, and the causal key range shrinks.
    seq = 5000
    q, k, v = (rng.standard_normal((seq, 8)) for _ in range(3))
    got = bench.attention_float64(q, k, v, 0.5, True)
    rows = [0, 837, 838, 2500, seq - 1]
    for i in rows:
        s = (k[: i + 1] @ q[i]) * 0.5
        p = np.exp(s - s.max())
        np.testing.assert_allclose(got[i], p @ v[: i + 1] / p.sum(), rtol=1e-10)


def test_reference_pairs_spread_and_budget():
    small = bench.Problem(2, 128, 128, 4, 2, 64, True, "bf16")
    assert bench.reference_pairs(small, 0) == [(b, h) for b in range(2) for h in range(4)]
    pairs = bench.reference_pairs(small, 3)
    assert pairs[0] == (0, 0) and pairs[-1] == (1, 3) and len(pairs) == 3
    big = bench.Problem(1, 16384, 16384, 16, 16, 128, True, "bf16")
    assert len(bench.reference_pairs(big, -1)) == 2  # the budget allows no more at 16K
    mid = bench.Problem(16, 1024, 1024, 16, 16, 128, True, "bf16")
    assert len(bench.reference_pairs(mid, -1)) == 16


def test_relative_error_on_gqa_slices(rng):
    problem = bench.Problem(2, 32, 48, 4, 2, 16, True, "bf16")
    q, k, v = random_qkv(rng, batch=2, seq_q=32, seq_k=48, heads_q=4, heads_kv=2, head_dim=16)
    ref = bench.compute_reference(problem, q, k, v, requested_pairs=0)
    exact, _ = naive_attention_f64(q, k, v, causal=True)
    err = bench.relative_error(jnp.asarray(exact, jnp.float32), ref)
    assert err["rel_l2"] < 1e-6 and err["finite"]
    # A wrong head mapping must show: swap the query heads.
    err = bench.relative_error(jnp.asarray(exact[:, :, ::-1], jnp.float32), ref)
    assert err["rel_l2"] > 0.1


def test_rotation_spans_the_requested_bytes():
    standard = bench.Problem(16, 1024, 1024, 16, 16, 128, True, "bf16")
    assert standard.set_bytes == 4 * 16 * 1024 * 16 * 128 * 2
    assert bench.rotation_sets(standard, 256) == 2
    tiny = bench.Problem(1, 128, 128, 4, 4, 128, True, "bf16")
    n = bench.rotation_sets(tiny, 256)
    assert n * tiny.set_bytes >= 256 * 2**20 > (n - 1) * tiny.set_bytes


# ---- Timers


class FakeClock:
    source = "fake"

    def __init__(self):
        self.values = iter(range(1000, 100000, 10))

    def read(self):
        return float(next(self.values)), 250.0

    def close(self):
        pass


def test_clock_monitor_samples_while_the_block_runs():
    monitor = _timing.ClockMonitor(FakeClock(), interval_s=0.001)
    with monitor:
        time.sleep(0.05)
    stats = monitor.stats()
    assert stats.source == "fake" and stats.samples >= 2
    assert stats.min_mhz == 1000 and stats.max_mhz > stats.min_mhz
    assert stats.median_watts == 250.0
    with monitor:  # a second block starts afresh, and always has a sample
        pass
    assert monitor.stats().samples >= 1 and monitor.stats().min_mhz > stats.max_mhz


def test_no_clock_off_gpu():
    if ON_GPU:
        pytest.skip("checks the CPU behaviour")
    assert _timing.open_clock_reader() is None
    monitor = _timing.ClockMonitor(None)
    with monitor:
        pass
    assert monitor.stats().median_mhz is None and monitor.stats().samples == 0
    with pytest.raises(_timing.TimingUnavailable):
        _timing.cupti_kernel_time(lambda x: x, [(jnp.ones(4),)], min_samples=2, min_seconds=0,
                                  max_iterations_per_chunk=2, monitor=monitor)


def test_cupti_samples_are_per_call_sums(monkeypatch):
    """The CUPTI path's bookkeeping, with profiler.measure faked (no GPU here)."""
    from jax.experimental.mosaic.gpu import profiler

    calls = []

    def fake_measure(f, *, aggregate, iterations):
        assert aggregate is False and iterations >= 2

        def wrapper(sets):
            calls.append(iterations)
            out = f(sets)
            # Two input sets per iteration; two kernels per call (a fused kernel and a copy).
            per_iteration = [("attn", 1.0), ("copy", 0.25), ("attn", 3.0), ("copy", 0.25)]
            return out, [per_iteration] * iterations
        return wrapper

    monkeypatch.setattr(_timing, "cupti_available", lambda: None)
    monkeypatch.setattr(profiler, "measure", fake_measure)
    sets = [(jnp.ones(8),), (jnp.full(8, 2.0),)]
    timing = _timing.cupti_kernel_time(lambda x: x * 2, sets, min_samples=5, min_seconds=0,
                                       max_iterations_per_chunk=3,
                                       monitor=_timing.ClockMonitor(None))
    assert calls == [3, 3]  # chunks bounded by memory, until min_samples
    assert timing.samples_ms == [2.25] * 6 and timing.calls_per_sample == 2
    assert timing.kernels[0] == {"name": "attn", "ms_per_call": 2.0, "launches_per_call": 1.0}
    assert timing.kernels[1]["ms_per_call"] == 0.25
    assert timing.summary()["median_ms"] == 2.25


def test_wall_clock_rotates_and_counts():
    seen = []

    def fn(x):
        seen.append(float(x[0]))
        return x + 1

    sets = [(jnp.zeros(4),), (jnp.ones(4),), (jnp.full(4, 2.0),)]
    timing = _timing.wall_clock(fn, sets, calls=12, rounds=4, monitor=_timing.ClockMonitor(None))
    assert len(timing.samples_ms) == 4 and timing.calls_per_sample == 3
    assert all(t > 0 for t in timing.samples_ms)
    assert seen == [0.0, 1.0, 2.0] * 4


# ---- Formatting


def _fake_result(**overrides):
    result = {
        "impl": "jzyfa", "batch": 2, "seq_q": 8192, "seq_k": 8192, "heads_q": 32, "heads_kv": 8,
        "head_dim": 128, "causal": True, "status": "ok", "message": None, "median_ms": 1.5,
        "tflops": 733.0, "sm_clock_mhz": 1755.0, "rel_err": 2.5e-3, "timing_source": "cupti",
        "wall": {"median_ms": 1.6},
    }
    result.update(overrides)
    return result


def test_tables():
    results = [
        _fake_result(),
        _fake_result(impl="cudnn", status="error", message="RuntimeError: cuDNN is not detected.",
                     median_ms=None, tflops=None, sm_clock_mhz=None, rel_err=None, wall=None,
                     timing_source=None),
    ]
    plain = bench.format_plain(results)
    assert "32/8" in plain and "733" in plain and "1755" in plain and "cuDNN is not" in plain
    env = {"device": "NVIDIA H200", "compute_capability": "9.0", "driver": "580.1",
           "jax": "0.11.2", "jaxlib": "0.11.2", "cuda": {"cudnn": 91900}, "jzyfa": {}}
    config = {"dtype": "bf16", "head_dim": 128, "heads": 32, "kv_heads": 8, "causal": True}
    markdown = bench.format_markdown(results, env, config)
    assert "| impl | 2x8192 |" in markdown
    assert "| jzyfa | 733 (1755 MHz) |" in markdown and "| cudnn | error |" in markdown
    assert "CUPTI kernel time" in markdown and "32 heads (8 kv heads)" in markdown


# ---- The command


def test_smoke_run_writes_sane_json(tmp_path):
    """The command as a user runs it, in smoke mode on this machine."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "jzyfa.bench", "--smoke", "--kv_heads", "2",
           "--shapes", "2x128,1x96x160", "--impls", "jzyfa,cudnn,xla", "--markdown",
           f"--json_out={out}"]
    if ON_GPU:
        cmd += ["--iters", "3", "--min_time_s", "0"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| impl |" in proc.stdout
    assert "[jzyfa.bench]" in proc.stderr  # progress lines

    report = json.loads(out.read_text())
    assert report["env"]["jax"] == jax.__version__
    assert report["config"]["smoke"] is True
    results = {(r["impl"], r["seq_q"], r["seq_k"]): r for r in report["results"]}
    assert len(results) == 6
    for (impl, seq_q, seq_k), r in results.items():
        assert r["heads_q"] == 4 and r["heads_kv"] == 2 and r["causal"] is True
        assert r["flops"] == bench.attention_flops(r["batch"], seq_q, seq_k, 4, 128, True)
        if impl != "jzyfa" and seq_q != seq_k:
            assert r["status"] == "unsupported"  # jax.nn's causal mask is top-left aligned
            continue
        if impl == "cudnn" and not ON_GPU:
            assert r["status"] == "error" and "cuDNN" in r["message"]
            continue
        if impl == "jzyfa" and ON_GPU and not jzyfa.kernel_available():
            # On a GPU the bench times the kernel or reports why not; it never falls back.
            assert r["status"] == "error" and "kernel" in r["message"]
            continue
        assert r["status"] == "ok", r
        assert 0 <= r["rel_err"] < 1e-2
        assert r["median_ms"] > 0 and r["tflops"] > 0
        assert r["wall"]["median_ms"] > 0 and r["wall"]["samples"] >= 1
        expected_source = "cupti" if ON_GPU else "wall"
        assert r["timing_source"] == expected_source
        if not ON_GPU:
            assert r["sm_clock_mhz"] is None and r["kernel"] is None


def test_nocausal_run_in_process():
    """Flags parsed as the command does; the report of a non-causal f16 run."""
    try:
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["bench", "--smoke", "--nocausal", "--dtype", "f16", "--shapes", "1x64",
                     "--impls", "jzyfa,jzyfa_xla", "--iters", "2", "--min_time_s", "0"])
        config = bench.resolve_config()
    finally:
        flags.FLAGS.unparse_flags()
    assert config["heads"] == 4 and config["max_rel_err"] == 5e-3  # smoke and f16 defaults
    report = bench.run(config)
    for r in report["results"]:
        assert r["status"] == "ok", r
        assert r["flops"] == 4 * 1 * 4 * 64 * 64 * 128
        assert r["rel_err"] < 5e-3
