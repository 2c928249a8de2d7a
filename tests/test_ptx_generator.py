"""The PTX generator (asm/gen_ptx.py): its text, and that nvcc turns it into HGMMA/QGMMA for sm_90a."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest
from repo_tools import load_tool

REPO = pathlib.Path(__file__).resolve().parents[1]


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_ptx", REPO / "asm" / "gen_ptx.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_ptx"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gen_ptx = load_generator()


find_tool = load_tool("register_peak").find_tool  # a CUDA tool on PATH, in the toolkit or in the wheels


def test_wgmma_operand_lists_are_complete():
    op = gen_ptx.Wgmma(128, "bf16", a_from_registers=False, b_transposed=False)
    text = gen_ptx.wgmma_function(op)
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in text
    # 64 accumulators %0..%63, then A descriptor %64, B descriptor %65, scale flag %66.
    accumulators = re.search(r'"\{(%0, .*?)\}, "', text).group(1).split(", ")
    assert accumulators == [f"%{i}" for i in range(64)]
    assert '"%64, %65, p, 1, 1, 0, 0;' in text
    assert text.count('"+f"(d[') == 64
    assert "setp.ne.b32 p, %66, 0;" in text


def test_register_a_operand_with_transposed_b():
    op = gen_ptx.Wgmma(64, "f16", a_from_registers=True, b_transposed=True)
    text = gen_ptx.wgmma_function(op)
    assert "m64n64k16.f32.f16.f16" in text
    # 32 accumulators, then four A registers %32..%35, B descriptor %36, tnsp-B = 1.
    assert '"{%32, %33, %34, %35}, %36, p, 1, 1, 1;' in text
    assert text.count('"r"(a[') == 4


def test_overwrite_variant_writes_without_reading():
    op = gen_ptx.Wgmma(128, "bf16", a_from_registers=False, b_transposed=False, overwrite=True)
    text = gen_ptx.wgmma_function(op)
    assert op.name.endswith("_zero")
    assert text.count('"=f"(d[') == 64 and '"+f"' not in text
    assert "setp.ne.b32 p, 0, 0;" in text and '"%64, %65, p, 1, 1, 0, 0;' in text


def instruction_operands(text: str) -> list[str]:
    """The wgmma's operands after the accumulator list: A, B descriptor, scale-d, immediates."""
    return re.search(r'\}, "\n\s*"(.*?);\\n"', text).group(1).replace("{", "").replace("}", "").split(", ")


