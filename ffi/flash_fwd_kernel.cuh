// The first Hopper forward kernel: correct before fast.
//
// One CTA = one warpgroup (128 threads) = 64 query rows of one (batch, head).
// Thread 0 loads the Q tile once and streams 128-key blocks of K and V through a
// 2-stage shared-memory ring with TMA, each stage completing on its own mbarrier.
// S = Q K^T and O += P V run on wgmma (HGMMA); softmax is online, in registers, in
// the log2 domain. The fast kernel (warp specialization, ping-pong, persistent grid)
// builds on these same pieces.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda.h>

#include <cstdint>

#include "jzyfa_ptx.h"

namespace jzyfa {

// Runtime arguments of one launch (the tensor maps travel as separate kernel parameters).
struct FwdArgs {
  void* out;
  float* lse;
  int seqlen_q;
  int seqlen_k;
  int heads_q;
  int heads_kv;
  float scale_log2;  // softmax_scale * log2(e)
  int causal;
};

template <int kHeadDim>
struct FwdTile {
  static constexpr int kBlockM = 64;    // query rows: one wgmma M
  static constexpr int kBlockN = 128;   // keys per block: the N of S = Q K^T
  static constexpr int kStages = 2;     // K/V ring depth
  static constexpr int kThreads = 128;  // one warpgroup
  // 128-byte swizzle atoms are 64 16-bit elements wide: the head dim comes in slices.
  static constexpr int kSliceCols = 64;
  static constexpr int kSlices = kHeadDim / kSliceCols;
  static constexpr int kQSliceBytes = kBlockM * 128;
  static constexpr int kKVSliceBytes = kBlockN * 128;
  static constexpr int kQBytes = kQSliceBytes * kSlices;
  static constexpr int kKVBytes = kKVSliceBytes * kSlices;  // one of K or V, one stage
  static constexpr int kSmemBytes = kQBytes + 2 * kStages * kKVBytes;
  static constexpr int kSmemAlign = 1024;  // 128-byte swizzle repeats every 1024 bytes
  static constexpr int kDynamicSmemBytes = kSmemBytes + kSmemAlign;
  static_assert(kHeadDim % kSliceCols == 0, "head dim must be a multiple of 64");
};

// wgmma shared-memory descriptor for a 128-byte-swizzled operand.
// K-major (Q, K): rows of 128 bytes, 8-row groups 1024 bytes apart (stride offset);
// the leading offset is unused. MN-major (V as B of P V): 8-key groups 1024 bytes apart;
// each wgmma we issue spans one 64-column atom in N, so the leading offset (next atom in
// N) is never taken; we set it to 1024 as well.
__device__ __forceinline__ uint64_t SmemDescSw128(uint32_t smem_addr, uint32_t lbo_bytes) {
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4);
  desc |= static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFF) << 16;
  desc |= static_cast<uint64_t>((1024 >> 4) & 0x3FFF) << 32;
  desc |= 1ull << 62;  // swizzle mode: 128 bytes
  return desc;
}

template <typename Element>
struct Wgmma;

