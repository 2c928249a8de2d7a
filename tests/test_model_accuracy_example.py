"""examples/model_accuracy.py on the CPU: a tiny untrained checkpoint, every variant tried, the report's parts."""

import json
import pathlib
import sys

import jax
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import lm
import model_accuracy
import prefill

TINY = prefill.Config(
    batch=1, seq=64, layers=2, d_model=64, heads_q=4, heads_kv=2, head_dim=32, mlp=64, vocab=256
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "lm.npz"
    lm.save_checkpoint(path, TINY, lm.init_params(TINY, jax.random.key(0)))
    return path


def test_report(checkpoint, tmp_path, capsys):
    out = tmp_path / "acc.json"
    report = model_accuracy.main(["--load", str(checkpoint), "--windows", "2", "--json_out", str(out),
                                  "--plot", str(tmp_path / "plots")])  # fmt: skip
    names = [r["variant"] for r in report["model"]]
    assert names[0] == "bf16" and "fp8_lean_p" in names and "fp8_exact_p_rotated" in names
    assert set(names) | set(report["skipped"]) == set(model_accuracy.VARIANTS)
    if jax.default_backend() != "gpu":
        assert "cudnn_fp8" in report["skipped"]
    ref = report["model"][0]
    assert ref["kl_mean"] == 0 and ref["top1_agreement"] == 1 and ref["perplexity"] > 1
    fp8 = next(r for r in report["model"] if r["variant"] == "fp8_lean_p")
    assert fp8["kl_mean"] >= 0 and fp8["finite"]
    layers = [r for r in report["layers"] if r["variant"] == "fp8_lean_p"]
    assert [r["layer"] for r in layers] == [0, 1] and all(0 < r["o_rel_l2"] < 0.2 for r in layers)
    bf16_layers = [r for r in report["layers"] if r["variant"] == "bf16"]
    assert all(r["o_rel_l2"] < 2e-2 and r["lse_rel_l2"] < 1e-2 for r in bf16_layers)
    assert report["tokens"] == 128 and json.loads(out.read_text())["skipped"] == report["skipped"]
    printed = capsys.readouterr().out
    assert "KL mean" in printed and "Relative L2 error of LSE" in printed
    if _has_matplotlib():
        assert (tmp_path / "plots" / "model_kl.png").is_file()


def test_variant_list_and_errors(checkpoint):
    assert model_accuracy.availability(model_accuracy.VARIANTS["bf16"], 4, 2, 32) is None
    with pytest.raises(SystemExit):
        model_accuracy.main(["--load", str(checkpoint), "--variants", "fp9"])
    with pytest.raises(SystemExit):
        model_accuracy.main(["--load", str(checkpoint.parent / "missing.npz")])
    with pytest.raises(SystemExit, match="--captured: no file"):
        model_accuracy.main(["--load", str(checkpoint), "--captured", str(checkpoint.parent / "missing.npz")])


def _has_matplotlib():
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None
