// What both backward kernels share: their arguments and sequences, the mask, and the skeleton they run
// (the forward's): a producer thread claims tiles and loads with TMA through an mbarrier ring
// (ProduceTiles), two consumer warpgroups of 64 rows compute. A tile's two operands (64 rows each per
// consumer) land once, the streamed blocks (64 rows, two operands) pass through kStages stages.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <type_traits>

#include "flash_fwd_common.cuh"
#include "sm90_mma.cuh"
#include "softcap.cuh"
#include "tile_size.h"

namespace jzyfa {

// q, k, v and dO reach the kernels as tensor maps (launch_bwd.cuh).
struct BwdArgs {
  const float* lse;    // [B, Hq, Sq], natural log
  const float* delta;  // [B, Hq, Sq]
  void* dq;
  void* dk;
  void* dv;
  int* tile_counter;  // this kernel's, zeroed by the launch (ProduceTiles' protocol)
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
  float scale_log2;  // softmax_scale * log2(e); with a softcap c, c * log2(e) (softcap.cuh)
  float softcap_tanh_scale;  // 2 log2(e) softmax_scale / c; 0: no softcap
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

// The tiles' sizes and shared-memory layout: the tile operands (K and V, or Q and dO) for two consumers
// of 64 rows, then kStages stages of the streamed operands (Q and dO, or K and V) of 64 rows; every
// operand 64-column slices of 64 rows x 128 bytes in the 128-byte swizzle, 1024-byte aligned. Operand
// 0 (K or Q, streamed Q or K) has head dim kHeadDimQK, operand 1 (V or dO) kHeadDimV. Gradient 0 (dK
// or dQ) has operand 0's columns, gradient 1 (dV) operand 1's.
template <int kHeadDimQK, int kHeadDimV, BwdKernelKind kKernel>
struct BwdTile {
  static constexpr BwdTileSize kSize = BwdTile16Size(kHeadDimQK, kHeadDimV);
  static constexpr int kConsumers = kBwdWarpgroups;
  static constexpr int kRows = kBwdRowsPerWarpgroup;  // per consumer, and per streamed block
  // Split columns (tile_size.h): the consumers share the tile's 64 rows, and each accumulates its
  // 64-column slices of the gradients (Columns, FirstColumn).
  static constexpr bool kSplitColumns = BwdSplitColumns(kKernel, kHeadDimQK, kHeadDimV);
  static constexpr int kTileOperands = kSplitColumns ? 1 : kConsumers;  // 64-row operands per tile operand
  static constexpr int kBlockM = kRows * kTileOperands;  // rows of the tile operands
  static constexpr int kBlockN = kRows;                  // rows of a streamed block
  static constexpr __host__ __device__ int HeadDim(int which) { return which == 0 ? kHeadDimQK : kHeadDimV; }
  // Gradient `which`'s columns that consumer c accumulates: Columns(which, c) from FirstColumn(which, c).
  static constexpr __host__ __device__ int Columns(int which, int consumer) {
    return kSplitColumns ? 64 * BwdConsumerSlices(HeadDim(which) / 64, consumer) : HeadDim(which);
  }
  static constexpr __host__ __device__ int FirstColumn(int which, int consumer) {
    return kSplitColumns ? 64 * BwdConsumerFirstSlice(HeadDim(which) / 64, consumer) : 0;
  }
  // Whether both consumers hold as many columns (one copy of the consumers' code) or not (MLA's
  // dK/dV: a copy per consumer, BwdTile's WithConsumerColumns).
  static constexpr bool kEvenColumns = Columns(0, 0) == Columns(0, 1) && Columns(1, 0) == Columns(1, 1);
  static constexpr int kMaxColumns = Columns(0, 0) > Columns(1, 0) ? Columns(0, 0) : Columns(1, 0);
  // Consumer c's first row of the tile.
  static constexpr __device__ int RowOffset(int consumer) { return kSplitColumns ? 0 : kRows * consumer; }
  static constexpr int kStages = kSize.stages;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kSliceBytes = kRows * 128;
  static constexpr __host__ __device__ int OperandBytes(int which) { return kSliceBytes * HeadDim(which) / 64; }
  static constexpr int kTileBytes = (OperandBytes(0) + OperandBytes(1)) * kTileOperands;
  static constexpr int kStageBytes = OperandBytes(0) + OperandBytes(1);
  // The gradients' staging rows (StoreAccumulator): 8 rows of the consumer's columns per consumer warp.
  static constexpr int kStagingWarpBytes = 8 * kMaxColumns * 2;
  static constexpr int kStagingBytes = kStagingWarpBytes * 4 * kConsumers;
  static constexpr int kSmemAlign = 1024;
  static constexpr int kDynamicSmemBytes = kTileBytes + kStages * kStageBytes + kStagingBytes + kSmemAlign;
  // The producer works out each step's head and block (the dK/dV tile's): at 40 registers it spilled;
  // the consumers hold dK and dV (or dQ), S^T and dP^T, P^T and dS^T fragments.
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static_assert(kBlockM == (kKernel == BwdKernelKind::kDkdv ? kSize.dkdv_block_n : kSize.dq_block_m));
  static_assert(kBlockN == (kKernel == BwdKernelKind::kDkdv ? kSize.dkdv_block_m : kSize.dq_block_n));
  static_assert(kHeadDimQK % 64 == 0 && kHeadDimV % 64 == 0, "operands are whole 64-column slices");
  static_assert(!kSplitColumns || (kHeadDimQK >= 128 && kHeadDimV >= 128), "each consumer takes a slice");
  static_assert(kDynamicSmemBytes <= 227 * 1024);
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= CtaRegisterPool(kThreads));
};

// f(std::integral_constant<int, c>) with c the consumer whose column counts the code is compiled for:
// 0 for both consumers where they hold as many columns (FirstColumn tells them apart at run time),
// else each consumer's own (two copies).
template <typename Tile, typename F>
__device__ __forceinline__ auto WithConsumerColumns(int consumer, F f) {
  if constexpr (Tile::kEvenColumns) {
    return f(std::integral_constant<int, 0>{});
  } else {
    return consumer == 0 ? f(std::integral_constant<int, 0>{}) : f(std::integral_constant<int, 1>{});
  }
}

template <typename Tile>
struct BwdSmem {
  uint32_t base;
  // Tile operand `which` (0: K or Q, 1: V or dO) of consumer c (split columns: the consumers' one).
  __device__ __forceinline__ uint32_t tile(int which, int consumer) const {
    return base + which * Tile::kTileOperands * Tile::OperandBytes(0) +
           (Tile::kSplitColumns ? 0 : consumer) * Tile::OperandBytes(which);
  }
  // Streamed operand `which` (0: Q or K, 1: dO or V) of a stage.
  __device__ __forceinline__ uint32_t stream(int stage, int which) const {
    return base + Tile::kTileBytes + stage * Tile::kStageBytes + which * Tile::OperandBytes(0);
  }
  // Consumer warp w's (0 .. 7) staging rows for the gradients' stores.
  __device__ __forceinline__ uint32_t staging(int warp) const {
    return base + Tile::kTileBytes + Tile::kStages * Tile::kStageBytes + warp * Tile::kStagingWarpBytes;
  }
};

// A consumer thread: its warpgroup among the consumers, its warp and lane; the first of its two
// accumulator rows in the warpgroup's 64 is 16 warp + lane / 4 (the other 8 further). turns: the
// consumers take turns issuing their GEMMs (the forward's ping-pong, named barriers 1 and 2), two a
// block (S and dP, then the register-A GEMMs), so one's elementwise work overlaps the other's GEMMs.
struct BwdThread {
  int consumer, warp, lane;
  PingPong turns;
  __device__ __forceinline__ int row() const { return 16 * warp + lane / 4; }
  // One lane per warp arrives on an "empty" barrier (each warp's wait_group covered its wgmma).
  __device__ __forceinline__ void Release(uint64_t& empty) const {
    if (lane == 0) ptx::mbarrier_arrive(SmemAddress(&empty));
  }
};

// 64 rows of a [tokens, heads, head_dim] tensor map (launch_bwd.cuh: dense batches as [B, S, H, D],
// a varlen pack as one batch of total tokens) into one operand, a TMA copy per 64-column slice.
// Rows past the map's end land as zeros; in a varlen pack rows past a sequence's end are the next
// sequence's tokens, which the masks give P = dS = 0.
template <int kHeadDim>
__device__ __forceinline__ void LoadOperand(uint32_t dst, const CUtensorMap* map, uint32_t bar, int row,
                                            int head, int batch) {
  constexpr int kSlice = kBwdRowsPerWarpgroup * 128;
  if constexpr (kHeadDim > 128) {
    // A loop, not unrolled copies: unrolled at head dim 256, the dQ kernel's producer spilled at its
    // 40 registers.
#pragma unroll 1
    for (int s = 0; s < kHeadDim / 64; ++s) ptx::tma_load_4d(dst + s * kSlice, map, bar, s * 64, row, head, batch);
  } else {
#pragma unroll
    for (int s = 0; s < kHeadDim / 64; ++s) ptx::tma_load_4d(dst + s * kSlice, map, bar, s * 64, row, head, batch);
  }
}

// Both tile operands (maps[a] then maps[b]) for both consumers: consumer c's 64 rows from row + 64c
// (split columns: one 64-row operand each, the consumers').
template <typename Tile>
__device__ __forceinline__ void LoadTileOperands(const BwdSmem<Tile>& smem, const CUtensorMap* a,
                                                 const CUtensorMap* b, uint32_t bar, int row, int head,
                                                 int batch) {
  for (int c = 0; c < Tile::kTileOperands; ++c)
    LoadOperand<Tile::HeadDim(0)>(smem.tile(0, c), a, bar, row + 64 * c, head, batch);
  for (int c = 0; c < Tile::kTileOperands; ++c)
    LoadOperand<Tile::HeadDim(1)>(smem.tile(1, c), b, bar, row + 64 * c, head, batch);
}

// A block's two smem x smem GEMMs of one consumer, in its turn once both streamed operands landed:
// x = tile operand 0 times streamed operand 0 (S or S^T), y = operand 1 times operand 1 (dP or dP^T),
// [64 x 64] each; waits for both.
template <typename Element, typename Tile, int kStages>
__device__ __forceinline__ void IssueBlockScores(float (&x)[32], float (&y)[32], const BwdSmem<Tile>& smem,
                                                 FwdBarriers<kStages, 1>& bars, const RingSlot<kStages>& slot,
                                                 int consumer, const PingPong& turns) {
  constexpr int kSlice = Tile::kSliceBytes;
  ptx::mbarrier_wait(SmemAddress(&bars.k_full[slot.stage]), slot.parity);
  ptx::mbarrier_wait(SmemAddress(&bars.v_full[slot.stage]), slot.parity);
  turns.Begin();
  IssueQK<Element, 64, Tile::HeadDim(0), kSlice, kSlice, 0>(x, smem.tile(0, consumer), smem.stream(slot.stage, 0), 0);
  IssueQK<Element, 64, Tile::HeadDim(1), kSlice, kSlice, 0>(y, smem.tile(1, consumer), smem.stream(slot.stage, 1), 0);
  turns.End();
  ptx::wgmma_wait_group<0>();
  FenceRegisters(x);
  FenceRegisters(y);
}

// Where a tile's rows sit in the tensor maps: a dense batch row b is map batch b from row 0, a varlen
// sequence map batch 0 from its first token.
struct BwdMapRows {
  int q_row0, k_row0, batch;
};

__device__ __forceinline__ BwdMapRows MapRowsOf(const BwdArgs& args, const BwdSequence& seq, int index) {
  if (args.cu_seqlens_q == nullptr) return BwdMapRows{0, 0, index};
  return BwdMapRows{static_cast<int>(seq.q_offset), static_cast<int>(seq.k_offset), 0};
}

// The skeleton both kernels run. Args: the kernel's argument type (PlanTile's overload for it gives the
// tile's work, with num_blocks streamed blocks). load_tile(smem, work, bar) issues the TMA copies of
// both tile operands of both consumers; load_stream(smem, work, block, stage, which, bar) one streamed
// operand. consume_tile(smem, bars, tile, ring, thread) runs a tile's blocks (ring: blocks consumed
// since the launch) and returns how many it consumed, releasing every stage and the tile buffer.
template <typename Tile, typename Args, typename LoadTile, typename LoadStream, typename ConsumeTile>
__device__ __forceinline__ void BwdTiles(const Args& args, LoadTile load_tile, LoadStream load_stream,
                                         ConsumeTile consume_tile) {
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) FwdBarriers<Tile::kStages, 1> bars;
  const BwdSmem<Tile> smem{(SmemAddress(smem_raw) + Tile::kSmemAlign - 1) &
                               ~uint32_t(Tile::kSmemAlign - 1)};
  const int warpgroup = threadIdx.x / 128;
  InitBarriers<Tile::kStages, Tile::kConsumers>(bars);
  __syncthreads();

