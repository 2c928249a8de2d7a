"""`python -m jzyfa.bench --head_dim 192 --v_head_dim 128` (MLA): the flag, the problem's shapes, bytes and
FLOPs (2 * (D + Dv) per visible pair), the inputs and the float64 reference at v's head dim, the peers that
have one head dim saying so (cuDNN through jax.nn included: no figure), the reports and a smoke run."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64
from bench_helpers import resolve_config, run_bench

from jzyfa import plan
from jzyfa.bench import peers, speed
from jzyfa.bench.problem import Problem, attention_flops, visible_pairs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ON_GPU = jax.default_backend() == "gpu"


def mla(batch=2, seq=64, causal=True, window=None, **kwargs) -> Problem:
    return Problem(batch, seq, seq, 4, 2, 192, causal, "bf16", window, head_dim_v=128, **kwargs)


def test_the_flag_reaches_the_config():
    assert resolve_config(["--head_dim", "192", "--v_head_dim", "128"])["v_head_dim"] == 128
    assert resolve_config([])["v_head_dim"] is None
    assert speed._config_head_dim_v({"head_dim": 192, "v_head_dim": 128}) == 128
    assert speed._config_head_dim_v({"head_dim": 128, "v_head_dim": 128}) is None  # one head dim
    assert speed._config_head_dim_v({"head_dim": 128}) is None  # a config from before the flag
    with pytest.raises(ValueError, match="--v_head_dim must be at least 1, got 0"):
        speed._config_head_dim_v({"head_dim": 128, "v_head_dim": 0})


def test_problem_shapes_bytes_and_flops():
    p = mla()
    assert (p.head_dim, p.v_head_dim, p.flops_head_dim) == (192, 128, 160)
    assert p.q_shape == (2, 64, 4, 192) and p.kv_shape == (2, 64, 2, 192)
    assert p.v_shape == (2, 64, 2, 128) and p.out_shape == (2, 64, 4, 128)
    assert p.set_bytes == 2 * (2 * 64 * 4 * 192 + 2 * 64 * 2 * 192 + 2 * 64 * 2 * 128) + 2 * 2 * 64 * 4 * 128
    # Q K^T: 2 * 192 per visible pair, P V: 2 * 128; causal Sq = Sk counted half (the convention).
    assert p.flops == (2 * 192 + 2 * 128) * 2 * 4 * 64 * 64 / 2
    windowed = mla(window=(8, 0))
    assert windowed.flops == (2 * 192 + 2 * 128) * 2 * 4 * visible_pairs(64, 64, True, (8, 0))
    packed = Problem.packed([(40, 50), (1, 3)], 4, 2, 192, True, "bf16", None, head_dim_v=128)
    assert packed.v_shape == (53, 2, 128) and packed.out_shape == (41, 4, 128)
    assert packed.flops == sum(attention_flops(1, q, k, 4, 160, True) for q, k in [(40, 50), (1, 3)])
    assert [a.shape for a in packed.abstract(jnp.bfloat16)] == [
        (41, 4, 192),
        (53, 2, 192),
        (53, 2, 128),
        (3,),
        (3,),
    ]
    # One head dim: as before.
    one = Problem(2, 64, 64, 4, 2, 128, True, "bf16")
    assert one.v_head_dim == 128 and one.v_shape == one.kv_shape and one.out_shape == one.q_shape


@pytest.mark.parametrize("kind", ["gaussian", "activations"])
@pytest.mark.parametrize("varlen", [False, True])
def test_inputs_and_reference_take_vs_head_dim(kind, varlen):
    p = (
        Problem.packed([(24, 30), (9, 9)], 4, 2, 192, False, "bf16", None, 128)
        if varlen
        else mla(seq=24)
    )
    (s,) = speed.make_input_sets(p, kind, 1, seed=0)
    assert s.q.shape == p.q_shape and s.k.shape == p.kv_shape and s.v.shape == p.v_shape
    ref = speed.compute_reference(p, s.q, s.k, s.v, requested_pairs=0)
    assert ref.out.shape[-1] == 128
    if not varlen:
        want, _ = naive_attention_f64(
            *(np.asarray(x, np.float32) for x in (s.q, s.k, s.v)), causal=True, softmax_scale=192**-0.5
        )
        np.testing.assert_allclose(ref.out, np.moveaxis(want, 2, 1).reshape(-1, 24, 128), atol=1e-6)


def test_peers_with_one_head_dim_say_so(monkeypatch):
    """jax.nn (cuDNN and XLA), Pallas, PyTorch SDPA, FlashAttention 2 and cuDNN FP8 get no MLA figure; the
    jzyfa peers and FlashAttention 3 (16-bit) are not refused for it."""
    p = mla()
    for name in "cudnn xla pallas torch_sdpa_cudnn torch_sdpa_flash flash_attn flash_attn3_fp8".split():
        reason = peers.PEERS[name].supports(p)
        assert reason and reason.startswith("v's head dim 128 != q's and k's 192: "), (name, reason)
    assert "cuDNN's own unequal head dims are not reachable" in peers.PEERS["cudnn"].supports(p)
    monkeypatch.setattr(peers, "_gpu_reason", lambda: None)  # cuDNN FP8 asks for the GPU first
    fp8 = Problem(2, 64, 64, 4, 2, 192, True, "fp8", head_dim_v=128)
    assert peers.PEERS["cudnn_fp8"].supports(fp8).startswith("v's head dim 128 != q's and k's 192")
    for name in ("jzyfa", "jzyfa_xla"):
        assert peers.PEERS[name].supports(p) is None
    assert "v's head dim" not in (peers.PEERS["flash_attn3"].supports(p) or "")


def test_reports_show_both_head_dims():
    row = {"head_dim": 192, "v_head_dim": 128}
    assert speed._head_dims_text(row) == "192/128"
    assert speed._head_dims_text({"head_dim": 128, "v_head_dim": 128}) == "128"
    assert speed._head_dims_text({"head_dim": 128}) == "128"  # reports from before the flag


def test_smoke_run_times_mla(tmp_path):
    out = tmp_path / "bench.json"
    impls = "jzyfa,jzyfa_xla,cudnn,xla,pallas"
    proc = run_bench("--smoke", "--head_dim", "192", "--v_head_dim", "128",
           "--shapes", "1x128", "--heads", "4", "--kv_heads", "2", "--impls", impls, "--inputs", "gaussian",
           "--markdown", f"--json_out={out}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "head dim 192/128" in proc.stdout.splitlines()[0]
    assert "| 192/128 |" in proc.stdout
    report = json.loads(out.read_text())
    assert report["config"]["v_head_dim"] == 128
    rows = {r["peer"]: r for r in report["results"]}
    for name in ("jzyfa", "jzyfa_xla"):
        r = rows[name]
        assert r["status"] == "ok" and r["rel_err"] < 1e-2 and r["v_head_dim"] == 128, r
        assert r["flops"] == (2 * 192 + 2 * 128) * 4 * 128 * 128 / 2
    for name in ("cudnn", "xla", "pallas"):
        assert rows[name]["status"] == "unsupported" and "v's head dim 128" in rows[name]["message"]


def test_fp8_mla_flags_reach_the_fp8_peers(monkeypatch):
    """`--dtype fp8 --head_dim 192 --v_head_dim 128`: the FP8 problem has MLA's shapes and the jzyfa FP8 peers
    take it. On a GPU (faked) they build the FP8 kernel's MLA instantiation (a row of `jzyfa.plan`)."""
    config = resolve_config(["--dtype", "fp8", "--head_dim", "192", "--v_head_dim", "128"])
    assert (config["dtype"], config["head_dim"], speed._config_head_dim_v(config)) == ("fp8", 192, 128)
    problem = Problem(1, 64, 64, 4, 2, 192, True, "fp8", head_dim_v=128)
    assert problem.v_shape == (1, 64, 2, 128) and problem.out_shape == (1, 64, 4, 128)
    assert plan.kernel_for(plan.Config("fp8", plan.MLA_HEAD_DIMS, "causal", "dense")) is not None
    monkeypatch.setattr(peers, "_on_gpu", lambda: True)
    for name in ("jzyfa_fp8", "jzyfa_fp8_exact_p"):
        peer = peers.PEERS[name]
        assert peer.supports(problem) is None
        assert peer.build(problem, peers.Options()).path == "kernel"