template <>
struct Wgmma<__nv_bfloat16> {
  template <int N>
  static __device__ __forceinline__ void ss(float (&d)[N / 2], uint64_t a, uint64_t b, int acc) {
    if constexpr (N == 64) ptx::wgmma_m64n64k16_f32_bf16_ss(d, a, b, acc);
    if constexpr (N == 128) ptx::wgmma_m64n128k16_f32_bf16_ss(d, a, b, acc);
  }
  static __device__ __forceinline__ void rs_n64(float (&d)[32], const uint32_t (&a)[4],
                                                uint64_t b) {
    ptx::wgmma_m64n64k16_f32_bf16_rs_tb(d, a, b, 1);
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
  }
  static __device__ __forceinline__ void rs_n64(float (&d)[32], const uint32_t (&a)[4],
                                                uint64_t b) {
    ptx::wgmma_m64n64k16_f32_f16_rs_tb(d, a, b, 1);
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

__device__ __forceinline__ float QuadMax(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float QuadSum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// Accumulator layout of a wgmma m64nN f32 result, per thread: for each 8-column chunk c,
// values 4c..4c+3 sit at rows (r, r, r+8, r+8) and columns (8c+2q, 8c+2q+1, ...), where
// r = 16 * warp + lane / 4 and q = lane % 4. So each thread owns two rows (h = 0, 1),
// and a row is spread over the 4 lanes of a quad.
template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(128, 1)
    FlashFwdKernel(const __grid_constant__ CUtensorMap tmap_q,
                   const __grid_constant__ CUtensorMap tmap_k,
                   const __grid_constant__ CUtensorMap tmap_v, const FwdArgs args) {
  using Tile = FwdTile<kHeadDim>;
  using Mma = Wgmma<Element>;
  constexpr int kBlockM = Tile::kBlockM;
  constexpr int kBlockN = Tile::kBlockN;
  constexpr int kSlices = Tile::kSlices;
  constexpr int kSChunks = kBlockN / 8;  // 8-column chunks of S per thread

  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t bar_q;
  __shared__ __align__(8) uint64_t bar_kv[Tile::kStages];

  const uint32_t smem_base =
      (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) + Tile::kSmemAlign - 1) &
      ~uint32_t(Tile::kSmemAlign - 1);
  const uint32_t smem_q = smem_base;
  auto smem_k = [&](int stage) { return smem_base + Tile::kQBytes + stage * 2 * Tile::kKVBytes; };
  auto smem_v = [&](int stage) { return smem_k(stage) + Tile::kKVBytes; };
  const uint32_t bar_q_addr = static_cast<uint32_t>(__cvta_generic_to_shared(&bar_q));
  auto bar_kv_addr = [&](int stage) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(&bar_kv[stage]));
  };

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int m_block = blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int kv_head = head / (args.heads_q / args.heads_kv);
  const int q_start = m_block * kBlockM;
  const int q_last = min(q_start + kBlockM, args.seqlen_q) - 1;
  // Bottom-right causal alignment: query i sees keys j <= i + diagonal.
  const int diagonal = args.seqlen_k - args.seqlen_q;
  int kv_end = args.seqlen_k;
  if (args.causal) kv_end = min(kv_end, q_last + diagonal + 1);
  const int num_blocks = kv_end > 0 ? (kv_end + kBlockN - 1) / kBlockN : 0;

  auto load_kv = [&](int block, int stage) {
    const uint32_t bar = bar_kv_addr(stage);
    ptx::mbarrier_arrive_expect_tx(bar, 2 * Tile::kKVBytes);
#pragma unroll
    for (int s = 0; s < kSlices; ++s) {
      ptx::tma_load_4d(smem_k(stage) + s * Tile::kKVSliceBytes, &tmap_k, bar, s * 64,
                       block * kBlockN, kv_head, batch);
      ptx::tma_load_4d(smem_v(stage) + s * Tile::kKVSliceBytes, &tmap_v, bar, s * 64,
                       block * kBlockN, kv_head, batch);
    }
  };

  if (tid == 0) {
    ptx::prefetch_tensor_map(&tmap_q);
    ptx::prefetch_tensor_map(&tmap_k);
    ptx::prefetch_tensor_map(&tmap_v);
    ptx::mbarrier_init(bar_q_addr, 1);
    for (int s = 0; s < Tile::kStages; ++s) ptx::mbarrier_init(bar_kv_addr(s), 1);
    ptx::fence_mbarrier_init();
  }
  __syncthreads();
  if (tid == 0 && num_blocks > 0) {
    ptx::mbarrier_arrive_expect_tx(bar_q_addr, Tile::kQBytes);
#pragma unroll
    for (int s = 0; s < kSlices; ++s) {
      ptx::tma_load_4d(smem_q + s * Tile::kQSliceBytes, &tmap_q, bar_q_addr, s * 64, q_start,
                       head, batch);
    }
    for (int b = 0; b < min(num_blocks, Tile::kStages); ++b) load_kv(b, b);
  }

  // Online-softmax state for this thread's two rows.
  float row_max[2] = {-INFINITY, -INFINITY};  // raw scores (before the scale)
  float row_sum[2] = {0.f, 0.f};              // this thread's share, summed over the quad at the end
  float o_acc[kSlices][32];
#pragma unroll
  for (int s = 0; s < kSlices; ++s)
#pragma unroll
    for (int i = 0; i < 32; ++i) o_acc[s][i] = 0.f;

  const int row_in_tile = 16 * warp + lane / 4;
  const int quad_col = 2 * (lane % 4);

  if (num_blocks > 0) ptx::mbarrier_wait(bar_q_addr, 0);
  for (int block = 0; block < num_blocks; ++block) {
    const int stage = block % Tile::kStages;
    ptx::mbarrier_wait(bar_kv_addr(stage), (block / Tile::kStages) & 1);

    // S = Q K^T over the head dim, 16 at a time.
    float s_acc[kBlockN / 2];
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t col_bytes = (kk % 4) * 32;  // 16 elements inside a 128-byte row
      const uint64_t desc_q = SmemDescSw128(smem_q + (kk / 4) * Tile::kQSliceBytes + col_bytes, 16);
      const uint64_t desc_k =
          SmemDescSw128(smem_k(stage) + (kk / 4) * Tile::kKVSliceBytes + col_bytes, 16);
      Mma::template ss<kBlockN>(s_acc, desc_q, desc_k, kk > 0);
    }
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group<0>();

