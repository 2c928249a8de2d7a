"""`--inputs captured:PATH` of `python -m jzyfa.bench` and `python -m jzyfa.bench.accuracy`: the capture
format's reader, its errors, and smoke runs on a tiny capture (CPU)."""

import numpy as np
import pytest
from bench_helpers import accuracy_config, resolve_config, run_bench

from jzyfa.bench import accuracy, captured, speed


def write_capture(path, layers=2, batch=1, seq=48, heads_q=4, heads_kv=2, head_dim=32, seed=0):
    rng = np.random.default_rng(seed)
    arrays = [
        tuple(
            rng.standard_normal((batch, seq, heads, head_dim), np.float32)
            for heads in (heads_q, heads_kv, heads_kv)
        )
        for _ in range(layers)
    ]
    captured.save_captured(path, arrays, {"layers": layers})
    return arrays


def test_reader_round_trip(tmp_path):
    path = tmp_path / "qkv.npz"
    arrays = write_capture(path)
    header = captured.read_header(path)
    assert header["layers"] == 2 and header["shapes"]["layer1_k"] == [1, 48, 2, 32]
    loaded = captured.load_captured(path)
    for got, want in zip(loaded[1], arrays[1]):
        assert got.dtype.name == "bfloat16"
        np.testing.assert_allclose(got.astype(np.float32), want, rtol=1e-2, atol=1e-2)


def test_reader_errors(tmp_path):
    path = tmp_path / "qkv.npz"
    write_capture(path)
    with pytest.raises(captured.CapturedFormatError, match="--captured_layer 2 is out of range.*0 to 1"):
        captured.load_layer(path, 2)
    with pytest.raises(captured.CapturedFormatError, match="--inputs x: no file .*examples/capture.py"):
        captured.load_layer(tmp_path / "missing.npz", 0, flag="--inputs x")
    (tmp_path / "text.npz").write_text("not a zip")
    with pytest.raises(captured.CapturedFormatError, match="not an .npz capture"):
        captured.load_layer(tmp_path / "text.npz", 0)
    np.savez(tmp_path / "plain.npz", q=np.zeros(3))
    with pytest.raises(captured.CapturedFormatError, match="no capture header"):
        captured.load_layer(tmp_path / "plain.npz", 0)


def _run(path, *extra):
    config = resolve_config(["--smoke", "--inputs", f"captured:{path}", "--shapes", "2x128", *extra])
    return speed.run(config)


def test_bench_runs_on_a_capture(tmp_path):
    path = tmp_path / "qkv.npz"
    write_capture(path)
    report = _run(path, "--captured_layer", "1", "--impls", "jzyfa_xla")
    (r,) = report["results"]
    assert r["status"] == "ok", r
    assert r["inputs"] == "captured:qkv.npz layer 1"
    # Shapes from the file, not --shapes or the smoke default heads.
    assert (r["batch"], r["seq_q"], r["seq_k"], r["heads_q"], r["heads_kv"], r["head_dim"]) == (
        1,
        48,
        48,
        4,
        2,
        32,
    )
    assert r["rel_err"] < 2e-2


def test_fp8_bench_on_a_capture(tmp_path):
    path = tmp_path / "qkv.npz"
    write_capture(path, head_dim=64)
    report = _run(path, "--dtype", "fp8", "--impls", "jzyfa_fp8_xla")
    (r,) = report["results"]
    assert r["status"] == "ok" and r["compute_dtype"] == "fp8", r
    assert r["head_dim"] == 64 and r["rel_err"] < 0.15


def test_bench_errors_name_the_flag(tmp_path):
    path = tmp_path / "qkv.npz"
    write_capture(path)
    with pytest.raises(ValueError, match="--captured_layer 5 is out of range"):
        _run(path, "--captured_layer", "5")
    with pytest.raises(ValueError, match=r"--inputs captured:\S+missing.npz: no file"):
        _run(tmp_path / "missing.npz")
    with pytest.raises(ValueError, match="give the capture's path"):
        speed.run(resolve_config(["--smoke", "--inputs", "captured:"]))


def test_model_kind_points_to_captured():
    proc = run_bench("--smoke", "--inputs", "model", "--shapes", "1x64", "--impls", "jzyfa")
    assert proc.returncode != 0
    assert "--inputs captured:" in proc.stderr


def test_layer_selection(tmp_path):
    path = tmp_path / "qkv.npz"
    write_capture(path, layers=3)
    assert captured.layers_of(path, -1) == [0, 1, 2] and captured.layers_of(path, 2) == [2]
    with pytest.raises(captured.CapturedFormatError, match="--captured_layer 3 is out of range"):
        captured.layers_of(path, 3)
    with pytest.raises(captured.CapturedFormatError, match="give the capture's path"):
        captured.path_of("captured:")


def test_accuracy_report_per_captured_layer(tmp_path):
    path = tmp_path / "qkv.npz"
    write_capture(path)
    config = accuracy_config(
        shapes=[(1, 32, 32)],
        inputs=["gaussian", f"captured:{path}"],
        variants=["jzyfa_bf16", "fp8_dequant_exact"],
    )
    report = accuracy.run(config, log=lambda line: None)
    kinds = [r["inputs"] for r in report["errors"]]
    assert kinds == ["gaussian"] * 2 + ["captured:qkv.npz layer 0"] * 2 + ["captured:qkv.npz layer 1"] * 2
    rows = [r for r in report["errors"] if r["inputs"].startswith("captured")]
    assert all(r["heads_q"] == 4 and r["seq_q"] == 48 and r["status"] == "ok" for r in rows)
    tables = accuracy.format_tables(report, markdown=True)
    assert "captured:qkv.npz layer 1 inputs, 1x48, 4/2 heads of 32 (the file's)" in tables
    one = accuracy.run(config | {"inputs": [f"captured:{path}"], "captured_layer": 1}, log=lambda line: None)
    assert {r["inputs"] for r in one["errors"]} == {"captured:qkv.npz layer 1"}


def test_accuracy_command_line_errors(tmp_path):
    path = tmp_path / "qkv.npz"
    write_capture(path)
    for args, message in [
        ([f"--inputs=captured:{tmp_path / 'missing.npz'}"], "no file"),
        ([f"--inputs=captured:{path}", "--captured_layer=2"], "--captured_layer 2 is out of range"),
    ]:
        proc = run_bench("--smoke", *args, module="jzyfa.bench.accuracy")
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
