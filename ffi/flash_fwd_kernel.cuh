// The Hopper forward kernel for 16-bit inputs (bf16, f16), head dims 64, 128 and 256, and MLA's
// (q/k head dim 192, v head dim 128); every head dim dense or varlen, with or without a window.
//
// A persistent grid (one CTA per SM) works through tiles of 128 query rows of one
// (batch, head), claimed in order from a global counter: (batch, head) pairs in groups, longest
// tiles first inside a group, its heads side by side, so that concurrent CTAs share K/V in L2
// (PlanTile, TileGroupPairs).
// Each CTA has three warpgroups:
//   warpgroup 0, the producer: one thread streams Q once and 128-key blocks of K and V
//     (64-key blocks at head dim 256: FwdTile) through a 2-stage shared-memory ring with TMA
//     (full/empty mbarriers), holding few registers (setmaxnreg) so the consumers can have more;
//   warpgroups 1 and 2, the consumers: 64 query rows each. S = Q K^T and O += P V run on
//     wgmma (HGMMA); the softmax is online, in registers, in the log2 domain.
// Overlap: inside a consumer, the next block's Q K^T is issued before this block's softmax
// and P V after it, so the softmax runs while the tensor cores work; between the two
// consumers, named barriers make them take turns issuing (ping-pong), so one's softmax
// overlaps the other's GEMMs. Across tiles, the producer loads the next tile's Q and first
// K/V blocks while the consumers finish this one (its last P V and the epilogue).
#pragma once

#include <cuda.h>

#include <cstdint>
#include <type_traits>

#include "flash_fwd_common.cuh"
#include "kernel_timeline.cuh"
#include "measure_variant.h"
#include "sm90_mma.cuh"
#include "softcap.cuh"
#include "tile_size.h"

