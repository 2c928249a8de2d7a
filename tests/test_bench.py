"""`python -m jzyfa.bench`: FLOP counting, the float64 reference, the timers, peers, the reports, smoke runs."""

import json
import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64, random_qkv
from bench_helpers import fake_result, quick_options, record_flash_attention, resolve_config, run_bench

import jzyfa
from jzyfa import plan
from jzyfa.bench import float64, peers, speed
from jzyfa.bench import report as bench_report
from jzyfa.bench import timing as _timing
from jzyfa.bench.problem import Problem, attention_flops, parse_shapes, visible_pairs

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
    assert visible_pairs(seq_q, seq_k, causal) == brute_force_pairs(seq_q, seq_k, causal)


def test_flops_standard_shapes():
    full = 4 * 16 * 16 * 1024 * 1024 * 128
    assert attention_flops(16, 1024, 1024, 16, 128, causal=False) == full
    # Causal squares count half (the FA3 / cuDNN convention), not the S(S+1)/2 pairs computed.
    assert attention_flops(16, 1024, 1024, 16, 128, causal=True) == full / 2
    # Every standard shape has B * S = 16K, so FLOPs grow with S.
    for batch, seq in [(8, 2048), (4, 4096), (2, 8192), (1, 16384)]:
        ratio = attention_flops(batch, seq, seq, 16, 128, True) / (full / 2)
        assert ratio == seq // 1024


def test_flops_causal_rectangles_count_visible_pairs():
    # One query sees every key (decode); a chunk of 1024 queries after 1024 keys of context.
    assert attention_flops(1, 1, 4096, 8, 128, True) == 4 * 8 * 4096 * 128
    pairs = 1024 * 1024 + 1024 * 1025 // 2
    assert attention_flops(2, 1024, 2048, 8, 64, True) == 4 * 2 * 8 * 64 * pairs


def test_parse_shapes():
    assert parse_shapes(speed.STANDARD_SHAPES) == [
        (16, 1024, 1024),
        (8, 2048, 2048),
        (4, 4096, 4096),
        (2, 8192, 8192),
        (1, 16384, 16384),
    ]
    assert parse_shapes(" 1x512x4096 ,2X64,") == [(1, 512, 4096), (2, 64, 64)]
    for bad in ["", "16", "16x", "0x128", "1x2x3x4", "ax128"]:
        with pytest.raises(ValueError, match="--shapes"):
            parse_shapes(bad)


# ---- Reference and error


@pytest.mark.parametrize("seq_q,seq_k", [(37, 37), (5, 61), (61, 5)])
@pytest.mark.parametrize("causal", [False, True])
def test_float64_reference_matches_the_oracle(rng, seq_q, seq_k, causal):
    q, k, v = (rng.standard_normal((s, 16)) for s in (seq_q, seq_k, seq_k))
    expected, _ = naive_attention_f64(
        q[None, :, None], k[None, :, None], v[None, :, None], causal=causal, softmax_scale=0.3
    )
    got = float64.attention_float64(q, k, v, 0.3, causal)
    np.testing.assert_allclose(got, expected[0, :, 0], rtol=1e-12, atol=1e-12)


def test_float64_reference_long_sequence_uses_blocks(rng):
    # 2**22 // seq_k rows per block: several blocks here, and the causal key range shrinks.
    seq = 5000
    q, k, v = (rng.standard_normal((seq, 8)) for _ in range(3))
    got = float64.attention_float64(q, k, v, 0.5, True)
    rows = [0, 837, 838, 2500, seq - 1]
    for i in rows:
        s = (k[: i + 1] @ q[i]) * 0.5
        p = np.exp(s - s.max())
        np.testing.assert_allclose(got[i], p @ v[: i + 1] / p.sum(), rtol=1e-10)


def test_reference_pairs_spread_and_budget():
    small = Problem(2, 128, 128, 4, 2, 64, True, "bf16")
    assert speed.reference_pairs(small, 0) == [(b, h) for b in range(2) for h in range(4)]
    pairs = speed.reference_pairs(small, 3)
    assert pairs[0] == (0, 0) and pairs[-1] == (1, 3) and len(pairs) == 3
    big = Problem(1, 16384, 16384, 16, 16, 128, True, "bf16")
    assert len(speed.reference_pairs(big, -1)) == 2  # the budget allows no more at 16K
    mid = Problem(16, 1024, 1024, 16, 16, 128, True, "bf16")
    assert len(speed.reference_pairs(mid, -1)) == 16


