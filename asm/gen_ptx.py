#!/usr/bin/env python3
"""Generates `jzyfa_ptx.h`: the inline-PTX wrappers the Hopper kernels use.

A `wgmma.mma_async` of shape m64nNk16 (16-bit inputs) or m64nNk32 (e4m3 inputs) with f32
accumulators names N/2 registers per thread (64 for N = 128, 128 for N = 256). Writing those
operand lists by hand, or with C++ template tricks, is error prone; this script spells every one
out. Both builds (CMake and Bazel) run it and the kernels `#include "jzyfa_ptx.h"`.

Usage: python3 asm/gen_ptx.py --out path/to/jzyfa_ptx.h
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

# The wgmma shapes the kernels use: S = Q K^T takes N = key-block width; O += P V takes
# N = 64 per 64-column slice of the head dim (one 128-byte swizzle atom wide).
WGMMA_N = (64, 128, 256)
# The FP8 kernel's P V: v's head dim (64 or 128) plus 8 columns that sum P (see all_wgmma_ops).
FP8_PV_WITH_SUM_N = (72, 136)
# At head dim 256 (a wgmma's N stops at 256) the 8 sum columns take a P V of their own.
FP8_ROW_SUM_N = (8,)
# Wider FP8 key blocks (S = Q K^T only, shared-memory operands): FlashFwdFp8WideKernel's 192.
FP8_WIDE_QK_N = (192,)
# Other 16-bit key blocks (S = Q K^T only, shared-memory operands; P V keeps N = head dim):
# hd128 without a mask, 176 keys (-DJZYFA_NOMASK_BLOCK_N=176); hd256, 80 keys (-DJZYFA_HD256_BLOCK_N=80).
WIDE_QK_N = (80, 176)
# The 16-bit backward's register-A products wider than WGMMA_N: MLA's dQ += dS K, N = q/k head dim 192.
BWD_WIDE_RS_N = (192,)
# Input type -> PTX type. A wgmma k-step covers 32 bytes of K: k16 for 16-bit, k32 for 8-bit inputs.
INPUT_TYPES = {"bf16": "bf16", "f16": "f16", "e4m3": "e4m3", "s8": "s8"}
INPUT_BITS = {"bf16": 16, "f16": 16, "e4m3": 8, "s8": 8}
# The INT8 kernels' S = Q K^T (s8 x s8 into exact int32 sums; shared-memory operands): their key
# blocks (64 at head dim 256, 128 at 128).
INT8_QK_N = (64, 128)


@dataclasses.dataclass(frozen=True)
class Wgmma:
    """One wgmma.mma_async variant: m64nNk16 (bf16, f16) or m64nNk32 (e4m3, s8); f32 accumulators, s32
    for s8 (held in uint32_t registers)."""

    n: int
    dtype: str  # "bf16", "f16", "e4m3" or "s8"
    a_from_registers: bool  # A in registers (P of P V) or in shared memory (Q of Q K^T)
    b_transposed: bool  # B is MN-major in shared memory (V of P V); 16-bit inputs only
    # D = A B, not D += A B: the accumulators are outputs only. Lets the compiler see that the
    # first k-step of a GEMM does not read registers that ordinary code wrote while other
    # wgmmas were in flight (otherwise ptxas serializes every wgmma, warning C7513).
    overwrite: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in INPUT_TYPES:
            raise ValueError(f"unknown wgmma input type {self.dtype!r}")
        if self.b_transposed and not self.transposable:
            raise ValueError(f"{self.dtype} wgmma takes K-major operands only: no transposed B")

    @property
    def k(self) -> int:
        return 256 // INPUT_BITS[self.dtype]

    @property
    def transposable(self) -> bool:
        """Only 16-bit inputs have the imm-trans-a / imm-trans-b operands (MN-major smem)."""
        return INPUT_BITS[self.dtype] == 16

    @property
    def num_acc(self) -> int:
        return self.n // 2

    @property
    def integer(self) -> bool:
        return self.dtype == "s8"

    @property
    def acc_type(self) -> str:
        return "s32" if self.integer else "f32"

    @property
    def acc_cpp(self) -> str:
        """The C++ type of an accumulator register and its asm constraint letter."""
        return "uint32_t" if self.integer else "float"

    @property
    def acc_constraint(self) -> str:
        return "r" if self.integer else "f"

    @property
    def name(self) -> str:
        a = "rs" if self.a_from_registers else "ss"
        b = "_tb" if self.b_transposed else ""
        z = "_zero" if self.overwrite else ""
        return f"wgmma_m64n{self.n}k{self.k}_{self.acc_type}_{self.dtype}_{a}{b}{z}"

    @property
    def mnemonic(self) -> str:
        t = INPUT_TYPES[self.dtype]
        return f"wgmma.mma_async.sync.aligned.m64n{self.n}k{self.k}.{self.acc_type}.{t}.{t}"

    @property
    def immediates(self) -> str:
        """imm-scale-a, imm-scale-b (1 = no negation), then the transpose flags where the type has
        them: imm-trans-a (A in shared memory only) and imm-trans-b. 8-bit types have none, integer
        types not even the scales (an empty string: no operand follows scale-d)."""
        if self.integer:
            return ""
        imms = ["1", "1"]
        if self.transposable:
            if not self.a_from_registers:
                imms.append("0")
            imms.append("1" if self.b_transposed else "0")
        return ", ".join(imms)


def _acc_list(count: int, first: int) -> str:
    return ", ".join(f"%{first + i}" for i in range(count))


def wgmma_function(op: Wgmma) -> str:
    """A C++ inline function wrapping one wgmma instruction.

    Operand numbering: accumulators first (read-write "+f", or "+r" for s32), then A (descriptor or four
    32-bit registers: two 16-bit or four e4m3 values each), the B descriptor and the scale-d flag.
    """
    acc = _acc_list(op.num_acc, 0)
    nxt = op.num_acc
    if op.a_from_registers:
        a_operand = "{" + _acc_list(4, nxt) + "}"
        a_param = "const uint32_t (&a)[4]"
        a_inputs = ", ".join(f'"r"(a[{i}])' for i in range(4))
        nxt += 4
    else:
        a_operand = f"%{nxt}"
        a_param = "uint64_t desc_a"
        a_inputs = '"l"(desc_a)'
        nxt += 1
    b_operand = f"%{nxt}"
    scale_operand = f"%{nxt + 1}"
    if op.overwrite:
        return _overwrite_function(op, acc, a_operand, a_param, a_inputs, b_operand)
    imms = op.immediates
    outputs = ", ".join(f'"+{op.acc_constraint}"(d[{i}])' for i in range(op.num_acc))
    lines = [
        f"// {op.mnemonic}: D[64 x {op.n}] (+)= A[64 x {op.k}] * B[{op.k} x {op.n}]"
        + (", B MN-major" if op.b_transposed else "")
        + (", A from registers" if op.a_from_registers else ""),
        f"__device__ __forceinline__ void {op.name}({op.acc_cpp} (&d)[{op.num_acc}], {a_param},",
        "    uint64_t desc_b, int accumulate) {",
        "  asm volatile(",
        '      "{\\n"',
        '      ".reg .pred p;\\n"',
        f'      "setp.ne.b32 p, {scale_operand}, 0;\\n"',
        f'      "{op.mnemonic} "',
        f'      "{{{acc}}}, "',
        f'      "{a_operand}, {b_operand}, p{", " + imms if imms else ""};\\n"',
        '      "}\\n"',
        f"      : {outputs}",
        f'      : {a_inputs}, "l"(desc_b), "r"(accumulate));',
        "}",
    ]
    return "\n".join(lines)


def _overwrite_function(
    op: Wgmma, acc: str, a_operand: str, a_param: str, a_inputs: str, b_operand: str
) -> str:
    imms = op.immediates
    outputs = ", ".join(f'"={op.acc_constraint}"(d[{i}])' for i in range(op.num_acc))
    lines = [
        f"// {op.mnemonic} with scale-d = false: D[64 x {op.n}] = A[64 x {op.k}] * B[{op.k} x {op.n}]"
        + (", B MN-major" if op.b_transposed else "")
        + (", A from registers" if op.a_from_registers else ""),
        f"__device__ __forceinline__ void {op.name}({op.acc_cpp} (&d)[{op.num_acc}], {a_param},",
        "    uint64_t desc_b) {",
        "  asm volatile(",
        '      "{\\n"',
        '      ".reg .pred p;\\n"',
        '      "setp.ne.b32 p, 0, 0;\\n"',
        f'      "{op.mnemonic} "',
        f'      "{{{acc}}}, "',
        f'      "{a_operand}, {b_operand}, p{", " + imms if imms else ""};\\n"',
        '      "}\\n"',
        f"      : {outputs}",
        f'      : {a_inputs}, "l"(desc_b));',
        "}",
    ]
    return "\n".join(lines)


def all_wgmma_ops() -> list[Wgmma]:
    ops = []
    for dtype in ("bf16", "f16"):
        for n in WGMMA_N:
            ops.append(Wgmma(n, dtype, a_from_registers=False, b_transposed=False))
            ops.append(Wgmma(n, dtype, a_from_registers=False, b_transposed=False, overwrite=True))
            ops.append(Wgmma(n, dtype, a_from_registers=True, b_transposed=True))
        for n in WIDE_QK_N:
            for overwrite in (False, True):
                ops.append(Wgmma(n, dtype, a_from_registers=False, b_transposed=False,
                                 overwrite=overwrite))
        for n in BWD_WIDE_RS_N:
            ops.append(Wgmma(n, dtype, a_from_registers=True, b_transposed=True))
    # FP8: K-major A and B only (no transposed B), so V reaches the kernel transposed (V^T,
    # seq-contiguous) and P V takes P from registers with a plain K-major B.
    for n in WGMMA_N:
        for a_from_registers in (False, True):
            for overwrite in (False, True):
                ops.append(Wgmma(n, "e4m3", a_from_registers, b_transposed=False, overwrite=overwrite))
    for n in FP8_WIDE_QK_N:
        for overwrite in (False, True):
            ops.append(Wgmma(n, "e4m3", False, b_transposed=False, overwrite=overwrite))
    # P V with 8 more columns: V^T's tile is followed by 8 rows of e4m3 ones, so columns
    # D..D+7 of O accumulate the row sum of exactly the rounded P (docs/fp8.md).
    for n in FP8_PV_WITH_SUM_N + FP8_ROW_SUM_N:
        for overwrite in (False, True):
            ops.append(Wgmma(n, "e4m3", True, b_transposed=False, overwrite=overwrite))
    # INT8 Q K^T: s8 operands from shared memory, K-major, exact s32 sums.
    for n in INT8_QK_N:
        for overwrite in (False, True):
            ops.append(Wgmma(n, "s8", False, b_transposed=False, overwrite=overwrite))
    return ops


# Synchronisation, TMA and mbarrier wrappers. Fixed text: one instruction each.
_COMMON = r"""
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit_group() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving accumulator reads/writes across a wgmma boundary.
__device__ __forceinline__ void fence_operand(float& r) {
  asm volatile("" : "+f"(r)::"memory");
}

