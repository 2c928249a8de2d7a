// Building blocks both backward kernels share: cp.async loads of row tiles into the 128-byte
// swizzled layout wgmma reads (SmemDescSw128), the persistent grid's tile claim, and the arguments.
#pragma once

#include <cstdint>

#include "sm90_mma.cuh"
#include "tile_size.h"

namespace jzyfa {

struct BwdArgs {
  const void* q;
  const void* k;
  const void* v;
  const void* dout;
  const float* lse;    // [B, Hq, Sq], natural log
  const float* delta;  // [B, Hq, Sq]
  void* dq;
  void* dk;
  void* dv;
  int* tile_counter;  // [2], zeroed by the launch: [0] the dK/dV kernel's, [1] the dQ kernel's
  int num_tiles;
  int batch;     // dense: the batch; varlen: the number of sequences
  int seqlen_q;  // dense: the lengths; varlen: max_seqlen_q, max_seqlen_k (the tile grid's)
  int seqlen_k;
  // Varlen (packed [total, heads, head_dim]; null when dense): sequence s holds tokens
  // cu_seqlens_q[s] .. cu_seqlens_q[s + 1] of q (likewise of k, v); lse and delta are [heads_q, total_q].
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  int total_q;
  int heads_q;
  int heads_kv;
  float scale;       // softmax_scale
  float scale_log2;  // softmax_scale * log2(e)
  // The mask, bottom-right aligned: query i at position i + seqlen_k - seqlen_q sees the keys from
  // position - window_left to position + window_right; kBwdNoBound on an unbounded side (none: both,
  // causal: right 0).
  int window_left;
  int window_right;
};

// A window side that bounds nothing: more than any distance between a key and a query's position
// (the handler refuses seqlen_q + seqlen_k > 2^30).
constexpr int kBwdNoBound = 1 << 30;

// Where one batch row (dense) or sequence (varlen) lives: its first query and key token (rows of
// [tokens, heads, head_dim]), its lengths, and its lse / delta index of head 0, row 0.
struct BwdSequence {
  int64_t q_offset;
  int64_t k_offset;
  int len_q;
  int len_k;
  int64_t lse_offset;
  int64_t lse_head_stride;  // what one more head adds to the lse / delta index
  __device__ __forceinline__ int diagonal() const { return len_k - len_q; }
};

__device__ __forceinline__ BwdSequence SequenceOf(const BwdArgs& args, int index) {
  BwdSequence seq;
  if (args.cu_seqlens_q == nullptr) {
    seq.q_offset = static_cast<int64_t>(index) * args.seqlen_q;
    seq.k_offset = static_cast<int64_t>(index) * args.seqlen_k;
    seq.len_q = args.seqlen_q;
    seq.len_k = args.seqlen_k;
    seq.lse_offset = static_cast<int64_t>(index) * args.heads_q * args.seqlen_q;
    seq.lse_head_stride = args.seqlen_q;
  } else {
    seq.q_offset = args.cu_seqlens_q[index];
    seq.k_offset = args.cu_seqlens_k[index];
    seq.len_q = max(args.cu_seqlens_q[index + 1] - args.cu_seqlens_q[index], 0);
    seq.len_k = max(args.cu_seqlens_k[index + 1] - args.cu_seqlens_k[index], 0);
    seq.lse_offset = seq.q_offset;
    seq.lse_head_stride = args.total_q;
  }
  return seq;
}

// Whether a query at `position` (its row + seqlen_k - seqlen_q) sees `key`.
__device__ __forceinline__ bool KeyVisible(const BwdArgs& args, int key, int position) {
  return key - position <= args.window_right && position - key <= args.window_left;
}

// The first and last index of the blocks of `block` rows (over `count` rows) holding a row in
// [first, last] (int64: a bound plus kBwdNoBound may pass int32); first > last when none does.
__device__ __forceinline__ void BlockRange(int64_t first, int64_t last, int count, int block,
                                           int* first_block, int* last_block) {
  first = first < 0 ? 0 : first;
  last = last > count - 1 ? count - 1 : last;
  *first_block = static_cast<int>(first / block);
  *last_block = last < first ? static_cast<int>(first / block) - 1 : static_cast<int>(last / block);
}

__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void CpAsync4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 4 : 0)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// kRows rows of kHeadDim 16-bit elements (row r at src + r * row_stride; rows >= valid_rows zero
// filled) into shared memory as groups of 64 rows, each group kHeadDim / 64 slices of 64 rows x 128
// bytes, 16-byte chunk c of row r at chunk c ^ (r % 8): the 128-byte swizzle of SmemDescSw128.
template <int kRows, int kHeadDim, int kThreads, typename Element>
__device__ __forceinline__ void LoadRowsSw128(uint32_t dst, const Element* src, int64_t row_stride,
                                              int valid_rows) {
  constexpr int kChunksPerRow = kHeadDim / 8;
  constexpr int kGroupBytes = 64 * kHeadDim * 2;
#pragma unroll 1
  for (int idx = threadIdx.x; idx < kRows * kChunksPerRow; idx += kThreads) {
    const int row = idx / kChunksPerRow, chunk = idx % kChunksPerRow;
    const int slice = chunk / 8, c = chunk % 8;
    const uint32_t to = dst + (row / 64) * kGroupBytes + slice * (64 * 128) + (row % 64) * 128 +
                        ((c ^ (row % 8)) << 4);
    const bool valid = row < valid_rows;
    CpAsync16(to, valid ? src + row * row_stride + chunk * 8 : src, valid);
  }
}