  if (warpgroup == 0) {  // ---------------------------------------------------- producer
    ptx::setmaxnreg_dec<Tile::kProducerRegs>();
    if (threadIdx.x != 0) return;
    ProduceTiles<Tile::kStages, Tile::kBlockM, Tile::kBlockN>(
        bars, args, Tile::kTileBytes, Tile::OperandBytes(0), Tile::OperandBytes(1),
        [&](const auto& work, int, uint32_t bar) { load_tile(smem, work, bar); },
        [&](const auto& work, int block, int stage, uint32_t bar) { load_stream(smem, work, block, stage, 0, bar); },
        [&](const auto& work, int block, int stage, uint32_t bar) { load_stream(smem, work, block, stage, 1, bar); });
    return;
  }

  // ---------------------------------------------------------------------------- consumers
  ptx::setmaxnreg_inc<Tile::kConsumerRegs>();
  const int consumer = warpgroup - 1, lane = static_cast<int>(threadIdx.x % 32);
  const BwdThread thread{consumer, static_cast<int>((threadIdx.x % 128) / 32), lane, PingPong{consumer, lane}};
  thread.turns.Open();
  uint32_t ring = 0;
  for (int round = 0;; ++round) {
    ptx::mbarrier_wait(SmemAddress(&bars.q_full[0]), RingSlot<1>(round).parity);
    const int tile = *reinterpret_cast<volatile int*>(&bars.tile[0]);
    if (tile >= args.num_tiles) break;
    ring += consume_tile(smem, bars, tile, ring, thread);
  }
  if (consumer == 0) thread.turns.Begin();  // consumer 1's last hand-over
}

