"""`python -m jzyfa.bench --window L,R`: the windowed FLOP count, the windowed float64 reference, the
peers' windows and skip reasons, the reports, the flag's errors and a smoke run."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64, random_qkv, visible_f64
from bench_helpers import fake_result, quick_options, record_flash_attention, resolve_config, run_bench

from jzyfa import plan
from jzyfa.bench import float64, peers, speed
from jzyfa.bench import timing as _timing
from jzyfa.bench.problem import Problem, attention_flops, mask_window, parse_window, visible_pairs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ON_GPU = jax.default_backend() == "gpu"

WINDOWS = [(0, 0), (-1, 0), (5, -1), (-1, -1), (0, -1), (-1, 0), (-1, 3), (3, 2), (1, 0), (7, 7), (100, 100)]
LENGTHS = [(1, 1), (7, 7), (1, 9), (5, 12), (12, 5), (64, 16), (16, 64), (37, 37)]


# ---- FLOPs


@pytest.mark.parametrize("seq_q,seq_k", LENGTHS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
def test_windowed_visible_pairs_match_the_mask(seq_q, seq_k, window, causal):
    expected = int(visible_f64(seq_q, seq_k, causal=causal, window=window).sum())
    assert visible_pairs(seq_q, seq_k, causal, window) == expected
    flops = attention_flops(3, seq_q, seq_k, 5, 64, causal, window)
    assert flops == 4 * 64 * expected * 3 * 5


@pytest.mark.parametrize("seq_q,seq_k", LENGTHS)
def test_causal_window_counts_the_causal_pairs(seq_q, seq_k):
    causal_pairs = visible_pairs(seq_q, seq_k, True)
    assert visible_pairs(seq_q, seq_k, False, (-1, 0)) == causal_pairs
    assert visible_pairs(seq_q, seq_k, True, (-1, -1)) == causal_pairs  # causal sets right to 0
    assert visible_pairs(seq_q, seq_k, False, (-1, -1)) == seq_q * seq_k


def test_windowed_flops_count_pairs_not_the_halving_convention():
    # A window equal to causal counts the S(S+1)/2 pairs; without --window the convention's S^2/2 stays.
    s = 1024
    assert attention_flops(2, s, s, 16, 128, True, (-1, 0)) == 4 * 2 * 16 * 128 * s * (s + 1) // 2
    assert attention_flops(2, s, s, 16, 128, True) == 4 * 2 * 16 * 128 * s * s / 2
    # (1024, 0) at 16K: every row but the first 1024 sees 1025 keys.
    s, w = 16384, 1024
    pairs = (s - w) * (w + 1) + (w * (w + 1)) // 2
    assert attention_flops(1, s, s, 16, 128, True, (w, 0)) == 4 * 16 * 128 * pairs
    problem = Problem(1, s, s, 16, 16, 128, True, "bf16", (w, 0))
    assert problem.flops == 4 * 16 * 128 * pairs


def test_visible_pairs_is_linear_in_seq_q():
    # Long sequences count by arithmetic per row, without a Sq x Sk mask (this would be 8 TB).
    s = 2**21
    assert visible_pairs(s, s, False, (0, 0)) == s
    assert visible_pairs(s, s, True, (1, 1)) == 2 * s - 1


# ---- The flag


@pytest.mark.parametrize(
    "text,expected",
    [
        ("1024,0", (1024, 0)),
        (" -1 , 0 ", (-1, 0)),
        ("5,-1", (5, -1)),
        ("0,0", (0, 0)),
        (None, None),
        ("", None),
    ],
)
def test_parse_window(text, expected):
    assert parse_window(text) == expected


@pytest.mark.parametrize("bad", ["64", "a,b", "-2,0", "0,-5", "1,2,3", "1.5,0", ",", "64,"])
def test_parse_window_errors_name_the_flag(bad):
    with pytest.raises(ValueError, match="--window: .* two integers >= -1"):
        parse_window(bad)


def test_config_holds_the_window():
    assert resolve_config(["--smoke", "--window", "64,0"])["window"] == [64, 0]
    assert resolve_config(["--smoke"])["window"] is None
    with pytest.raises(ValueError, match="--window"):
        resolve_config(["--smoke", "--window", "64"])


def test_bad_window_fails_before_any_work():
    proc = run_bench("--smoke", "--window", "64,-3", "--shapes", "1x64")
    assert proc.returncode != 0
    assert "--window: '64,-3' is not L,R with two integers >= -1" in proc.stderr, proc.stderr[-2000:]
    assert "[jzyfa.bench]" not in proc.stderr  # nothing was set up or measured


# ---- The float64 reference


@pytest.mark.parametrize("seq_q,seq_k", [(37, 37), (5, 61), (61, 5)])
@pytest.mark.parametrize("window", [(0, 0), (-1, 0), (5, -1), (3, 2), (-1, 4), (0, -1)])
@pytest.mark.parametrize("causal", [False, True])
def test_windowed_reference_matches_the_oracle(rng, seq_q, seq_k, window, causal):
    q, k, v = (rng.standard_normal((s, 16)) for s in (seq_q, seq_k, seq_k))
    expected, _ = naive_attention_f64(
        q[None, :, None], k[None, :, None], v[None, :, None], causal=causal, softmax_scale=0.3, window=window
    )
    mask = mask_window(causal, window)
    got = float64.attention_float64(q, k, v, 0.3, False, window=mask)
    np.testing.assert_allclose(got, expected[0, :, 0], rtol=1e-12, atol=1e-12)


def test_windowed_reference_long_sequence_uses_blocks(rng):
    # 2**22 // 3000 = 1398 rows per block: three blocks, each with its own key range.
    seq, left = 3000, 100
    q, k, v = (rng.standard_normal((seq, 8)) for _ in range(3))
    got = float64.attention_float64(q, k, v, 0.5, False, window=(left, 0))
    for i in [0, 99, 100, 1397, 1398, 1500, 2796, seq - 1]:
        lo = max(0, i - left)
        s = (k[lo : i + 1] @ q[i]) * 0.5
        p = np.exp(s - s.max())
        np.testing.assert_allclose(got[i], p @ v[lo : i + 1] / p.sum(), rtol=1e-10)


@pytest.mark.parametrize("causal,window", [(True, (7, 7)), (False, (7, 7)), (False, (0, -1))])
def test_compute_reference_applies_the_window(rng, causal, window):
    problem = Problem(2, 32, 48, 4, 2, 16, causal, "bf16", window)
    q, k, v = random_qkv(rng, batch=2, seq_q=32, seq_k=48, heads_q=4, heads_kv=2, head_dim=16)
    ref = speed.compute_reference(problem, q, k, v, requested_pairs=0)
    exact, _ = naive_attention_f64(q, k, v, causal=causal, window=window)
    err = speed.relative_error(jnp.asarray(exact, jnp.float32), ref)
    assert err["rel_l2"] < 1e-6 and err["finite"]
    unwindowed, _ = naive_attention_f64(q, k, v, causal=causal)
    assert speed.relative_error(jnp.asarray(unwindowed, jnp.float32), ref)["rel_l2"] > 0.1


def test_reference_budget_counts_the_window():
    full = Problem(1, 16384, 16384, 16, 16, 128, True, "bf16")
    narrow = dataclasses.replace(full, window=(1024, 0))
    assert len(speed.reference_pairs(full, -1)) == 2 and len(speed.reference_pairs(narrow, -1)) == 16


# ---- Peers


def _problem(window, causal=True, seq_q=256, seq_k=256, dtype="bf16"):
    return Problem(1, seq_q, seq_k, 4, 4, 128, causal, dtype, window)


def test_problem_mask():
    p = _problem((64, 64))
    assert p.mask == (64, 0) and p.sliding_window == (64, 0) and not p.mask_causal
    p = _problem((64, 64), causal=False)
    assert p.mask == (64, 64) and p.sliding_window == (64, 64)
    # Windows that are causal or no mask for these lengths: no sliding window.
    assert _problem((8192, 0)).sliding_window is None and _problem((8192, 0)).mask_causal
    assert _problem((-1, 0), causal=False).mask_causal
    assert _problem((300, 300), causal=False).sliding_window is None
    assert not _problem((300, 300), causal=False).mask_causal
    assert _problem(None).mask_causal and not _problem(None, causal=False).mask_causal


NO_WINDOW_PEERS = ["pallas", "torch_sdpa_cudnn", "torch_sdpa_flash", "flash_attn", "flash_attn3"]


@pytest.mark.parametrize("window,causal", [((64, 0), True), ((64, 64), False), ((0, -1), False)])
def test_peers_without_windows_say_so(window, causal):
    problem = _problem(window, causal)
    for name in NO_WINDOW_PEERS:
        reason = peers.PEERS[name].supports(problem)
        assert reason.startswith("no sliding window") and str(problem.sliding_window) in reason, (
            name,
            reason,
        )
    fp8 = dataclasses.replace(problem, dtype="fp8")
    for name in ["cudnn_fp8", "flash_attn3_fp8"]:
        assert peers.PEERS[name].supports(fp8).startswith("no sliding window"), name
    for name in ["jzyfa", "jzyfa_xla"]:
        assert peers.PEERS[name].supports(problem) is None, name
    for name in ["jzyfa_fp8", "jzyfa_fp8_xla", "jzyfa_fp8_exact_p"]:
        assert peers.PEERS[name].supports(fp8) is None, name


def test_windows_equal_to_causal_run_everywhere():
    """A window that is causal for these lengths is no sliding window: peers run their causal mask."""
    problem = _problem((8192, 0))
    for name in NO_WINDOW_PEERS + ["cudnn"]:
        reason = peers.PEERS[name].supports(problem)
        assert reason is None or "sliding window" not in reason, (name, reason)
    assert peers.jax_nn_mask(problem, "cudnn") == (True, None)
    assert peers.jax_nn_mask(_problem((-1, -1), causal=False), "xla") == (False, None)


def test_jax_nn_windows():
    # cuDNN: only (left, 0), as is_causal=True with its sliding_window_length = left + 1.
    assert peers.jax_nn_mask(_problem((64, 0)), "cudnn") == (True, (64, 0))
    assert peers.jax_nn_mask(_problem((64, 9)), "cudnn") == (True, (64, 0))  # causal: right 0
    for window in [(64, 64), (64, -1), (-1, 3)]:
        reason = peers.jax_nn_mask(_problem(window, causal=False), "cudnn")
        assert "only sliding windows (left, 0)" in reason, window
        assert "only sliding windows (left, 0)" in peers.PEERS["cudnn"].supports(
            _problem(window, causal=False)
        )
    # XLA: any window, unbounded sides as seq_k.
    assert peers.jax_nn_mask(_problem((64, 64), causal=False), "xla") == (False, (64, 64))
    assert peers.jax_nn_mask(_problem((64, -1), causal=False), "xla") == (False, (64, 256))
    assert peers.jax_nn_mask(_problem((-1, 3), causal=False), "xla") == (False, (256, 3))
    # Top-left alignment: no sliding windows on rectangles.
    rectangle = _problem((16, 0), seq_q=128, seq_k=256)
    for name in ["xla", "cudnn"]:
        assert "top-left" in peers.jax_nn_mask(rectangle, name)
        assert "top-left" in peers.PEERS[name].supports(rectangle)
        with pytest.raises(peers.Unsupported, match="top-left"):
            peers.PEERS[name].build(rectangle, peers.Options())


def test_jzyfa_peers_pass_the_window(monkeypatch):
    calls = record_flash_attention(monkeypatch)
    for dtype, names in [("bf16", ["jzyfa", "jzyfa_xla"]), ("fp8", ["jzyfa_fp8", "jzyfa_fp8_xla"])]:
        problem = Problem(1, 32, 32, 2, 2, 16, True, dtype, (4, 4))
        inputs = speed.make_input_sets(problem, "gaussian", 1, seed=0)[0]
        for name in names:
            peer = peers.PEERS[name]
            peer.build(problem, peers.Options()).fn(*peer.arguments(problem, inputs))
            kwargs = calls.pop()
            assert kwargs["window"] == (4, 4) and kwargs["causal"] is True, (name, kwargs)
    problem = Problem(1, 32, 32, 2, 2, 16, True, "bf16")
    inputs = speed.make_input_sets(problem, "gaussian", 1, seed=0)[0]
    peers.PEERS["jzyfa"].build(problem, peers.Options()).fn(*peers.PEERS["jzyfa"].arguments(problem, inputs))
    assert "window" not in calls.pop()  # without --window, the call is unchanged


@pytest.mark.parametrize("allow", [False, True])
def test_fp8_window_without_a_kernel(monkeypatch, allow):
    """On a GPU (faked), a sliding window where the plan has no FP8 kernel for it (MLA's head dims take
    none and causal only): unsupported, or with --allow_xla_fallback the pure-JAX FP8 path as
    jzyfa_fp8[xla-fallback]; against the windowed reference."""
    monkeypatch.setattr(peers, "_on_gpu", lambda: True)
    assert plan.kernel_for(plan.Config("fp8", plan.MLA_HEAD_DIMS, "window", "dense")) is None
    problem = Problem(1, 128, 128, 2, 2, 192, True, "fp8", (16, 0), head_dim_v=128)
    sets = speed.make_input_sets(problem, "gaussian", 2, seed=0)
    ref = speed.compute_reference(problem, sets[0].q, sets[0].k, sets[0].v, 0)
    r = speed.measure_peer(
        peers.PEERS["jzyfa_fp8"], problem, sets, ref, quick_options(allow), _timing.ClockMonitor(None)
    )
    if allow:
        assert r["status"] == "ok" and r["impl"] == "jzyfa_fp8[xla-fallback]" and r["rel_err"] < 0.15, r
        assert r["window"] == [16, 0]
    else:
        assert r["status"] == "unsupported" and "window" in r["message"], r
        assert "--allow_xla_fallback" in r["message"] and r["tflops"] is None


def test_xla_and_jzyfa_windows_match_the_reference():
    """jax.nn's XLA attention with the translated window, and jzyfa, against the windowed float64."""
    for causal, window in [(False, (3, 2)), (False, (0, -1)), (True, (5, 5))]:
        problem = Problem(1, 64, 64, 2, 1, 32, causal, "bf16", window)
        sets = speed.make_input_sets(problem, "gaussian", 2, seed=1)
        ref = speed.compute_reference(problem, sets[0].q, sets[0].k, sets[0].v, 0)
        for name in ["xla", "jzyfa"]:
            r = speed.measure_peer(
                peers.PEERS[name], problem, sets, ref, quick_options(), _timing.ClockMonitor(None)
            )
            assert r["status"] == "ok" and r["rel_err"] < 1e-2, (name, window, r)


