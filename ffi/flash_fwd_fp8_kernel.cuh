// The Hopper forward kernel for FP8 (e4m3) inputs, head dims 64, 128 and 256 (and MLA's, q/k 192
// with v 128: Fp8MlaTile): the schedule of the 16-bit kernel (flash_fwd_kernel.cuh: persistent grid, producer +
// two consumer warpgroups, K/V ring, in-warpgroup overlap, ping-pong) with the FP8 softmax of
// docs/fp8.md, which jzyfa/fp8_emulation.py specifies bit for bit where it can:
//   - S = Q K^T and O += P V on e4m3 wgmma (QGMMA, k32). FP8 wgmma reads both operands K-major,
//     so O += P V reads V^T [head_dim, keys], keys permuted inside each 32-key group
//     (jzyfa/fp8_layout.py). Two sources, a compile-time choice (Fp8TileT's kStagedV): "staged"
//     TMA-loads V as it is and three producer warps transpose each tile in shared memory
//     (fp8_value_transpose.cuh); "vt" TMA-loads tiles of a V^T that a layout kernel wrote to global
//     memory beforehand (fp8_value_operand.cu). P goes from the S accumulators into A registers
//     without moving a byte between lanes.
//   - One integer reference exponent r per row (the softmax: fp8_softmax.cuh): P~ = 2^(t - r), t the
//     score in log2 units. r rises lazily (only when a block's largest P~ would pass 2^(7 + 1.75)) and
//     falls for blocks far below the row maximum (per-block power-of-two scaling), so O is rescaled by
//     exact powers of two.
//   - Lean P: each probability's e4m3 code from one FFMA, RNE(s * 8 scale + 56 - 8 r), read off the
//     float's low byte (no MUFU.EX2 in the loop); kLeanP = false rounds ex2.approx to e4m3 instead.
//   - The row sum is the sum of exactly the rounded P~: V^T's tile is followed by 8 rows of e4m3
//     ones, so the P V wgmma (N = 136) accumulates it in O's columns 128..135. Head dim 256 (a
//     wgmma's N stops at 256): a second wgmma of N = 8 on one shared block of ones
//     (Fp8TileT::kSeparateSums), into O's columns 256..263.
//   - Two-level accumulation: FP8 wgmma adds into its accumulator with only ~14 significant bits
//     (the products are aligned to the largest term, the accumulator included), so O and the row
//     sums lose precision as they grow over many keys (measured: 9% error at 16K keys, 16% at 32K,
//     against 5% for the same algorithm in float32). Every kPromoteBlocks key blocks a consumer
//     adds its wgmma accumulator into a float32 copy of O in shared memory and the next P V
//     starts from zero (scale-d = 0), as DeepSeek-V3 does for FP8 GEMMs.
//   - The epilogue hands bf16 O to a TMA store through a tile in shared memory (TmaEpilogue; the
//     varlen kernels and MLA's staged one store from registers) and writes the LSE from registers.
//   - Key blocks of 128 keys, or 192 in FlashFwdFp8WideKernel (the dense V^T kernel for long rows:
//     its fixed per-block costs spread over more keys; docs/fp8.md 10.26, 10.28), codes packed late.
//   - INT8 (Int8Args, precision="int8"): the same kernel with Q K^T on s8 wgmma and per-key-block
//     scales (see Int8Args).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "flash_fwd_common.cuh"
#include "fp8_softmax.cuh"
#include "fp8_tile.cuh"
#include "fp8_value_transpose.cuh"
#include "kernel_timeline.cuh"
#include "measure_variant.h"
#include "sm90_mma.cuh"

