// Small device-side building blocks of the Hopper kernels: wgmma shared-memory
// descriptors, the per-dtype wgmma wrappers, register fences and quad reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "jzyfa_ptx.h"

namespace jzyfa {

// wgmma shared-memory descriptor for a 128-byte-swizzled operand: 8-row groups 1024 bytes
// apart (the stride offset). K-major (Q, K): the leading offset is unused. MN-major (V as
// B of P V): the leading offset is the distance between 64-column atoms along N.
__device__ __forceinline__ uint64_t SmemDescSw128(uint32_t smem_addr, uint32_t lbo_bytes) {
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4);
  desc |= static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFF) << 16;
  desc |= static_cast<uint64_t>((1024 >> 4) & 0x3FFF) << 32;
  desc |= 1ull << 62;  // swizzle mode: 128 bytes
  return desc;
}

// The wgmma flavours a kernel needs, per 16-bit input type.
template <typename Element>
struct Wgmma;

template <>
struct Wgmma<__nv_bfloat16> {
  template <int N>
  static __device__ __forceinline__ void ss(float (&d)[N / 2], uint64_t a, uint64_t b, int acc) {
    if constexpr (N == 64) ptx::wgmma_m64n64k16_f32_bf16_ss(d, a, b, acc);
    if constexpr (N == 128) ptx::wgmma_m64n128k16_f32_bf16_ss(d, a, b, acc);
    if constexpr (N == 256) ptx::wgmma_m64n256k16_f32_bf16_ss(d, a, b, acc);
  }
  template <int N>
  static __device__ __forceinline__ void ss_zero(float (&d)[N / 2], uint64_t a, uint64_t b) {
    if constexpr (N == 64) ptx::wgmma_m64n64k16_f32_bf16_ss_zero(d, a, b);
    if constexpr (N == 128) ptx::wgmma_m64n128k16_f32_bf16_ss_zero(d, a, b);
    if constexpr (N == 256) ptx::wgmma_m64n256k16_f32_bf16_ss_zero(d, a, b);
  }
  // D += A B with A from registers and B MN-major (V of P V).
  template <int N>
  static __device__ __forceinline__ void rs_tb(float (&d)[N / 2], const uint32_t (&a)[4],
                                               uint64_t b) {
    if constexpr (N == 64) ptx::wgmma_m64n64k16_f32_bf16_rs_tb(d, a, b, 1);
    if constexpr (N == 128) ptx::wgmma_m64n128k16_f32_bf16_rs_tb(d, a, b, 1);
    if constexpr (N == 256) ptx::wgmma_m64n256k16_f32_bf16_rs_tb(d, a, b, 1);
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

template <>
struct Wgmma<__half> {
  template <int N>
  static __device__ __forceinline__ void ss(float (&d)[N / 2], uint64_t a, uint64_t b, int acc) {
    if constexpr (N == 64) ptx::wgmma_m64n64k16_f32_f16_ss(d, a, b, acc);
    if constexpr (N == 128) ptx::wgmma_m64n128k16_f32_f16_ss(d, a, b, acc);
    if constexpr (N == 256) ptx::wgmma_m64n256k16_f32_f16_ss(d, a, b, acc);
  }
  template <int N>
  static __device__ __forceinline__ void ss_zero(float (&d)[N / 2], uint64_t a, uint64_t b) {
    if constexpr (N == 64) ptx::wgmma_m64n64k16_f32_f16_ss_zero(d, a, b);
    if constexpr (N == 128) ptx::wgmma_m64n128k16_f32_f16_ss_zero(d, a, b);
    if constexpr (N == 256) ptx::wgmma_m64n256k16_f32_f16_ss_zero(d, a, b);
  }
  // D += A B with A from registers and B MN-major (V of P V).
  template <int N>
  static __device__ __forceinline__ void rs_tb(float (&d)[N / 2], const uint32_t (&a)[4],
                                               uint64_t b) {
    if constexpr (N == 64) ptx::wgmma_m64n64k16_f32_f16_rs_tb(d, a, b, 1);
    if constexpr (N == 128) ptx::wgmma_m64n128k16_f32_f16_rs_tb(d, a, b, 1);
    if constexpr (N == 256) ptx::wgmma_m64n256k16_f32_f16_rs_tb(d, a, b, 1);
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

// Accumulators of an in-flight wgmma must not be touched by ordinary code until its
// wait_group: passing them through an empty volatile asm pins reads and writes in order.
template <int N>
__device__ __forceinline__ void FenceRegisters(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) ptx::fence_operand(r[i]);
}

__device__ __forceinline__ float QuadMax(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float QuadSum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

}  // namespace jzyfa
