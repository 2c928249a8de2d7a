"""The PTX generator (asm/gen_ptx.py): its text, and that nvcc turns it into HGMMA for sm_90a."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_ptx", REPO / "asm" / "gen_ptx.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_ptx"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gen_ptx = load_generator()


def find_tool(name: str) -> str | None:
    """A CUDA tool on PATH, in the CUDA toolkit, or in the pip wheels (nvidia-cuda-*)."""
    candidates = [shutil.which(name), f"/usr/local/cuda/bin/{name}"]
    purelib = pathlib.Path(sysconfig.get_paths()["purelib"])
    candidates += [str(p) for p in sorted(purelib.glob(f"nvidia/cu*/bin/{name}"))]
    return next((c for c in candidates if c and os.path.exists(c)), None)


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


def test_header_has_every_shape_once():
    header = gen_ptx.render_header()
    for op in gen_ptx.all_wgmma_ops():
        assert header.count(f"void {op.name}(") == 1
    for name in ("mbarrier_wait", "tma_load_4d", "wgmma_fence", "wgmma_commit_group", "ex2_approx"):
        assert f" {name}(" in header


def test_dispatch_structs_name_every_role():
    text = gen_ptx.dispatch_structs()
    for dtype, element in gen_ptx.CPP_ELEMENT_TYPES.items():
        for n in gen_ptx.WGMMA_N:
            assert f"struct Wgmma<{element}, {n}> {{" in text
            for role, suffix in (("ss", "ss"), ("ss_zero", "ss_zero"), ("rs_tb", "rs_tb")):
                assert f"static constexpr auto {role} = wgmma_m64n{n}k16_f32_{dtype}_{suffix};" in text


def test_generator_cli_writes_header(tmp_path):
    out = tmp_path / "sub" / "jzyfa_ptx.h"
    subprocess.run([sys.executable, str(REPO / "asm" / "gen_ptx.py"), "--out", str(out)], check=True)
    assert out.read_text() == gen_ptx.render_header()


PROBE_KERNEL = r"""
// Runs one generated wgmma so its shape reaches the SASS.
__global__ void probe_%NAME%(float* out, uint64_t da, uint64_t db, uint32_t a0) {
  const uint32_t a[4] = {a0, a0 + 1, a0 + 2, a0 + 3};
  float d[%ACC%] = {};
  wgmma_fence();
  %NAME%(d, %A%, db%ACCUMULATE%);
  wgmma_commit_group();
  wgmma_wait_group<0>();
  for (int i = 0; i < %ACC%; ++i) out[i * blockDim.x + threadIdx.x] = d[i];
}
"""


def probe_source() -> str:
    kernels = ['#include "jzyfa_ptx.h"', "using namespace jzyfa::ptx;"]
    for op in gen_ptx.all_wgmma_ops():
        kernels.append(
            PROBE_KERNEL.replace("%NAME%", op.name)
            .replace("%ACC%", str(op.num_acc))
            .replace("%A%", "a" if op.a_from_registers else "da")
            .replace("%ACCUMULATE%", "" if op.overwrite else ", 1")
        )
    return "\n".join(kernels)


@pytest.mark.skipif(os.environ.get("JZYFA_SKIP_NVCC") == "1", reason="JZYFA_SKIP_NVCC=1")
def test_compiles_to_hgmma_for_sm90a(tmp_path):
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
    for op in gen_ptx.all_wgmma_ops():
        # e.g. HGMMA.64x128x16.F32.BF16 (the f16 form prints without a type suffix)
        assert re.search(rf"HGMMA\.64x{op.n}x16\.F32", sass), f"no HGMMA for {op.name}"
    assert "HGMMA.64x256x16.F32.BF16" in sass
    assert "LDL" not in sass and "STL" not in sass, "register spills in the probe kernel"