// kRows floats (rows >= valid_rows zero filled).
template <int kRows>
__device__ __forceinline__ void LoadRowFloats(uint32_t dst, const float* src, int valid_rows,
                                              int thread) {
  if (thread >= 0 && thread < kRows) CpAsync4(dst + 4 * thread, thread < valid_rows ? src + thread : src, thread < valid_rows);
}

// What both backward tiles share: two warpgroups of 64 rows, rows of 64-column slices in the
// 128-byte swizzle (LoadRowsSw128), the table's sizes.
template <int kHeadDim>
struct BwdTileBase {
  static constexpr BwdTileSize kSize = BwdTile16Size(kHeadDim);
  static constexpr int kThreads = 128 * kBwdWarpgroups;
  static constexpr int kStages = kSize.stages;
  static constexpr int kSliceBytes = 64 * 128;           // 64 rows of one 64-column slice
  static constexpr int kGroupBytes = 64 * kHeadDim * 2;  // 64 rows, every slice
  static constexpr int kSmemAlign = 1024;                // the swizzle repeats every 1024 bytes
};

// This thread's place: its warpgroup, and the first of its two accumulator rows in the warpgroup's
// 64 (the other is 8 further).
struct BwdThread {
  int warpgroup = threadIdx.x / 128;
  int lane = threadIdx.x % 32;
  int row_in_warpgroup = 16 * ((threadIdx.x % 128) / 32) + (threadIdx.x % 32) / 4;
};

// The dynamic shared memory's first kSmemAlign-aligned address (the launch adds kSmemAlign bytes).
__device__ __forceinline__ uint32_t AlignedSmemBase(const uint8_t* smem_raw) {
  return (SmemAddress(smem_raw) + 1023) & ~uint32_t(1023);
}

// The persistent grid's next tile: one thread claims it, every thread of the CTA reads it.
__device__ __forceinline__ int ClaimTile(int* counter, int* slot) {
  __syncthreads();  // everyone has read the previous claim
  if (threadIdx.x == 0) *slot = atomicAdd(counter, 1);
  __syncthreads();
  return *slot;
}

// lse (natural log) in the log2 domain, +inf for rows that saw no key (P = exp2(x - inf) = 0).
__device__ __forceinline__ float LseLog2(float lse) {
  return lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
}

// The wgmma accumulator's 16-key (or 16-row) column blocks as register A fragments (P and dS).
template <typename Element, int kN>
__device__ __forceinline__ void PackFragments(const float (&s)[kN / 2], uint32_t (&p)[kN / 16][4]) {
#pragma unroll
  for (int j = 0; j < kN / 16; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) p[j][r] = PackPair<Element>(s[8 * j + 2 * r], s[8 * j + 2 * r + 1]);
}

// acc += A (register fragments, kK columns) B, B [kK rows x kN] MN-major in shared memory (64-column
// slices of kSliceBytes, rows of 128 bytes): the forward's P V.
template <typename Element, int kN, int kK, int kSliceBytes>
__device__ __forceinline__ void IssueRegTimesSmem(float (&acc)[kN / 2], const uint32_t (&a)[kK / 16][4],
                                                  uint32_t smem_b) {
  ptx::wgmma_fence();
#pragma unroll
  for (int j = 0; j < kK / 16; ++j) {
    ptx::Wgmma<Element, kN>::rs_tb(acc, a[j], SmemDescSw128(smem_b + j * 2048, kSliceBytes), 1);
  }
  ptx::wgmma_commit_group();
}

// A 64-row accumulator tile (wgmma layout, head_dim columns) times `factor` into rows of a [.., D]
// 16-bit tensor: row r (< valid_rows) at dst + r * row_stride.
template <typename Element, int kHeadDim>
__device__ __forceinline__ void StoreAccumulator(const float (&acc)[kHeadDim / 2], Element* dst,
                                                 int64_t row_stride, int first_row, int valid_rows,
                                                 float factor) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = first_row + 8 * h;
    if (row >= valid_rows) continue;
#pragma unroll
    for (int c = 0; c < kHeadDim / 8; ++c) {
      *reinterpret_cast<uint32_t*>(dst + row * row_stride + 8 * c + 2 * (lane % 4)) =
          PackPair<Element>(acc[4 * c + 2 * h] * factor, acc[4 * c + 2 * h + 1] * factor);
    }
  }
}

}  // namespace jzyfa
