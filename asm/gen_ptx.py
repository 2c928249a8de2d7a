#!/usr/bin/env python3
"""Generates `jzyfa_ptx.h`: the inline-PTX wrappers the Hopper kernels use.

A `wgmma.mma_async` of shape m64nNk16 with f32 accumulators names N/2 registers per
thread (64 for N = 128, 128 for N = 256). Writing those operand lists by hand, or with
C++ template tricks, is error prone; this script spells every one out. Both builds
(CMake and Bazel) run it and the kernels `#include "jzyfa_ptx.h"`.

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
INPUT_TYPES = {"bf16": "bf16", "f16": "f16"}


@dataclasses.dataclass(frozen=True)
class Wgmma:
    """One wgmma.mma_async variant: m64nNk16, f32 accumulators, 16-bit inputs."""

    n: int
    dtype: str  # "bf16" or "f16"
    a_from_registers: bool  # A in registers (P of P V) or in shared memory (Q of Q K^T)
    b_transposed: bool  # B is MN-major in shared memory (V of P V)
    # D = A B, not D += A B: the accumulators are outputs only. Lets the compiler see that the
    # first k-step of a GEMM does not read registers that ordinary code wrote while other
    # wgmmas were in flight (otherwise ptxas serializes every wgmma, warning C7513).
    overwrite: bool = False

    @property
    def num_acc(self) -> int:
        return self.n // 2

    @property
    def name(self) -> str:
        a = "rs" if self.a_from_registers else "ss"
        b = "_tb" if self.b_transposed else ""
        z = "_zero" if self.overwrite else ""
        return f"wgmma_m64n{self.n}k16_f32_{self.dtype}_{a}{b}{z}"

    @property
    def mnemonic(self) -> str:
        t = INPUT_TYPES[self.dtype]
        return f"wgmma.mma_async.sync.aligned.m64n{self.n}k16.f32.{t}.{t}"


def _acc_list(count: int, first: int) -> str:
    return ", ".join(f"%{first + i}" for i in range(count))


def wgmma_function(op: Wgmma) -> str:
    """A C++ inline function wrapping one wgmma instruction.

    Operand numbering: accumulators first (read-write "+f"), then A (descriptor or four
    32-bit registers), the B descriptor and the scale-d flag.
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
    trans_b = 1 if op.b_transposed else 0
    # Immediate operands: scale-a, scale-b (1 = no negation), then the transpose flags.
    # With A from registers only tnsp-B exists.
    if op.a_from_registers:
        imms = f"1, 1, {trans_b}"
    else:
        imms = f"1, 1, 0, {trans_b}"
    outputs = ", ".join(f'"+f"(d[{i}])' for i in range(op.num_acc))
    lines = [
        f"// {op.mnemonic}: D[64 x {op.n}] (+)= A[64 x 16] * B[16 x {op.n}]"
        + (", B MN-major" if op.b_transposed else "")
        + (", A from registers" if op.a_from_registers else ""),
        f"__device__ __forceinline__ void {op.name}(float (&d)[{op.num_acc}], {a_param},",
        "    uint64_t desc_b, int accumulate) {",
        "  asm volatile(",
        '      "{\\n"',
        '      ".reg .pred p;\\n"',
        f'      "setp.ne.b32 p, {scale_operand}, 0;\\n"',
        f'      "{op.mnemonic} "',
        f'      "{{{acc}}}, "',
        f'      "{a_operand}, {b_operand}, p, {imms};\\n"',
        '      "}\\n"',
        f"      : {outputs}",
        f'      : {a_inputs}, "l"(desc_b), "r"(accumulate));',
        "}",
    ]
    return "\n".join(lines)


def _overwrite_function(
    op: Wgmma, acc: str, a_operand: str, a_param: str, a_inputs: str, b_operand: str
) -> str:
    trans = "1" if op.b_transposed else "0"
    imms = f"1, 1, {trans}" if op.a_from_registers else f"1, 1, 0, {trans}"
    outputs = ", ".join(f'"=f"(d[{i}])' for i in range(op.num_acc))
    lines = [
        f"// {op.mnemonic} with scale-d = false: D[64 x {op.n}] = A[64 x 16] * B[16 x {op.n}]",
        f"__device__ __forceinline__ void {op.name}(float (&d)[{op.num_acc}], {a_param},",
        "    uint64_t desc_b) {",
        "  asm volatile(",
        '      "{\\n"',
        '      ".reg .pred p;\\n"',
        '      "setp.ne.b32 p, 0, 0;\\n"',
        f'      "{op.mnemonic} "',
        f'      "{{{acc}}}, "',
        f'      "{a_operand}, {b_operand}, p, {imms};\\n"',
        '      "}\\n"',
        f"      : {outputs}",
        f'      : {a_inputs}, "l"(desc_b));',
        "}",
    ]
    return "\n".join(lines)


def all_wgmma_ops() -> list[Wgmma]:
    ops = []
    for dtype in INPUT_TYPES:
        for n in WGMMA_N:
            ops.append(Wgmma(n, dtype, a_from_registers=False, b_transposed=False))
            ops.append(Wgmma(n, dtype, a_from_registers=False, b_transposed=False, overwrite=True))
            ops.append(Wgmma(n, dtype, a_from_registers=True, b_transposed=True))
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


CPP_ELEMENT_TYPES = {"bf16": "__nv_bfloat16", "f16": "__half"}


def dispatch_structs() -> str:
    """`Wgmma<Element, N>`: the wrappers of one input type and width, for templated kernels."""
    by_shape: dict[tuple[str, int], list[Wgmma]] = {}
    for op in all_wgmma_ops():
        by_shape.setdefault((op.dtype, op.n), []).append(op)
    role = {(False, False, False): "ss", (False, False, True): "ss_zero", (True, True, False): "rs_tb"}
    lines = [
        "// Wgmma<Element, N>::ss (Q K^T: both operands in shared memory), ::ss_zero (the same,",
        "// overwriting D) and ::rs_tb (P V: A from registers, B MN-major).",
        "template <typename Element, int N>",
        "struct Wgmma;",
    ]
    for (dtype, n), ops in by_shape.items():
        lines.append(f"template <>\nstruct Wgmma<{CPP_ELEMENT_TYPES[dtype]}, {n}> {{")
        for op in ops:
            name = role[(op.a_from_registers, op.b_transposed, op.overwrite)]
            lines.append(f"  static constexpr auto {name} = {op.name};")
        lines.append("};")
    return "\n".join(lines)


def render_header() -> str:
    parts = [
        "// Generated by asm/gen_ptx.py. Do not edit: change the generator.",
        "#pragma once",
        "#include <cuda_bf16.h>",
        "#include <cuda_fp16.h>",
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
    parts += [dispatch_structs(), "", "}  // namespace ptx", "}  // namespace jzyfa", ""]
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