namespace jzyfa {

struct Fp8Args {
  __nv_bfloat16* out;
  float* lse;
  int* tile_counter;  // zero before the launch; each claim takes the next tile
  // Descales (float32 in device memory): one value, or one per (batch, KV head).
  const float* descale_q;
  const float* descale_k;
  const float* descale_v;
  int descale_per_head;
  int num_tiles;    // batch * m_tiles * heads_q
  int m_tiles;      // query tiles per (batch, head)
  int group_pairs;  // (batch, head) pairs per group of the tile order (PlanTile)
  int seqlen_q;
  int seqlen_k;
  int heads_q;
  int heads_kv;
  float scale_log2;  // f32(softmax_scale * log2 e), rounded once on the host
  int causal;
};

// INT8 Q K^T (precision="int8", docs/int8.md): q and k int8 with one float32 scale per 128 tokens and
// head, v e4m3 (as it is, or V^T) with descale_v per (batch, KV head). descale_q then points at q_scale [batch,
// heads_q, q_blocks] and descale_k at k_scale [batch, heads_kv, k_blocks]. S = Q K^T on s8 wgmma
// (IGMMA: exact int32 sums, a 128-deep product of int8 values fits in 22 bits), turned into floats
// exactly (I2F), and each key block's factor to log2 units, (q_scale * k_scale) * scale_log2 (the
// emulation's order: jzyfa/int8_emulation.py), is the one multiply lean P's FFMA takes. A tile's 128
// rows are one Q scale block, a key block of 128 keys one K scale block (head dim 256's 64-key blocks:
// two to a K scale block). The rest is the FP8 kernel's. Varlen (Int8VarlenArgs): the scales are
// per sequence, q_scale [num_seqs, heads_q, q_blocks] and k_scale [num_seqs, heads_kv, k_blocks],
// their blocks counted from each sequence's first token (descale_v [num_seqs, heads_kv]).
struct Int8ScaleBlocks {
  int q_blocks;  // ceil(seqlen_q / 128), varlen ceil(max_seqlen_q / 128): q_scale's last dim
  int k_blocks;  // ceil(seqlen_k / 128), varlen ceil(max_seqlen_k / 128): k_scale's last dim
};
template <typename Base>
struct Int8ArgsT : Base, Int8ScaleBlocks {};

template <typename Args>
constexpr bool kIsInt8 = std::is_base_of_v<Int8ScaleBlocks, Args>;

// Tokens per INT8 scale block (jzyfa.int8_quant.INT8_BLOCK): the tile's rows and the key block.
constexpr int kInt8ScaleBlock = 128;

// A packed variable-length batch (jzyfa.flash_attention_varlen with e4m3 inputs): the 16-bit
// kernel's varlen arguments (q [total_q, heads_q, 128], k and v [total_k, heads_kv, 128],
// cu_seqlens on the device, out bf16 [total_q, heads_q, 128], lse [heads_q, total_q]) plus the
// descales, one value or one per (sequence, KV head); exact P is not instantiated. With V^T
// (kStagedV false) v is [heads_kv, 128, vt_keys] with sequence s's keys from column
// Fp8VarlenValueColumn (jzyfa/fp8_layout.py, fp8_varlen_value_operand).
struct Fp8VarlenArgs : VarlenFwdArgs {
  const float* descale_q;
  const float* descale_k;
  const float* descale_v;
  int descale_per_head;
};

using Int8Args = Int8ArgsT<Fp8Args>;
using Int8VarlenArgs = Int8ArgsT<Fp8VarlenArgs>;

// The varlen tile plan for the FP8 and INT8 varlen arguments (otherwise the dense PlanTile, a template
// over any argument struct, would be the better match for them).
template <int kBlockM, int kBlockN>
__device__ __forceinline__ VarlenWork PlanTile(int tile, const Fp8VarlenArgs& args) {
  return PlanTile<kBlockM, kBlockN>(tile, static_cast<const VarlenFwdArgs&>(args));
}
template <int kBlockM, int kBlockN>
__device__ __forceinline__ VarlenWork PlanTile(int tile, const Int8VarlenArgs& args) {
  return PlanTile<kBlockM, kBlockN>(tile, static_cast<const VarlenFwdArgs&>(args));
}

// The V^T column of a sequence's first key, given its first key's token k_offset and its index:
// roundup32(k_offset) + 32 seq, so every sequence starts on a 32-key group of the permuted layout and
// no two overlap (jzyfa/fp8_layout.py). A windowed tile's k_offset moved by whole key blocks (multiples
// of 32), which moves the column by as much.
__device__ __forceinline__ int Fp8VarlenValueColumn(int k_offset, int seq) {
  return ((k_offset + 31) & ~31) + 32 * seq;
}

// The FP8 kernel's barriers besides FwdBarriers: V's staging buffer of each stage is full (TMA's
// bytes; the transposing warps wait on it), and 1 + the K/V block count at which the producer ran
// out of tiles (the transposing warps stop there; 0 until then).
template <int kStages>
struct Fp8StagingBarriers {
  uint64_t v_staged[kStages];
  uint32_t stop_after;
};

// The kernel's body, for Fp8Args (no mask, or causal), WindowedArgs<Fp8Args> (a sliding window:
// each tile visits only the key blocks its rows' windows reach, from work.first_block on), and
// Fp8VarlenArgs and its window (packed sequences: a tile's rows and keys start at its sequence's
// offsets, the tensor maps cover the packed tensors as one batch, O is stored per token). Tile:
// Fp8Tile, or Fp8MlaTile (MLA's head dims, Fp8Args only: FlashFwdFp8MlaKernel).
//
// V's operand: warp 0's first lane (the TMA thread) loads V's tile as it is ([128 keys][128 bytes],
// like K's) into the stage's staging buffer, completing v_staged; warps 1..3 of the producer
// warpgroup wait on it, write the stage's V^T tile (generic-proxy stores), fence them for the async
// proxy (wgmma) and arrive on v_full (96 arrivals). The consumers' v_empty releases both buffers:
// the TMA thread waits on it before it refills the staging buffer, so the V^T tile is never written
// while a P V may still read it. Every V^T byte comes from V's bytes or TMA's zeros (keys past the
// tensor's end), never from uninitialized shared memory.
//
// With Tile::kStagedV false, tmap_v is V^T's map ([batch, heads_kv, 128, keys padded to 32]:
// fp8_value_operand.cu; varlen: [1, heads_kv, 128, vt_keys], Fp8VarlenValueColumn) and the TMA
// thread loads each stage's V^T tile directly (completing v_full); warps 1..3 exit at once and
// there are no staging buffers.
//
// tmap_o: O's map, bf16 [batch, seq_q, heads_q, 128] in boxes of 64 columns x 64 rows, for the tiles
// with the TMA-store epilogue (Tile::kEpilogueTma); the others store from registers (nullptr).
template <bool kLeanP, typename Tile = Fp8Tile, typename Args>
__device__ __forceinline__ void FlashFwdFp8Tiles(const CUtensorMap& tmap_q, const CUtensorMap& tmap_k,
                                                 const CUtensorMap& tmap_v, const CUtensorMap* tmap_o,
                                                 const Args& args) {
  constexpr bool kWindow = kHasWindow<Args>;
  constexpr bool kVarlen = kIsVarlen<Args>;
  constexpr bool kTmaEpilogue = Tile::kEpilogueTma;
  static_assert(!(kVarlen && kTmaEpilogue), "varlen stores O from registers");
  constexpr bool kMla = Tile::kHeadDimQK != Tile::kHeadDimV;
  static_assert(!kMla || (!kWindow && !kVarlen), "MLA's FP8 tile serves dense causal / no-mask calls");
  // Q and K rows past 128 bytes (MLA's 192, head dim 256) take a second 128-byte slice.
  constexpr bool kTwoQkSlices = Tile::kHeadDimQK > 128;
  static_assert(Tile::kQkSlices == (kTwoQkSlices ? 2 : 1), "Q and K rows take one or two slices");
  constexpr bool kStagedV = Tile::kStagedV;
  constexpr int kBlockN = Tile::kBlockN;
  constexpr bool kInt8 = kIsInt8<Args>;
  static_assert(!kInt8 || (kLeanP && kInt8ScaleBlock % kBlockN == 0 && Tile::kBlockM == kInt8ScaleBlock),
                "INT8: lean P; one Q scale per tile, one K scale per key block or per two");
  constexpr int kStages = Tile::kStages;
  // Wider blocks, and head dim 256's 132-register O: one P buffer, packed from the codes left in S
  // once the previous block's P V (which reads the buffer) has landed; two buffers of 192 keys
  // spilled, as did head dim 256's two (ptxas 13.0). Otherwise the codes are packed in the softmax,
  // into two alternating buffers.
  constexpr bool kLatePack = kBlockN > 128 || Tile::kSeparateSums;
  using Slot = RingSlot<kStages>;

  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) FwdBarriers<kStages, Tile::kQBuffers> bars;
  __shared__ __align__(8) Fp8StagingBarriers<kStages> staging_bars;
  const uint32_t smem_base = (SmemAddress(smem_raw) + Tile::kSmemAlign - 1) &
                             ~uint32_t(Tile::kSmemAlign - 1);
  auto smem_q = [&](int consumer, int buffer) {
    return smem_base + buffer * Tile::kQBytes + consumer * Tile::kQConsumerBytes;
  };
  auto smem_k = [&](int stage) { return smem_base + Tile::kRingOffset + stage * Tile::kStageBytes; };
  auto smem_vt = [&](int stage) { return smem_k(stage) + Tile::kKBytes; };
  auto smem_v_staging = [&](int stage) {
    return smem_base + Tile::kVStagingOffset + stage * Tile::kVStagingBytes;
  };

