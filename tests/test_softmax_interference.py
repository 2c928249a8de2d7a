"""tools/softmax_interference.cu (the FP8 softmax's cycles per block beside tensor-core work, docs/fp8.md
10.33) on the CPU: it builds without spills, and each probe's timed loop holds what its variant says: the
Q K^T (and the own P V where the variant has it), and with the softmax its instructions (the max tree,
two codes per score, the quad shuffles), without it none of them, with a synthetic work its 320
instructions. A probe whose softmax ptxas dropped
as dead code would measure nothing."""

import collections
import os
import re
import subprocess

import pytest
from repo_tools import REPO, load_tool
from test_kernel_build import kernels, toolchain

pytestmark = pytest.mark.skipif(os.environ.get("JZYFA_SKIP_NVCC") == "1", reason="JZYFA_SKIP_NVCC=1")

sass_budget = load_tool("sass_budget")

# The probe's synthetic work kinds (enum Work) -> the SASS opcodes of their instruction.
SYNTHETIC = {2: r"FFMA", 3: r"FMNMX", 4: r"IMAD(\.MOV)?(\.U32)?", 5: r"LOP3\.LUT", 6: r"HMNMX2|VHMNMX", 7: r"HFMA2(\.MMA)?",
             8: r"FFMA", 9: r"MUFU\.EX2"}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("softmax_interference")
    nvcc, cuobjdump, env = toolchain(tmp)
    binary = tmp / "softmax_interference"
    build = subprocess.run(
        [nvcc, "-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
         "-Xptxas=-v,-warn-spills,-Werror", "-I", str(REPO / "ffi"), "-I", str(tmp), "-o", str(binary),
         str(REPO / "tools" / "softmax_interference.cu")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert build.returncode == 0, build.stderr
    sass = subprocess.run([cuobjdump, "--dump-sass", str(binary)], capture_output=True, text=True, check=True,
                          env=env).stdout
    return build.stderr, kernels(sass)


def timed_loop(text: str) -> list:
    """The measured warpgroup's loop: between two consecutive clock reads, from the last backward
    branch's target to it, and the one that stores P (the other warpgroup's loop, timed too, does not)."""
    instructions = sass_budget.parse(text)
    clocks = [i for i, ins in enumerate(instructions) if "SR_CLOCK" in ins.text]
    loops = []
    for first, second in zip(clocks, clocks[1:]):
        timed = instructions[first:second]
        back = [i for i, ins in enumerate(timed) if ins.branch_target is not None and ins.branch_target < ins.address]
        if not back:
            continue
        branch = timed[back[-1]]
        start = next((i for i, ins in enumerate(timed) if ins.address == branch.branch_target), None)
        if start is not None and any(ins.base in ("ST", "STS") for ins in timed[start : back[-1] + 1]):
            loops.append(timed[start : back[-1] + 1])
    assert len(loops) == 1, f"{len(loops)} loops store P between clock reads"
    return loops[0]


def test_no_spills_and_no_wgmma_serialization(built):
    report, _ = built
    assert not re.search(r"\(C751\d\)", report), report  # a serialized probe would time something else
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert len(frames) == 46 and all(f == ("0", "0", "0") for f in frames), report


def test_each_probe_times_what_its_variant_says(built):
    _, found = built
    probes = {}
    for name, text in found.items():
        # Probe<Shape<keys per block, warpgroups>, own P V, companion, work>
        match = re.search(r"ProbeINS_5ShapeILi(\d+)ELi(\d)EEELi(\d)ELi(\d)ELi(\d)E", name)
        if match:
            probes[tuple(int(g) for g in match.groups())] = text
    # At 128 keys and two warpgroups (own P V: none, A in registers, A in shared memory; companion;
    # work: none, softmax, eight synthetic instructions): ten softmax variants, two of each synthetic
    # one, and the baseline (no work) of each; six schedules (two at 128 keys among the above) with and
    # without the softmax.
    assert len(probes) == 46, list(found)
    assert {(n, w) for n, w, *_ in probes} == {(128, 2), (192, 2), (64, 2), (64, 3)}
    for (block_n, _, own_pv, _, work), text in probes.items():
        loop = timed_loop(text)
        opcodes = collections.Counter(ins.opcode for ins in loop)
        bases = collections.Counter(ins.base for ins in loop)
        blocks = 2  # the loop body is two blocks (P alternates between two register sets)
        # Q K^T (N = the block's keys), and the own P V: N = 136 from registers (1), N = 128 from
        # shared memory (2), one k-step per 32 keys.
        qk = opcodes[f"QGMMA.64x{block_n}x32.F32.E4M3.E4M3"]
        pv_shared = (block_n // 32) * blocks if own_pv == 2 else 0
        assert qk == 4 * blocks + (pv_shared if block_n == 128 else 0)
        assert opcodes["QGMMA.64x136x32.F32.E4M3.E4M3"] == ((block_n // 32) * blocks if own_pv == 1 else 0)
        scores = block_n // 2  # per thread and block
        if work == 1:
            # A code each from FFMA.SAT then FFMA; the max tree over 2 rows (scores / 2 - 2 FMNMX) and
            # the quads (4); two shuffles per row.
            assert opcodes["FFMA.SAT"] == scores * blocks
            assert bases["FFMA"] >= 2 * scores * blocks
            assert bases["FMNMX"] >= (scores + 2) * blocks
            assert bases["SHFL"] == 4 * blocks
        elif work == 0:
            assert bases["FMNMX"] == 0 and bases["FFMA"] == 0 and bases["SHFL"] == 0
        else:  # 5 rounds of one instruction over the 64 values (ptxas may fuse two HMNMX2 into VHMNMX)
            pattern = SYNTHETIC[work]
            count = sum(n for opcode, n in opcodes.items() if re.fullmatch(pattern, opcode))
            assert count >= (160 if work == 6 else 320) * blocks, (work, opcodes)
