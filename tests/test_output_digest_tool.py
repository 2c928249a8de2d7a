"""tools/output_digest.py: the digests and the A/B comparison (the GPU run itself needs the kernel)."""

import numpy as np
import pytest
from repo_tools import load_tool

@pytest.fixture(scope="module")
def tool():
    return load_tool("output_digest")


def test_digest_changes_with_one_bit(tool):
    out = np.linspace(-1, 1, 64, dtype=np.float32).reshape(4, 16)
    lse = np.arange(4, dtype=np.float32)
    flipped = out.copy()
    flipped.view(np.uint32)[2, 3] ^= 1
    assert tool.digest(out, lse) == tool.digest(out.copy(), lse.copy())
    assert tool.digest(out, lse).split()[1] != tool.digest(flipped, lse).split()[1]


def test_compare_names_only_the_configurations_that_differ(tool):
    log = [
        "A bf16 causal hd128: O 1 LSE 2 |O|^2 3",
        "A fp8 lean causal: O 4 LSE 5 |O|^2 6",
        "B bf16 causal hd128: O 1 LSE 2 |O|^2 3",
        "B fp8 lean causal: O 9 LSE 5 |O|^2 6",
        "B some unrelated line",
    ]
    assert tool.compare(log) == ["fp8 lean causal: A O 4 LSE 5 |O|^2 6 | B O 9 LSE 5 |O|^2 6"]
    assert tool.compare(log[:1] + log[2:3]) == []
    # A configuration that only one build printed (the other failed) is a difference too.
    assert tool.compare(log[:2] + log[2:3]) == ["fp8 lean causal: A O 4 LSE 5 |O|^2 6 | B None"]


def test_one_configuration_end_to_end_on_the_pure_jax_path(tool, capsys):
    tool.main(["--implementation", "xla", "--only", "fp8 varlen causal"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fp8 varlen causal: O ")
    assert "NONFINITE" not in lines[0]