# ---- Reports


def _fake_result(**overrides):
    sizes = {"batch": 1, "seq_q": 16384, "seq_k": 16384, "heads_q": 16, "heads_kv": 16}
    return fake_result(**{**sizes, "window": [1024, 0], "tflops": 500.0, **overrides})


ENV = {"date": "2026-11-30T12:00:00+00:00", "device": "NVIDIA H200", "jax": "0.12.0", "jaxlib": "0.12.0"}


def test_tables_show_the_window():
    config = {
        "dtype": "bf16",
        "head_dim": 128,
        "heads": 16,
        "kv_heads": None,
        "causal": True,
        "window": [1024, 64],
    }
    results = [_fake_result()]
    markdown = speed.format_markdown(results, ENV, config)
    assert "causal, window (1024, 0) (left, right)" in markdown.splitlines()[0]
    assert "FLOPs 4 * D per visible (query, key) pair" in markdown and "counted half" not in markdown
    assert "| win(1024,0) |" in markdown
    plain = speed.format_plain(results)
    assert plain.splitlines()[2].split()[speed.TABLE_COLUMNS.index("causal")] == "win(1024,0)"
    assert " causal window (1024, 0): err" in speed.progress_line(results[0])
    # Without a window nothing changes.
    old = dict(config, window=None)
    assert "causal FLOPs counted half" in speed.format_markdown([_fake_result(window=None)], ENV, old)
    assert "window" not in speed.progress_line(_fake_result(window=None))