namespace jzyfa {

// Runtime arguments of one launch (the tensor maps travel as separate kernel parameters).
struct FwdArgs {
  void* out;
  float* lse;
  int* tile_counter;  // zero before the launch; each claim takes the next tile
  int num_tiles;      // batch * m_tiles * heads_q
  int m_tiles;        // query tiles per (batch, head)
  int group_pairs;    // (batch, head) pairs per group of the tile order (PlanTile)
  int seqlen_q;
  int seqlen_k;
  int heads_q;
  int heads_kv;
  float scale_log2;  // softmax_scale * log2(e); with a softcap c, c * log2(e) (softcap.cuh)
  int causal;
  float softcap_tanh_scale;  // 2 log2(e) softmax_scale / c; 0: no softcap
};

// The tile geometry of head dims kHeadDimQK for q and k (Q's and K's tiles, the Q K^T k-loop) and
// kHeadDimV for v and o (V's tile, P V's N, the O accumulator and its stores); equal except for MLA.
// kKeyBlock: the keys per block; a multiple of 16 (P V's k-steps) up to 256 (wgmma's N). kLayout:
// dense or varlen (varlen stores O from registers). The sizes are tile_size.h's (Fwd16TileSize); this
// struct derives the shared-memory layout from them.
template <int kHeadDimQK, int kHeadDimV = kHeadDimQK, int kKeyBlock = Fwd16DefaultBlockN(kHeadDimV),
          Layout kLayout = Layout::kDense>
struct FwdTile {
  static constexpr TileSize kSize = Fwd16TileSize(kHeadDimV, kLayout, kKeyBlock);
  static constexpr int kConsumers = kFwdConsumers;
  static constexpr int kRowsPerConsumer = kFwdRowsPerConsumer;  // one wgmma M
  static constexpr int kBlockM = kConsumers * kRowsPerConsumer;
  // Keys per block: the N of S = Q K^T. Shared memory at hd256: Q 64 KB + 2 stages x (K + V) 32 KB
  // each = 192 KB.
  static constexpr int kBlockN = kSize.block_n;
  // S (kBlockN / 2), two P buffers (kBlockN / 4 each) and O (kHeadDimV / 2): 192 registers per
  // consumer thread in every default tile that has two P buffers (hd64: 128; hd128, MLA: 192). Wider
  // key blocks (hd128 with 176 keys: 240) would overflow the 232: one P buffer there (kOneP).
  static constexpr bool kOnePForRegisters = kBlockN + kHeadDimV / 2 > 192;
  static constexpr int kStages = kSize.stages;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kProducerRegs = kSize.producer_regs;
  static constexpr int kConsumerRegs = kSize.consumer_regs;
  // 128-byte swizzle atoms are 64 16-bit elements wide: the head dims come in slices.
  static constexpr int kQKSlices = kHeadDimQK / 64;  // of Q and K
  static constexpr int kVSlices = kHeadDimV / 64;    // of V and O
  static constexpr int kQSliceBytes = kRowsPerConsumer * 128;  // O's slices too
  static constexpr int kQConsumerBytes = kQSliceBytes * kQKSlices;
  static constexpr int kQBytes = kQConsumerBytes * kConsumers;
  static constexpr int kKVSliceBytes = kBlockN * 128;
  static constexpr int kKBytes = kKVSliceBytes * kQKSlices;  // one stage
  static constexpr int kVBytes = kKVSliceBytes * kVSlices;   // one stage
  // With the TMA-store epilogue each consumer also has an O tile: Q itself is being refilled for
  // the next tile while the epilogue runs.
  static constexpr int kOConsumerBytes = kQSliceBytes * kVSlices;
  static constexpr int kSmemAlign = 1024;  // 128-byte swizzle repeats every 1024 bytes
  static constexpr int kMaxDynamicSmemBytes = 227 * 1024;
  // One Q tile (a second, to prefetch the next tile's Q, measured no gain: BF16 -1% to +1%).
  static constexpr int kQBuffers = 1;
  // Q, then the K/V ring.
  static constexpr int kRingSmemBytes = kQBytes + kStages * (kKBytes + kVBytes);
  // The TMA-store epilogue where the table asks for it and the O tiles fit (not hd256: Q 64 KB + 2 x
  // (K + V) 64 KB + O 64 KB = 256 KB; not MLA: 208 + 32 KB).
  static constexpr bool kEpilogueTma =
      kSize.epilogue_tma &&
      kRingSmemBytes + kOConsumerBytes * kConsumers + kSmemAlign <= kMaxDynamicSmemBytes;
  static constexpr int kOBytes = kEpilogueTma ? kOConsumerBytes * kConsumers : 0;
  static constexpr int kSmemBytes = kRingSmemBytes + kOBytes;
  static constexpr int kDynamicSmemBytes = kSmemBytes + kSmemAlign;
  // An sm_90 block opts in to at most 227 KB of dynamic shared memory: every tile fits (MLA: Q 48 KB
  // + 2 x (K 48 KB + V 32 KB) = 208 KB).
  static constexpr bool kFitsSharedMemory = kDynamicSmemBytes <= kMaxDynamicSmemBytes;
  static_assert(kFitsSharedMemory, "the tile must fit Hopper's shared memory");
  static_assert(kHeadDimQK % 64 == 0 && kHeadDimV % 64 == 0, "head dims must be multiples of 64");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "key blocks: multiples of 16, up to 256");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= CtaRegisterPool(kThreads));
};

// Online softmax of one consumer warpgroup over one key block. Accumulator layout of a
// wgmma m64nN f32 result, per thread: for each 8-column chunk c, values 4c..4c+3 sit at
// rows (r, r, r+8, r+8) and columns (8c+2q, 8c+2q+1, ...), with r = 16 * warp + lane / 4
// and q = lane % 4. Each thread owns two rows (h = 0, 1); a row spans a quad of lanes.
template <typename Element, int kBlockN>
struct OnlineSoftmax {
  float row_max[2] = {-INFINITY, -INFINITY};  // raw scores (before the scale)
  float row_sum[2] = {0.f, 0.f};              // this thread's share; quad-summed at the end

  // Masks, exponentiates S in place, packs P as the A operand of P V (Pack), and returns the
  // factor by which O must be rescaled.
  __device__ __forceinline__ void Step(float (&s)[kBlockN / 2], uint32_t (&p)[kBlockN / 16][4],
                                       float (&correction)[2], bool needs_mask, int key_start,
                                       int first_row, int lane, int seqlen_k, bool causal,
                                       int diagonal, float scale_log2) {
    Exponentiate(s, correction, needs_mask, key_start, first_row, lane, seqlen_k, causal, diagonal,
                 scale_log2);
    Pack(s, p);
  }

