"""tools/real_model_session.sh --smoke: the whole real-model recipe at CPU sizes (train, capture, bench on
captured inputs with sustained rows, model accuracy), and what it leaves in its output folder."""

import json
import os
import pathlib
import re
import subprocess
import sys
import tarfile

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_smoke_session(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, TRAIN_STEPS="2", WORK_DIR=str(tmp_path / "work"))
    proc = subprocess.run(
        ["bash", str(REPO / "tools" / "real_model_session.sh"), "--smoke", str(out)],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    names = {p.name for p in out.iterdir()}
    assert {"session.log", "summary.md", "real_model.tar.gz"} <= names and len(names) <= 8
    with tarfile.open(out / "real_model.tar.gz") as tar:
        members = {pathlib.Path(m).name for m in tar.getnames()}
        assert {"bench_bf16.json", "bench_fp8.json", "bench_sustained.json", "model_accuracy.json"} <= members
        sustained = json.load(tar.extractfile("./bench_sustained.json"))
        accuracy = json.load(tar.extractfile("./model_accuracy.json"))
    impls = {r["impl"] for r in sustained["results"]}
    assert any(i.endswith(" sustained") for i in impls)
    assert {r["inputs"] for r in sustained["results"]} == {"activations", "captured:qkv.npz layer 0"}
    assert accuracy["model"][0]["variant"] == "bf16" and len(accuracy["layers"]) >= 2
    assert (tmp_path / "work" / "lm.npz").is_file() and (tmp_path / "work" / "qkv.npz").is_file()
    summary = (out / "summary.md").read_text()
    assert "held-out loss" in summary and "KL mean" in summary and "captured:qkv.npz" in summary
    assert re.search(r"\] step +0/\d+ +loss \d", summary), "the training curve's logged steps"