@pytest.mark.parametrize("n", gen_ptx.WGMMA_N)
def test_e4m3_shared_memory_operands_have_no_transpose_immediates(n):
    for overwrite in (False, True):
        op = gen_ptx.Wgmma(n, "e4m3", a_from_registers=False, b_transposed=False, overwrite=overwrite)
        text = gen_ptx.wgmma_function(op)
        assert op.k == 32
        assert op.name == f"wgmma_m64n{n}k32_f32_e4m3_ss" + ("_zero" if overwrite else "")
        assert f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 " in text
        accumulators = re.search(r'"\{(%0, .*?)\}, "', text).group(1).split(", ")
        assert accumulators == [f"%{i}" for i in range(n // 2)]
        # d, a-desc, b-desc, scale-d, imm-scale-a, imm-scale-b: no imm-trans-a / imm-trans-b.
        assert instruction_operands(text) == [f"%{n // 2}", f"%{n // 2 + 1}", "p", "1", "1"]
        constraint = '"=f"(d[' if overwrite else '"+f"(d['
        assert text.count(constraint) == n // 2 and text.count('"l"(desc_') == 2
        if overwrite:
            assert '"+f"' not in text and "setp.ne.b32 p, 0, 0;" in text
        else:
            assert f"setp.ne.b32 p, %{n // 2 + 2}, 0;" in text


@pytest.mark.parametrize("n", gen_ptx.WGMMA_N)
def test_e4m3_register_a_operand(n):
    for overwrite in (False, True):
        op = gen_ptx.Wgmma(n, "e4m3", a_from_registers=True, b_transposed=False, overwrite=overwrite)
        text = gen_ptx.wgmma_function(op)
        assert op.name == f"wgmma_m64n{n}k32_f32_e4m3_rs" + ("_zero" if overwrite else "")
        assert "const uint32_t (&a)[4]" in text and text.count('"r"(a[') == 4
        # N/2 accumulators, four A registers (four e4m3 each), the B descriptor, p, 1, 1.
        a = [f"%{n // 2 + i}" for i in range(4)]
        assert instruction_operands(text) == [*a, f"%{n // 2 + 4}", "p", "1", "1"]
        assert f'"{{{", ".join(a)}}}, %{n // 2 + 4}, p, 1, 1;' in text
        assert text.count('"=f"(d[' if overwrite else '"+f"(d[') == n // 2


def test_e4m3_has_no_transposed_b():
    with pytest.raises(ValueError, match="K-major"):
        gen_ptx.Wgmma(64, "e4m3", a_from_registers=True, b_transposed=True)


SIXTEEN_BIT_OPS = [op for op in gen_ptx.all_wgmma_ops() if op.dtype in ("bf16", "f16")]
INT8_OPS = [op for op in gen_ptx.all_wgmma_ops() if op.dtype == "s8"]


@pytest.mark.parametrize("op", SIXTEEN_BIT_OPS, ids=lambda op: op.name)
def test_16_bit_wrappers_keep_their_transpose_immediates(op):
    text = gen_ptx.wgmma_function(op)
    assert op.k == 16 and f".m64n{op.n}k16.f32.{op.dtype}.{op.dtype} " in text
    assert f"_m64n{op.n}k16_f32_{op.dtype}_" in op.name
    operands = instruction_operands(text)
    if op.a_from_registers:  # four A registers, b-desc, p, scale-a, scale-b, imm-trans-b = 1
        assert operands[4:] == [f"%{op.num_acc + 4}", "p", "1", "1", "1"]
    else:  # a-desc, b-desc, p, scale-a, scale-b, imm-trans-a = 0, imm-trans-b = 0
        assert operands == [f"%{op.num_acc}", f"%{op.num_acc + 1}", "p", "1", "1", "0", "0"]


@pytest.mark.parametrize("op", INT8_OPS, ids=lambda op: op.name)
def test_int8_wrappers_accumulate_in_s32_without_immediates(op):
    """s8 x s8 wgmma (the INT8 kernel's Q K^T): k32, s32 accumulators in uint32_t registers ("+r" or
    "=r"), and no imm-scale or transpose operands after the scale-d predicate (integer types take none)."""
    text = gen_ptx.wgmma_function(op)
    assert op.k == 32 and f".m64n{op.n}k32.s32.s8.s8 " in text
    assert f"uint32_t (&d)[{op.num_acc}]" in text
    assert ('"=r"(d[0])' if op.overwrite else '"+r"(d[0])') in text
    assert instruction_operands(text) == [f"%{op.num_acc}", f"%{op.num_acc + 1}", "p"]


def test_pack4_e4m3_swaps_the_cvt_operands():
    header = gen_ptx.render_header()
    assert "#include <cuda_fp8.h>" in header
    assert "__device__ __forceinline__ uint32_t pack4_e4m3(float a, float b, float c, float d)" in header
    # cvt...e4m3x2.f32 d, x, y puts x in the upper byte: (b, a) gives a in the low byte.
    assert "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;" in header
    assert "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;" in header
    assert "mov.b32 %0, {lo, hi};" in header


def test_header_has_every_shape_once():
    header = gen_ptx.render_header()
    for op in gen_ptx.all_wgmma_ops():
        assert header.count(f"void {op.name}(") == 1
    for name in ("mbarrier_wait", "tma_load_4d", "wgmma_fence", "wgmma_commit_group", "ex2_approx"):
        assert f" {name}(" in header


def test_dispatch_structs_name_every_role():
    text = gen_ptx.dispatch_structs()
    for dtype, element in gen_ptx.CPP_ELEMENT_TYPES.items():
        if dtype == "s8":  # Q K^T only, at the INT8 kernel's key block
            body = re.search(r"struct Wgmma<int8_t, 128> \{\n(.*?)\n\};", text, re.DOTALL).group(1)
            assert body.splitlines() == [
                f"  static constexpr auto {role} = wgmma_m64n128k32_s32_s8_{role};" for role in ("ss", "ss_zero")
            ]
            continue
        k = 32 if dtype == "e4m3" else 16
        roles = ("ss", "ss_zero", "rs", "rs_zero") if dtype == "e4m3" else ("ss", "ss_zero", "rs_tb")
        for n in gen_ptx.WGMMA_N:
            body = re.search(rf"struct Wgmma<{element}, {n}> {{\n(.*?)\n}};", text, re.DOTALL).group(1)
            assert body.splitlines() == [
                f"  static constexpr auto {role} = wgmma_m64n{n}k{k}_f32_{dtype}_{role};" for role in roles
            ]
    assert "template <int N>\nusing WgmmaFp8 = Wgmma<__nv_fp8_e4m3, N>;" in text


def test_generator_cli_writes_header(tmp_path):
    out = tmp_path / "sub" / "jzyfa_ptx.h"
    subprocess.run([sys.executable, str(REPO / "asm" / "gen_ptx.py"), "--out", str(out)], check=True)
    assert out.read_text() == gen_ptx.render_header()


PROBE_KERNEL = r"""
// Runs one generated wgmma so its shape reaches the SASS.
__global__ void probe_%NAME%(float* out, uint64_t da, uint64_t db, uint32_t a0) {
  const uint32_t a[4] = {a0, a0 + 1, a0 + 2, a0 + 3};
  %ACCTYPE% d[%ACC%] = {};
  wgmma_fence();
  %NAME%(d, %A%, db%ACCUMULATE%);
  wgmma_commit_group();
  wgmma_wait_group<0>();
  for (int i = 0; i < %ACC%; ++i) out[i * blockDim.x + threadIdx.x] = d[i];
}
"""


PACK_KERNEL = r"""
__global__ void probe_pack4_e4m3(uint32_t* out, const float4* in) {
  const float4 x = in[threadIdx.x];
  out[threadIdx.x] = pack4_e4m3(x.x, x.y, x.z, x.w);
}
"""


def probe_source() -> str:
    kernels = ['#include "jzyfa_ptx.h"', "using namespace jzyfa::ptx;"]
    for op in gen_ptx.all_wgmma_ops():
        kernels.append(
            PROBE_KERNEL.replace("%NAME%", op.name)
            .replace("%ACC%", str(op.num_acc))
            .replace("%ACCTYPE%", op.acc_cpp)
            .replace("%A%", "a" if op.a_from_registers else "da")
            .replace("%ACCUMULATE%", "" if op.overwrite else ", 1")
        )
    kernels.append(PACK_KERNEL)
    return "\n".join(kernels)


def sass_by_probe(sass: str) -> dict[str, str]:
    """SASS text per probe kernel, keyed by the name after `probe_` (mangled: _Z<len>probe_<name>P...)."""
    parts = re.split(r"\n\s*Function : _Z\d+probe_(\w+?)P\w*", sass)
    return dict(zip(parts[1::2], parts[2::2]))


def expected_gmma(op) -> str:
    """The SASS of one wgmma: e.g. `QGMMA.64x128x32.F32.E4M3.E4M3 R24, R88, gdesc[UR4], RZ, ...` (A
    from registers), `HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, ...` (both descriptors in one
    gdesc; the f16 form prints without a type suffix), `..., gdesc[UR4].tnspB, ...` (MN-major B)."""
    if op.dtype == "s8":
        mnemonic = rf"IGMMA\.64x{op.n}x32\.S8\.S8"
    elif op.dtype == "e4m3":
        mnemonic = rf"QGMMA\.64x{op.n}x32\.F32\.E4M3\.E4M3"
    else:
        mnemonic = rf"HGMMA\.64x{op.n}x16\.F32" + (r"\.BF16" if op.dtype == "bf16" else "")
    operands = r"gdesc\[UR\d+\]" + (r"\.tnspB" if op.b_transposed else "")
    if op.a_from_registers:
        operands = r"R\d+, " + operands
    return rf"\b{mnemonic} R\d+, {operands}, "


@pytest.mark.skipif(os.environ.get("JZYFA_SKIP_NVCC") == "1", reason="JZYFA_SKIP_NVCC=1")
def test_compiles_to_gmma_for_sm90a(tmp_path):
    nvcc = find_tool("nvcc")
    cuobjdump = find_tool("cuobjdump")
    assert nvcc, "nvcc not found: install the CUDA toolkit (or set JZYFA_SKIP_NVCC=1)"
    assert cuobjdump, "cuobjdump not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm"
    (tmp_path / "jzyfa_ptx.h").write_text(gen_ptx.render_header())
    (tmp_path / "probe.cu").write_text(probe_source())
    obj = tmp_path / "probe.o"
    subprocess.run(
        [
            nvcc,
            "-gencode",
            "arch=compute_90a,code=sm_90a",
            "-std=c++17",
            "-O3",
            "-I",
            str(tmp_path),
            "-c",
            str(tmp_path / "probe.cu"),
            "-o",
            str(obj),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    env = dict(os.environ, PATH=f"{pathlib.Path(cuobjdump).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    sass = subprocess.run(
        [cuobjdump, "--dump-sass", str(obj)], check=True, capture_output=True, text=True, env=env
    ).stdout
    probes = sass_by_probe(sass)
    ops = gen_ptx.all_wgmma_ops()
    assert sorted(probes) == sorted([op.name for op in ops] + ["pack4_e4m3"])
    for op in ops:
        assert re.search(expected_gmma(op), probes[op.name]), f"{op.name}:\n{probes[op.name]}"
    assert "HGMMA.64x256x16.F32.BF16" in sass and "QGMMA.64x256x32.F32.E4M3.E4M3" in sass
    assert "LDL" not in sass and "STL" not in sass, "register spills in the probe kernel"
    # pack4_e4m3: one conversion per cvt.rn.satfinite.e4m3x2.f32, the second merging the first's
    # 16 bits (ptxas 13: F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C), and no byte shuffling.
    pack = probes["pack4_e4m3"]
    assert len(re.findall(r"\bF2FP\.SATFINITE\.E4M3\.F32\.PACK_AB\w*", pack)) == 2, pack
    assert "PRMT" not in pack, pack
