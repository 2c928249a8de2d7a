"""`python -m jzyfa.bench.accuracy`: the chunked float64 reference, the error and KL metrics, the variants, the report."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64, random_qkv
from bench_helpers import accuracy_config

from jzyfa.bench import accuracy, float64
from jzyfa.bench import inputs as realistic_inputs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ON_GPU = jax.default_backend() == "gpu"
MICRO_MODEL = accuracy.ModelConfig(
    batch=1, seq=24, layers=1, d_model=32, heads_q=2, heads_kv=1, head_dim=16, mlp=32, vocab=32
)


# ---- The float64 reference


def test_attention_float64_hand_computed():
    q = np.array([[1.0, 0.0], [0.0, 2.0]])
    k = np.eye(2)
    v = np.array([[1.0, 0.0], [0.0, 1.0]])
    out, lse = accuracy.attention_float64(q, k, v, 1.0, False, return_lse=True)
    e = math.e
    np.testing.assert_allclose(out[0], [e / (e + 1), 1 / (e + 1)], rtol=1e-15)
    np.testing.assert_allclose(lse, [math.log(e + 1), math.log(1 + e**2)], rtol=1e-15)
    out, lse = accuracy.attention_float64(q, k, v, 1.0, True, return_lse=True)  # row 0 sees key 0 only
    np.testing.assert_allclose(out[0], [1.0, 0.0])
    np.testing.assert_allclose(lse[0], 1.0)
    # Sq > Sk under the bottom-right mask: the first row sees no key.
    out, lse = accuracy.attention_float64(q, k[:1], v[:1], 1.0, True, return_lse=True)
    assert np.all(out[0] == 0) and lse[0] == -np.inf and lse[1] == 0.0


@pytest.mark.parametrize("seq_q,seq_k", [(40, 40), (7, 33), (33, 7)])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_float64_in_blocks_matches_the_oracle(rng, monkeypatch, seq_q, seq_k, causal):
    monkeypatch.setattr(float64, "ROWS_BUDGET", 5 * seq_k)  # blocks of 5 rows
    q, k, v = (rng.standard_normal((s, 8)) for s in (seq_q, seq_k, seq_k))
    expected_out, expected_lse = naive_attention_f64(
        q[None, :, None], k[None, :, None], v[None, :, None], causal=causal, softmax_scale=0.4
    )
    out, lse = accuracy.attention_float64(q, k, v, 0.4, causal, return_lse=True)
    np.testing.assert_allclose(out, expected_out[0, :, 0], rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(expected_lse[0, 0]))
    finite = np.isfinite(lse)
    np.testing.assert_allclose(lse[finite], expected_lse[0, 0][finite], rtol=1e-12)


def test_reference_on_gqa_pairs(rng):
    q, k, v = random_qkv(rng, batch=2, seq_q=16, seq_k=24, heads_q=4, heads_kv=2, head_dim=8)
    pairs = accuracy.spread_pairs(2, 4, 3)
    assert pairs == [(0, 0), (1, 0), (1, 3)]
    assert accuracy.spread_pairs(1, 2, 0) == [(0, 0), (0, 1)]
    long = dict(seq_q=32768, seq_k=32768, head_dim=128)
    assert (
        accuracy.reference_pair_count(-1, long, True) == 2
        and accuracy.reference_pair_count(3, long, True) == 3
    )
    assert accuracy.reference_pair_count(-1, dict(long, seq_q=4096, seq_k=4096), True) == 8
    ref = accuracy.reference_on_pairs(q, k, v, pairs, scale=0.3, causal=True)
    expected_out, expected_lse = naive_attention_f64(q, k, v, causal=True, softmax_scale=0.3)
    for i, (b, h) in enumerate(pairs):
        np.testing.assert_allclose(ref.out[i], expected_out[b, :, h], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(ref.lse[i], expected_lse[b, h], rtol=1e-10)


# ---- Metrics


def test_error_metrics_hand_computed():
    ref_out = np.array([[[3.0, 4.0]]])  # norm 5
    ref_lse = np.array([[1.0, -np.inf]])
    m = accuracy.error_metrics(np.array([[[3.0, 4.5]]]), ref_out, np.array([[1.5, -np.inf]]), ref_lse)
    assert m["o_rel_l2"] == pytest.approx(0.1) and m["o_max_abs"] == pytest.approx(0.5) and m["finite"]
    # The empty row (-inf in both) is left out of the LSE errors.
    assert m["lse_rel_l2"] == pytest.approx(0.5) and m["lse_max_abs"] == pytest.approx(0.5)
    m = accuracy.error_metrics(
        ref_out, ref_out, np.array([[1.0, 0.0]]), ref_lse
    )  # a row that should be empty
    assert m["o_rel_l2"] == 0 and m["lse_max_abs"] == math.inf
    m = accuracy.error_metrics(np.array([[[np.nan, 4.0]]]), ref_out)
    assert not m["finite"] and m["lse_rel_l2"] is None


def test_kl_divergence_hand_computed():
    p = np.log(np.array([[0.5, 0.5], [0.9, 0.1]]))
    q = np.log(np.array([[0.25, 0.75], [0.9, 0.1]])) + 3.0  # logits: a shift changes nothing
    kl = accuracy.kl_divergence(p, q)
    first = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert kl["kl_mean"] == pytest.approx(first / 2, rel=1e-12)
    assert kl["kl_max"] == pytest.approx(first, rel=1e-12)
    assert kl["top1_agreement"] == 0.5  # argmax of [0.5, 0.5] is 0, of [0.25, 0.75] is 1
    assert accuracy.kl_divergence(p, p)["kl_mean"] == 0


# ---- Variants


@pytest.fixture(scope="module")
def small_case():
    shape = dict(batch=1, seq_q=96, heads_q=2, heads_kv=1, head_dim=32)
    q, k, v = realistic_inputs.make_qkv("activations", 0, **shape)
    setting = accuracy.Setting(causal=True, softmax_scale=1 / math.sqrt(32))
    ref = accuracy.reference_on_pairs(q, k, v, [(0, 0), (0, 1)], scale=setting.softmax_scale, causal=True)
    return q, k, v, setting, ref


def test_variants_against_float64(small_case):
    q, k, v, setting, ref = small_case
    results = {
        name: accuracy.evaluate_variant(accuracy.VARIANTS[name], q, k, v, setting, ref)
        for name in [
            "jzyfa_bf16",
            "fp8_dequant_exact",
            "fp8_emul_lean",
            "fp8_emul_exact_hadamard",
            "int8_emul",
            "int8_emul_hadamard",
            "cudnn_fp8",
        ]
    }
    bf16 = results["jzyfa_bf16"]
    assert bf16["status"] == "ok" and bf16["o_rel_l2"] < 1e-2 and bf16["lse_max_abs"] < 1e-3
    for name in [
        "fp8_dequant_exact",
        "fp8_emul_lean",
        "fp8_emul_exact_hadamard",
        "int8_emul",
        "int8_emul_hadamard",
    ]:
        r = results[name]
        assert r["status"] == "ok", r
        # FP8 rounding shows, but the result is attention on the same inputs.
        assert bf16["o_rel_l2"] < r["o_rel_l2"] < 0.15 and 0 < r["lse_max_abs"] < 2.0
    if not ON_GPU:
        assert results["cudnn_fp8"]["status"] == "unsupported" and "GPU" in results["cudnn_fp8"]["message"]


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_dequant_exact_per_kv_head_is_the_whole_call(granularity):
    """fp8_dequant_exact runs jzyfa's pure-JAX FP8 path one KV head at a time (memory); the result
    is that of one call over all heads (GQA: each KV head with its query heads)."""
    import jzyfa

    q, k, v = realistic_inputs.make_qkv(
        "activations", 1, batch=2, seq_q=64, heads_q=4, heads_kv=2, head_dim=32
    )
    setting = accuracy.Setting(causal=True, softmax_scale=1 / math.sqrt(32), granularity=granularity)
    out, lse = accuracy.VARIANTS["fp8_dequant_exact"].run(q, k, v, setting)
    f = accuracy._quantized(q, k, v, setting, False)
    want_out, want_lse = jzyfa.flash_attention(
        f.q, f.k, f.v, descale_q=f.descale_q, descale_k=f.descale_k, descale_v=f.descale_v, causal=True,
        softmax_scale=setting.softmax_scale, return_lse=True, implementation="xla",
    )  # fmt: skip
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(want_out, np.float32), rtol=1e-2, atol=1e-3
    )
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)


def test_variant_errors_are_reported(small_case):
    q, k, v, setting, ref = small_case

    def broken(q, k, v, setting):
        raise RuntimeError("boom\nsecond line")

    r = accuracy.evaluate_variant(accuracy.Variant("broken", "", broken), q, k, v, setting, ref)
    assert r["status"] == "error" and r["message"] == "RuntimeError: boom" and "traceback" in r
    head = dataclasses.replace(setting, granularity="head")
    r = accuracy.evaluate_variant(accuracy.VARIANTS["fp8_emul_lean"], q, k, v, head, ref)
    assert r["status"] == "ok" and r["o_rel_l2"] < 0.15  # one descale per (batch, kv head)


# ---- KL and the report


def test_kl_of_a_micro_model():
    kl = accuracy.run_kl(MICRO_MODEL, ["fp8_emul_lean", "cudnn_fp8"], {}, seed=0, log=lambda _: None)
    rows = {r["variant"]: r for r in kl["results"]}
    assert rows["f32_attention"]["status"] == "ok" and rows["f32_attention"]["kl_mean"] < 1e-4
    lean = rows["fp8_emul_lean"]
    assert lean["status"] == "ok" and 0 < lean["kl_mean"] < 0.5 and 0 <= lean["top1_agreement"] <= 1
    if not ON_GPU:
        assert rows["cudnn_fp8"]["status"] == "unsupported"
    assert kl["bf16_entropy_nats"] > 0.5  # peaked, but not a one-hot


def test_report_in_process(tmp_path):
    config = accuracy_config(
        inputs=["gaussian", "model"],
        variants=["jzyfa_bf16", "fp8_emul_exact", "jzyfa_fp8"],
        kl=True,
        kl_variants=["fp8_emul_exact"],
        model=MICRO_MODEL,
        seed=1,
    )
    logged = []
    report = accuracy.run(config, log=logged.append)
    assert any("model" in line and "no installable package" in line for line in logged)
    assert [r["variant"] for r in report["errors"]] == config["variants"]
    assert report["errors"][0]["path"] in ("kernel", "pure-JAX")
    markdown = accuracy.format_tables(report, markdown=True)
    assert "| variant | O rel L2 | O max abs | LSE rel L2 | LSE max abs | status |" in markdown
    assert "gaussian inputs, 1x64" in markdown and "KL(p_bf16 || p_variant)" in markdown
    plain = accuracy.format_tables(report, markdown=False)
    assert "fp8_emul_exact" in plain and "|" not in plain.split("\n")[3]
    path = tmp_path / "acc.json"
    accuracy.write_json(report, str(path))
    loaded = json.loads(path.read_text())
    assert set(loaded) == {"env", "config", "errors", "kl"} and loaded["config"]["model"]["vocab"] == 32
    with pytest.raises(ValueError, match="unknown variants"):
        accuracy.run(dict(config, variants=["nope"]))


def test_model_overrides():
    cfg = accuracy.parse_model_overrides("seq=128, qk_gain=2", accuracy.SMOKE_MODEL)
    assert cfg.seq == 128 and cfg.qk_gain == 2.0 and cfg.vocab == accuracy.SMOKE_MODEL.vocab
    with pytest.raises(ValueError, match="--model"):
        accuracy.parse_model_overrides("depth=3", cfg)


def test_command_smoke(tmp_path):
    out = tmp_path / "acc.json"
    cmd = [sys.executable, "-m", "jzyfa.bench.accuracy", "--smoke", "--shapes", "1x64", "--head_dim", "32",
           "--variants", "jzyfa_bf16,fp8_emul_lean,cudnn_fp8", "--kl_variants", "fp8_emul_lean",
           "--model", "seq=16,vocab=32,layers=1", "--inputs", "activations", f"--json_out={out}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "activations inputs, 1x64" in proc.stdout and "[jzyfa.bench.accuracy]" in proc.stderr
    report = json.loads(out.read_text())
    assert [r["variant"] for r in report["errors"]] == ["jzyfa_bf16", "fp8_emul_lean", "cudnn_fp8"]
    assert report["kl"]["model"]["seq"] == 16 and report["config"]["heads"] == 2
