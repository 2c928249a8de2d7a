"""The kernels as the compiler sees them, without a GPU: resources and SASS.

Compiles the forward instantiations (ffi/instantiations/*.cu, one per (family, head dims, layout) group of
ffi/tile_size.h's table) and ffi/fp8_value_operand.cu for sm_90a the way both builds do, and measuring
variants (tools/measure/*.h, force-included as CMake's -DJZYFA_MEASURE does), and reads ptxas's report and
the disassembly: no register spills, no wgmma serialization (ptxas info C7513, which silently
turns every wgmma into issue-and-wait), HGMMA present, and wgmma batches of several
instructions per fence.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
from repo_tools import load_tool
from test_ptx_generator import find_tool

REPO = pathlib.Path(__file__).resolve().parents[1]
SASS_BUDGET = load_tool("sass_budget")  # its SASS parser serves reachable() below too

pytestmark = pytest.mark.skipif(os.environ.get("JZYFA_SKIP_NVCC") == "1", reason="JZYFA_SKIP_NVCC=1")


# The translation units that hold kernels: every forward instantiation file and the FP8 kernel's V-operand
# layout.
KERNEL_SOURCES = (
    *sorted(f"instantiations/{p.stem}" for p in (REPO / "ffi" / "instantiations").glob("*.cu")),
    "fp8_value_operand",
    "int8_quantize",
)

# A forward kernel's symbol: FwdKernel (dense, O's tensor map last) or FwdVarlenKernel over Fwd16Mainloop
# <Element, head dims, keys per block> or Fp8Mainloop<lean P, Fp8TileT<q/k head dim, staged V, layout, keys
# per block>>, with its arguments (WindowedArgs<...> for the sliding-window kernels).
KERNEL_NAME = re.compile(
    r"_ZN5jzyfa\d+(?P<entry>FwdKernel|FwdVarlenKernel)INS_\d+"
    r"(?:Fwd16MainloopI(?P<element>13__nv_bfloat16|6__half)Li(?P<qk>\d+)ELi(?P<v>\d+)ELi(?P<n>\d+)E"
    r"|Fp8MainloopILb(?P<lean>[01])ENS_8Fp8TileTILi(?P<fqk>\d+)ELb(?P<staged>[01])ELNS_6LayoutE(?P<layout>[01])"
    r"ELi(?P<fn>\d+)E)"
)


def info(name: str) -> dict | None:
    """What a forward kernel's symbol says: family ("16bit", "fp8", "int8": the FP8 mainloop over
    Int8Args), element (16-bit: "bf16", "f16"), the head dims, keys per block, varlen, windowed, mla, and
    for FP8 and INT8 lean (P) and staged (V)."""
    m = KERNEL_NAME.match(name)
    if not m:
        return None
    fp8 = m["fqk"] is not None
    qk = int(m["fqk"] if fp8 else m["qk"])
    v = (128 if qk == 192 else qk) if fp8 else int(m["v"])  # FP8: MLA's v 128, else q's head dim
    return {
        "family": ("int8" if "Int8Args" in name else "fp8") if fp8 else "16bit",
        "element": None if fp8 else ("bf16" if "bfloat16" in m["element"] else "f16"),
        "qk": qk,
        "v": v,
        "n": int(m["fn"] if fp8 else m["n"]),
        "varlen": m["entry"] == "FwdVarlenKernel",
        "windowed": "WindowedArgs" in name,
        "mla": qk != v,
        "lean": fp8 and m["lean"] == "1",
        "staged": fp8 and m["staged"] == "1",
    }


def select(sass: str, **want) -> dict[str, str]:
    """The forward kernels whose info() has every field of `want` (a value, or a predicate)."""
    found = {}
    for name, text in kernels(sass).items():
        k = info(name)
        if k and all(w(k[f]) if callable(w) else k[f] == w for f, w in want.items()):
            found[name] = text
    return found


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kernel")
    nvcc, cuobjdump, env = toolchain(tmp)
    reports, sass = zip(*(compile_kernels(nvcc, cuobjdump, env, tmp, source) for source in KERNEL_SOURCES))
    return "\n".join(reports), "\n".join(sass)


def toolchain(tmp):
    """(nvcc, cuobjdump, environment for cuobjdump), with the generated PTX header written to tmp."""
    nvcc, cuobjdump = find_tool("nvcc"), find_tool("cuobjdump")
    assert nvcc, "nvcc not found: install the CUDA toolkit (or set JZYFA_SKIP_NVCC=1)"
    assert cuobjdump, "cuobjdump not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm"
    subprocess.run(
        [sys.executable, str(REPO / "asm" / "gen_ptx.py"), "--out", str(tmp / "jzyfa_ptx.h")], check=True
    )
    env = dict(os.environ, PATH=f"{pathlib.Path(cuobjdump).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    return nvcc, cuobjdump, env


def compile_kernels(nvcc, cuobjdump, env, tmp, source: str, measure: str | None = None) -> tuple[str, str]:
    """(ptxas's report, the SASS) of ffi/<source>.cu built as both builds build it, or as a measuring build
    with tools/measure/<measure>.h (CMake's -DJZYFA_MEASURE=<measure>)."""
    obj = tmp / f"{source.replace('/', '_')}{measure or ''}.o"
    build = subprocess.run(
        [
            nvcc,
            "-gencode",
            "arch=compute_90a,code=sm_90a",
            "-std=c++17",
            "-O3",
            "--expt-relaxed-constexpr",
            "-Xptxas=-v,-warn-spills,-Werror",
            *([f"--pre-include={REPO / 'tools' / 'measure' / measure}.h"] if measure else []),
            "-I",
            str(tmp),
            "-I",
            str(REPO / "ffi"),
            "-c",
            str(REPO / "ffi" / f"{source}.cu"),
            "-o",
            str(obj),
        ],
        capture_output=True,
        text=True,
        check=False,  # the assertion below shows ptxas's messages
    )
    assert build.returncode == 0, build.stderr
    sass = subprocess.run(
        [cuobjdump, "--dump-sass", str(obj)], check=True, capture_output=True, text=True, env=env
    ).stdout
    return build.stderr, sass


def kernels(sass: str) -> dict[str, str]:
    """SASS text per kernel function."""
    parts = re.split(r"\n\s*Function : (\S+)", sass)
    return dict(zip(parts[1::2], parts[2::2]))


def test_no_spills_and_no_wgmma_serialization(compiled):
    report, _ = compiled
    # C7510-C7519: ptxas serialized the wgmma pipeline or injected a wait or an arrive (C7515 and
    # C7517 when a wgmma group may be in flight across a join or a loop's back edge: docs/fp8.md 10.22).
    assert not re.search(r"\(C751\d\)", report), (
        "ptxas serialized or waited on the wgmma pipeline:\n" + report
    )
    assert "C7508" not in report, "ptxas ignored setmaxnreg:\n" + report
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert frames and all(f == ("0", "0", "0") for f in frames), report


def test_every_forward_kernel_uses_hgmma_in_batches(compiled):
    _, sass = compiled
    found = select(sass, family="16bit", varlen=False, windowed=False, mla=False)
    assert len(found) == 6, list(found)  # {bf16, f16} x {64, 128, 256}
    for name, text in found.items():
        hgmma = len(re.findall(r"\bHGMMA\.64x\d+x16\.F32", text))
        fences = len(re.findall(r"\bWARPGROUP\.ARRIVE\b", text))
        assert hgmma >= 16, name
        # Each fence opens a batch of k-steps (8 for Q K^T at hd128, 8 for P V); serialized
        # code would show one fence per HGMMA.
        assert fences * 3 < hgmma, f"{name}: {fences} fences for {hgmma} HGMMA"
        assert "USETMAXREG" in text, f"{name}: no setmaxnreg"
        assert not re.search(r"\b(LDL|STL)\b", text), f"{name}: local memory traffic"


def test_head_dim_256_kernels_use_64_key_blocks_in_their_registers(compiled):
    """The hd256 instantiations (dense and varlen, plain and windowed): S = Q K^T on 64x64x16 (64-key
    blocks, 16 k-steps per batch), P V on 64x256x16 (4 k-steps per batch), the producer at 40 and the
    consumers at 232 registers, no local memory (the spill check above covers ptxas's report)."""
    _, sass = compiled
    found = select(sass, family="16bit", qk=256)
    kinds = sorted((info(name)["varlen"], info(name)["windowed"], info(name)["element"]) for name in found)
    assert kinds == sorted((varlen, windowed, element) for varlen in (False, True) for windowed in (False, True)
                           for element in ("bf16", "f16")), list(found)  # fmt: skip
    for name, text in found.items():
        qk = len(re.findall(r"\bHGMMA\.64x64x16\.F32(?:\.BF16)? R\d+, gdesc", text))
        pv = len(re.findall(r"\bHGMMA\.64x256x16\.F32(?:\.BF16)? R\d+, R\d+, gdesc\[UR\d+\]\.tnspB", text))
        assert qk >= 16 and qk % 16 == 0, f"{name}: {qk} Q K^T HGMMA"
        assert pv >= 4 and pv % 4 == 0, f"{name}: {pv} P V HGMMA"
        assert not re.search(r"\bHGMMA\.64x128x16\b", text), name
        assert re.search(r"USETMAXREG\.DEALLOC\.CTAPOOL 0x28\b", text), f"{name}: producer not at 40"
        assert re.search(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d, 0xe8\b", text), f"{name}: consumers off 232"
        assert not re.search(r"\b(LDL|STL)\b", text), f"{name}: local memory traffic"


def test_varlen_kernels_use_hgmma_in_batches_and_store_from_registers(compiled):
    """The 16-bit kernel over packed batches (ffi/instantiations/fwd_16bit_*_varlen.cu), as fast in its inner loop (the
    same HGMMA batches, no local memory), with O stored from registers (no TMA store: a box would
    spill into the next sequence) and the offsets read from global memory."""
    _, sass = compiled
    found = select(sass, family="16bit", varlen=True, windowed=False, mla=False)
    assert len(found) == 6, list(found)  # {bf16, f16} x {64, 128, 256}
    for name, text in found.items():
        hgmma = len(re.findall(r"\bHGMMA\.64x\d+x16\.F32", text))
        fences = len(re.findall(r"\bWARPGROUP\.ARRIVE\b", text))
        assert hgmma >= 16, name
        assert fences * 3 < hgmma, f"{name}: {fences} fences for {hgmma} HGMMA"
        assert "USETMAXREG" in text, f"{name}: no setmaxnreg"
        assert not re.search(r"\b(LDL|STL)\b", text), f"{name}: local memory traffic"
        assert "UTMASTG" not in text, name
        assert len(re.findall(r"\bUTMALDG\.4D\b", text)) >= 3, name  # Q, K, V


def check_mla_kernel(name: str, text: str) -> None:
    """An MLA instantiation's SASS: Q K^T in 12 k-steps of 64x128x16 (three 64-column slices), P V in 8 of
    64x128x16 with V transposed (v's 128 columns), the same fences per batch, the producer at 40 registers
    and the consumers at 232, no local memory, O stored from registers."""
    assert "Li192ELi128E" in name, name
    qk = len(re.findall(r"\bHGMMA\.64x128x16\.F32(\.BF16)? R\d+, gdesc", text))  # f16: no suffix
    pv = len(re.findall(r"\bHGMMA\.64x128x16\.F32(\.BF16)? R\d+, R\d+, gdesc\[UR\d+\]\.tnspB", text))
    assert qk >= 12 and qk % 12 == 0, f"{name}: {qk} Q K^T HGMMA"
    assert pv >= 8 and pv % 8 == 0, f"{name}: {pv} P V HGMMA"
    assert not re.search(r"\bHGMMA\.64x192", text), name  # O is 128 wide, not 192
    fences = len(re.findall(r"\bWARPGROUP\.ARRIVE\b", text))
    assert fences * 3 < qk + pv, f"{name}: {fences} fences for {qk + pv} HGMMA"
    assert re.search(r"USETMAXREG\.DEALLOC\.CTAPOOL 0x28\b", text), f"{name}: producer not at 40"
    assert re.search(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d, 0xe8\b", text), f"{name}: consumers not at 232"
    assert not re.search(r"\b(LDL|STL)\b", text), f"{name}: local memory traffic"
    assert "UTMASTG" not in text, name
    assert len(re.findall(r"\bUTMALDG\.4D\b", text)) >= 3, name  # Q, K, V


def test_mla_kernels_use_hgmma_in_batches_and_fit_the_registers(compiled):
    """MLA's dense instantiation (q/k head dim 192, v 128; fwd_16bit_hd192x128_dense.cu; check_mla_kernel;
    the producer's K-slice loop stays rolled for its 40 registers)."""
    _, sass = compiled
    found = select(sass, family="16bit", mla=True, varlen=False, windowed=False)
    assert len(found) == 2, list(found)  # bf16, f16
    for name, text in found.items():
        check_mla_kernel(name, text)


def mla_variant(name: str) -> str:
    """Which arguments (windowed, varlen) an MLA kernel symbol has."""
    if "WindowedArgsINS_13VarlenFwdArgs" in name:
        return "windowed varlen"
    return "windowed" if "WindowedArgs" in name else "varlen" if "VarlenFwdArgs" in name else name


def test_mla_variant_kernels_fit_the_registers(compiled):
    """MLA's windowed (dense and varlen) and varlen instantiations, built as the dense MLA kernel is (check_mla_kernel): the windowed ones keep one P buffer and mask by row bounds for that."""
    _, sass = compiled
    found = select(sass, family="16bit", mla=True)
    found = {name: text for name, text in found.items() if info(name)["varlen"] or info(name)["windowed"]}
    kinds = sorted(mla_variant(name) for name in found)
    assert kinds == sorted(["windowed", "varlen", "windowed varlen"] * 2), list(found)  # bf16, f16
    for name, text in found.items():
        check_mla_kernel(name, text)


def test_window_kernels_are_built_and_use_hgmma_in_batches(compiled):
    """The sliding-window instantiations (dense and varlen), kernels of their own: the same HGMMA batches and no local memory; the producer gives back down to 40 registers
    (setmaxnreg), as in the other kernels: at 48, with the consumers at 232, producer and consumers would
    need more than the CTA's register pool and a consumer's setmaxnreg.inc would wait forever."""
    _, sass = compiled
    for varlen in (False, True):
        found = select(sass, family="16bit", windowed=True, mla=False, varlen=varlen)
        assert len(found) == 6, (varlen, list(found))  # {bf16, f16} x {64, 128, 256}
        for name, text in found.items():
            assert "WindowedArgs" in name, name
            hgmma = len(re.findall(r"\bHGMMA\.64x\d+x16\.F32", text))
            fences = len(re.findall(r"\bWARPGROUP\.ARRIVE\b", text))
            assert hgmma >= 16, name
            assert fences * 3 < hgmma, f"{name}: {fences} fences for {hgmma} HGMMA"
            assert "USETMAXREG" in text, f"{name}: no setmaxnreg"
            assert re.search(r"USETMAXREG\.DEALLOC\.CTAPOOL 0x28\b", text), f"{name}: producer not at 40"
            assert not re.search(r"\b(LDL|STL)\b", text), f"{name}: local memory traffic"
            if varlen:
                assert "UTMASTG" not in text, name


def test_fp8_kernels_use_qgmma_and_lean_p_has_no_exponentials(compiled):
    _, sass = compiled
    found = select(sass, family="fp8", varlen=False, windowed=False, qk=128, n=128)
    assert len(found) == 4, list(found)  # lean P, exact P; each V staged and V^T loaded
    for name, text in found.items():
        lean = info(name)["lean"]
        # S = Q K^T on 64x128x32, P V on 64x136x32 (8 columns that sum the rounded P).
        assert len(re.findall(r"\bQGMMA\.64x128x32\.F32\.E4M3\.E4M3", text)) >= 4, name
        assert len(re.findall(r"\bQGMMA\.64x136x32\.F32\.E4M3\.E4M3 R\d+, R\d+,", text)) >= 4, name
        fences = len(re.findall(r"\bWARPGROUP\.ARRIVE\b", text))
        assert fences * 3 < len(re.findall(r"\bQGMMA\b", text)), name
        assert "USETMAXREG" in text and not re.search(r"\b(LDL|STL)\b", text), name
        exponentials = len(re.findall(r"\bMUFU\.EX2\b", text))
        if lean:  # one FFMA per probability writes its e4m3 code: no MUFU in the softmax
            assert exponentials == 0, f"{name}: {exponentials} MUFU.EX2"
            assert "F2FP.SATFINITE.E4M3" not in text, name
        else:
            assert exponentials >= 64, name
            assert "F2FP.SATFINITE.E4M3" in text, name


def test_int8_kernels_use_igmma_and_convert_the_scores_exactly(compiled):
    """The INT8 instantiations (dense, head dim 128, lean P; V staged or V^T loaded, plain and windowed): S = Q K^T on
    s8 wgmma (IGMMA 64x128x32, int32 sums), each score turned into a float by I2FP (exact below 2^24:
    64 per block and thread, in each of the loop's three softmax sites), P V as the FP8 kernel's (QGMMA
    64x136x32), lean P without MUFU.EX2, no local memory."""
    _, sass = compiled
    found = select(sass, family="int8", qk=128, varlen=False)
    kinds = sorted((info(name)["staged"], info(name)["windowed"]) for name in found)
    assert kinds == [(False, False), (False, True), (True, False), (True, True)], list(found)
    for name, text in found.items():
        k = info(name)
        assert k["lean"] and (k["qk"], k["n"], k["varlen"]) == (128, 128, False), name
        assert len(re.findall(r"\bIGMMA\.64x128x32\.S8\.S8\b", text)) >= 12, name  # 4 k-steps, 3 sites
        assert not re.search(r"\bQGMMA\.64x128x32", text), name
        assert len(re.findall(r"\bQGMMA\.64x136x32\.F32\.E4M3\.E4M3 R\d+, R\d+,", text)) >= 4, name
        assert len(re.findall(r"\bI2FP\.F32\.S32\b", text)) >= 3 * 64, name
        assert not re.search(r"\bMUFU\.EX2\b", text), name
        assert "USETMAXREG" in text and not re.search(r"\b(LDL|STL)\b", text), name
        assert len(re.findall(r"\bUTMASTG\.4D\b", text)) == 2, name  # O through the TMA store, as FP8's


def test_int8_varlen_kernels_are_the_fp8_varlen_tile_on_igmma(compiled):
    """The INT8 varlen instantiations (fwd_int8_hd128_varlen.cu: lean P, V staged or V^T loaded, plain and
    windowed): the dense INT8 kernels' IGMMA Q K^T and exact I2FP conversions on the FP8 varlen tile,
    which stores O from registers (a store box would reach into the next sequence), the FP8 kernels'
    registers."""
    _, sass = compiled
    found = select(sass, family="int8", qk=128, varlen=True)
    kinds = sorted((info(name)["staged"], info(name)["windowed"]) for name in found)
    assert kinds == [(False, False), (False, True), (True, False), (True, True)], list(found)
    for name, text in found.items():
        assert info(name)["lean"] and info(name)["n"] == 128, name
        assert len(re.findall(r"\bIGMMA\.64x128x32\.S8\.S8\b", text)) >= 12, name
        assert not re.search(r"\bQGMMA\.64x128x32", text), name
        assert len(re.findall(r"\bQGMMA\.64x136x32\.F32\.E4M3\.E4M3 R\d+, R\d+,", text)) >= 4, name
        assert len(re.findall(r"\bI2FP\.F32\.S32\b", text)) >= 3 * 64, name
        assert not re.search(r"\bMUFU\.EX2\b", text), name
        assert "UTMASTG" not in text, name
        check_fp8_registers(name, text)


def test_int8_hd256_kernels_are_the_fp8_hd256_tile_on_igmma(compiled):
    """Head dim 256's INT8 instantiations (dense, lean P, V^T loaded, plain and windowed): the FP8
    head-dim-256 tile (64-key blocks, two to a K scale block) with S = Q K^T on IGMMA 64x64x32 (8 k-steps
    over two 128-byte slices), 32 I2FP conversions a block and thread in each of the three softmax
    sites, P V on 64x256x32 beside 64x8x32 for the sums, the FP8 kernels' registers, O from registers."""
    _, sass = compiled
    found = select(sass, family="int8", qk=256)
    assert sorted((info(name)["staged"], info(name)["windowed"]) for name in found) == [
        (False, False), (False, True),
    ], list(found)  # fmt: skip
    for name, text in found.items():
        assert info(name)["lean"] and info(name)["n"] == 64 and not info(name)["varlen"], name
        qk = len(re.findall(r"\bIGMMA\.64x64x32\.S8\.S8\b", text))
        pv = len(re.findall(r"\bQGMMA\.64x256x32\.F32\.E4M3\.E4M3 R\d+, R\d+,", text))
        sums = len(re.findall(r"\bQGMMA\.64x8x32\.F32\.E4M3\.E4M3 R\d+, R\d+,", text))
        assert qk >= 24 and qk % 8 == 0 and qk // 8 == pv // 2 and sums == pv, f"{name}: {qk}, {pv}, {sums}"
        assert not re.search(r"\bQGMMA\.64x64x32", text), name
        assert len(re.findall(r"\bI2FP\.F32\.S32\b", text)) >= 3 * 32, name
        assert not re.search(r"\bMUFU\.EX2\b", text), name
        check_fp8_registers(name, text)
        assert "UTMASTG" not in text, name


def test_int8_mla_kernels_are_the_fp8_mla_tile_on_igmma(compiled):
    """MLA's INT8 instantiations (192/128, dense, lean P, causal or no mask; V staged or V^T loaded): the
    FP8 MLA tile with S = Q K^T on IGMMA 64x128x32 (6 k-steps over a 128- and a 64-byte slice, 3 sites),
    P V on 64x136x32, 64 exact I2FP conversions a block and thread per site, the FP8 kernels' registers."""
    _, sass = compiled
    found = select(sass, family="int8", qk=192)
    assert sorted((info(name)["staged"], info(name)["windowed"]) for name in found) == [
        (False, False), (True, False),
    ], list(found)  # fmt: skip
    for name, text in found.items():
        assert info(name)["lean"] and info(name)["v"] == 128 and info(name)["n"] == 128, name
        qk = len(re.findall(r"\bIGMMA\.64x128x32\.S8\.S8\b", text))
        assert qk >= 18 and qk % 6 == 0, f"{name}: {qk}"
        assert len(re.findall(r"\bQGMMA\.64x136x32\.F32\.E4M3\.E4M3 R\d+, R\d+,", text)) >= 4, name
        assert not re.search(r"\bQGMMA\.64x128x32", text), name
        assert len(re.findall(r"\bI2FP\.F32\.S32\b", text)) >= 3 * 64, name
        assert not re.search(r"\bMUFU\.EX2\b", text), name
        check_fp8_registers(name, text)


def test_fp8_window_kernels_are_built_like_the_fp8_kernels(compiled):
    """The FP8 kernel's sliding-window instantiations (dense), kernels of their own: the
    same QGMMA batches, no local memory (the consumers at 232 registers leave none to spare: the window
    mask works from per-row bounds), the producer at 40 registers (setmaxnreg), lean P without MUFU."""
    _, sass = compiled
    found = select(sass, family="fp8", varlen=False, windowed=True, qk=128)
    assert len(found) == 4, list(found)  # lean P, exact P; each V staged and V^T loaded
    for name, text in found.items():
        assert "WindowedArgs" in name and "Fp8Args" in name, name
        check_fp8_instantiation(name, text, lean=info(name)["lean"])


def check_fp8_instantiation(name: str, text: str, *, lean: bool) -> None:
    """An FP8 kernel built like the plain dense one: QGMMA in batches, the producer at 40 registers and the
    consumers at 232 (setmaxnreg), no local memory, lean P without MUFU."""
    assert len(re.findall(r"\bQGMMA\.64x128x32\.F32\.E4M3\.E4M3", text)) >= 4, name
    assert len(re.findall(r"\bQGMMA\.64x136x32\.F32\.E4M3\.E4M3 R\d+, R\d+,", text)) >= 4, name
    fences = len(re.findall(r"\bWARPGROUP\.ARRIVE\b", text))
    assert fences * 3 < len(re.findall(r"\bQGMMA\b", text)), name
    check_fp8_registers(name, text)
    if lean:
        assert not re.search(r"\bMUFU\.EX2\b", text), name


def check_fp8_registers(name: str, text: str) -> None:
    """The FP8 kernels' register split (setmaxnreg): the producer at 40, the consumers at 232, and no
    local memory."""
    assert re.search(r"USETMAXREG\.DEALLOC\.CTAPOOL 0x28\b", text), f"{name}: producer not at 40"
    assert re.search(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d, 0xe8\b", text), f"{name}: consumers not at 232"
    assert not re.search(r"\b(LDL|STL)\b", text), f"{name}: local memory traffic"


def check_dense_and_varlen_set(found: dict) -> None:
    """A head dim's FP8 instantiations: dense with lean and exact P, plain and windowed; varlen with lean
    P, plain and windowed."""
    kinds = sorted((info(name)["varlen"], info(name)["windowed"], info(name)["lean"]) for name in found)
    assert kinds == [
        (False, False, False), (False, False, True), (False, True, False), (False, True, True),
        (True, False, True), (True, True, True),
    ], list(found)  # fmt: skip


def test_fp8_hd64_kernels_are_built_like_the_fp8_kernels(compiled):
    """Head dim 64's FP8 instantiations (fwd_fp8_hd64_dense.cu: lean and exact P, plain and windowed;
    fwd_fp8_hd64_varlen.cu: lean P, plain and windowed), V^T loaded only: S = Q K^T in 2 k32 steps on
    64x128x32 (64-byte rows), P V in 4 on 64x72x32 (64 columns of O, 8 of sums), the producer at 40
    registers and the consumers at 232, no local memory, lean P without exponentials."""
    _, sass = compiled
    found = select(sass, family="fp8", qk=64)
    check_dense_and_varlen_set(found)
    for name, text in found.items():
        assert not staged_v(name) and info(name)["v"] == 64, name
        qk = len(re.findall(r"\bQGMMA\.64x128x32\.F32\.E4M3\.E4M3", text))
        pv = len(re.findall(r"\bQGMMA\.64x72x32\.F32\.E4M3\.E4M3 R\d+, R\d+,", text))
        assert qk % 2 == 0 and pv % 4 == 0 and qk // 2 + 1 == pv // 4, f"{name}: {qk} Q K^T, {pv} P V"
        assert not re.search(r"\bQGMMA\.64x136x32\b", text), name
        assert len(re.findall(r"\bWARPGROUP\.ARRIVE\b", text)) * 3 < qk + pv, name
        check_fp8_registers(name, text)
        assert ("MUFU.EX2" in text) != info(name)["lean"], name


def test_fp8_hd256_kernels_are_built_like_the_fp8_kernels(compiled):
    """Head dim 256's FP8 instantiations (fwd_fp8_hd256_dense.cu: lean and exact P, plain and windowed;
    fwd_fp8_hd256_varlen.cu: lean P, plain and windowed), V^T loaded only, 64-key blocks: S = Q K^T in
    8 k32 steps on 64x64x32 (two 128-byte slices of Q and K), P V in 2 on 64x256x32 (O's 256 columns)
    each beside one 64x8x32 (the 8 sum columns: a wgmma's N stops at 256), the producer at 40 registers
    and the consumers at 232, no local memory, O stored from registers, lean P without exponentials."""
    _, sass = compiled
    found = select(sass, family="fp8", qk=256)
    check_dense_and_varlen_set(found)
    for name, text in found.items():
        assert not staged_v(name) and info(name)["v"] == 256 and info(name)["n"] == 64, name
        qk = len(re.findall(r"\bQGMMA\.64x64x32\.F32\.E4M3\.E4M3", text))
        pv = len(re.findall(r"\bQGMMA\.64x256x32\.F32\.E4M3\.E4M3 R\d+, R\d+,", text))
        sums = len(re.findall(r"\bQGMMA\.64x8x32\.F32\.E4M3\.E4M3 R\d+, R\d+,", text))
        assert qk % 8 == 0 and pv % 2 == 0 and qk // 8 == pv // 2 and sums == pv, f"{name}: {qk}, {pv}, {sums}"
        assert len(re.findall(r"\bWARPGROUP\.ARRIVE\b", text)) * 3 < qk + pv, name
        check_fp8_registers(name, text)
        assert "UTMASTG" not in text, name
        assert ("MUFU.EX2" in text) != info(name)["lean"], name


def test_fp8_mla_kernels_are_built_like_the_fp8_kernels(compiled):
    """MLA's FP8 instantiations (fwd_fp8_hd192x128_dense.cu: q/k head dim 192, v 128, lean and exact P),
    built like the head-dim-128 ones: S = Q K^T in 6 k32 steps (two
    128-byte slices of Q and K), P V in 4 on 64x136x32, no local memory."""
    _, sass = compiled
    found = select(sass, family="fp8", mla=True)
    assert len(found) == 4, list(found)  # lean P, exact P; each V staged and V^T loaded
    for name, text in found.items():
        assert "Fp8Args" in name and "WindowedArgs" not in name, name
        check_fp8_instantiation(name, text, lean=info(name)["lean"])
        qk = len(re.findall(r"\bQGMMA\.64x128x32\.F32\.E4M3\.E4M3", text))
        pv = len(re.findall(r"\bQGMMA\.64x136x32\.F32\.E4M3\.E4M3 R\d+, R\d+,", text))
        assert qk % 6 == 0 and pv % 4 == 0 and qk // 6 + 1 == pv // 4, f"{name}: {qk} Q K^T, {pv} P V"


def test_fp8_varlen_kernels_are_built_like_the_fp8_kernels(compiled):
    """The FP8 kernel over packed batches (fwd_fp8_hd128_varlen.cu: plain and sliding-window, lean P only,
    each with V staged and V^T loaded), built like the dense ones; O stored from registers (no TMA store)."""
    _, sass = compiled
    found = select(sass, family="fp8", varlen=True, qk=128)
    assert sorted((info(name)["windowed"], info(name)["staged"], info(name)["lean"]) for name in found) == [
        (False, False, True),
        (False, True, True),
        (True, False, True),
        (True, True, True),
    ], list(found)
    for name, text in found.items():
        assert "Fp8VarlenArgs" in name, name
        check_fp8_instantiation(name, text, lean=True)
        assert "UTMASTG" not in text, name


@pytest.mark.parametrize("head_dim", [128, 64])
def test_value_operand_kernel_is_a_coalesced_shared_memory_transpose(compiled, head_dim):
    """ffi/fp8_value_operand.cu, per head dim D (bytes of a key row): per thread D / 32 16-byte
    evict-first loads of key rows into shared memory, sixteen conflict-free 4-byte shared loads, the
    byte transpose in PRMT (8 per 4 x 4 bytes), four 16-byte shared stores of V^T rows (lanes below
    D / 4), then D / 32 16-byte loads of them and as many 16-byte global stores; two barriers, no local
    memory."""
    _, sass = compiled
    (text,) = [text for name, text in kernels(sass).items() if f"Fp8ValueOperandKernelILi{head_dim}E" in name]
    moves = head_dim // 32
    assert len(re.findall(r"\bLDG\b", text)) == len(re.findall(r"\bLDG\.E\.EF\.128\b", text)) == moves
    assert len(re.findall(r"\bSTG\b", text)) == len(re.findall(r"\bSTG\.E\.128\b", text)) == moves
    assert len(re.findall(r"\bSTS\b", text)) == len(re.findall(r"\bSTS\.128\b", text)) == moves + 4
    assert len(re.findall(r"\bLDS\.128\b", text)) == moves
    assert len(re.findall(r"\bLDS\s", text)) == 16  # 32-bit: one word of a key row per lane
    assert len(re.findall(r"\bPRMT\b", text)) == 32
    assert len(re.findall(r"\bBAR\.SYNC\b", text)) == 2
    assert not re.search(r"\b(LDL|STL)\b", text)


def test_int8_quantization_kernels_use_wide_accesses_and_no_local_memory(compiled):
    """ffi/int8_quantize.cu, bf16 and f16: QuantizeKernel reads a thread's half token row in eight 16-byte
    loads and writes its 64 codes in four 16-byte stores (int8, and e4m3 for v); the rotation's last
    butterfly stage is a shuffle with the partner thread; KeyStatsKernel sums columns in order. No local
    memory in either."""
    _, sass = compiled
    found = {name: text for name, text in kernels(sass).items() if "QuantizeKernel" in name or "KeyStatsKernel" in name}
    assert sorted(name.split("Kernel")[0][-8:] for name in found) == ["KeyStats", "KeyStats", "Quantize", "Quantize"]
    for name, text in found.items():
        assert not re.search(r"\b(LDL|STL)\b", text), name
        if "QuantizeKernel" in name:
            assert len(re.findall(r"\bLDG\.E\.128\b", text)) >= 8, name
            assert len(re.findall(r"\bSTG\.E\.128\b", text)) >= 8, name  # int8 and e4m3 stores
            assert len(re.findall(r"\bSHFL\.BFLY\b", text)) >= 64, name


def staged_v(name: str) -> bool:
    """Whether an FP8 kernel builds V^T in shared memory (Fp8TileT's kStagedV) rather than loading the
    layout kernel's V^T."""
    return info(name)["staged"]


def reachable(text: str, start: str) -> list[str]:
    """The instructions of one kernel's SASS reachable from the first one matching `start` (a regex),
    following branches, calls and fall-through (EXIT and RET end a path; predicated ones fall through)."""
    code = SASS_BUDGET.parse(text)
    index = {instruction.address: n for n, instruction in enumerate(code)}
    first = next(n for n, instruction in enumerate(code) if re.search(start, instruction.text))
    seen, todo = set(), [first]
    while todo:
        n = todo.pop()
        if n in seen or n >= len(code):
            continue
        seen.add(n)
        instruction = code[n]
        target = re.search(r"\b0x([0-9a-f]+)", instruction.text)
        if instruction.base in ("BRA", "CALL") and target:
            todo.append(index[int(target.group(1), 16)])
            if instruction.base == "BRA" and not instruction.conditional:
                continue
        elif instruction.base in ("EXIT", "RET") and not instruction.conditional:
            continue
        todo.append(n + 1)
    return [code[n].text for n in sorted(seen)]


def highest_register(instruction: str) -> int:
    """The highest general register an instruction touches (64/128-bit operands span 2/4 registers)."""
    parts = instruction.split()
    op = parts[1] if instruction.startswith("@") else parts[0]
    operands = instruction.split(op, 1)[1]
    width = 4 if ".128" in op else 2 if re.search(r"\.64\b|\.WIDE\b", op) else 1
    highest = -1
    for address, register in re.findall(r"(\[[^\]]*\])|\bR(\d+)\b", operands):
        if address:
            for r, wide in re.findall(r"\bR(\d+)(\.64)?", address):
                highest = max(highest, int(r) + (1 if wide else 0))
        else:
            highest = max(highest, int(register) + width - 1)
    return highest


def producer_ops(text: str) -> list[str]:
    """The opcodes an FP8 kernel's producer warps can reach after their setmaxnreg to 40 (which ptxas does
    not enforce by itself), checked to use R0..R39 only."""
    producer = reachable(text, r"USETMAXREG\.DEALLOC\.CTAPOOL 0x28\b")
    assert max(highest_register(i) for i in producer) < 40
    return [i.split()[1 if i.startswith("@") else 0] for i in producer]


def test_fp8_producer_transposes_v_within_its_40_registers(compiled):
    """V^T is built in the staged FP8 kernels (ffi/fp8_value_transpose.cuh, the matrix-instruction
    transpose, the default): the code the producer's warps can reach (the TMA thread's loop and the
    transposing warps') uses R0..R39 only; per 16-key piece and lane 4 LDSM.16.MT88.4 (ldmatrix .trans), 16
    PRMT and 4 STSM.16.M88.4, then the proxy fence (FENCE.VIEW.ASYNC.S) before v_full's arrival. The V^T-loading
    kernels' producer stays within R0..R39 too, with no transposing code. The INT8 kernels' producer is
    the staged FP8 kernels'."""
    _, sass = compiled
    found = select(sass, family=lambda f: f in ("fp8", "int8"))
    # FP8: plain, window, MLA (lean, exact; V staged, V^T), varlen (plain, window; V staged, V^T), the
    # 192-key plain kernel (lean, exact; V^T), head dims 64 and 256 (each dense plain, window: lean, exact;
    # varlen plain, window; V^T only); INT8: plain, window (head dim 128: V staged, V^T; 256: V^T), MLA
    # plain (V staged, V^T), varlen plain, window (V staged, V^T)
    assert len(found) == 42, list(found)
    assert sum(staged_v(name) for name in found) == 13, list(found)
    for name, text in found.items():
        ops = producer_ops(text)
        if not staged_v(name):  # V^T's tiles come by TMA: no transposing code (only the tile index's STS)
            assert not {"STS.128", "PRMT", "LDS", "LDSM.16.MT88.4", "STSM.16.M88.4"} & set(ops), name
            continue
        # ptxas unrolls the piece loop (its 3/3/2 trips) into several copies of the piece's 4 + 16 + 4.
        loads = ops.count("LDSM.16.MT88.4")
        assert loads >= 4 and loads % 4 == 0 and ops.count("STSM.16.M88.4") == loads, name
        assert ops.count("PRMT") == 4 * loads, name
        assert "FENCE.VIEW.ASYNC.S" in ops, name


def test_prmt_transpose_variant_builds(tmp_path):
    """The measuring build's transpose (tools/measure/prmt_transpose.h): per 16-key piece 16 conflict-free
    4-byte shared loads, 24 PRMT (ptxas recomputes up to 8 rather than hold them) and 4 16-byte shared
    stores in the staged dense kernels' producer, within its 40 registers, no spills."""
    nvcc, cuobjdump, env = toolchain(tmp_path)
    builds = [
        compile_kernels(nvcc, cuobjdump, env, tmp_path, source, "prmt_transpose")
        for source in ("instantiations/fwd_fp8_hd128_dense", "instantiations/fwd_fp8_hd192x128_dense")
    ]
    report, sass = "\n".join(b[0] for b in builds), "\n".join(b[1] for b in builds)
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert frames and all(f == ("0", "0", "0") for f in frames), report
    staged = select(sass, family="fp8", staged=True)
    assert len(staged) == 6, list(staged)
    for name, text in staged.items():
        ops = producer_ops(text)
        assert ops.count("LDS") >= 16 and ops.count("STS.128") == 4, name
        assert 24 <= ops.count("PRMT") <= 32, name
        assert "LDSM.16.MT88.4" not in ops and "FENCE.VIEW.ASYNC.S" in ops, name


def test_dense_kernels_store_o_with_tma_where_the_o_tiles_fit(compiled):
    """The TMA-store epilogue (tile_size.h's epilogue_tma for dense tiles): head dims 64 and 128, plain and windowed, write O through
    shared memory and one TMA store per 64-column slice; head dim 256 and MLA (their O tiles would not fit
    next to the K/V ring) and the varlen kernels store from registers."""
    _, sass = compiled
    dense = select(sass, family="16bit", varlen=False)
    assert len(dense) == 16, list(dense)
    for name, text in dense.items():
        stores = len(re.findall(r"\bUTMASTG\.4D\b", text))
        wide = info(name)["qk"] > 128
        assert stores == (0 if wide else 2 if info(name)["qk"] == 128 else 1), name


def test_fp8_dense_kernels_store_o_with_tma_where_the_o_tiles_fit(compiled):
    """The FP8 kernels' epilogue (the TMA store where the O tiles fit): the plain and windowed kernels, and
    MLA's with V^T loaded, write bf16 O through shared memory and one TMA store per 64-column slice (two),
    and only the LSE from registers, as do the 192-key kernels (their V^T in 64-key slices leaves the
    room); MLA's staged kernels (no room for the O tiles next to the staging buffers) and the varlen
    kernels store O from registers, as do head dim 256's (its O tiles, 64 KB, do not fit beside O's
    float32 copies)."""
    _, sass = compiled
    fp8 = select(sass, family="fp8")
    assert len(fp8) == 30, list(fp8)  # head dims 64 and 256 add 4 dense and 2 varlen kernels each
    for name, text in fp8.items():
        tma = not info(name)["varlen"] and not (info(name)["mla"] and staged_v(name)) and info(name)["v"] != 256
        stores = len(re.findall(r"\bUTMASTG\.4D\b", text))
        global_stores = len(re.findall(r"\bSTG\.E\b", text))
        slices = info(name)["v"] // 64  # one store per 64-column slice of O
        if tma:
            assert stores == slices and global_stores <= 2, f"{name}: {stores} UTMASTG, {global_stores} STG"
        else:
            assert stores == 0 and global_stores >= 16 * slices, f"{name}: {stores} UTMASTG, {global_stores} STG"


@pytest.mark.parametrize(
    "source",
    [
        "instantiations/fwd_16bit_hd128_dense",
        "instantiations/fwd_16bit_hd192x128_dense",
        "instantiations/fwd_16bit_hd128_varlen",
        "instantiations/fwd_fp8_hd128_dense",
        "instantiations/fwd_fp8_hd128_varlen",
    ],
)
def test_timeline_variant_builds(tmp_path, source):
    """The timeline build (tools/measure/timeline.h, tools/kernel_timeline.py): no spills, clock reads and
    stores in the loop. The sliding-window kernels and MLA's are built too but record nothing (their
    stamps' registers would spill), nor do the FP8 varlen ones, FP8 MLA's and the 192-key FP8 ones."""
    nvcc, cuobjdump, env = toolchain(tmp_path)
    report, sass = compile_kernels(nvcc, cuobjdump, env, tmp_path, source, "timeline")
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert frames and all(f == ("0", "0", "0") for f in frames), report
    found = select(sass, family=lambda f: True)
    assert found, source
    for name, text in found.items():
        k = info(name)
        if k["windowed"] or k["mla"] or (k["family"] == "fp8" and (k["varlen"] or k["n"] != 128)):
            assert not re.search(r"\bCS2R\b[^;]*SR_CLOCK", text), name
            continue
        # Eight clock reads per iteration (CS2R of SR_CLOCKLO/HI), more with the unrolled copies.
        assert len(re.findall(r"\bCS2R\b[^;]*SR_CLOCK", text)) >= 8, name


def check_variant_changes(
    compiled, tmp_path, source: str, measure: str, count: int, unchanged
) -> dict[str, str]:
    """ffi/<source>.cu built with tools/measure/<measure>.h: no spills, no wgmma serialization, `count`
    kernels; those for which unchanged(name) holds are the default build's, every other one differs from it
    or is new. Returns the variant's SASS per kernel."""
    nvcc, cuobjdump, env = toolchain(tmp_path)
    report, sass = compile_kernels(nvcc, cuobjdump, env, tmp_path, source, measure)
    assert not re.search(r"\(C751\d\)", report), report
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert frames and all(f == ("0", "0", "0") for f in frames), report
    default = kernels(compiled[1])
    variant = kernels(sass)
    assert len(variant) == count, list(variant)
    for name, text in variant.items():
        if unchanged(name):
            assert instructions(text) == instructions(default[name]), f"{name}: must not change"
        else:  # changed, or a kernel only the switch builds
            assert name not in default or instructions(text) != instructions(default[name]), (
                f"{name}: the switch left it as it was"
            )
            assert re.search(r"\b[HQ]GMMA\b", text), name
    return variant


def instructions(text: str) -> list[str]:
    """A kernel's SASS instructions in order, without addresses, encodings or the dump's padding (which
    follows the longest line of the whole object)."""
    return [" ".join(m.split()) for m in re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*;)", text)]


def test_fp8_wide_kernels_use_192_key_blocks(compiled):
    """The 192-key FP8 kernels (docs/fp8.md 10.26, 10.28: 192-key blocks for the dense kernel with V^T from
    memory, which Fp8KeyBlock picks for rows that see many keys), lean and exact P: S = Q K^T in
    64x192 QGMMAs (four k-steps), P V over six k-steps of 32 keys in 64x136 ones, no 128-key S, QGMMA in
    batches, no local memory; lean P without exponentials. (Their V^T comes in three 64-key,
    64-byte-swizzled slices, docs/fp8.md 10.29, which leaves room for the TMA-store epilogue: checked above.)"""
    _, sass = compiled
    wide = select(sass, family="fp8", n=192)
    assert len(wide) == 2, list(wide)
    for name, text in wide.items():
        qk = len(re.findall(r"\bQGMMA\.64x192x32\.F32\.E4M3\.E4M3", text))
        pv = len(re.findall(r"\bQGMMA\.64x136x32\.F32\.E4M3\.E4M3 R\d+, R\d+,", text))
        assert qk >= 4 and qk % 4 == 0 and pv >= 6 and pv % 6 == 0, f"{name}: {qk} Q K^T, {pv} P V"
        assert not re.search(r"\bQGMMA\.64x128x32\b", text), name
        assert len(re.findall(r"\bWARPGROUP\.ARRIVE\b", text)) * 3 < len(re.findall(r"\bQGMMA\b", text)), name
        assert "USETMAXREG" in text and not re.search(r"\b(LDL|STL)\b", text), name
        assert ("MUFU.EX2" in text) != info(name)["lean"], name


def common_path(text: str, qk_shape: str, name: str):
    """tools/sass_budget.py's walk of one key block, (instructions, opcodes), checked free of the rare
    paths: no shared-memory copy or local memory, no call, not the mask's FSELs or the rescale's FMULs."""
    path = SASS_BUDGET.common_iteration(SASS_BUDGET.parse(text), qk_shape)
    ops = [i.opcode for i in path]
    assert not {"LDS", "STS", "LDL", "STL", "CALL"} & {i.base for i in path}, name
    assert sum(op == "FSEL" for op in ops) < 8 and sum(op == "FMUL" for op in ops) < 16, name
    return path, ops


@pytest.mark.parametrize("block_n", [192, 128])
def test_fp8_sass_budget_walks_one_key_block(compiled, block_n):
    """tools/sass_budget.py (docs/fp8.md 10.32) on the dense V^T FP8 kernels: the common path of one key
    block holds one Q K^T (four k-steps) and one P V (block_n / 32 k-steps), one code per score (64 x
    block_n per warpgroup, block_n / 2 per thread: lean, an FFMA.SAT each and no exponential; exact,
    an EX2 each and an F2FP per two), and none of the rare paths (the mask's FSELs, the promotion's
    shared-memory copy, the rescale's FMULs)."""
    _, sass = compiled
    found = select(sass, family="fp8", n=block_n, staged=False, varlen=False, windowed=False, qk=128)
    assert len(found) == 2, list(found)  # lean and exact P
    scores = block_n // 2
    for name, text in found.items():
        path, ops = common_path(text, f"QGMMA.64x{block_n}x32", name)
        assert sum(op.startswith(f"QGMMA.64x{block_n}x32") for op in ops) == 4, name
        assert sum(op.startswith("QGMMA.64x136x32") for op in ops) == block_n // 32, name
        if info(name)["lean"]:
            assert ops.count("FFMA.SAT") == scores and "MUFU.EX2" not in ops, name
        else:
            assert ops.count("MUFU.EX2") == scores and sum(op.startswith("F2FP") for op in ops) == scores // 2
        budget = SASS_BUDGET.budget(path, block_n)
        assert budget["tensor_cycles"] == 2 * (64 * block_n * 128 * 2 + 64 * 136 * block_n * 2) / 8192
        assert budget["issue_per_scheduler"] == 2 * len(path) < budget["tensor_cycles"], name


def test_sass_budget_walks_the_16bit_kernel(compiled):
    """The same walk on the 16-bit kernel (bf16, head dim 128; docs/fp8.md 10.32): Q K^T and P V in eight
    k-steps of 16 each, one exponential per score (64 per thread) on the common path, no mask or rescale;
    its tensor time at the bf16 rate (4096 FLOP per SM and clock) with no sum columns."""
    _, sass = compiled
    (text,) = select(sass, family="16bit", element="bf16", qk=128, varlen=False, windowed=False).values()
    path, ops = common_path(text, "HGMMA.64x128x16", "bf16")
    assert sum(op.startswith("HGMMA.64x128x16") for op in ops) == 16
    assert 64 <= ops.count("MUFU.EX2") <= 68
    assert SASS_BUDGET.budget(path, 128, dtype="bf16")["tensor_cycles"] == 2048


def wide_16bit_kernels(
    compiled, tmp_path, measure: str, count: int, head_dim: int, block_n: int, hgmmas: int
):
    """The dense head_dim instantiations built with tools/measure/<measure>.h (check_variant_changes: `count`
    kernels, the default ones unchanged): its two wide kernels (bf16, f16) at (head_dim, block_n), S = Q K^T
    in `hgmmas` 64 x block_n HGMMAs each. Returns their SASS per kernel."""
    source = f"instantiations/fwd_16bit_hd{head_dim}_dense"
    default_n = 64 if head_dim > 128 else 128
    variant = check_variant_changes(
        compiled, tmp_path, source, measure, count, lambda name: info(name)["n"] == default_n
    )
    wide = {name: text for name, text in variant.items() if info(name)["n"] == block_n}
    assert len(wide) == 2 and all(f"Li{head_dim}ELi{head_dim}ELi{block_n}E" in name for name in wide), list(
        wide
    )
    for name, text in wide.items():
        assert len(re.findall(rf"\bHGMMA\.64x{block_n}x16\b", text)) == hgmmas, name
    return wide


def test_16bit_hd256_80_key_variant_builds(compiled, tmp_path):
    """tools/measure/hd256_80_keys.h (80-key blocks at head dim 256, causal or no mask; docs/benchmarks.md)
    puts 80-key kernels for bf16 and f16 where the 64-key ones were, without spills or wgmma serialization:
    S = Q K^T in 64x80 HGMMAs (three issue sites of sixteen k-steps), its producer at 24 registers and its
    consumers at 240 (at 232 they spill); the windowed kernels unchanged."""
    wide = wide_16bit_kernels(compiled, tmp_path, "hd256_80_keys", 4, 256, 80, 48)
    for name, text in wide.items():
        assert re.search(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d, 0xf0\b", text), (
            f"{name}: consumers not at 240"
        )
        # ptxas does not hold the producer to its setmaxnreg: what its warps can reach must use R0..R23.
        producer = reachable(text, r"USETMAXREG\.DEALLOC\.CTAPOOL 0x18\b")
        assert producer and max(highest_register(i) for i in producer) < 24, name


def test_16bit_wide_no_mask_variant_builds(compiled, tmp_path):
    """tools/measure/nomask_176_keys.h (docs/fp8.md 10.27: 176-key blocks for head dim 128 without a mask)
    adds 176-key kernels for bf16 and f16, without spills or wgmma serialization, S = Q K^T in 64x176
    HGMMAs (three issue sites of eight k-steps); every default kernel stays as it was."""
    wide_16bit_kernels(compiled, tmp_path, "nomask_176_keys", 6, 128, 176, 24)


# The backward kernels (ffi/instantiations/bwd_16bit_hd*.cu): BwdKernel over BwdDkdvMainloop and
# BwdDqMainloop <Element, q/k head dim, v head dim>.
BWD_KERNEL_NAME = re.compile(
    r"_ZN5jzyfa9BwdKernelINS_\d+(?P<kind>BwdDkdvMainloop|BwdDqMainloop)I(?P<element>13__nv_bfloat16|6__half)"
    r"Li(?P<qk>\d+)ELi(?P<v>\d+)E"
)
# Register-A GEMMs (A = P^T, dS^T or dS from registers, an MN-major B), by N, per block of each kernel:
# 4 k-steps of 16 rows each. Not split (64, 128; MLA's dQ): N = the head dim. Head dim 256 splits the
# columns in halves (N = 128), MLA's dK/dV unevenly, a code copy per consumer: consumer 0 dV N = 64
# and dK N = 128, consumer 1 both N = 64 (ffi/tile_size.h's BwdSplitColumns).
BWD_REGISTER_A_GEMMS = {
    ("BwdDkdvMainloop", 64, 64): {64: 8},
    ("BwdDkdvMainloop", 128, 128): {128: 8},
    ("BwdDkdvMainloop", 256, 256): {128: 8},
    ("BwdDkdvMainloop", 192, 128): {64: 12, 128: 4},
    ("BwdDqMainloop", 64, 64): {64: 4},
    ("BwdDqMainloop", 128, 128): {128: 4},
    ("BwdDqMainloop", 256, 256): {128: 4},
    ("BwdDqMainloop", 192, 128): {192: 4},
}


def test_backward_kernels_use_hgmma_without_local_memory(compiled):
    """Both backward kernels, bf16 and f16, head dims 64, 128, 256 and 192/128: spill-free (the report
    check above), no local memory, per key/query block S (S^T) and dP (dP^T) on 64x64x16 HGMMA (qk / 16
    and v / 16 k-steps; MLA's dK/dV has them in each consumer's copy) and the register-A GEMMs of
    BWD_REGISTER_A_GEMMS, ex2 on the MUFU, TMA loads, the producer at 40 registers and the consumers at
    232."""
    _, sass = compiled
    found = {name: text for name, text in kernels(sass).items() if BWD_KERNEL_NAME.match(name)}
    kinds = sorted(
        (m["kind"], m["element"], int(m["qk"]), int(m["v"]))
        for m in (BWD_KERNEL_NAME.match(name) for name in found)
    )
    assert kinds == sorted(
        (kind, element, qk, v)
        for kind, qk, v in BWD_REGISTER_A_GEMMS
        for element in ("13__nv_bfloat16", "6__half")
    ), kinds
    for name, text in found.items():
        m = BWD_KERNEL_NAME.match(name)
        qk, v = int(m["qk"]), int(m["v"])
        copies = 2 if (m["kind"], qk, v) == ("BwdDkdvMainloop", 192, 128) else 1
        ss = len(re.findall(r"\bHGMMA\.64x64x16\.F32(?:\.BF16)? R\d+, gdesc", text))
        assert ss >= copies * (qk + v) // 16, f"{name}: {ss} shared-memory HGMMA"
        for n, want in BWD_REGISTER_A_GEMMS[m["kind"], qk, v].items():
            rs = len(re.findall(rf"\bHGMMA\.64x{n}x16\.F32(?:\.BF16)? R\d+, R\d+, gdesc\[UR\d+\]\.tnspB", text))
            assert rs >= want, f"{name}: {rs} register-A HGMMA of N = {n}"
        assert "MUFU.EX2" in text, name
        assert not re.search(r"\b(LDL|STL)\b", text), f"{name}: local memory traffic"
        # The producer warpgroup loads with TMA at 40 registers, the consumers compute at 232.
        assert "UTMALDG.4D" in text, name
        assert re.search(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d+, 0xe8\b", text), name
        assert re.search(r"USETMAXREG\.DEALLOC\.CTAPOOL 0x28\b", text), name