  const int warpgroup = threadIdx.x / 128;
  uint8_t* const smem_aligned = smem_raw + (smem_base - SmemAddress(smem_raw));

  // The ones below each stage's V^T tile, or in their own block (separate sums) (e4m3 1.0 = 0x38):
  // written once, read by every P V.
  if constexpr (Tile::kSeparateSums) {
    for (int i = threadIdx.x; i < Tile::kOnesBytes / 4; i += Tile::kThreads)
      reinterpret_cast<uint32_t*>(smem_aligned + Tile::kSumOnesOffset)[i] = 0x38383838u;
    ptx::fence_proxy_async_shared();  // generic-proxy writes, read by wgmma (async proxy)
  } else {
    constexpr int kSlices = kStages * Tile::kVtSlices;
    for (int i = threadIdx.x; i < kSlices * Tile::kOnesBytes / 4; i += Tile::kThreads) {
      const int slice = i / (Tile::kOnesBytes / 4), word = i % (Tile::kOnesBytes / 4);
      const int stage = slice / Tile::kVtSlices, part = slice % Tile::kVtSlices;
      reinterpret_cast<uint32_t*>(smem_aligned + (smem_vt(stage) - smem_base) +
                                  part * Tile::kVtSliceBytes + Tile::kVtBytes)[word] = 0x38383838u;
    }
    ptx::fence_proxy_async_shared();  // generic-proxy writes, read by wgmma (async proxy)
  }
  if constexpr (kStagedV) {
    if (threadIdx.x == 0) {
      for (int s = 0; s < kStages; ++s) ptx::mbarrier_init(SmemAddress(&staging_bars.v_staged[s]), 1);
    }
    InitBarriers<kStages, Tile::kConsumers, Fp8ValueTranspose::kThreads>(bars);  // its fence: both
    // Zeroed by a transposing thread: stored by thread 0 (with the barriers), it moved ptxas's
    // register allocation of the windowed consumers into a one-register spill (ptxas 13.0).
    if (threadIdx.x == 32) staging_bars.stop_after = 0;
  } else {
    InitBarriers<kStages, Tile::kConsumers>(bars);
  }
  __syncthreads();

