"""examples/sharded_prefill.py and tools/multi_gpu_prefill.py at tiny sizes on 8 CPU devices."""

import importlib.util
import pathlib
import sys

import jax
import pytest

REPO = pathlib.Path(__file__).parent.parent
TINY = [
    "--seq",
    "64",
    "--layers",
    "1",
    "--d-model",
    "64",
    "--heads-q",
    "8",
    "--heads-kv",
    "2",
    "--head-dim",
    "64",
    "--mlp",
    "128",
    "--vocab",
    "128",
    "--iters",
    "1",
]
# A few bf16 ulps of the logits: sharded matmuls and attention chunks round differently.
LOGITS_TOLERANCE = 0.1


def load(path: pathlib.Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return load(REPO / "examples" / "sharded_prefill.py", "sharded_prefill")


@pytest.fixture(scope="module")
def tool(example):
    return load(REPO / "tools" / "multi_gpu_prefill.py", "multi_gpu_prefill")


@pytest.fixture(autouse=True)
def cpu_devices(monkeypatch):
    """The 8 CPU devices, also on a GPU host."""
    cpu = jax.devices("cpu")
    monkeypatch.setattr(
        jax, "devices", lambda *backend: cpu if not backend else jax.local_devices(backend=backend[0])
    )
    with jax.default_device(cpu[0]):
        yield


@pytest.mark.parametrize(
    "mesh,extra",
    [
        ("data=2,tensor=4", []),
        ("data=2,sequence=4", ["--strategy", "ring"]),  # the tool below runs allgather on sequence=8
    ],
)
def test_sharded_prefill_matches_one_device(example, capsys, mesh, extra):
    results = example.main(TINY + ["--batch", "2", "--mesh", mesh] + extra)
    assert results["devices"] == 8 and results["tokens_per_second"] > 0
    assert results["logits_max_abs_diff"] < LOGITS_TOLERANCE
    assert "sharded prefill:" in capsys.readouterr().out


def test_default_mesh_uses_what_divides(example):
    cfg = example.prefill.PRESETS["gpu"]  # batch 4, 16 query heads
    assert example.default_mesh_text(8, cfg) == "data=4,tensor=2"


def test_bad_mesh_is_refused(example):
    with pytest.raises(ValueError, match="mesh axis 'pipeline' is not one of"):
        example.parse_mesh("pipeline=2", jax.devices())
    with pytest.raises(ValueError, match="needs 16 devices, there are 8"):
        example.parse_mesh("data=16", jax.devices())


def test_multi_gpu_tool_runs_every_mode(tool, capsys):
    rows = tool.main(
        [
            "--preset",
            "cpu",
            "--seqs",
            "64",
            "--layers",
            "1",
            "--d-model",
            "64",
            "--heads-q",
            "8",
            "--mlp",
            "128",
            "--vocab",
            "128",
            "--iters",
            "1",
        ]
    )
    assert [row["mode"] for row in rows] == ["batch", "heads", "cp-gather", "cp-ring"]
    assert all(row["ok"] and row["devices"] == 8 and row["ratio"] > 0 for row in rows)
    assert rows[0]["batch"] == 8  # the batch grows with the device count
    assert "cp-ring" in capsys.readouterr().out