// softmax(masked, capped), both std::bool_constant: the block's softmax in the copy for its mask and
// softcap, picked by one branch a block (a per-element test compiles to a branch per element).
template <typename Softmax>
__device__ __forceinline__ void SoftmaxCopy(bool masked, bool capped, Softmax& softmax) {
  if (capped) {
    masked ? softmax(std::true_type{}, std::true_type{}) : softmax(std::false_type{}, std::true_type{});
  } else {
    masked ? softmax(std::true_type{}, std::false_type{}) : softmax(std::false_type{}, std::false_type{});
  }
}

// A row's raw lse or delta (`outside` past the sequence): a load whose use can come a block later.
__device__ __forceinline__ float RawQueryRow(const float* rows, int64_t row0, int row, int len, float outside) {
  return row < len ? __ldg(rows + row0 + row) : outside;
}

// lse in the log2 domain, +inf where P must be 0 (rows past the sequence and rows that saw no key).
__device__ __forceinline__ float LseLog2(float lse) {
  return lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
}

// lse (log2 domain) and delta (0 past the sequence) at row `row` of a sequence.
__device__ __forceinline__ float LseLog2At(const float* lse, int row, int len) {
  return LseLog2(RawQueryRow(lse, 0, row, len, -INFINITY));
}

__device__ __forceinline__ float DeltaAt(const float* delta, int row, int len) {
  return RawQueryRow(delta, 0, row, len, 0.f);
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

// A 64-row accumulator tile (wgmma layout, kColumns columns) times `factor` into rows of a [.., D]
// 16-bit tensor: row r (< valid_rows) at dst + r * row_stride; this warp's 16 rows from warp_row.
// Each warp's rows go out 8 at a time through its staging rows in shared memory (stmatrix in the
// accumulator's layout; 16-byte chunk c of row r at chunk c ^ r within its group of 8, so that the
// stmatrix stores and the 16-byte loads meet no bank conflict) and 16-byte global stores, whole rows
// per quarter warp: 4-byte stores straight from the accumulators (8 rows x 16 bytes a warp store)
// held the dK/dV consumers for ~9% of their time (docs/benchmarks.md). The staging rows are the
// warp's own: __syncwarp orders their reuse.
template <typename Element, int kColumns>
__device__ __forceinline__ void StoreAccumulator(const float (&acc)[kColumns / 2], uint32_t staging, Element* dst,
                                                 int64_t row_stride, int warp_row, int valid_rows,
                                                 float factor) {
  constexpr int kChunks = kColumns / 8, kRowBytes = kColumns * 2;
  const int lane = threadIdx.x % 32;
  auto chunk_address = [&](int row, int chunk) {
    return staging + row * kRowBytes + ((chunk & ~7) | ((chunk ^ row) & 7)) * 16;
  };
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // rows 8h .. 8h + 7 of the warp's 16
    // stmatrix x4: chunks c .. c + 3 of the 8 rows; lane t addresses row t % 8 of chunk c + t / 8.
    __syncwarp();  // the previous pass's loads from the staging rows are done
#pragma unroll
    for (int c = 0; c < kChunks; c += 4) {
      StoreMatrixX4(chunk_address(lane % 8, c + lane / 8),
                    PackPair<Element>(acc[4 * c + 2 * h] * factor, acc[4 * c + 2 * h + 1] * factor),
                    PackPair<Element>(acc[4 * c + 4 + 2 * h] * factor, acc[4 * c + 5 + 2 * h] * factor),
                    PackPair<Element>(acc[4 * c + 8 + 2 * h] * factor, acc[4 * c + 9 + 2 * h] * factor),
                    PackPair<Element>(acc[4 * c + 12 + 2 * h] * factor, acc[4 * c + 13 + 2 * h] * factor));
    }
    __syncwarp();
#pragma unroll
    for (int i = lane; i < 8 * kChunks; i += 32) {
      const int row = i / kChunks, chunk = i % kChunks, out_row = warp_row + 8 * h + row;
      const uint4 v = LoadShared16(chunk_address(row, chunk));
      // 16-byte aligned: row_stride and 8 chunk are multiples of 8 elements, the tensors' bases of 16
      // bytes (a plain uint4 store compiled to four 4-byte ones).
      if (out_row < valid_rows) StoreGlobal16(dst + static_cast<int64_t>(out_row) * row_stride + 8 * chunk, v);
    }
  }
}

}  // namespace jzyfa