  // Step without the packing: S holds the block's unnormalised probabilities (hd256 packs them
  // once the previous block's P V, which reads its one P buffer, has landed).
  __device__ __forceinline__ void Exponentiate(float (&s)[kBlockN / 2], float (&correction)[2],
                                               bool needs_mask, int key_start, int first_row,
                                               int lane, int seqlen_k, bool causal, int diagonal,
                                               float scale_log2) {
    const int quad_col = 2 * (lane % 4);
    // The ablation's masked keys get 0 (finite P, so the tensor cores see ordinary operands).
    constexpr float kMasked = MeasureVariant<>::kSoftmaxAblation ? 0.f : -INFINITY;
    if (needs_mask) {
#pragma unroll
      for (int c = 0; c < kBlockN / 8; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key_start + 8 * c + quad_col + (e & 1);
          const int row = first_row + 8 * (e >> 1);
          const bool visible = key < seqlen_k && (!causal || key <= row + diagonal);
          if (!visible) s[4 * c + e] = kMasked;
        }
    }
    if constexpr (MeasureVariant<>::kSoftmaxAblation) {
#pragma unroll
      for (int i = 0; i < kBlockN / 2; ++i) s[i] *= scale_log2;
      correction[0] = correction[1] = 1.f;
      row_max[0] = row_max[1] = 0.f;
      row_sum[0] = row_sum[1] = 1.f;
      return;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float block_max = -INFINITY;
#pragma unroll
      for (int c = 0; c < kBlockN / 8; ++c)
        block_max = fmaxf(block_max, fmaxf(s[4 * c + 2 * h], s[4 * c + 2 * h + 1]));
      const float new_max = fmaxf(row_max[h], QuadMax(block_max));
      // A row with no visible key so far keeps max = -inf; use 0 so no inf - inf appears.
      const float max_scaled = new_max == -INFINITY ? 0.f : new_max * scale_log2;
      correction[h] = ptx::ex2_approx(row_max[h] * scale_log2 - max_scaled);
      row_max[h] = new_max;
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < kBlockN / 8; ++c)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[4 * c + 2 * h + e];
          x = ptx::ex2_approx(fmaf(x, scale_log2, -max_scaled));
          sum += x;
        }
      row_sum[h] = row_sum[h] * correction[h] + sum;
    }
  }

  // P as the A operand of P V: the accumulator of keys 16j..16j+15 is the register fragment of a
  // k16 A tile.
  static __device__ __forceinline__ void Pack(const float (&s)[kBlockN / 2],
                                              uint32_t (&p)[kBlockN / 16][4]) {
#pragma unroll
    for (int j = 0; j < kBlockN / 16; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        p[j][r] = PackPair<Element>(s[8 * j + 2 * r], s[8 * j + 2 * r + 1]);
  }

  // Sliding windows (before Step, which then masks nothing): row i, at i + diagonal, sees keys
  // pos - left .. pos + right (-1: unbounded) below seqlen_k; the others get -inf. A row that sees
  // no key of any block keeps max -inf and sum 0: O = 0, LSE = -inf. No overflow: positions, keys
  // and bounds are below 2^30 in magnitude (the launch checks seqlen_q + seqlen_k).
  __device__ __forceinline__ void MaskWindow(float (&s)[kBlockN / 2], int key_start, int first_row,
                                             int lane, int seqlen_k, int diagonal, int left,
                                             int right) {
    const int quad_col = 2 * (lane % 4);
#pragma unroll
    for (int c = 0; c < kBlockN / 8; ++c)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key_start + 8 * c + quad_col + (e & 1);
        const int offset = key - (first_row + 8 * (e >> 1) + diagonal);  // key - position
        const bool visible =
            key < seqlen_k && (left < 0 || offset >= -left) && (right < 0 || offset <= right);
        if (!visible) s[4 * c + e] = -INFINITY;
      }
  }
};

// The kernel's body, for dense batches (FwdArgs) and packed variable-length ones (VarlenFwdArgs:
// 4-D maps over [1, total, heads, D], per-sequence offsets, lengths and masks, and the register
// epilogue only, since a TMA store box would spill into the next sequence).
template <typename Element, int kHeadDimQK, int kHeadDimV,
          int kKeyBlock = FwdTile<kHeadDimQK, kHeadDimV>::kBlockN, typename Args>
