"""The FP8 kernel's P V register bookkeeping on the hardware (see jzyfa/fp8_layout.py).

Builds tests/cuda/fp8_fragment_check.cu (one warpgroup: P packed from the f32 accumulator layout into
e4m3 A fragments, four m64n128k32 QGMMA against V^T in shared memory) and runs it: with V's keys
permuted as `fp8_value_operand` permutes them the product equals P V from the same e4m3 values; with
V's keys in order it does not (so the check can fail).
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
from gpu_utils import requires_hopper
from test_ptx_generator import find_tool

REPO = pathlib.Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.gpu, requires_hopper]


def test_packed_p_with_permuted_v_matches_on_the_gpu(tmp_path):
    nvcc = find_tool("nvcc")
    assert nvcc, "nvcc not found"
    subprocess.run(
        [sys.executable, str(REPO / "asm" / "gen_ptx.py"), "--out", str(tmp_path / "jzyfa_ptx.h")], check=True
    )
    binary = tmp_path / "fp8_fragment_check"
    subprocess.run(
        [
            nvcc,
            "-gencode",
            "arch=compute_90a,code=sm_90a",
            "-std=c++17",
            "-O2",
            "-I",
            str(tmp_path),
            "-I",
            str(REPO / "ffi"),
            str(REPO / "tests" / "cuda" / "fp8_fragment_check.cu"),
            "-o",
            str(binary),
        ],
        check=True,
    )
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120, check=False)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    errors = {
        layout: (float(err), float(ref))
        for layout, err, ref in re.findall(r"(\w+) max_abs_err=(\S+) max_abs_ref=(\S+)", run.stdout)
    }
    permuted_err, scale = errors["permuted"]
    in_order_err, _ = errors["in_order"]
    # f32 accumulation of 128 exact e4m3 products (the tensor cores' internal precision included).
    assert permuted_err <= 1e-3 * scale, errors
    assert in_order_err > 1e-2 * scale, errors