  // ---------------------------------------------------------------- producer
  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<Tile::kProducerRegs>();
    if constexpr (kStagedV) {
      if (threadIdx.x >= 32) {
        // Warps 1..3: V^T of every K/V block the TMA thread loads, in the ring's order, until the
        // block count it stopped at. Warp t takes pieces t, t + 3, t + 6 of each tile.
        const Fp8ValueTransposeLane lane(threadIdx.x % 32);
        const uint32_t first_piece = threadIdx.x / 32 - 1;
        for (uint32_t ring = 0;; ++ring) {
          const Slot slot(ring);
          ptx::mbarrier_wait(SmemAddress(&staging_bars.v_staged[slot.stage]), slot.parity);
          if (ring + 1 == *reinterpret_cast<volatile uint32_t*>(&staging_bars.stop_after)) return;
          for (uint32_t piece = first_piece; piece < Fp8ValueTranspose::kPieces;
               piece += Fp8ValueTranspose::kWarps) {
            TransposeValuePiece(smem_v_staging(slot.stage), smem_vt(slot.stage), piece, lane);
          }
          ptx::fence_proxy_async_shared();  // generic-proxy writes, read by wgmma (async proxy)
          ptx::mbarrier_arrive(SmemAddress(&bars.v_full[slot.stage]));
        }
      }
    }
    if (threadIdx.x != 0) return;
    ptx::prefetch_tensor_map(&tmap_q);
    ptx::prefetch_tensor_map(&tmap_k);
    ptx::prefetch_tensor_map(&tmap_v);
    // One byte per element: a box row of 128 bytes is the whole head dim (of Q, K or V); MLA's Q and
    // K rows (192 bytes) take two boxes, columns 0..127 and 128..255 (TMA's zeros past 191), as do
    // head dim 256's.
    // Varlen: one packed "batch"; a tile's rows start at its sequence's offset. Rows and keys past
    // the sequence's end are the next sequence's (finite) tokens or TMA's zeros: such rows are not
    // stored, such keys are masked (P = 0).
    auto load_q = [&](const auto& work, int buffer, uint32_t bar) {
      int row = work.q_start, batch = work.batch;
      if constexpr (kVarlen) row += work.q_offset, batch = 0;
      for (int c = 0; c < Tile::kConsumers; ++c)
        ptx::tma_load_4d(smem_q(c, buffer), &tmap_q, bar, 0, row + c * Tile::kRowsPerConsumer,
                         work.head, batch);
      if constexpr (kTwoQkSlices) {  // the second slices (apart, so that head dim 128's code stays as it was)
        for (int c = 0; c < Tile::kConsumers; ++c)
          ptx::tma_load_4d(smem_q(c, buffer) + Tile::kQSliceBytes, &tmap_q, bar, Tile::kQkSliceCols,
                           row + c * Tile::kRowsPerConsumer, work.head, batch);
      }
    };
    // A window's tile starts at key block work.first_block (varlen: 0, its k_offset moved instead).
    auto first_key = [&](const auto& work, int block) {
      int key = block * kBlockN;
      if constexpr (kWindow) key += work.first_block * kBlockN;
      return key;
    };
    auto load_k = [&](const auto& work, int block, int stage, uint32_t bar) {
      int key = first_key(work, block), batch = work.batch;
      if constexpr (kVarlen) key += work.k_offset, batch = 0;
      ptx::tma_load_4d(smem_k(stage), &tmap_k, bar, 0, key, work.kv_head, batch);
      if constexpr (kTwoQkSlices) {
        ptx::tma_load_4d(smem_k(stage) + Tile::kKSliceBytes, &tmap_k, bar, Tile::kQkSliceCols, key,
                         work.kv_head, batch);
      }
    };
    if constexpr (!kStagedV) {
      // V^T: 128 keys (the box's inner, contiguous dimension) x the 128 head-dim rows. A window's
      // first key is a multiple of 128, and a varlen sequence's first column one of 32, so every
      // box starts on a 32-key group of the permuted layout.
      auto load_vt = [&](const auto& work, int block, int stage, uint32_t bar) {
        int column = first_key(work, block), batch = work.batch;
        if constexpr (kVarlen) column += Fp8VarlenValueColumn(work.k_offset, work.batch), batch = 0;
#pragma unroll
        for (int part = 0; part < Tile::kVtSlices; ++part)
          ptx::tma_load_4d(smem_vt(stage) + part * Tile::kVtSliceBytes, &tmap_v, bar,
                           column + Tile::kVtSliceKeys * part, 0, work.kv_head, batch);
      };
      ProduceTiles<kStages, Tile::kBlockM, kBlockN>(bars, args, Tile::kQBytes, Tile::kKBytes,
                                                     Tile::kVtSlices * Tile::kVtBytes, load_q, load_k,
                                                     load_vt);
    } else {
      // V as K: 128 key rows of 128 bytes, into the staging buffer (bar: v_staged).
      auto load_v = [&](const auto& work, int block, int stage, uint32_t bar) {
        int key = first_key(work, block), batch = work.batch;
        if constexpr (kVarlen) key += work.k_offset, batch = 0;
        ptx::tma_load_4d(smem_v_staging(stage), &tmap_v, bar, 0, key, work.kv_head, batch);
      };
      // Out of tiles after `ring` blocks: once the stage's last block was released (its phase of
      // v_staged complete, so one arrival completes the next), the transposing warps wake on it and
      // stop.
      auto stop_transposers = [&](uint32_t ring) {
        const Slot slot(ring);
        const uint32_t v_empty = SmemAddress(&bars.v_empty[slot.stage]);
        if (ring >= kStages) ptx::mbarrier_wait(v_empty, slot.parity ^ 1);
        *reinterpret_cast<volatile uint32_t*>(&staging_bars.stop_after) = ring + 1;
        ptx::mbarrier_arrive(SmemAddress(&staging_bars.v_staged[slot.stage]));  // release: stop_after
      };
      // The tile plan's loop-invariant addresses (varlen: the offsets' tail entry) formed here
      // rather than hoisted by ptxas above the warp roles, where they took registers of this
      // thread's 40 for the whole loop (a spill).
      Args plan_args = args;
      if constexpr (kVarlen) {
        asm volatile("" : "+l"(plan_args.cu_seqlens_q), "+l"(plan_args.cu_seqlens_k));
      }
      ProduceTiles<kStages, Tile::kBlockM, kBlockN>(bars, plan_args, Tile::kQBytes, Tile::kKBytes,
                                                     Tile::kVStagingBytes, load_q, load_k, load_v,
                                                     staging_bars.v_staged, stop_transposers);
    }
    return;
  }

  // ---------------------------------------------------------------- consumers
  ptx::setmaxnreg_inc<Tile::kConsumerRegs>();
  const int consumer = warpgroup - 1;
  const int lane = threadIdx.x % 32;
  const int warp = (threadIdx.x % 128) / 32;

  // Ping-pong turns and releases (PingPong), S = Q K^T (IssueQK: 32 columns per k-step, MLA's two
  // slices): as in the 16-bit mainloop.
  const PingPong turns{consumer, lane};
  auto begin_turn = [&]() { turns.Begin(); };
  auto end_turn = [&]() { turns.End(); };
  turns.Open();
  auto release = [&](uint64_t& empty) { turns.Release(empty); };
  auto issue_qk = [&](float (&s)[kBlockN / 2], int stage, int q_buffer) {
    if constexpr (kInt8) {
      // int32 sums into S's registers; softmax_step turns them into floats.
      IssueQK<int8_t, kBlockN, Tile::kHeadDimQK, Tile::kQSliceBytes, Tile::kKSliceBytes, Tile::kQBytes>(
          reinterpret_cast<uint32_t(&)[kBlockN / 2]>(s), smem_q(consumer, 0), smem_k(stage), q_buffer);
    } else {
      IssueQK<__nv_fp8_e4m3, kBlockN, Tile::kHeadDimQK, Tile::kQSliceBytes, Tile::kKSliceBytes,
              Tile::kQBytes>(s, smem_q(consumer, 0), smem_k(stage), q_buffer);
    }
  };
  // B = V^T's tile and the ones below it: rows (head-dim columns of O, then 8 sum columns) 1024
  // bytes per 8 (512 in 64-key slices), keys contiguous; k-step j starts 32 bytes (keys) into its
  // slice's rows. Separate sums: B = V^T's tile into O's first kHeadDim columns, then B = the shared
  // ones into the last 8.
  // keep = 0 (warpgroup-uniform) starts the accumulator afresh after a promotion.
  auto issue_pv = [&](float (&o)[Tile::kPvN / 2], const uint32_t (&p)[kBlockN / 32][4], int stage, int keep) {
    ptx::wgmma_fence();
#pragma unroll
    for (int j = 0; j < kBlockN / 32; ++j) {
      constexpr int kSteps = Tile::kVtStepsPerSlice;
      const uint32_t vt = smem_vt(stage) + (j / kSteps) * Tile::kVtSliceBytes + 32 * (j % kSteps);
      const uint64_t desc_vt = SmemDescSwizzled<Tile::kVtSliceKeys>(vt, 16);  // one row per slice
      if constexpr (Tile::kSeparateSums) {
        const uint64_t desc_ones =
            SmemDescSwizzled<Tile::kVtSliceKeys>(smem_base + Tile::kSumOnesOffset + 32 * (j % kSteps), 16);
        ptx::Wgmma<__nv_fp8_e4m3, Tile::kHeadDim>::rs(*reinterpret_cast<float(*)[Tile::kHeadDim / 2]>(&o[0]),
                                                      p[j], desc_vt, j == 0 ? keep : 1);
        ptx::Wgmma<__nv_fp8_e4m3, 8>::rs(*reinterpret_cast<float(*)[4]>(&o[Tile::kHeadDim / 2]), p[j],
                                         desc_ones, j == 0 ? keep : 1);
      } else {
        ptx::Wgmma<__nv_fp8_e4m3, Tile::kPvN>::rs(o, p[j], desc_vt, j == 0 ? keep : 1);
      }
    }
    ptx::wgmma_commit_group();
  };

  // This thread's part of O's float32 copy (see Fp8Tile::kOCopyBytes).
  float4* const o_copy =
      reinterpret_cast<float4*>(smem_aligned + Tile::kOCopyOffset + consumer * Tile::kOCopyBytes) +
      threadIdx.x % 128;
  constexpr int kOChunks = Tile::kOChunks;  // float4s per thread
  constexpr int kRegChunks = Tile::kRegCopyChunks;
  constexpr int kRegFirst = Tile::kRegCopyFirst;  // chunks kRegFirst .. + kRegChunks in registers
  static_assert(kRegChunks >= 0 && kRegFirst >= 0 && kRegFirst + kRegChunks <= kOChunks);

  // No code unless a measuring build records the timeline (tools/measure/timeline.h); the windowed, varlen, MLA and 192-key
  // kernels never record (their stamps' registers would spill).
  std::conditional_t<kWindow || kVarlen || kMla || kInt8 || Tile::kBlockN != 128, NoTimeline,
                     typename MeasureVariant<>::Timeline>
      timeline(consumer);
  uint32_t ring = 0;
  for (int round = 0;; ++round) {
    const RingSlot<Tile::kQBuffers> q_slot(round);  // the round's Q buffer and index
    const int q_buffer = q_slot.stage;
    ptx::mbarrier_wait(SmemAddress(&bars.q_full[q_buffer]), q_slot.parity);
    const int tile = *reinterpret_cast<volatile int*>(&bars.tile[q_buffer]);
    if (tile >= args.num_tiles) break;
    timeline.MarkTile(round, kTileStart);
    const auto work = PlanTile<Tile::kBlockM, kBlockN>(tile, args);
    const int rows_start = work.q_start + consumer * Tile::kRowsPerConsumer;
    const int first_row = rows_start + 16 * warp + lane / 4;
    int seqlen_k, descale_batch = work.batch;  // this tile's keys; its descales' batch or sequence
    if constexpr (kVarlen) {
      seqlen_k = work.len_k;
      descale_batch = min(work.batch, args.num_seqs - 1);  // the tail (no keys) reads any sequence's
    } else {
      seqlen_k = args.seqlen_k;
    }
    const int descale_index =
        args.descale_per_head ? descale_batch * args.heads_kv + work.kv_head : 0;

    // O (columns 0..127) and the row sums of P~ (columns 128..135, all equal) are
    //   o + (promoted ? o_copy * copy_scale : 0),
    // o the wgmma accumulator (the key blocks since the last promotion), o_copy the float32 copy
    // (its first kRegChunks float4s in reg_copy, the rest in shared memory), copy_scale a per-row
    // power of two that takes the lazy rescales, so a rescale touches registers only.
    // Accumulator value i belongs to row (i >> 1) & 1.
    float o[Tile::kPvN / 2];
    bool promoted = false;
    int pending = 0;  // key blocks in the accumulator (warpgroup-uniform)
    float copy_scale[2] = {1.f, 1.f};
    float4 reg_copy[kRegChunks > 0 ? kRegChunks : 1] = {};  // read only once `promoted`
    // Chunk c of the copy (c is a constant in the unrolled loops below): in registers, or at its
    // place among the chunks in shared memory.
    auto in_registers = [](int c) { return c >= kRegFirst && c < kRegFirst + kRegChunks; };
    auto smem_chunk = [](int c) { return c < kRegFirst ? c : c - kRegChunks; };
    auto load_copy = [&](int c) {
      return in_registers(c) ? reg_copy[c - kRegFirst] : o_copy[smem_chunk(c) * 128];
    };
    auto store_copy = [&](int c, const float4& value) {
      if (in_registers(c)) {
        reg_copy[c - kRegFirst] = value;
      } else {
        o_copy[smem_chunk(c) * 128] = value;
      }
    };
    // o_copy += o / copy_scale: exact scaling (powers of two), one FFMA per value.
    auto promote = [&]() {
      const float inv0 = promoted ? __frcp_rn(copy_scale[0]) : 1.f;
      const float inv1 = promoted ? __frcp_rn(copy_scale[1]) : 1.f;
      if (!promoted) copy_scale[0] = copy_scale[1] = 1.f;
#pragma unroll
      for (int c = 0; c < kOChunks; ++c) {
        const float4 kept = promoted ? load_copy(c) : make_float4(0.f, 0.f, 0.f, 0.f);
        store_copy(c, make_float4(fmaf(o[4 * c], inv0, kept.x), fmaf(o[4 * c + 1], inv0, kept.y),
                                  fmaf(o[4 * c + 2], inv1, kept.z), fmaf(o[4 * c + 3], inv1, kept.w)));
      }
      promoted = true;
    };
    // Every kPromoteBlocks blocks, before the next P V (which then overwrites the accumulator),
    // and once after the first block: an attention sink (a huge P at key 0) would otherwise set
    // the accumulator's scale for the blocks after it. Issued inside the wgmma turn, right after
    // Q K^T, while the tensor cores are busy. `promoted` changes only here: warpgroup-uniform.
    auto promote_if_due = [&]() {
      if (pending == Tile::kPromoteBlocks || (pending == 1 && !promoted)) {
        promote();
        pending = 0;
      }
    };
    // A rescale by alpha (powers of two, or 0 for a row's first visible key).
    auto rescale = [&](const float (&alpha)[2]) {
#pragma unroll
      for (int i = 0; i < Tile::kPvN / 2; ++i) o[i] *= alpha[(i >> 1) & 1];
      if (!promoted) return;
      copy_scale[0] *= alpha[0];
      copy_scale[1] *= alpha[1];
      // Keep 1 / copy_scale finite and exact: rarely (r moved 2^64 since the copy began), fold
      // the scale into the copy.
      auto out_of_range = [](float x) { return !(x >= 0x1p-64f && x <= 0x1p64f); };
      if (out_of_range(copy_scale[0]) || out_of_range(copy_scale[1])) {
#pragma unroll
        for (int c = 0; c < kOChunks; ++c) {
          const float4 kept = load_copy(c);
          store_copy(c, make_float4(kept.x * copy_scale[0], kept.y * copy_scale[0],
                                    kept.z * copy_scale[1], kept.w * copy_scale[1]));
        }
        copy_scale[0] = copy_scale[1] = 1.f;
      }
    };
    Fp8OnlineSoftmax<kLeanP, kBlockN> softmax;
    float descale_v = 0.f;  // loaded while the last P V runs (no key: O = 0 whatever its value)

    if (work.num_blocks == 0) {
#pragma unroll
      for (int i = 0; i < Tile::kPvN / 2; ++i) o[i] = 0.f;
      release(bars.q_empty[q_buffer]);
    } else {
      float row_scale;  // set once block 0's Q K^T is issued (INT8: per key block, below)
      // INT8: the tile's Q scale, and the K scale of the block whose Q K^T was issued last (loaded
      // then, its latency behind the wgmma's).
      float q_scale = 0.f, key_scale = 0.f;
      // The tile's first key block in its sequence: a dense window's first_block; a varlen window
      // moved k_offset instead (by whole key blocks from the sequence's first key).
      int first_key_block = 0;
      if constexpr (kInt8 && kWindow) {
        if constexpr (kVarlen) {
          first_key_block = (work.k_offset - args.cu_seqlens_k[work.batch]) / kBlockN;
        } else {
          first_key_block = work.first_block;
        }
      }
      auto load_key_scale = [&](int block) {
        if constexpr (kInt8) {
          const int key_block = first_key_block + block;
          // The K scale block (128 keys) holding this key block (128 keys, or 64 at head dim 256).
          const int scale_block = key_block / (kInt8ScaleBlock / kBlockN);
          return args.descale_k[(static_cast<int64_t>(work.batch) * args.heads_kv + work.kv_head) *
                                    args.k_blocks + scale_block];
        } else {
          return 0.f;  // FP8: one descale per tile (row_scale below)
        }
      };
      auto softmax_step = [&](float (&s)[kBlockN / 2], uint32_t (&p)[kBlockN / 32][4], float (&alpha)[2],
                              int block) {
        if constexpr (kInt8) {
          // The exact int32 sums as floats (below 2^24: exact), and the block's factor.
#pragma unroll
          for (int i = 0; i < kBlockN / 2; ++i) s[i] = static_cast<float>(static_cast<int>(__float_as_uint(s[i])));
          row_scale = (q_scale * key_scale) * args.scale_log2;
          softmax.SetRowScale(row_scale);
        }
        if constexpr (kWindow) {
          // Block `block` of the tile holds keys from (first_block + block) * kBlockN. Blocks inside
          // every row's window (and the keys) stay unmasked: a block needs the mask if it ends past
          // the seq_k tail or the first row's right edge, or starts before the last row's left edge
          // (this consumer's 64 rows). Step then masks nothing.
          const int key_start = (work.first_block + block) * kBlockN;
          const int first_pos = rows_start + work.diagonal;
          const int left = args.window_left, right = args.window_right;
          const bool needs_mask =
              key_start + kBlockN > seqlen_k ||
              (right >= 0 && key_start + kBlockN - 1 > first_pos + right) ||
              (left >= 0 && key_start < first_pos + Tile::kRowsPerConsumer - 1 - left);
          if (needs_mask) {
            MaskWindowByRowBounds<kBlockN>(s, key_start, first_row, lane, seqlen_k, work.diagonal,
                                           left, right);
          }
          softmax.template Step<!kLatePack>(s, p, alpha, row_scale, false, key_start, first_row, lane, seqlen_k, false,
                       work.diagonal, timeline);
        } else {
          const int key_start = block * kBlockN;
          const bool needs_mask =
              key_start + kBlockN > seqlen_k ||
              (args.causal && key_start + kBlockN - 1 > rows_start + work.diagonal);
          softmax.template Step<!kLatePack>(s, p, alpha, row_scale, needs_mask, key_start, first_row, lane, seqlen_k,
                       args.causal, work.diagonal, timeline);
        }
      };
      auto after_qk = [&](int block, int stage) {
        release(bars.k_empty[stage]);
        if (block == work.num_blocks - 1) release(bars.q_empty[q_buffer]);
      };

      float s_acc[kBlockN / 2];
      uint32_t p_even[kBlockN / 32][4], p_odd[kBlockN / 32][4];  // alternate, as in the 16-bit kernel (no C7513)
      float alpha[2];

      const Slot first(ring);
      ptx::mbarrier_wait(SmemAddress(&bars.k_full[first.stage]), first.parity);
      timeline.MarkTile(round, kFirstKeys);
      begin_turn();
      issue_qk(s_acc, first.stage, q_buffer);
      end_turn();
      timeline.MarkTile(round, kFirstIssued);
      // (descale_q * descale_k) * scale_log2, in the emulation's order: loaded and multiplied
      // while block 0's Q K^T runs (before it, the loads' latency held up the tile's start).
      if constexpr (kInt8) {
        q_scale = args.descale_q[(static_cast<int64_t>(work.batch) * args.heads_q + work.head) * args.q_blocks +
                                 work.q_start / kInt8ScaleBlock];
        key_scale = load_key_scale(0);
      } else {
        row_scale = (args.descale_q[descale_index] * args.descale_k[descale_index]) * args.scale_log2;
        softmax.SetRowScale(row_scale);
      }
      ptx::wgmma_wait_group<0>();
      FenceRegisters(s_acc);
      timeline.MarkTile(round, kFirstScores);
      after_qk(0, first.stage);
      softmax_step(s_acc, p_even, alpha, 0);  // O is 0: nothing to rescale
      if constexpr (kLatePack) softmax.Pack(s_acc, p_even);
      timeline.MarkTile(round, kFirstSoftmax);

      auto iteration = [&](int block, const uint32_t (&p_prev)[kBlockN / 32][4],
                           uint32_t (&p_next)[kBlockN / 32][4]) {
        const Slot cur(ring + block), prev(ring + block - 1);
        timeline.Mark(kIterationStart);
        ptx::mbarrier_wait(SmemAddress(&bars.k_full[cur.stage]), cur.parity);
        timeline.Mark(kKeysReady);
        begin_turn();
        timeline.Mark(kTurnHeld);
        issue_qk(s_acc, cur.stage, q_buffer);
        if constexpr (kInt8) key_scale = load_key_scale(block);
        promote_if_due();  // while the tensor cores run this Q K^T
        // V of the previous block, waited for while this Q K^T runs (outside the turn the wait's
        // latency adds to the K wait's: measured 78 -> 130 cycles per block, docs/benchmarks.md).
        ptx::mbarrier_wait(SmemAddress(&bars.v_full[prev.stage]), prev.parity);
        issue_pv(o, p_prev, prev.stage, pending > 0);
        end_turn();
        timeline.Mark(kIssued);
        ptx::wgmma_wait_group<1>();
        FenceRegisters(s_acc);
        timeline.Mark(kScoresLanded);
        after_qk(block, cur.stage);
        softmax_step(s_acc, p_next, alpha, block);
        timeline.Mark(kSoftmaxDone);
        ptx::wgmma_wait_group<0>();
        FenceRegisters(o);
        timeline.Mark(kOutputLanded);
        if constexpr (kLatePack) softmax.Pack(s_acc, p_next);  // p_prev's P V has landed
        release(bars.v_empty[prev.stage]);
        // Lazy rescale: r rarely changes, and then by an exact power of two (sums included).
        if (__any_sync(0xffffffff, alpha[0] != 1.f || alpha[1] != 1.f)) rescale(alpha);
        ++pending;
        timeline.Mark(kIterationEnd);
        timeline.Next();
      };
      ForLaterBlocks<kLatePack>(work.num_blocks, iteration, p_even, p_odd);

      const int last_block = work.num_blocks - 1;
      const Slot last(ring + last_block);
      ptx::mbarrier_wait(SmemAddress(&bars.v_full[last.stage]), last.parity);
      begin_turn();
      promote_if_due();
      if (kLatePack || last_block % 2 == 0) {
        issue_pv(o, p_even, last.stage, pending > 0);
      } else {
        issue_pv(o, p_odd, last.stage, pending > 0);
      }
      end_turn();
      descale_v = args.descale_v[descale_index];  // its latency behind the last P V's
      ptx::wgmma_wait_group<0>();
      FenceRegisters(o);
      timeline.MarkTile(round, kLastOutput);
      release(bars.v_empty[last.stage]);
      ring += work.num_blocks;
      if (promoted) {
#pragma unroll
        for (int c = 0; c < kOChunks; ++c) {
          const float4 kept = load_copy(c);
          o[4 * c] = fmaf(kept.x, copy_scale[0], o[4 * c]);
          o[4 * c + 1] = fmaf(kept.y, copy_scale[0], o[4 * c + 1]);
          o[4 * c + 2] = fmaf(kept.z, copy_scale[1], o[4 * c + 2]);
          o[4 * c + 3] = fmaf(kept.w, copy_scale[1], o[4 * c + 3]);
        }
      }
    }
    timeline.MarkTile(round, kEpilogueStart);

    // Epilogue: O * descale_v / l in bf16, LSE = (r + log2 l) ln 2; l = 0 (no visible key):
    // O = 0, LSE = -inf. kTmaEpilogue: O through this consumer's shared-memory tile and one TMA
    // store (TmaEpilogue), which also drops rows past seqlen_q.
    const int quad_col = 2 * (lane % 4);
    const TmaEpilogue<Tile::kHeadDimV, Tile::kOSliceBytes> epilogue(
        smem_aligned + Tile::kOTileOffset + consumer * Tile::kOConsumerBytes,
        smem_base + Tile::kOTileOffset + consumer * Tile::kOConsumerBytes, consumer);
    if constexpr (kTmaEpilogue) epilogue.Begin();
    auto store_lse = [&](int h, float total, int64_t lse_index) {
      if (lane % 4 == 0) {
        const float lse = total > 0.f ? (softmax.r[h] + __log2f(total)) * 0.69314718f : -INFINITY;
        args.lse[lse_index] = lse;
      }
    };
    // Row h of this thread to out[out_row ..] and lse[lse_index], from registers.
    auto store_row = [&](int h, float total, float inv, int64_t out_row, int64_t lse_index) {
      __nv_bfloat16* const out = static_cast<__nv_bfloat16*>(args.out);
#pragma unroll
      for (int c = 0; c < Tile::kHeadDim / 8; ++c) {
        *reinterpret_cast<uint32_t*>(out + out_row + 8 * c + quad_col) =
            PackPair<__nv_bfloat16>(o[4 * c + 2 * h] * inv, o[4 * c + 2 * h + 1] * inv);
      }
      store_lse(h, total, lse_index);
    };
    float totals[2];  // kTmaEpilogue: the rows' sums, for their LSE once O's store is issued
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float total = o[Tile::kHeadDim / 2 + 2 * h];  // a sum column of row h
      totals[h] = total;
      const float inv = total > 0.f ? descale_v / total : 0.f;
      const int row = first_row + 8 * h;
      if constexpr (kVarlen) {
        // The tile's offsets are planned again rather than held in registers through the key loop.
        const auto rows = PlanTile<Tile::kBlockM, kBlockN>(tile, args);
        ForEachVarlenToken(rows, row, args.total_q, [&](int64_t token) {
          store_row(h, total, inv, (token * args.heads_q + rows.head) * Tile::kHeadDim,
                    static_cast<int64_t>(rows.head) * args.total_q + token);
        });
      } else {
        if constexpr (kTmaEpilogue) {
          epilogue.template WriteRow<__nv_bfloat16>(o, h, row - rows_start, quad_col, inv);
        } else {
          if (row >= args.seqlen_q) continue;
          // Head dim 256: the tile's batch and head planned again, as varlen's offsets are, rather
          // than held through the key loop (the windowed kernels spilled them, ptxas 13.0).
          const auto where = [&] {
            if constexpr (Tile::kSeparateSums) {
              return PlanTile<Tile::kBlockM, kBlockN>(tile, args);
            } else {
              return work;
            }
          }();
          const int64_t lse_index =
              (static_cast<int64_t>(where.batch) * args.heads_q + where.head) * args.seqlen_q + row;
          const int64_t out_row =
              ((static_cast<int64_t>(where.batch) * args.seqlen_q + row) * args.heads_q + where.head) *
              Tile::kHeadDim;
          store_row(h, total, inv, out_row, lse_index);
        }
      }
    }
    if constexpr (kTmaEpilogue) {
      epilogue.Store(tmap_o, rows_start, work.head, work.batch);
      // The LSE after O's store: the store's proxy fence waits for this thread's earlier memory
      // accesses (MEMBAR.ALL.CTA), global stores included.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = first_row + 8 * h;
        const int64_t lse_index =
            (static_cast<int64_t>(work.batch) * args.heads_q + work.head) * args.seqlen_q + row;
        if (row < args.seqlen_q) store_lse(h, totals[h], lse_index);
      }
    }
    timeline.MarkTile(round, kTileEnd);
  }
  if constexpr (kTmaEpilogue) TmaEpilogue<Tile::kHeadDimV, Tile::kOSliceBytes>::Finish();
  if (consumer == 0) begin_turn();  // consumer 1's last hand-over
}

// The FP8 mainloop as fwd_kernel.cuh's kernels run it: lean or exact P, over a tile (Fp8TileT: head
// dims, V source, layout, keys per block); the arguments (dense or varlen, windowed or not) are the
// kernel's.
template <bool kLeanP, typename Tile>
struct Fp8Mainloop {
  static constexpr int kThreads = Tile::kThreads;
  template <typename Args>
  static __device__ __forceinline__ void Run(const CUtensorMap& tmap_q, const CUtensorMap& tmap_k,
                                             const CUtensorMap& tmap_v, const CUtensorMap* tmap_o,
                                             const Args& args) {
    FlashFwdFp8Tiles<kLeanP, Tile>(tmap_q, tmap_k, tmap_v, tmap_o, args);
  }
};

}  // namespace jzyfa
