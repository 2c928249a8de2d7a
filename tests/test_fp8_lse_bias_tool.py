"""tools/fp8_lse_bias.py: its statistics (the GPU run itself needs the kernel)."""

import numpy as np
import pytest
from repo_tools import load_tool

import jzyfa

@pytest.fixture(scope="module")
def tool():
    return load_tool("fp8_lse_bias")


def test_bias_statistics_skip_rows_without_keys(tool):
    emulated = np.array([[1.0, 2.0, -np.inf, 4.0]])
    kernel = np.array([[0.99, 2.0, -np.inf, 3.97]])
    stats = tool.lse_bias(kernel, emulated)
    assert stats["rows"] == 3
    assert stats["mean"] == pytest.approx(-0.04 / 3)
    assert stats["lower_share"] == pytest.approx(2 / 3)
    assert stats["max_abs"] == pytest.approx(0.03)


@pytest.mark.skipif(jzyfa.kernel_available(), reason="on a Hopper GPU the tool runs the kernel")
def test_without_the_kernel_the_tool_says_why(tool):
    with pytest.raises(SystemExit, match="cannot run here"):
        tool.main(["--seq", "128"])


def test_the_comparison_runs_end_to_end_on_the_pure_jax_path(tool):
    """The tool's plumbing (quantization, the call, the CPU emulation) with the exact pure-JAX FP8 path in
    the kernel's place: its LSE sums unrounded probabilities, so it sits close to the emulation's."""
    stats, o_err = tool.run(seq=256, heads=2, seed=1, implementation="xla")
    assert stats["rows"] == 2 * 256
    assert abs(stats["mean"]) < 0.05 and o_err < 0.1
