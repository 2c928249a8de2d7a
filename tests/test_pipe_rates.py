"""tools/pipe_rates.cu (instruction rates per SM on the GPU, docs/fp8.md 10.25) on the CPU: it builds, and
each kernel's timed loop holds the instruction it is named after (32 steps per loop branch), so that a
rate measured on the H200 is that instruction's."""

import os
import re
import subprocess

import pytest
from repo_tools import REPO
from test_kernel_build import kernels, toolchain

pytestmark = pytest.mark.skipif(os.environ.get("JZYFA_SKIP_NVCC") == "1", reason="JZYFA_SKIP_NVCC=1")

# Kernel (Rate<Op>) -> the SASS opcode its loop must repeat, and how many per 32 steps.
EXPECTED = {
    "Ffma": (r"FFMA", 32),
    "Fmnmx": (r"FMNMX", 32),
    "Hfma2": (r"HFMA2(\.MMA)?", 32),  # ptxas spreads them over HFMA2 and HFMA2.MMA
    "Hmnmx2": (r"VHMNMX|HMNMX2", 16),  # two dependent maxima fused into one 3-input VHMNMX
    "F2fpF16": (r"F2FP\.F16\.F32\.PACK_AB", 32),
    "F2fpE4m3": (r"F2FP\.SATFINITE\.E4M3\.F32\.PACK_AB\w*", 32),
    "Prmt": (r"PRMT", 32),
    "Imad": (r"IMAD", 32),
    "Ex2": (r"MUFU\.EX2", 32),
}


def test_each_rate_kernel_times_its_instruction(tmp_path):
    nvcc, cuobjdump, env = toolchain(tmp_path)
    binary = tmp_path / "pipe_rates"
    source = REPO / "tools" / "pipe_rates.cu"
    build = subprocess.run(
        [nvcc, "-O3", "-gencode", "arch=compute_90a,code=sm_90a", "-o", str(binary), str(source)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert build.returncode == 0, build.stderr
    dump = [cuobjdump, "--dump-sass", str(binary)]
    sass = subprocess.run(dump, capture_output=True, text=True, check=True, env=env)
    found = {}
    for name, text in kernels(sass.stdout).items():
        op = re.search(r"RateINS_\d+(\w+?)EEEv", name).group(1)
        clocks = [m.start() for m in re.finditer(r"SR_CLOCK", text)]
        assert len(clocks) >= 2, name
        loop = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?P\d\s+)?([A-Z0-9_.]+)", text[clocks[0] : clocks[-1]])
        pattern, count = EXPECTED[op]
        found[op] = sum(1 for opcode in loop if re.fullmatch(pattern, opcode))
        assert found[op] >= count, f"{op}: {found[op]} of {count} {pattern} in the loop: {loop}"
    assert set(found) == set(EXPECTED)