__device__ __forceinline__ void FlashFwdTiles(const CUtensorMap& tmap_q, const CUtensorMap& tmap_k,
                                              const CUtensorMap& tmap_v,
                                              const CUtensorMap* tmap_o, const Args& args) {
  constexpr bool kVarlen = kIsVarlen<Args>;
  constexpr bool kWindow = kHasWindow<Args>;  // the tile's blocks start at work.first_block
  using Tile = FwdTile<kHeadDimQK, kHeadDimV, kKeyBlock, kVarlen ? Layout::kVarlen : Layout::kDense>;
  // O through shared memory and a TMA store (tmap_o), or from registers (tmap_o unused).
  constexpr bool kTmaEpilogue = Tile::kEpilogueTma;
  static_assert(!(kVarlen && kTmaEpilogue), "varlen stores O from registers");
  static_assert(Tile::kFitsSharedMemory, "this tile needs more shared memory than a block can have");
  constexpr int kBlockN = Tile::kBlockN;
  constexpr int kStages = Tile::kStages;
  using Slot = RingSlot<kStages>;

  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) FwdBarriers<kStages, Tile::kQBuffers> bars;
  const uint32_t smem_base = (SmemAddress(smem_raw) + Tile::kSmemAlign - 1) &
                             ~uint32_t(Tile::kSmemAlign - 1);
  auto smem_q = [&](int consumer, int buffer) {
    return smem_base + buffer * Tile::kQBytes + consumer * Tile::kQConsumerBytes;
  };
  auto smem_k = [&](int stage) {
    return smem_base + Tile::kQBuffers * Tile::kQBytes + stage * (Tile::kKBytes + Tile::kVBytes);
  };
  auto smem_v = [&](int stage) { return smem_k(stage) + Tile::kKBytes; };
  auto smem_o = [&](int consumer) { return smem_base + Tile::kRingSmemBytes + consumer * Tile::kOConsumerBytes; };

  const int warpgroup = threadIdx.x / 128;
  // hd256: one P buffer, packed once the previous P V has landed (see the key loop), as a second
  // one overflows the consumers' 232 registers. MLA's windowed kernels likewise: with two P buffers
  // (S 64 + O 64 + P 2 x 32) and the window's bounds they spill 8-28 bytes (ptxas); with one, none.
  // Key blocks wider than the default (FwdTile::kOnePForRegisters) likewise.
  constexpr bool kOneP =
      kHeadDimV > 128 || (kWindow && kHeadDimQK != kHeadDimV) || Tile::kOnePForRegisters;
  // Head dim 256 and MLA's: the consumers' registers are full (O, S and P at 232).
  constexpr bool kWideHeadDims = kHeadDimQK > 128;

  // The windowed tile plan needs a few more registers in the producer (48), taken from the
  // consumers (224): the CTA's pool is full at 40 / 232 (CtaRegisterPool).
  constexpr int kProducerRegs = Tile::kProducerRegs;
  constexpr int kConsumerRegs = Tile::kConsumerRegs;
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * Tile::kConsumers <=
                CtaRegisterPool(Tile::kThreads));

  InitBarriers<kStages, Tile::kConsumers>(bars);
  __syncthreads();

  // ---------------------------------------------------------------- producer
  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x != 0) return;
    ptx::prefetch_tensor_map(&tmap_q);
    ptx::prefetch_tensor_map(&tmap_k);
    ptx::prefetch_tensor_map(&tmap_v);
    // 64-column slices of the head dims: one 128-byte swizzle atom each.
    // Varlen: one packed "batch"; a tile's rows start at its sequence's offset. Keys past the
    // sequence's end are the next sequence's (finite) tokens, masked like TMA's zero fill.
    auto load_q = [&](const auto& work, int buffer, uint32_t bar) {
      int row = work.q_start, batch = work.batch;
      if constexpr (kVarlen) row += work.q_offset, batch = 0;
      for (int c = 0; c < Tile::kConsumers; ++c)
        for (int s = 0; s < Tile::kQKSlices; ++s)
          ptx::tma_load_4d(smem_q(c, buffer) + s * Tile::kQSliceBytes, &tmap_q, bar, s * 64,
                           row + c * Tile::kRowsPerConsumer, work.head, batch);
    };
    auto load_k = [&](const auto& work, int block, int stage, uint32_t bar) {
      int row = block * kBlockN, batch = work.batch;
      if constexpr (kWindow) row += work.first_block * kBlockN;
      if constexpr (kVarlen) row += work.k_offset, batch = 0;
      // MLA's three K slices and hd256's four, unrolled, hold too many registers for the 40-register
      // producer (ptxas spilled the next tile's index); as a loop they spill nothing. One or two stay
      // unrolled.
#pragma unroll(Tile::kQKSlices > 2 ? 1 : Tile::kQKSlices)
      for (int s = 0; s < Tile::kQKSlices; ++s)
        ptx::tma_load_4d(smem_k(stage) + s * Tile::kKVSliceBytes, &tmap_k, bar, s * 64, row,
                         work.kv_head, batch);
    };
    auto load_v = [&](const auto& work, int block, int stage, uint32_t bar) {
      int row = block * kBlockN, batch = work.batch;
      if constexpr (kWindow) row += work.first_block * kBlockN;
      if constexpr (kVarlen) row += work.k_offset, batch = 0;
#pragma unroll(Tile::kVSlices > 2 ? 1 : Tile::kVSlices)  // hd256's four: as for K
      for (int s = 0; s < Tile::kVSlices; ++s)
        ptx::tma_load_4d(smem_v(stage) + s * Tile::kKVSliceBytes, &tmap_v, bar, s * 64, row,
                         work.kv_head, batch);
    };
    ProduceTiles<kStages, Tile::kBlockM, kBlockN>(bars, args, Tile::kQBytes, Tile::kKBytes,
                                                   Tile::kVBytes, load_q, load_k, load_v);
    return;
  }

  // ---------------------------------------------------------------- consumers
  ptx::setmaxnreg_inc<kConsumerRegs>();
  const int consumer = warpgroup - 1;
  const int lane = threadIdx.x % 32;
  const int warp = (threadIdx.x % 128) / 32;

  // Ping-pong turns and releases (PingPong), S = Q K^T (IssueQK): as in the FP8 mainloop.
  const PingPong turns{consumer, lane};
  auto begin_turn = [&]() { turns.Begin(); };
  auto end_turn = [&]() { turns.End(); };
  turns.Open();
  auto release = [&](uint64_t& empty) { turns.Release(empty); };
  auto issue_qk = [&](float (&s)[kBlockN / 2], int stage, int q_buffer) {
    IssueQK<Element, kBlockN, kHeadDimQK, Tile::kQSliceBytes, Tile::kKVSliceBytes, Tile::kQBytes>(
        s, smem_q(consumer, 0), smem_k(stage), q_buffer);
  };
  // V is [keys x head_dim_v] with head_dim_v contiguous: an MN-major B operand whose
  // 64-column atoms (the head-dim slices) lie kKVSliceBytes apart. Keys 16j..16j+15
  // are two 8-key groups starting at byte 2048 j.
  auto issue_pv = [&](float (&o)[kHeadDimV / 2], const uint32_t (&p)[kBlockN / 16][4], int stage) {
    ptx::wgmma_fence();
#pragma unroll
    for (int j = 0; j < kBlockN / 16; ++j) {
      const uint64_t desc_v = SmemDescSw128(smem_v(stage) + j * 2048, Tile::kKVSliceBytes);
      ptx::Wgmma<Element, kHeadDimV>::rs_tb(o, p[j], desc_v, 1);
    }
    ptx::wgmma_commit_group();
  };

  // No code unless a measuring build records the timeline (tools/measure/timeline.h); the windowed
  // kernels and MLA's never record (the stamps' registers would spill there: at hd128 windowed, and
  // at MLA's head dims).
  constexpr bool kRecords = !kWindow && kHeadDimQK == kHeadDimV;
  std::conditional_t<kRecords, typename MeasureVariant<>::Timeline, NoTimeline> timeline(consumer);
  uint32_t ring = 0;  // K/V blocks consumed since the launch, as the producer counts them
  for (int round = 0;; ++round) {
    const RingSlot<Tile::kQBuffers> q_slot(round);  // the round's Q buffer and index
    const int q_buffer = q_slot.stage;
    ptx::mbarrier_wait(SmemAddress(&bars.q_full[q_buffer]), q_slot.parity);
    const int tile = *reinterpret_cast<volatile int*>(&bars.tile[q_buffer]);
    if (tile >= args.num_tiles) break;
    timeline.MarkTile(round, kTileStart);
    const auto work = PlanTile<Tile::kBlockM, kBlockN>(tile, args);
    int seqlen_k;  // this tile's keys
    if constexpr (kVarlen) {
      seqlen_k = work.len_k;
    } else {
      seqlen_k = args.seqlen_k;
    }
    const int rows_start = work.q_start + consumer * Tile::kRowsPerConsumer;
    const int first_row = rows_start + 16 * warp + lane / 4;  // this thread's row h = 0

    // O accumulator, wgmma layout of an m64n{kHeadDimV} result (see OnlineSoftmax).
    float o[kHeadDimV / 2];
#pragma unroll
    for (int i = 0; i < kHeadDimV / 2; ++i) o[i] = 0.f;
    using Softmax = OnlineSoftmax<Element, kBlockN>;
    Softmax softmax;

    if (work.num_blocks == 0) {
      release(bars.q_empty[q_buffer]);
    } else {
      auto softmax_step = [&](float (&s)[kBlockN / 2], uint32_t (&p)[kBlockN / 16][4],
                              float (&correction)[2], int block) {
        // Softcap: the capped scores (in units of c) before the masks, which set -inf.
        if constexpr (Fwd16HasSoftcap(kHeadDimQK, kHeadDimV, kBlockN)) {
          if (args.softcap_tanh_scale != 0.f) CapScores(s, args.softcap_tanh_scale);
        }
        if constexpr (kWindow) {
          // Blocks inside every row's window (and the keys) stay unmasked. A block needs the mask
          // if it ends past the seq_k tail or the first row's right edge, or starts before the
          // last row's left edge (this consumer's 64 rows).
          // Block `block` of the tile is block first_block + block of the keys (dense; varlen tiles
          // count keys from their first block already, with first_block 0).
          const int key_start = (work.first_block + block) * kBlockN;
          const int first_pos = rows_start + work.diagonal;
          const int left = args.window_left, right = args.window_right;
          const bool needs_mask =
              key_start + kBlockN > seqlen_k ||
              (right >= 0 && key_start + kBlockN - 1 > first_pos + right) ||
              (left >= 0 && key_start < first_pos + Tile::kRowsPerConsumer - 1 - left);
          if (needs_mask) {
            // The wide head dims' consumers have no registers left for MaskWindow's per-key
            // bounds (they spill); bounds per row need fewer live values.
            if constexpr (kWideHeadDims) {
              MaskWindowByRowBounds<kBlockN>(s, key_start, first_row, lane, seqlen_k, work.diagonal,
                                             left, right);
            } else {
              softmax.MaskWindow(s, key_start, first_row, lane, seqlen_k, work.diagonal, left,
                                 right);
            }
          }
          if constexpr (kOneP) {  // the caller packs P
            softmax.Exponentiate(s, correction, false, key_start, first_row, lane, seqlen_k, false,
                                 0, args.scale_log2);
          } else {
            softmax.Step(s, p, correction, false, key_start, first_row, lane, seqlen_k, false,
                         0, args.scale_log2);
          }
        } else {
          const int key_start = block * kBlockN;
          const bool needs_mask =
              key_start + kBlockN > seqlen_k ||
              (args.causal && key_start + kBlockN - 1 > rows_start + work.diagonal);
          if constexpr (kOneP) {  // the caller packs P
            softmax.Exponentiate(s, correction, needs_mask, key_start, first_row, lane, seqlen_k,
                                 args.causal, work.diagonal, args.scale_log2);
          } else {
            softmax.Step(s, p, correction, needs_mask, key_start, first_row, lane, seqlen_k,
                         args.causal, work.diagonal, args.scale_log2);
          }
        }
      };
      // Q is free once the tile's last S = Q K^T has landed.
      auto after_qk = [&](int block, int stage) {
        release(bars.k_empty[stage]);
        if (block == work.num_blocks - 1) release(bars.q_empty[q_buffer]);
      };

      float s_acc[kBlockN / 2];
      // P lives in two register buffers that alternate: the one P V reads stays untouched
      // while the softmax writes the other. (Copying one into the other instead lets ptxas
      // give both the same registers, and it then serializes every wgmma, warning C7513.)
      // With kOneP (hd256, MLA windowed) there is room for one only: p_even, packed from S once
      // P V has landed.
      uint32_t p_even[kBlockN / 16][4], p_odd[kBlockN / 16][4];
      float correction[2];

      // Block 0: S only.
      const Slot first(ring);
      ptx::mbarrier_wait(SmemAddress(&bars.k_full[first.stage]), first.parity);
      timeline.MarkTile(round, kFirstKeys);
      begin_turn();
      issue_qk(s_acc, first.stage, q_buffer);
      end_turn();
      timeline.MarkTile(round, kFirstIssued);
      ptx::wgmma_wait_group<0>();
      FenceRegisters(s_acc);
      timeline.MarkTile(round, kFirstScores);
      after_qk(0, first.stage);
      softmax_step(s_acc, p_even, correction, 0);
      if constexpr (kOneP) Softmax::Pack(s_acc, p_even);
      timeline.MarkTile(round, kFirstSoftmax);

      // Block b: S_b and P_{b-1} V_{b-1} go to the tensor cores, then softmax(S_b) runs
      // while P V is in flight; O is rescaled once P V has landed.
      auto iteration = [&](int block, const uint32_t (&p_prev)[kBlockN / 16][4],
                           uint32_t (&p_next)[kBlockN / 16][4]) {
        const Slot cur(ring + block), prev(ring + block - 1);
        timeline.Mark(kIterationStart);
        ptx::mbarrier_wait(SmemAddress(&bars.k_full[cur.stage]), cur.parity);
        timeline.Mark(kKeysReady);
        begin_turn();
        timeline.Mark(kTurnHeld);
        issue_qk(s_acc, cur.stage, q_buffer);
        ptx::mbarrier_wait(SmemAddress(&bars.v_full[prev.stage]), prev.parity);
        issue_pv(o, p_prev, prev.stage);
        end_turn();
        timeline.Mark(kIssued);
        ptx::wgmma_wait_group<1>();  // S is ready; P V still runs during the softmax
        FenceRegisters(s_acc);
        timeline.Mark(kScoresLanded);
        after_qk(block, cur.stage);
        softmax_step(s_acc, p_next, correction, block);
        timeline.Mark(kSoftmaxDone);
        ptx::wgmma_wait_group<0>();
        FenceRegisters(o);
        timeline.Mark(kOutputLanded);
        if constexpr (kOneP) Softmax::Pack(s_acc, p_next);  // P V has read p_prev, the same buffer
        release(bars.v_empty[prev.stage]);
        // Rescale O only where some row's maximum grew (multiplying by 1 is exact anyway:
        // this saves the work, never changes a bit). The branch is warp-uniform.
        if (__any_sync(0xffffffff, correction[0] != 1.f || correction[1] != 1.f)) {
#pragma unroll
          for (int i = 0; i < kHeadDimV / 2; ++i) o[i] *= correction[(i >> 1) & 1];
        }
        timeline.Mark(kIterationEnd);
        timeline.Next();
      };
      ForLaterBlocks<kOneP>(work.num_blocks, iteration, p_even, p_odd);

      // The last block's P V: its P is in p_even when the block index is even (always with kOneP).
      const int last_block = work.num_blocks - 1;
      const Slot last(ring + last_block);
      ptx::mbarrier_wait(SmemAddress(&bars.v_full[last.stage]), last.parity);
      begin_turn();
      if (kOneP || last_block % 2 == 0) {
        issue_pv(o, p_even, last.stage);
      } else {
        issue_pv(o, p_odd, last.stage);
      }
      end_turn();
      ptx::wgmma_wait_group<0>();
      FenceRegisters(o);
      timeline.MarkTile(round, kLastOutput);
      release(bars.v_empty[last.stage]);
      ring += work.num_blocks;
    }
    timeline.MarkTile(round, kEpilogueStart);

    // Epilogue: normalise, write O (bf16/f16) and the LSE (natural log). Rows with no
    // visible key have a zero sum: O = 0, LSE = -inf.
    Element* out = static_cast<Element*>(args.out);
    const int quad_col = 2 * (lane % 4);
    // kTmaEpilogue: O goes through this consumer's shared-memory tile and one TMA store
    // (TmaEpilogue), which also drops rows past seqlen_q.
    const TmaEpilogue<kHeadDimV, Tile::kQSliceBytes> epilogue(
        smem_raw + (smem_o(consumer) - SmemAddress(smem_raw)), smem_o(consumer), consumer);
    if constexpr (kTmaEpilogue) epilogue.Begin();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float total = QuadSum(softmax.row_sum[h]);
      const float inv = total > 0.f ? 1.f / total : 0.f;
      const int row = first_row + 8 * h;
      if constexpr (kVarlen) {
        // Rows < len_q at token q_offset + row (the tail's rows repeat every row_stride); every
        // token is checked against total_q, so bad offsets never write out of range. The tile's
        // offsets are read again here rather than held in registers through the key loop.
        const auto rows = PlanTile<Tile::kBlockM, kBlockN>(tile, args);
        for (int r = row; r < rows.len_q; r += rows.row_stride) {
          int64_t token = static_cast<int64_t>(rows.q_offset) + r;
          if (rows.row_stride != 0 && token >= args.total_q) token -= args.total_q;  // the tail
          if (token >= 0 && token < args.total_q) {
            const int64_t out_row = (token * args.heads_q + rows.head) * kHeadDimV;
#pragma unroll
            for (int c = 0; c < kHeadDimV / 8; ++c) {
              *reinterpret_cast<uint32_t*>(out + out_row + 8 * c + quad_col) =
                  PackPair<Element>(o[4 * c + 2 * h] * inv, o[4 * c + 2 * h + 1] * inv);
            }
            if (lane % 4 == 0) {
              const float lse = total > 0.f ? (softmax.row_max[h] * args.scale_log2 +
                                               __log2f(total)) * 0.69314718f
                                            : -INFINITY;
              args.lse[static_cast<int64_t>(rows.head) * args.total_q + token] = lse;
            }
          }
          if (rows.row_stride == 0) break;
        }
      } else {
        if constexpr (kTmaEpilogue) {
          epilogue.template WriteRow<Element>(o, h, row - rows_start, quad_col, inv);
          if (row >= args.seqlen_q) continue;
        } else {
          if (row >= args.seqlen_q) continue;
          const int64_t out_row =
              ((static_cast<int64_t>(work.batch) * args.seqlen_q + row) * args.heads_q +
               work.head) *
              kHeadDimV;
#pragma unroll
          for (int c = 0; c < kHeadDimV / 8; ++c) {
            *reinterpret_cast<uint32_t*>(out + out_row + 8 * c + quad_col) =
                PackPair<Element>(o[4 * c + 2 * h] * inv, o[4 * c + 2 * h + 1] * inv);
          }
        }
        if (lane % 4 == 0) {
          const float lse =
              total > 0.f ? (softmax.row_max[h] * args.scale_log2 + __log2f(total)) * 0.69314718f
                          : -INFINITY;
          args.lse[(static_cast<int64_t>(work.batch) * args.heads_q + work.head) * args.seqlen_q +
                   row] = lse;
        }
      }
    }
    if constexpr (kTmaEpilogue) epilogue.Store(tmap_o, rows_start, work.head, work.batch);
    timeline.MarkTile(round, kTileEnd);
  }
  if constexpr (kTmaEpilogue) TmaEpilogue<kHeadDimV, Tile::kQSliceBytes>::Finish();
  if (consumer == 0) begin_turn();  // consumer 1's last hand-over
}

// The 16-bit mainloop as fwd_kernel.cuh's kernels run it: Element (bf16, f16), the head dims and the
// keys per block; the arguments (dense or varlen, windowed or not) are the kernel's.
template <typename Element, int kHeadDimQK, int kHeadDimV,
          int kKeyBlock = FwdTile<kHeadDimQK, kHeadDimV>::kBlockN>
struct Fwd16Mainloop {
  static constexpr int kThreads = FwdTile<kHeadDimQK, kHeadDimV, kKeyBlock>::kThreads;
  template <typename Args>
  static __device__ __forceinline__ void Run(const CUtensorMap& tmap_q, const CUtensorMap& tmap_k,
                                             const CUtensorMap& tmap_v, const CUtensorMap* tmap_o,
                                             const Args& args) {
    FlashFwdTiles<Element, kHeadDimQK, kHeadDimV, kKeyBlock>(tmap_q, tmap_k, tmap_v, tmap_o, args);
  }
};

}  // namespace jzyfa