def test_relative_error_on_gqa_slices(rng):
    problem = Problem(2, 32, 48, 4, 2, 16, True, "bf16")
    q, k, v = random_qkv(rng, batch=2, seq_q=32, seq_k=48, heads_q=4, heads_kv=2, head_dim=16)
    ref = speed.compute_reference(problem, q, k, v, requested_pairs=0)
    exact, _ = naive_attention_f64(q, k, v, causal=True)
    err = speed.relative_error(jnp.asarray(exact, jnp.float32), ref)
    assert err["rel_l2"] < 1e-6 and err["finite"]
    # A wrong head mapping must show: swap the query heads.
    err = speed.relative_error(jnp.asarray(exact[:, :, ::-1], jnp.float32), ref)
    assert err["rel_l2"] > 0.1


def test_rotation_spans_the_requested_bytes():
    standard = Problem(16, 1024, 1024, 16, 16, 128, True, "bf16")
    assert standard.set_bytes == 4 * 16 * 1024 * 16 * 128 * 2
    assert speed.rotation_sets(standard, 256) == 2
    tiny = Problem(1, 128, 128, 4, 4, 128, True, "bf16")
    n = speed.rotation_sets(tiny, 256)
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
        _timing.cupti_kernel_time(
            lambda x: x,
            [(jnp.ones(4),)],
            min_samples=2,
            min_seconds=0,
            max_iterations_per_chunk=2,
            monitor=monitor,
        )


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
    timing = _timing.cupti_kernel_time(
        lambda x: x * 2,
        sets,
        min_samples=5,
        min_seconds=0,
        max_iterations_per_chunk=3,
        monitor=_timing.ClockMonitor(None),
    )
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


# ---- Timers of PyTorch peers (a stand-in torch: the bookkeeping, not CUDA)


class FakeEvent:
    clock = [0.0]

    def __init__(self, enable_timing):
        assert enable_timing
        self.at = None

    def record(self):
        FakeEvent.clock[0] += 1.0  # each record is 1 ms after the previous one
        self.at = FakeEvent.clock[0]

    def elapsed_time(self, end):
        return end.at - self.at


class FakeTorch:
    class cuda:
        Event = FakeEvent
        syncs = 0

        @staticmethod
        def synchronize():
            FakeTorch.cuda.syncs += 1