    // Mask keys past the end and, for causal, past each row's diagonal.
    const int key_start = block * kBlockN;
    const bool needs_mask = key_start + kBlockN > args.seqlen_k ||
                            (args.causal && key_start + kBlockN - 1 > q_start + diagonal);
    if (needs_mask) {
#pragma unroll
      for (int c = 0; c < kSChunks; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key_start + 8 * c + quad_col + (e & 1);
          const int row = q_start + row_in_tile + 8 * (e >> 1);
          const bool visible = key < args.seqlen_k && (!args.causal || key <= row + diagonal);
          if (!visible) s_acc[4 * c + e] = -INFINITY;
        }
    }

    // Online softmax in the log2 domain: p = 2^(s * scale_log2 - max * scale_log2).
    float correction[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float block_max = -INFINITY;
#pragma unroll
      for (int c = 0; c < kSChunks; ++c) {
        block_max = fmaxf(block_max, fmaxf(s_acc[4 * c + 2 * h], s_acc[4 * c + 2 * h + 1]));
      }
      block_max = QuadMax(block_max);
      const float new_max = fmaxf(row_max[h], block_max);
      // A row with no visible key so far keeps max = -inf; use 0 so no inf - inf appears.
      const float max_scaled = new_max == -INFINITY ? 0.f : new_max * args.scale_log2;
      correction[h] = ptx::ex2_approx(row_max[h] * args.scale_log2 - max_scaled);
      row_max[h] = new_max;
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < kSChunks; ++c)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s_acc[4 * c + 2 * h + e];
          x = ptx::ex2_approx(fmaf(x, args.scale_log2, -max_scaled));
          sum += x;
        }
      row_sum[h] = row_sum[h] * correction[h] + sum;
    }
#pragma unroll
    for (int s = 0; s < kSlices; ++s)
#pragma unroll
      for (int c = 0; c < 8; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) o_acc[s][4 * c + e] *= correction[e >> 1];

    // P as the A operand of P V: the accumulator of keys 16j..16j+15 is already the
    // register fragment of a k16 A tile, two values per 32-bit register.
    uint32_t p_frag[kBlockN / 16][4];
#pragma unroll
    for (int j = 0; j < kBlockN / 16; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        p_frag[j][r] = Mma::pack(s_acc[8 * j + 2 * r], s_acc[8 * j + 2 * r + 1]);

    // O += P V: V is [keys x head_dim] with head_dim contiguous, i.e. MN-major B.
    ptx::wgmma_fence();
#pragma unroll
    for (int s = 0; s < kSlices; ++s)
#pragma unroll
      for (int j = 0; j < kBlockN / 16; ++j) {
        const uint64_t desc_v =
            SmemDescSw128(smem_v(stage) + s * Tile::kKVSliceBytes + j * 2048, 1024);
        Mma::rs_n64(o_acc[s], p_frag[j], desc_v);
      }
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group<0>();

    // Every thread is done with this stage: refill it with the block two ahead.
    __syncthreads();
    if (tid == 0 && block + Tile::kStages < num_blocks) load_kv(block + Tile::kStages, stage);
  }

  // Epilogue: normalise, write O (bf16/f16) and the LSE (natural log).
  Element* out = static_cast<Element*>(args.out);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float total = QuadSum(row_sum[h]);
    const float inv = total > 0.f ? 1.f / total : 0.f;
    const int row = q_start + row_in_tile + 8 * h;
    if (row >= args.seqlen_q) continue;
    const int64_t out_row =
        ((static_cast<int64_t>(batch) * args.seqlen_q + row) * args.heads_q + head) * kHeadDim;
#pragma unroll
    for (int s = 0; s < kSlices; ++s)
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const int col = s * 64 + 8 * c + quad_col;
        const uint32_t packed =
            Mma::pack(o_acc[s][4 * c + 2 * h] * inv, o_acc[s][4 * c + 2 * h + 1] * inv);
        *reinterpret_cast<uint32_t*>(out + out_row + col) = packed;
      }
    if (lane % 4 == 0) {
      const float lse = total > 0.f ? (row_max[h] * args.scale_log2 + __log2f(total)) * 0.69314718f
                                    : -INFINITY;
      args.lse[(static_cast<int64_t>(batch) * args.heads_q + head) * args.seqlen_q + row] = lse;
    }
  }
}

}  // namespace jzyfa