# ---- The command


def test_smoke_run_with_a_window(tmp_path):
    out = tmp_path / "bench.json"
    impls = "jzyfa,jzyfa_xla,xla,cudnn,pallas,torch_sdpa_cudnn,flash_attn3"
    proc = run_bench("--smoke", "--window", "64,0", "--shapes", "2x128,1x96x160",
           "--impls", impls, "--inputs", "gaussian", "--markdown", f"--json_out={out}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "window (64, 0) (left, right)" in proc.stdout.splitlines()[0]
    assert "| win(64,0) |" in proc.stdout
    assert "causal window (64, 0): err" in proc.stderr  # progress lines
    report = json.loads(out.read_text())
    assert report["config"]["window"] == [64, 0]
    rows = {(r["peer"], r["seq_q"], r["seq_k"]): r for r in report["results"]}
    assert len(rows) == 2 * 7
    for (peer, seq_q, seq_k), r in rows.items():
        assert r["window"] == [64, 0] and r["causal"] is True
        assert r["flops"] == attention_flops(r["batch"], seq_q, seq_k, 4, 128, True, (64, 0))
        assert r["flops"] < attention_flops(r["batch"], seq_q, seq_k, 4, 128, True)
        if peer in ("jzyfa", "jzyfa_xla") or (peer == "xla" and seq_q == seq_k):
            assert r["status"] == "ok" and r["rel_err"] < 1e-2, r
        elif peer == "xla":
            assert r["status"] == "unsupported" and "top-left" in r["message"]
        elif peer in ("pallas", "torch_sdpa_cudnn", "flash_attn3"):
            assert r["status"] == "unsupported" and r["message"].startswith("no sliding window"), r
        elif not ON_GPU:  # cudnn
            assert r["status"] == "unsupported" and ("GPU" in r["message"] or "top-left" in r["message"])
