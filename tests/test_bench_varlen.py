"""`python -m jzyfa.bench --varlen L1,L2,...`: one packed batch timed through flash_attention_varlen.

The FLOP count (the sum of the dense problems per sequence), the packed inputs, the float64 reference
against the oracle, the peers' skip reasons, the jzyfa peers' calls, the reports, the flag's errors
and a smoke run."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_varlen_f64
from bench_helpers import fake_result, quick_options, resolve_config, run_bench

import jzyfa
from jzyfa.bench import inputs as bench_inputs
from jzyfa.bench import peers, speed
from jzyfa.bench import timing as _timing
from jzyfa.bench.problem import Problem, attention_flops, parse_varlen, visible_pairs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ON_GPU = jax.default_backend() == "gpu"

SEQLENS = [
    [(200, 200), (64, 64), (1, 1)],
    [(8192, 8192), (4096, 4096), (100, 100), (1, 1)],
    [(5, 12), (12, 5), (37, 37), (1, 9)],
]


def _packed(seqlens, causal=True, window=None, heads_q=4, heads_kv=4, head_dim=128, dtype="bf16"):
    return Problem.packed(seqlens, heads_q, heads_kv, head_dim, causal, dtype, window)


# ---- The flag


@pytest.mark.parametrize(
    "text,expected",
    [
        ("200,64,1", [(200, 200), (64, 64), (1, 1)]),
        (" 8192 , 512:1024 ", [(8192, 8192), (512, 1024)]),
        ("7", [(7, 7)]),
        ("3:1", [(3, 1)]),
        (None, None),
    ],
)
def test_parse_varlen(text, expected):
    assert parse_varlen(text) == expected


@pytest.mark.parametrize("bad", ["0,5", "5,0", "a", "8:b", "1:2:3", "-4", "1.5", "8:", ":8", "2:0"])
def test_parse_varlen_errors_name_the_flag(bad):
    with pytest.raises(
        ValueError, match="--varlen: .* is not a sequence length L or Lq:Lk with integers >= 1"
    ):
        parse_varlen(bad)


@pytest.mark.parametrize("bad", ["8,,4", "8,", ",8", "", " ", ","])
def test_parse_varlen_empty_items(bad):
    with pytest.raises(ValueError, match="--varlen: empty item"):
        parse_varlen(bad)


def test_config_holds_the_lengths():
    config = resolve_config(["--smoke", "--varlen", "200,64:32,1"])
    assert config["varlen"] == [[200, 200], [64, 32], [1, 1]] and config["shapes"] is None
    config = resolve_config(["--smoke"])
    assert config["varlen"] is None and config["shapes"] == speed.SMOKE_SHAPES
    with pytest.raises(ValueError, match="--varlen: '0' in '0,5'"):
        resolve_config(["--smoke", "--varlen", "0,5"])
    with pytest.raises(ValueError, match="--varlen: empty item"):
        resolve_config(["--smoke", "--varlen", ""])


def test_varlen_and_shapes_together_are_refused():
    with pytest.raises(ValueError, match="--varlen and --shapes were both given"):
        resolve_config(["--varlen", "64,32", "--shapes", "1x64"])
    # The smoke mode's --shapes is no explicit flag: --varlen alone is fine there.
    assert resolve_config(["--smoke", "--varlen", "64"])["varlen"] == [[64, 64]]


@pytest.mark.parametrize(
    "bad,message",
    [
        ("0,5", "--varlen: '0' in '0,5' is not a sequence length"),
        ("a", "--varlen: 'a' in 'a' is not a sequence length"),
        ("64,,8", "--varlen: empty item in '64,,8'"),
    ],
)
def test_bad_varlen_fails_before_any_work(bad, message):
    proc = run_bench("--smoke", f"--varlen={bad}", "--impls", "jzyfa")
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]
    assert "[jzyfa.bench]" not in proc.stderr  # nothing was set up or measured


# ---- The problem and its FLOPs


@pytest.mark.parametrize("seqlens", SEQLENS)
@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (16, 0)), (False, (3, 7))])
def test_flops_sum_the_dense_problems_per_sequence(seqlens, causal, window):
    problem = _packed(seqlens, causal, window, heads_q=8, heads_kv=2, head_dim=64)
    dense = [Problem(1, q, k, 8, 2, 64, causal, "bf16", window) for q, k in seqlens]
    assert problem.flops == sum(p.flops for p in dense)
    assert problem.flops == sum(attention_flops(1, q, k, 8, 64, causal, window) for q, k in seqlens)
    if window is not None:  # every sequence by its visible pairs
        pairs = sum(visible_pairs(q, k, causal, window) for q, k in seqlens)
        assert problem.flops == 4 * 8 * 64 * pairs


def test_equal_lengths_count_as_the_dense_batch():
    for causal in (True, False):
        assert (
            _packed([(1024, 1024)] * 4, causal).flops
            == Problem(4, 1024, 1024, 4, 4, 128, causal, "bf16").flops
        )
    # causal 8192 + 64: the halving convention per sequence, as the dense rows count it.
    assert _packed([(8192, 8192), (64, 64)]).flops == 4 * 4 * 128 * (8192**2 + 64**2) / 2


def test_packed_problem_shapes_and_label():
    p = _packed([(200, 300), (64, 64), (1, 5)], heads_q=4, heads_kv=2)
    assert p.varlen and (p.batch, p.seq_q, p.seq_k) == (3, 200, 300)  # max_seqlen_q/k
    assert (p.total_q, p.total_k) == (265, 369)
    assert p.q_shape == (265, 4, 128) and p.kv_shape == (369, 2, 128)
    assert p.cu_seqlens_q.tolist() == [0, 200, 264, 265] and p.cu_seqlens_k.tolist() == [0, 300, 364, 369]
    assert p.cu_seqlens_q.dtype == np.int32
    assert p.label == "varlen 3 seqs, 265/369 tokens"
    assert _packed([(8192, 8192), (4096, 4096), (4032, 4032)]).label == "varlen 3 seqs, 16320 tokens"
    assert _packed([(64, 64)]).label == "varlen 1 seq, 64 tokens"
    assert p.set_bytes == 2 * (265 * 4 * 128 + 2 * 369 * 2 * 128) + 2 * 265 * 4 * 128
    abstract = p.abstract(jnp.bfloat16)
    assert [a.shape for a in abstract] == [(265, 4, 128), (369, 2, 128), (369, 2, 128), (4,), (4,)]
    assert not Problem(1, 64, 64, 4, 4, 128, True, "bf16").varlen


def test_packed_inputs_are_per_sequence():
    """Each sequence's slice is that sequence's inputs made on their own (positions from 0)."""
    p = _packed([(48, 64), (16, 16)], heads_q=4, heads_kv=2, head_dim=64)
    (s,) = speed.make_input_sets(p, "activations", 1, seed=3)
    assert s.q.shape == (64, 4, 64) and s.k.shape == (80, 2, 64) and s.v.shape == (80, 2, 64)
    key = jax.random.split(jax.random.key(3), 1)[0]
    q1, k1, _ = bench_inputs.make_qkv(
        "activations", jax.random.fold_in(key, 1), batch=1, seq_q=16, seq_k=16, heads_q=4, heads_kv=2,
        head_dim=64, dtype=jnp.bfloat16,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(s.q[48:], np.float32), np.asarray(q1[0], np.float32))
    np.testing.assert_array_equal(np.asarray(s.k[64:], np.float32), np.asarray(k1[0], np.float32))


# ---- The float64 reference


@pytest.mark.parametrize("seqlens", [SEQLENS[0], SEQLENS[2], [(40, 1), (3, 3)]])
@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (5, 0)), (False, (3, 2))])
def test_varlen_reference_matches_the_oracle(seqlens, causal, window):
    problem = _packed(seqlens, causal, window, heads_q=4, heads_kv=2, head_dim=32)
    (s,) = speed.make_input_sets(problem, "gaussian", 1, seed=0)
    ref = speed.compute_reference(problem, s.q, s.k, s.v, requested_pairs=0)
    assert ref.heads.tolist() == [0, 1, 2, 3] and ref.batches.tolist() == [0] * 4
    expected, _ = naive_varlen_f64(
        s.q, s.k, s.v, problem.cu_seqlens_q, problem.cu_seqlens_k, causal=causal, window=window
    )
    np.testing.assert_allclose(ref.out, np.moveaxis(expected, 1, 0), rtol=1e-10, atol=1e-12)
    # relative_error takes the packed [total_q, Hq, D] output.
    err = speed.relative_error(jnp.asarray(expected, jnp.float32), ref)
    assert err["rel_l2"] < 1e-6 and err["finite"]
    # A dense mask over the packed tokens (sequences seeing each other) is far off.
    whole, _ = naive_varlen_f64(
        s.q, s.k, s.v, [0, problem.total_q], [0, problem.total_k], causal=causal, window=window
    )
    if len(seqlens) > 1:
        assert speed.relative_error(jnp.asarray(whole, jnp.float32), ref)["rel_l2"] > 1e-2


def test_varlen_reference_budget_counts_every_sequence():
    # One head over 8K + 4K + ... causal: ~2.3e10 FLOPs, so the 2e11 budget takes 8 of 16 heads.
    long = _packed(
        [(8192, 8192), (4096, 4096), (2048, 2048), (1024, 1024), (512, 512)], heads_q=16, heads_kv=16
    )
    pairs = speed.reference_pairs(long, -1)
    assert len(pairs) == 8 and {b for b, _ in pairs} == {0} and pairs[0] == (0, 0) and pairs[-1] == (0, 15)
    assert len(speed.reference_pairs(_packed([(64, 64)] * 3, heads_q=16, heads_kv=16), -1)) == 16
    assert len(speed.reference_pairs(_packed([(64, 64)] * 3, heads_q=16, heads_kv=16), 3)) == 3
    huge = _packed([(16384, 16384)] * 16, heads_q=16, heads_kv=16)
    assert len(speed.reference_pairs(huge, -1)) == 2  # at least 2 heads


# ---- Peers


VARLEN_PEERS = ["jzyfa", "jzyfa_xla"]  # 16-bit; jzyfa_fp8 times flash_attention_varlen's FP8 path


def test_peers_without_varlen_say_so():
    problem = _packed(SEQLENS[0])
    for name, peer in peers.PEERS.items():
        for dtype in ("bf16", "fp8"):
            reason = peer.supports(dataclasses.replace(problem, dtype=dtype))
            if name in VARLEN_PEERS or name in ("jzyfa_fp8", "jzyfa_fp8_xla"):
                assert reason is None, (name, dtype, reason)
            elif name == "jzyfa_fp8_exact_p" and dtype == "bf16":
                assert "--dtype fp8" in reason
            else:
                assert reason.startswith("no varlen: "), (name, dtype, reason)
    reasons = {name: peers.PEERS[name].supports(problem) for name in peers.PEERS}
    assert "no packed (cu_seqlens) API in JAX" in reasons["cudnn"] and "cuDNN" in reasons["cudnn"]
    assert "no packed (cu_seqlens) API in JAX" in reasons["xla"]
    assert (
        "flash_attn_varlen_func" in reasons["flash_attn"]
        and "flash_attn_varlen_func" in reasons["flash_attn3"]
    )
    exact_p = peers.PEERS["jzyfa_fp8_exact_p"].supports(dataclasses.replace(problem, dtype="fp8"))
    assert "lean P only" in exact_p
    # Dense problems are unchanged.
    dense = Problem(1, 64, 64, 4, 4, 128, True, "bf16")
    assert all("varlen" not in (peers.PEERS[n].supports(dense) or "") for n in peers.PEERS)


def test_jzyfa_peers_call_flash_attention_varlen(monkeypatch):
    calls = []

    def recorder(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        calls.append((np.asarray(cu_q).tolist(), np.asarray(cu_k).tolist(), max_q, max_k, kwargs))
        return jnp.zeros(q.shape, jnp.bfloat16)

    monkeypatch.setattr(peers, "_on_gpu", lambda: False)
    monkeypatch.setattr(jzyfa, "flash_attention_varlen", recorder)
    problem = _packed([(40, 50), (8, 8)], True, (4, 4), heads_q=2, heads_kv=2, head_dim=16)
    inputs = speed.make_input_sets(problem, "gaussian", 1, seed=0)[0]
    for name, implementation in [("jzyfa", None), ("jzyfa_xla", "xla")]:
        peer = peers.PEERS[name]
        args = peer.arguments(problem, inputs)
        assert len(args) == 5 and args[3].dtype == jnp.int32
        peer.build(problem, peers.Options()).fn(*args)
        cu_q, cu_k, max_q, max_k, kwargs = calls.pop()
        assert (cu_q, cu_k, max_q, max_k) == ([0, 40, 48], [0, 50, 58], 40, 50)
        assert kwargs["causal"] is True and kwargs["window"] == (4, 4)
        assert kwargs["implementation"] == implementation
    # FP8: e4m3 q/k/v, the offsets, then the three descales as keywords.
    peer = peers.PEERS["jzyfa_fp8"]
    args = peer.arguments(problem, inputs)
    assert len(args) == 8 and args[0].dtype == jnp.float8_e4m3fn and args[3].dtype == jnp.int32
    peer.build(problem, peers.Options()).fn(*args)
    *_, kwargs = calls.pop()
    for name, value in zip(("descale_q", "descale_k", "descale_v"), args[5:]):
        assert kwargs[name] is value


@pytest.mark.parametrize("causal,window", [(True, None), (False, (3, 2))])
def test_jzyfa_varlen_matches_the_reference(causal, window):
    problem = _packed([(70, 70), (9, 30), (1, 1)], causal, window, heads_q=2, heads_kv=1, head_dim=32)
    sets = speed.make_input_sets(problem, "gaussian", 2, seed=1)
    ref = speed.compute_reference(problem, sets[0].q, sets[0].k, sets[0].v, 0)
    for name in VARLEN_PEERS:
        r = speed.measure_peer(
            peers.PEERS[name], problem, sets, ref, quick_options(), _timing.ClockMonitor(None)
        )
        assert r["status"] == "ok" and r["rel_err"] < 1e-2, (name, r)
        assert r["varlen"] == [[70, 70], [9, 30], [1, 1]] and (r["batch"], r["seq_q"], r["seq_k"]) == (
            3,
            70,
            70,
        )
        assert r["flops"] == problem.flops
    r = speed.measure_peer(
        peers.PEERS["xla"], problem, sets, ref, quick_options(), _timing.ClockMonitor(None)
    )
    assert r["status"] == "unsupported" and r["message"].startswith("no varlen")


def test_jzyfa_varlen_on_a_gpu_traces_the_kernel(monkeypatch):
    """On a GPU (faked) the peer checks the varlen kernel with its five abstract arguments: it serves
    head dim 128 as "kernel"; head dim 96 (no instantiation) is an error, or with --allow_xla_fallback the
    pure-JAX path."""
    monkeypatch.setattr(peers, "_on_gpu", lambda: True)
    built = peers.PEERS["jzyfa"].build(_packed([(200, 200), (64, 64)]), peers.Options())
    assert built.path == "kernel"
    wide = _packed([(64, 64), (16, 16)], heads_q=2, heads_kv=2, head_dim=96)
    sets = speed.make_input_sets(wide, "gaussian", 2, seed=0)
    ref = speed.compute_reference(wide, sets[0].q, sets[0].k, sets[0].v, 0)
    peer = peers.PEERS["jzyfa"]
    r = speed.measure_peer(peer, wide, sets, ref, quick_options(False), _timing.ClockMonitor(None))
    assert r["status"] == "error" and "kernel" in r["message"], r
    r = speed.measure_peer(peer, wide, sets, ref, quick_options(True), _timing.ClockMonitor(None))
    assert r["status"] == "ok" and r["impl"] == "jzyfa[xla-fallback]" and r["rel_err"] < 1e-2, r


# ---- Reports


def _fake_result(**overrides):
    packed = [[8192, 8192], [4096, 4096], [4032, 4032]]
    return fake_result(**{"batch": 3, "heads_q": 16, "heads_kv": 16, "varlen": packed, "tflops": 500.0, **overrides})


ENV = {"date": "2026-11-30T12:00:00+00:00", "device": "NVIDIA H200", "jax": "0.12.0", "jaxlib": "0.12.0"}


def test_tables_show_the_packed_batch(tmp_path, capsys):
    config = {"dtype": "bf16", "head_dim": 128, "heads": 16, "kv_heads": None, "causal": True, "window": None,
              "varlen": [[8192, 8192], [4096, 4096], [4032, 4032]]}  # fmt: skip
    results = [_fake_result(), _fake_result(impl="jzyfa_xla", tflops=50.0)]
    markdown = speed.format_markdown(results, ENV, config)
    assert "lengths 8192,4096,4032." in markdown.splitlines()[0]
    assert "| impl | varlen 3 seqs, 16320 tokens |" in markdown
    assert "| 3 | varlen 16320 | 16 | 128 | yes |" in markdown
    plain = speed.format_plain(results)
    assert "varlen 16320" in plain.splitlines()[2]
    assert "jzyfa gaussian varlen 3 seqs, 16320 tokens (max Sq=8192 Sk=8192) H=16/16" in speed.progress_line(
        results[0]
    )
    # Unequal totals; and dense rows stay as they were.
    r = _fake_result(varlen=[[5, 12], [3, 3]], seq_q=5, seq_k=12, batch=2)
    assert (
        speed._shape_cells(r)[:2] == ["2", "varlen 8/15"] and speed._label(r) == "varlen 2 seqs, 8/15 tokens"
    )
    dense = _fake_result(varlen=None, batch=1)
    assert speed._label(dense) == "1x8192" and "varlen" not in speed.progress_line(dense)
    assert "varlen" not in speed.format_markdown([dense], ENV, dict(config, varlen=None))
    # No plot for a packed batch: a note, exit status 0, no file.
    png = tmp_path / "v.png"
    assert speed._write_plot(results, ENV, config, str(png)) == 0 and not png.exists()
    assert "no plot for --varlen" in capsys.readouterr().err


# ---- The command


def test_smoke_run_with_varlen(tmp_path):
    out = tmp_path / "bench.json"
    png = tmp_path / "bench.png"
    impls = "jzyfa,jzyfa_xla,xla,cudnn,flash_attn,jzyfa_fp8"
    proc = run_bench("--smoke", "--varlen", "200,64,1", "--kv_heads", "2",
           "--impls", impls, "--inputs", "gaussian", "--markdown", f"--json_out={out}", f"--plot={png}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lengths 200,64,1." in proc.stdout.splitlines()[0]
    assert "| impl | varlen 3 seqs, 265 tokens |" in proc.stdout
    assert "gaussian varlen 3 seqs, 265 tokens: " in proc.stderr  # the problem's log line
    assert "[6/6]" in proc.stderr and "no plot for --varlen" in proc.stderr and not png.exists()
    report = json.loads(out.read_text())
    assert report["config"]["varlen"] == [[200, 200], [64, 64], [1, 1]] and report["config"]["shapes"] is None
    rows = {r["peer"]: r for r in report["results"]}
    assert list(rows) == impls.split(",")
    flops = sum(attention_flops(1, s, s, 4, 128, True) for s in (200, 64, 1))
    for peer, r in rows.items():
        assert r["varlen"] == [[200, 200], [64, 64], [1, 1]] and r["flops"] == flops
        assert (r["batch"], r["seq_q"], r["seq_k"], r["heads_q"], r["heads_kv"]) == (3, 200, 200, 4, 2)
        if peer in VARLEN_PEERS:
            assert r["status"] == "ok" and r["rel_err"] < 1e-2 and r["tflops"] > 0, r
            assert r["reference_pairs"] == 4  # smoke: --ref_pairs 0, every head
            if not ON_GPU:
                assert r["path"] == ("pure-JAX" if peer == "jzyfa_xla" else "pure-JAX (no GPU)")
        elif peer == "jzyfa_fp8":  # FP8 error, on e4m3 inputs quantized from the bf16 ones
            assert r["status"] == "ok" and r["rel_err"] < 8e-2 and r["tflops"] > 0, r
        else:
            assert r["status"] == "unsupported" and r["message"].startswith("no varlen: "), r
