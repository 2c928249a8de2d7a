"""tools/int8_wgmma_probe.cu (s8 against e4m3 wgmma rates, int32 -> float conversions; docs/int8.md) on the
CPU: it builds without spills or wgmma serialization, each rate kernel's timed loop holds the wgmma it is
named after (IGMMA for s8, QGMMA for e4m3, four k32 steps of its N), and each conversion loop holds its
instructions (128 per pass), so that a rate measured on the H200 is that instruction's."""

import os
import re
import subprocess

import pytest
from repo_tools import REPO
from test_kernel_build import kernels, toolchain

pytestmark = pytest.mark.skipif(os.environ.get("JZYFA_SKIP_NVCC") == "1", reason="JZYFA_SKIP_NVCC=1")

# ConvertRate<kind> -> the SASS opcodes its loop must hold 128 of each (kConvertRegisters).
CONVERSIONS = {
    0: {"FFMA"},
    1: {"I2FP.F32.S32", "FFMA"},  # sm_90's form of cvt.rn.f32.s32
    2: {"IADD3|VIADD", "FADD", "FFMA"},
    3: {"IADD3|VIADD", "FFMA"},
}


def test_probe_builds_and_times_what_it_names(tmp_path):
    nvcc, cuobjdump, env = toolchain(tmp_path)
    binary = tmp_path / "int8_wgmma_probe"
    build = subprocess.run(
        [nvcc, "-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "-Xptxas", "-v", "-o", str(binary),
         str(REPO / "tools" / "int8_wgmma_probe.cu")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    assert not re.search(r"\(C751\d\)", build.stderr), build.stderr
    assert not re.search(r"[1-9]\d* bytes spill", build.stderr), build.stderr
    sass = subprocess.run(
        [cuobjdump, "--dump-sass", str(binary)], capture_output=True, text=True, check=True, env=env
    )
    seen = set()
    for name, text in kernels(sass.stdout).items():
        clocks = [m.start() for m in re.finditer(r"SR_CLOCK", text)]
        loop = re.findall(
            r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.x]+)",
            text[clocks[0] : clocks[-1]] if clocks else "",
        )
        if rate := re.search(r"WgmmaRateILb(\d)ELi(\d+)ELi(\d)E", name):
            int8, n, _ = rate.groups()
            want = f"IGMMA.64x{n}x32.S8.S8" if int8 == "1" else f"QGMMA.64x{n}x32.F32.E4M3.E4M3"
            assert loop.count(want) == 4 and not any("GMMA" in op and op != want for op in loop), (name, loop)
            seen.add(rate.groups())
        elif convert := re.search(r"ConvertRateILi(\d)E", name):
            for pattern in CONVERSIONS[int(convert.group(1))]:
                count = sum(1 for op in loop if re.fullmatch(pattern, op))
                assert count >= 128, (name, pattern, count)
            seen.add(convert.group(1))
    assert len(seen) == 8 + 4