def test_torch_event_time_brackets_each_rotation(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", FakeTorch)
    calls = []
    sets = [(1,), (2,), (3,), (4,)]
    timing = _timing.torch_event_time(
        calls.append,
        sets,
        min_samples=5,
        min_seconds=0,
        monitor=_timing.ClockMonitor(None),
        samples_per_chunk=3,
    )
    # Two chunks of 3 samples; each sample spans one call per set, 1 ms between begin and end.
    assert timing.source == "cuda-events" and timing.calls_per_sample == 4
    assert timing.samples_ms == [1.0 / 4] * 6 and FakeTorch.cuda.syncs == 2
    assert calls == [1, 2, 3, 4] * 6


class NumpyPeer(peers.Peer):
    """A 'torch' peer computing exact attention in NumPy: measure_peer's PyTorch path, minus CUDA."""

    name = "numpy_torch_like"
    framework = "torch"

    def arguments(self, problem, inputs):
        return tuple(np.asarray(x, np.float32) for x in (inputs.q, inputs.k, inputs.v))

    def build(self, problem, options):
        def fn(q, k, v):
            group = q.shape[2] // k.shape[2]
            out = np.zeros(q.shape)
            for b in range(q.shape[0]):
                for h in range(q.shape[2]):
                    out[b, :, h] = float64.attention_float64(
                        q[b, :, h],
                        k[b, :, h // group],
                        v[b, :, h // group],
                        problem.softmax_scale,
                        problem.causal,
                    )
            return out

        return peers.Built(fn)

    def decode(self, raw, args):
        return raw


def test_measure_peer_times_torch_peers_with_events(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", FakeTorch)
    problem = Problem(1, 32, 32, 2, 1, 16, True, "bf16")
    sets = speed.make_input_sets(problem, "activations", 2, seed=3)
    ref = speed.compute_reference(problem, sets[0].q, sets[0].k, sets[0].v, 0)
    opts = speed.Options(
        iters=4, min_time_s=0, warmup_s=0, wall_rounds=2, cupti=True, cupti_mem_mb=1, max_rel_err=None
    )
    r = speed.measure_peer(NumpyPeer(), problem, sets, ref, opts, _timing.ClockMonitor(None))
    assert r["status"] == "ok", r
    assert r["rel_err"] < 1e-6 and r["max_rel_err"] == 2e-2 and r["framework"] == "torch"
    assert r["timing_source"] == "cuda-events" and r["kernel"]["samples"] >= 4 and r["wall"]["samples"] == 2


# ---- Peers


def test_peers_off_gpu_say_why():
    if ON_GPU:
        pytest.skip("checks the CPU behaviour")
    problem = Problem(1, 256, 256, 4, 4, 128, True, "bf16")
    for name in [
        "cudnn",
        "cudnn_fp8",
        "pallas",
        "torch_sdpa_cudnn",
        "torch_sdpa_flash",
        "flash_attn",
        "flash_attn3",
    ]:
        assert "GPU" in peers.PEERS[name].supports(problem), name
    for name in ["jzyfa", "jzyfa_xla", "jzyfa_fp8", "jzyfa_fp8_xla", "xla"]:
        assert peers.PEERS[name].supports(problem) is None, name
    fp8_problem = dataclasses_replace(problem, dtype="fp8")
    assert peers.PEERS["jzyfa_fp8_exact_p"].supports(fp8_problem) is None


def test_peer_limits():
    rectangle = Problem(1, 128, 256, 4, 4, 128, True, "bf16")
    assert "top-left" in peers.PEERS["xla"].supports(rectangle)
    assert peers.PEERS["xla"].supports(dataclasses_replace(rectangle, causal=False)) is None
    huge = Problem(1, 32768, 32768, 16, 16, 128, True, "bf16")
    assert "GiB" in peers.PEERS["xla"].supports(huge)
    assert peers.AUTO_FP8[0] == "jzyfa_fp8" and "jzyfa" in peers.auto_peers("fp8")
    assert "pallas" in peers.auto_peers("bf16") and "jzyfa_xla" not in peers.auto_peers("bf16")
    assert speed.resolve_impls("auto,jzyfa_xla,jzyfa", "bf16")[-1] == "jzyfa_xla"  # deduplicated
    with pytest.raises(ValueError, match="--impls"):
        speed.resolve_impls("jzyfa,nope", "bf16")


def dataclasses_replace(problem, **changes):
    import dataclasses

    return dataclasses.replace(problem, **changes)


def test_cudnn_fp8_params_and_decode():
    """Descales pass through, P uses e4m3's range, and scale_o = 1/descale_v makes O = out8 * descale_v."""
    pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    q = jnp.full((1, 4, 1, 16), 3.0, jnp.bfloat16)
    v = jnp.full((1, 4, 1, 16), 100.0, jnp.bfloat16)
    f = peers.quantize_qkv(q, q, v)
    params = peers.cudnn_fp8_params(f)
    assert set(params) == set(cudnn_attention.fp8_params_keys)
    assert all(p.shape == (1, 1, 1, 1) and p.dtype == jnp.float32 for p in params.values())
    assert float(params["scale_s"][0, 0, 0, 0]) == 448 and float(
        params["descale_s"][0, 0, 0, 0]
    ) == np.float32(1 / 448)
    assert float(params["descale_v"][0, 0, 0, 0]) == float(f.descale_v)
    assert float(params["scale_o"][0, 0, 0, 0]) * float(f.descale_v) == 1.0
    # Attention over equal values returns them: the e4m3 output is v8, decoded back to 100.
    out = peers.PEERS["cudnn_fp8"].decode(f.v, (f.q, f.k, f.v, params))
    assert np.allclose(np.asarray(out), 100.0, rtol=1 / 16)


def test_pallas_arguments_prescale_q_in_f16():
    problem = Problem(1, 128, 128, 2, 2, 64, True, "bf16")
    inputs = speed.make_input_sets(problem, "gaussian", 1, seed=0)[0]
    q, k, v = peers.PEERS["pallas"].arguments(problem, inputs)
    assert q.dtype == k.dtype == v.dtype == jnp.float16
    expected = np.asarray(inputs.q, np.float32) / 8.0
    np.testing.assert_allclose(np.asarray(q, np.float32), expected, rtol=1e-3, atol=1e-6)
    assert peers.PEERS["pallas"].compute_dtype(problem) == "f16"


@pytest.mark.parametrize("allow", [False, True])
def test_fp8_without_a_kernel_is_never_timed_as_jzyfa(monkeypatch, allow):
    """On a GPU (faked here) the FP8 peer asks for the kernel; where the plan has none (FP8 at head dim
    96): unsupported (saying why, and how to time the pure-JAX path), or with --allow_xla_fallback the
    pure-JAX path under a name that says so."""
    monkeypatch.setattr(peers, "_on_gpu", lambda: True)
    problem = Problem(1, 64, 64, 2, 2, 96, True, "fp8")
    sets = speed.make_input_sets(problem, "gaussian", 2, seed=0)
    ref = speed.compute_reference(problem, sets[0].q, sets[0].k, sets[0].v, 0)
    opts = quick_options(allow)
    r = speed.measure_peer(peers.PEERS["jzyfa_fp8"], problem, sets, ref, opts, _timing.ClockMonitor(None))
    if allow:
        assert r["status"] == "ok" and r["impl"] == "jzyfa_fp8[xla-fallback]" and r["path"] == "xla-fallback"
        assert r["compute_dtype"] == "fp8" and r["max_rel_err"] == 0.15 and r["rel_err"] < 0.15
    else:
        assert r["status"] == "unsupported" and "--allow_xla_fallback" in r["message"], r
        assert r["impl"] == "jzyfa_fp8" and r["tflops"] is None
    # The lean_p=False variant: unsupported either way (the pure-JAX path has no lean P to switch
    # off, so a fallback would time what jzyfa_fp8[xla-fallback] times).
    exact = speed.measure_peer(
        peers.PEERS["jzyfa_fp8_exact_p"], problem, sets, ref, opts, _timing.ClockMonitor(None)
    )
    assert exact["status"] == "unsupported" and exact["impl"] == "jzyfa_fp8_exact_p", exact
    assert ("no fallback for lean_p=False" if allow else "--allow_xla_fallback") in exact["message"]
    for unsupported in [exact] + ([] if allow else [r]):
        assert "head dim" in unsupported["message"], unsupported["message"]  # jzyfa's reason comes first


def test_fp8_peers_pass_lean_p(monkeypatch):
    """jzyfa_fp8 passes lean_p=True, jzyfa_fp8_exact_p lean_p=False; 16-bit jzyfa passes none. Off
    GPU both FP8 peers build jzyfa's default (pure-JAX FP8) path, as jzyfa does."""
    calls = record_flash_attention(monkeypatch)
    problem = Problem(1, 32, 32, 2, 2, 16, True, "fp8")
    inputs = speed.make_input_sets(problem, "gaussian", 1, seed=0)[0]
    for name, expected in [("jzyfa_fp8", True), ("jzyfa_fp8_exact_p", False), ("jzyfa", None)]:
        peer = peers.PEERS[name]
        built = peer.build(problem, peers.Options())
        assert built.path == "pure-JAX (no GPU)", name
        built.fn(*peer.arguments(problem, inputs))
        kwargs = calls.pop()
        assert kwargs["implementation"] is None and kwargs.get("lean_p", "absent") == (
            "absent" if expected is None else expected
        ), (name, kwargs)
        assert ("descale_q" in kwargs) == (expected is not None)
    assert "lean_p=False" in peers.PEERS["jzyfa_fp8_exact_p"].description
    assert "exp2 rounded to e4m3" in peers.PEERS["jzyfa_fp8_exact_p"].description
    assert "lean_p=True" in peers.PEERS["jzyfa_fp8"].description


def test_fp8_exact_p_runs_only_in_fp8_runs():
    peer = peers.PEERS["jzyfa_fp8_exact_p"]
    assert "jzyfa_fp8_exact_p" in peers.auto_peers("fp8")
    assert "jzyfa_fp8_exact_p" not in peers.auto_peers("bf16") + peers.auto_peers("f16")
    for dtype in ("bf16", "f16"):
        reason = peer.supports(Problem(1, 64, 64, 2, 2, 128, True, dtype))
        assert "--dtype fp8" in reason and dtype in reason
    problem = Problem(1, 64, 64, 2, 2, 128, True, "bf16")
    sets = speed.make_input_sets(problem, "gaussian", 1, seed=0)
    ref = speed.compute_reference(problem, sets[0].q, sets[0].k, sets[0].v, 0)
    opts = speed.Options(
        iters=2, min_time_s=0, warmup_s=0, wall_rounds=1, cupti=False, cupti_mem_mb=1, max_rel_err=None
    )
    r = speed.measure_peer(peer, problem, sets, ref, opts, _timing.ClockMonitor(None))
    assert r["status"] == "unsupported" and "--dtype fp8" in r["message"] and r["tflops"] is None


@pytest.mark.parametrize("name", ["jzyfa_fp8", "jzyfa_fp8_exact_p"])
def test_fp8_peers_build_the_kernel_call_where_the_plan_has_one(monkeypatch, name):
    """On a GPU (faked) the FP8 peers build the kernel call where `jzyfa.plan` has a kernel (head dim
    128); where it has none (head dim 96) the reason is jzyfa's."""
    monkeypatch.setattr(peers, "_on_gpu", lambda: True)
    peer = peers.PEERS[name]
    assert plan.kernel_for(plan.Config("fp8", (128, 128), "causal", "dense")) is not None
    assert peer.build(Problem(1, 64, 64, 2, 2, 128, True, "fp8"), peers.Options()).path == "kernel"
    with pytest.raises(peers.Unsupported, match="head dim"):
        peer.build(Problem(1, 64, 64, 2, 2, 96, True, "fp8"), peers.Options())


def test_fp8_sets_quantize_once():
    problem = Problem(1, 32, 32, 2, 2, 16, False, "fp8")
    inputs = speed.make_input_sets(problem, "gaussian", 1, seed=1)[0]
    assert inputs.q.dtype == jnp.bfloat16  # FP8 runs start from bf16
    f = inputs.fp8()
    assert f is inputs.fp8() and f.q.dtype == jnp.float8_e4m3fn and f.descale_q.shape == ()
    back = np.asarray(f.q, np.float32) * float(f.descale_q)
    np.testing.assert_allclose(
        back, np.asarray(inputs.q, np.float32), rtol=2**-3, atol=float(f.descale_q) * 2**-6
    )
    assert problem.set_bytes == 3 * 32 * 2 * 16 + 2 * 32 * 2 * 16  # e4m3 inputs, bf16 output


# ---- Reports


def _fake_result(**overrides):
    return fake_result(**overrides)


ENV = {
    "date": "2026-11-29T12:00:00+00:00",
    "device": "NVIDIA H200",
    "compute_capability": "9.0",
    "driver": "580.1",
    "sm_clock_max_mhz": 1980.0,
    "power_limit_w": 700.0,
    "jax": "0.11.2",
    "jaxlib": "0.11.2",
    "cuda": {"cudnn": 91900},
    "jzyfa": {},
}
CONFIG = {"dtype": "bf16", "head_dim": 128, "heads": 32, "kv_heads": 8, "causal": True}


def _results():
    return [
        _fake_result(),
        _fake_result(
            impl="cudnn",
            status="error",
            message="RuntimeError: cuDNN is not detected.",
            median_ms=None,
            tflops=None,
            sm_clock_mhz=None,
            rel_err=None,
            wall=None,
            timing_source=None,
        ),
        _fake_result(impl="jzyfa", inputs="activations", tflops=701.0, seq_q=16384, seq_k=16384, batch=1),
        _fake_result(
            impl="torch_sdpa_cudnn",
            inputs="activations",
            tflops=650.0,
            timing_source="cuda-events",
            notes="layout",
        ),
    ]


def test_tables():
    results = _results()
    plain = speed.format_plain(results)
    assert "32/8" in plain and "733" in plain and "1755" in plain and "cuDNN is not" in plain
    assert "activations" in plain and "bf16" in plain
    markdown = speed.format_markdown(results, ENV, CONFIG)
    assert "| impl | 2x8192 |" in markdown and "| impl | 1x16384 | 2x8192 |" in markdown
    assert "| jzyfa | 733 (1755 MHz) |" in markdown and "| cudnn | error |" in markdown
    assert "TFLOP/s on gaussian inputs" in markdown and "TFLOP/s on activations inputs" in markdown
    assert "CUDA-event time / CUPTI kernel time" in markdown and "32 heads (8 kv heads)" in markdown
    assert (
        "2026-11-29" in markdown and "max SM clock 1980 MHz" in markdown and "power limit 700 W" in markdown
    )
    assert "- torch_sdpa_cudnn: layout" in markdown
    # No power reading (as on a GPU whose nvidia-smi says [N/A]): the W column says n/a.
    w = speed.TABLE_COLUMNS.index("W")
    assert speed.TABLE_COLUMNS[w - 1] == "SM MHz"
    assert [row[w] for row in speed.table_rows(results)] == ["n/a"] * 4
    assert "(SM clock during the timed loop)" in markdown


def test_tables_with_board_power():
    results = _results()
    results[0]["board_power_w"] = 690.4
    plain = speed.format_plain(results)
    header, _, first = plain.splitlines()[:3]
    assert header.split()[header.split().index("MHz") + 1] == "W"
    assert first.split()[speed.TABLE_COLUMNS.index("W")] == "690"  # one word per cell in data rows
    markdown = speed.format_markdown(results, ENV, CONFIG)
    assert "| jzyfa | 733 (1755 MHz, 690 W) |" in markdown
    assert "TFLOP/s on gaussian inputs (SM clock and board power during the timed loop)" in markdown
    assert "| jzyfa | 701 (1755 MHz) |" in markdown  # activations: no reading, no "W"
    assert "SM 1755 MHz, 690 W" in speed.progress_line(results[0])
    assert "SM 1755 MHz, n/a W" in speed.progress_line(results[2])
    no_clock = _fake_result(sm_clock_mhz=None)
    assert "SM n/a MHz, n/a W" in speed.progress_line(no_clock)
    assert "| jzyfa | 733 |" in speed.format_markdown([no_clock], ENV, CONFIG)


def test_plot_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    assert speed.write_plot(_results(), ENV, CONFIG, str(path)) == 3  # the error has no point
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_plot_without_matplotlib_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    with pytest.raises(speed.PlotUnavailable, match="pip install matplotlib"):
        speed.write_plot(_results(), ENV, CONFIG, str(tmp_path / "x.png"))
    assert not (tmp_path / "x.png").exists()


# ---- The command


RESULT_KEYS = {
    "impl", "peer", "description", "notes", "framework", "path", "inputs", "batch", "seq_q", "seq_k", "heads_q",
    "heads_kv", "head_dim", "causal", "dtype", "compute_dtype", "flops", "input_sets", "status", "message",
    "rel_err", "max_abs_err", "max_rel_err", "err_ok", "median_ms", "tflops", "timing_source", "sm_clock_mhz",
    "board_power_w", "kernel", "kernel_unavailable", "wall", "wall_tflops", "reference_pairs",
}  # fmt: skip


def test_smoke_run_writes_sane_json(tmp_path):
    """The command as a user runs it, in smoke mode on this machine, on both input kinds."""
    out = tmp_path / "bench.json"
    png = tmp_path / "bench.png"
    impls = "jzyfa,cudnn,xla,pallas,torch_sdpa_cudnn,flash_attn3,cudnn_fp8,jzyfa_fp8,jzyfa_fp8_exact_p"
    proc = run_bench("--smoke", "--kv_heads", "2", "--shapes", "2x128,1x96x160",
           "--impls", impls, "--inputs", "gaussian,activations", "--markdown", f"--json_out={out}",
           f"--plot={png}")  # fmt: skip
    has_matplotlib = importlib_find("matplotlib")
    assert proc.returncode == (0 if has_matplotlib else 3), proc.stderr[-3000:]
    assert "| impl |" in proc.stdout and "TFLOP/s on activations inputs" in proc.stdout
    assert "[jzyfa.bench] [18/36]" in proc.stderr  # progress lines
    if has_matplotlib:
        assert png.read_bytes()[:4] == b"\x89PNG"
    else:
        assert "pip install matplotlib" in proc.stderr

    report = json.loads(out.read_text())
    assert set(report) == {"env", "config", "impls", "skipped_inputs", "results"}
    assert report["env"]["jax"] == jax.__version__ and "packages" in report["env"]
    assert report["config"]["smoke"] is True and report["impls"] == impls.split(",")
    results = {(r["inputs"], r["peer"], r["seq_q"], r["seq_k"]): r for r in report["results"]}
    assert len(results) == 2 * 2 * 9
    for (kind, peer, seq_q, seq_k), r in results.items():
        assert set(r) >= RESULT_KEYS, RESULT_KEYS - set(r)
        assert r["heads_q"] == 4 and r["heads_kv"] == 2 and r["causal"] is True
        assert r["flops"] == attention_flops(r["batch"], seq_q, seq_k, 4, 128, True)
        if peer == "jzyfa_fp8_exact_p":  # a bf16 run
            assert r["status"] == "unsupported" and "--dtype fp8" in r["message"]
            continue
        if not ON_GPU and peer in ("cudnn", "pallas", "torch_sdpa_cudnn", "flash_attn3", "cudnn_fp8"):
            assert r["status"] == "unsupported" and "GPU" in r["message"]
            continue
        if peer not in ("jzyfa", "jzyfa_fp8", "flash_attn3") and seq_q != seq_k:
            assert r["status"] == "unsupported" and "top-left" in r["message"]
            continue
        if peer == "jzyfa" and ON_GPU and not jzyfa.kernel_available():
            # On a GPU the bench times the kernel or reports why not; it never falls back.
            assert r["status"] == "error" and "kernel" in r["message"]
            continue
        if peer == "jzyfa_fp8" and ON_GPU:
            assert r["status"] in ("ok", "unsupported")  # unsupported until the FP8 kernel exists
            continue
        if r["status"] == "unsupported":  # optional GPU peers that are not installed
            assert ON_GPU and peer in ("torch_sdpa_cudnn", "flash_attn3")
            continue
        assert r["status"] == "ok", r
        assert 0 <= r["rel_err"] < (0.15 if peer.endswith("fp8") else 1e-2)
        assert r["median_ms"] > 0 and r["tflops"] > 0
        assert r["wall"]["median_ms"] > 0 and r["wall"]["samples"] >= 1
        if not ON_GPU:
            assert r["timing_source"] == "wall" and r["sm_clock_mhz"] is None and r["kernel"] is None
            assert r["board_power_w"] is None
            assert r["path"] == "pure-JAX (no GPU)" if peer.startswith("jzyfa") else r["path"] is None


def importlib_find(name):
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_model_inputs_are_reported_unavailable(tmp_path):
    proc = run_bench("--smoke", "--inputs", "model", "--shapes", "1x64", "--impls", "jzyfa")
    assert proc.returncode != 0
    assert "no installable package ships a causal language model" in proc.stderr




def test_nocausal_run_in_process():
    """Flags parsed as the command does; the report of a non-causal f16 run."""
    config = resolve_config(["--smoke", "--nocausal", "--dtype", "f16", "--shapes", "1x64", "--inputs", "gaussian",
                       "--impls", "jzyfa,jzyfa_xla", "--iters", "2", "--min_time_s", "0"])  # fmt: skip
    assert config["heads"] == 4 and config["max_rel_err"] is None  # smoke default; per-peer thresholds
    report = speed.run(config)
    for r in report["results"]:
        assert r["status"] == "ok", r
        assert r["flops"] == 4 * 1 * 4 * 64 * 64 * 128
        assert r["rel_err"] < 5e-3 and r["max_rel_err"] == 5e-3 and r["compute_dtype"] == "f16"


def test_fp8_run_in_process():
    config = resolve_config(["--smoke", "--dtype", "fp8", "--shapes", "1x128", "--inputs", "activations",
                       "--iters", "2"])  # fmt: skip
    report = speed.run(config)
    by_peer = {r["peer"]: r for r in report["results"]}
    assert list(by_peer) == peers.AUTO_FP8
    fp8, bf16 = by_peer["jzyfa_fp8"], by_peer["jzyfa"]
    exact = by_peer["jzyfa_fp8_exact_p"]
    if not ON_GPU:
        assert fp8["status"] == "ok" and fp8["compute_dtype"] == "fp8" and fp8["dtype"] == "fp8"
        # Both are measured against float64 attention on the same unquantized inputs.
        assert bf16["rel_err"] < 1e-2 < fp8["rel_err"] < 0.15
        # Off GPU the lean_p=False peer runs the same pure-JAX FP8 path (it has no lean P).
        assert exact["status"] == "ok" and exact["path"] == fp8["path"] == "pure-JAX (no GPU)"
        assert exact["rel_err"] == pytest.approx(fp8["rel_err"], rel=1e-6)
    else:
        # The plan has FP8 at head dim 128: timed where the kernel runs, else unsupported saying why.
        expected = "ok" if jzyfa.kernel_available() else "unsupported"
        assert exact["status"] == fp8["status"] == expected, (exact, fp8)


class PowerClock:
    """A clock reader as on a GPU: a constant SM clock, and the board power or None ([N/A])."""

    source = "fake-power"

    def __init__(self, watts):
        self.watts = watts

    def read(self):
        return 1560.0, self.watts

    def close(self):
        pass


@pytest.mark.parametrize("watts", [655.0, None])
def test_board_power_reaches_json_and_tables(monkeypatch, watts):
    """The median board power of the timed loop goes into each result, the JSON, both tables and
    the progress line; a reader without power gives None, shown as n/a."""
    monkeypatch.setattr(_timing, "open_clock_reader", lambda device=None: PowerClock(watts))
    config = resolve_config(["--smoke", "--shapes", "1x64", "--inputs", "gaussian", "--impls", "jzyfa_xla,cudnn",
                       "--iters", "2", "--min_time_s", "0"])  # fmt: skip
    report = json.loads(json.dumps(bench_report.json_safe(speed.run(config)), allow_nan=False))  # as main writes it
    timed, other = report["results"]
    assert timed["status"] == "ok" and timed["sm_clock_mhz"] == 1560.0 and timed["board_power_w"] == watts
    clock = timed["wall"]["sm_clock"]
    assert clock["source"] == "fake-power" and clock["median_watts"] == watts
    assert clock["min_watts"] == clock["max_watts"] == watts
    w = speed.TABLE_COLUMNS.index("W")
    shown = "n/a" if watts is None else "655"
    assert speed.table_rows(report["results"])[0][w] == shown
    assert speed.table_rows(report["results"])[1][w] == "n/a"  # no timed loop
    markdown = speed.format_markdown(report["results"], report["env"], config)
    cell = next(line for line in markdown.splitlines() if line.startswith("| jzyfa_xla | "))
    assert cell.endswith("(1560 MHz, 655 W) |" if watts else "(1560 MHz) |"), cell
    assert f"SM 1560 MHz, {shown} W" in speed.progress_line(timed)
    if ON_GPU:
        return
    assert other["status"] == "unsupported" and other["board_power_w"] is None


def test_replot_draws_a_saved_report_without_measuring(tmp_path):
    """--replot: the tables and the PNG of an earlier run's JSON, with no GPU and no timing."""
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "bench.json", tmp_path / "again.png"
    run = [sys.executable, "-m", "jzyfa.bench", "--smoke", "--shapes", "2x128,1x256", "--impls", "jzyfa,xla",
           f"--json_out={out}"]  # fmt: skip
    subprocess.run(run, check=True, capture_output=True, text=True)
    saved = json.loads(out.read_text())
    again = subprocess.run(
        [sys.executable, "-m", "jzyfa.bench", f"--replot={out}", f"--plot={png}", "--markdown"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| jzyfa |" in again.stdout and "| xla |" in again.stdout
    assert f"({len([r for r in saved['results'] if r['tflops'] is not None])} points)" in again.stderr


def test_top_kernel_ms_is_the_longest_kernel():
    result = {"kernel": {"kernels": [{"name": "a", "ms_per_call": 0.02}, {"name": "b", "ms_per_call": 0.14}]}}
    assert speed.top_kernel_ms(result) == 0.14
    assert speed.top_kernel_ms({"kernel": None}) is None  # no CUPTI (wall-clock or smoke runs)
    assert speed.top_kernel_ms({}) is None


def test_fp8_v_layout_flag_sets_the_variable_for_the_run_only(monkeypatch):
    """--fp8_v_layout reaches the config, and run() holds JZYFA_FP8_V_LAYOUT at it while it traces and
    times (recorded in the report's env), then restores what was there."""
    FP8_V_LAYOUT_ENV = plan.FP8_V_LAYOUT_ENV
    assert resolve_config(["--fp8_v_layout", "staged"])["fp8_v_layout"] == "staged"
    assert resolve_config([])["fp8_v_layout"] is None
    monkeypatch.delenv(FP8_V_LAYOUT_ENV, raising=False)
    with speed.fp8_v_layout("transposed"):
        assert os.environ[FP8_V_LAYOUT_ENV] == "transposed"
        assert speed._jzyfa_status()["fp8_v_layout_env"] == "transposed"
    assert FP8_V_LAYOUT_ENV not in os.environ
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "staged")
    with speed.fp8_v_layout("transposed"):
        assert os.environ[FP8_V_LAYOUT_ENV] == "transposed"
    assert os.environ[FP8_V_LAYOUT_ENV] == "staged"
    with speed.fp8_v_layout(None):
        assert os.environ[FP8_V_LAYOUT_ENV] == "staged"


# ---- The package


@pytest.mark.parametrize("module", ["jzyfa.bench", "jzyfa.bench.accuracy", "jzyfa.bench.overhead"])
def test_help_exits_0(module):
    proc = run_bench("--help", module=module, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--markdown" in proc.stdout and (module == "jzyfa.bench.overhead" or "--json_out" in proc.stdout)


# What the bench may import of jzyfa: the package's top-level names and its public modules.
PUBLIC_MODULES = {
    "jzyfa", "jzyfa.plan", "jzyfa.reference", "jzyfa.varlen", "jzyfa.fp8_emulation", "jzyfa.int8_emulation", "jzyfa.fp8_layout",
    "jzyfa.quantize", "jzyfa.merge", "jzyfa.sequence_layout", "jzyfa.e4m3_codes",
}  # fmt: skip


def test_the_bench_uses_the_public_api_only():
    """jzyfa/bench/ imports jzyfa's public modules and top-level names only, reads no private
    attribute of jzyfa, and names no kill switch."""
    import ast
    import pathlib

    package = pathlib.Path(REPO, "jzyfa", "bench")
    texts = {path.name: path.read_text() for path in sorted(package.glob("*.py"))}
    for name, text in texts.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module == "jzyfa":
                modules = [f"jzyfa.{a.name}" for a in node.names if a.name not in jzyfa.__all__]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jzyfa"):
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names if a.name.startswith("jzyfa")]
            else:
                continue
            for module in modules:
                assert module in PUBLIC_MODULES or module.startswith("jzyfa.bench"), (name, module)
        for attribute in re.findall(r"\bjzyfa\.(\w+)", text):
            assert attribute in jzyfa.__all__ or f"jzyfa.{attribute}" in PUBLIC_MODULES or attribute in (
                "bench", "handler_calls"
            ), (name, attribute)
        assert not re.search(r"UNVERIFIED|_VERIFIED", text), name
