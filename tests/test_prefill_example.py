"""examples/prefill.py runs on CPU at tiny sizes, and its jzyfa model agrees with jax.nn attention."""

import importlib.util
import pathlib
import sys

import pytest

import jzyfa

EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "prefill.py"
TINY = ["--seq", "48", "--layers", "2", "--d-model", "64", "--heads-q", "4", "--heads-kv", "1",
        "--head-dim", "64", "--mlp", "128", "--vocab", "128", "--iters", "1"]


@pytest.fixture(scope="module")
def prefill():
    spec = importlib.util.spec_from_file_location("prefill_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("implementation", ["auto", "xla"])
def test_tiny_prefill(prefill, capsys, implementation):
    results = prefill.main(TINY + ["--implementation", implementation])
    assert results["tokens_per_second"] > 0
    # A few bf16 ulps: both compute the same causal GQA attention, rounding differently.
    assert results["attention_max_abs_diff"] < 0.05
    assert results["logits_max_abs_diff"] < 0.1
    assert "tokens/s" in capsys.readouterr().out


@pytest.mark.skipif(jzyfa.kernel_available(), reason="the kernel runs here")
def test_kernel_demanded_without_hopper_is_refused(prefill):
    with pytest.raises(ValueError, match="Hopper"):
        prefill.main(TINY + ["--implementation", "kernel"])