__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t arrive_count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrive_count)
               : "memory");
}
// Orders this thread's ordinary shared-memory writes before later reads by the async proxy
// (wgmma operands, TMA); a barrier must still follow for other threads' wgmma.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
// Blocks until the barrier's phase with the given parity has completed.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// TMA: a 4-D tile of the tensor map lands in shared memory; completion is counted in
// bytes on the mbarrier. Coordinates are innermost first.
__device__ __forceinline__ void tma_load_4d(uint32_t smem_dst, const void* tensor_map,
                                            uint32_t bar, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(smem_dst),
      "l"(tensor_map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
// TMA store: a 4-D box of shared memory to the tensor map's tensor (elements past its end are
// not written), tracked by bulk groups: commit, then wait until the source was read (.read: the
// buffer may be reused) or the writes are done.
__device__ __forceinline__ void tma_store_4d(const void* tensor_map, uint32_t smem_src, int c0,
                                             int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
          tensor_map),
      "r"(smem_src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
__device__ __forceinline__ void tma_store_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
template <int kPending>
__device__ __forceinline__ void tma_store_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}
// Warp specialization: the producer warpgroup gives registers back, consumers take them.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
// Named barriers (id 0 is __syncthreads): `count` threads, a multiple of 32, take part.
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// 2^x on the MUFU unit (flush-to-zero, ~2 ulp): the softmax's exponential.
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ void prefetch_tensor_map(const void* tensor_map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(tensor_map) : "memory");
}
"""


# FP8 conversion for the A operand of the e4m3 wgmma (P of P V). Fixed text.
_FP8 = r"""// Four floats to the four e4m3 bytes of one 32-bit register, `a` in the lowest byte (the
// lowest k index of a wgmma A-fragment register). Round to nearest even; finite values beyond
// +-448 saturate to +-448 (.satfinite). Careful: `cvt.rn.satfinite.e4m3x2.f32 d, x, y` puts
// its FIRST source x in the UPPER byte of d and y in the lower byte (PTX ISA, cvt: "the value
// converted from input a is stored in the upper half of d"), as in cuda_fp8.hpp's
// `cvt... %0, %2, %1` for (x.x, x.y); hence the swapped operands below.
__device__ __forceinline__ uint32_t pack4_e4m3(float a, float b, float c, float d) {
  uint32_t packed;
  asm("{\n"
      ".reg .b16 lo, hi;\n"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      "mov.b32 %0, {lo, hi};\n"
      "}\n"
      : "=r"(packed)
      : "f"(a), "f"(b), "f"(c), "f"(d));
  return packed;
}
"""


CPP_ELEMENT_TYPES = {"bf16": "__nv_bfloat16", "f16": "__half", "e4m3": "__nv_fp8_e4m3", "s8": "int8_t"}


def dispatch_structs() -> str:
    """`Wgmma<Element, N>`: the wrappers of one input type and width, for templated kernels."""
    by_shape: dict[tuple[str, int], list[Wgmma]] = {}
    for op in all_wgmma_ops():
        by_shape.setdefault((op.dtype, op.n), []).append(op)
    role = {
        (False, False, False): "ss",
        (False, False, True): "ss_zero",
        (True, True, False): "rs_tb",
        (True, False, False): "rs",
        (True, False, True): "rs_zero",
    }
    lines = [
        "// Wgmma<Element, N>::ss (Q K^T: both operands in shared memory), ::ss_zero (the same,",
        "// overwriting D) and ::rs_tb (P V: A from registers, B MN-major).",
        "// Wgmma<__nv_fp8_e4m3, N>, alias WgmmaFp8<N> (k32, K-major operands only): ::ss, ::ss_zero,",
        "// ::rs (P V: A from registers, B = V^T, K-major) and ::rs_zero.",
        "// Wgmma<int8_t, N> (k32, s32 accumulators in uint32_t registers): ::ss and ::ss_zero.",
        "template <typename Element, int N>",
        "struct Wgmma;",
    ]
    for (dtype, n), ops in by_shape.items():
        lines.append(f"template <>\nstruct Wgmma<{CPP_ELEMENT_TYPES[dtype]}, {n}> {{")
        for op in ops:
            name = role[(op.a_from_registers, op.b_transposed, op.overwrite)]
            lines.append(f"  static constexpr auto {name} = {op.name};")
        lines.append("};")
    lines += ["template <int N>", f"using WgmmaFp8 = Wgmma<{CPP_ELEMENT_TYPES['e4m3']}, N>;"]
    return "\n".join(lines)


def render_header() -> str:
    parts = [
        "// Generated by asm/gen_ptx.py. Do not edit: change the generator.",
        "#pragma once",
        "#include <cuda_bf16.h>",
        "#include <cuda_fp16.h>",
        "#include <cuda_fp8.h>",
        "",
        "#include <cstdint>",
        "",
        "namespace jzyfa {",
        "namespace ptx {",
        _COMMON,
    ]
    for op in all_wgmma_ops():
        parts.append(wgmma_function(op))
        parts.append("")
    parts += [_FP8, dispatch_structs(), "", "}  // namespace ptx", "}  // namespace jzyfa", ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path of the header to write")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = render_header()
    # Rewrite only on change, so builds that track timestamps stay incremental.
    if not out.exists() or out.read_text() != text:
        out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
