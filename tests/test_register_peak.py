"""tools/register_peak.py: the peak of nvdisasm's live-register counts and what is live there, on a
synthetic listing and on a kernel compiled here for sm_90a."""

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
import register_peak  # noqa: E402

# Three instructions of one kernel as nvdisasm -plr -lrm narrow prints them (register columns R0..R5,
# then the predicates' group).
LISTING = """\
//--------------------- .text._Z6kernelv --------------------------
        /*0000*/                   LDC R1, c[0x0][0x28] ;            // |   1  ^     | P
        /*0010*/                   S2R R4, SR_TID.X ;                // |   2  :  ^  |
        /*0020*/                   FADD R5, R4, 1 ;                  // |   3  :  v^ |
        /*0030*/                   STG.E [R1], R5 ;                  // |   2  v   v |
"""


def test_parses_counts_and_finds_the_peak_and_its_writers():
    ((name, instructions),) = register_peak.parse(LISTING).items()
    assert name == "_Z6kernelv"
    assert [i.live for i in instructions] == [1, 2, 3, 2]
    assert instructions[2].text == "FADD R5, R4, 1"
    top, starts = register_peak.peaks(instructions)
    assert (top, starts) == (3, [2])
    # At the peak R1, R4 and R5 are live; FADD (math) is left out unless every=True.
    assert register_peak.live_values(instructions, 0x20, every=False) == [
        "  R1    /*0000*/ LDC R1, c[0x0][0x28]",
        "  R4    /*0010*/ S2R R4, SR_TID.X",
    ]
    assert len(register_peak.live_values(instructions, 0x20, every=True)) == 3


def run_tool(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "register_peak.py"), *map(str, args)],
        capture_output=True,
        text=True,
    )


@pytest.mark.skipif(os.environ.get("JZYFA_SKIP_NVCC") == "1", reason="JZYFA_SKIP_NVCC=1")
def test_reports_a_compiled_kernel(tmp_path):
    nvcc = register_peak.find_tool("nvcc")
    assert nvcc, "nvcc not found: install the CUDA toolkit (or set JZYFA_SKIP_NVCC=1)"
    assert register_peak.find_tool("nvdisasm"), "nvdisasm not found: pip install nvidia-cuda-nvdisasm"
    (tmp_path / "k.cu").write_text(
        "__global__ void saxpy(float* y, const float* x, float a, int n) {\n"
        "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
        "  if (i < n) y[i] = a * x[i] + y[i];\n"
        "}\n"
    )
    subprocess.run(
        [nvcc, "-c", "-gencode=arch=compute_90a,code=sm_90a", "k.cu", "-o", "k.o"], cwd=tmp_path, check=True
    )
    out = run_tool(tmp_path / "k.o", "--kernel", "saxpy", "--live")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("_Z5saxpyPfPKffi: peak ") and "live registers" in out.stdout
    assert "live at /*" in out.stdout and "LDC" in out.stdout
    missing = run_tool(tmp_path / "k.o", "--kernel", "nothing")
    assert missing.returncode != 0 and "no kernel named like 'nothing'" in missing.stderr
