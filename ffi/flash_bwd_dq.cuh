// The backward's dQ kernel (16-bit inputs, dense or varlen; no mask, causal or a sliding window). A
// persistent grid claims tiles of 128 query rows of one (query block, head, batch or sequence), the
// last query blocks first (causal: they see the most keys). Two warpgroups own 64 rows each. Q, dO,
// lse and delta are loaded once; the key blocks the tile sees stream K and V through a 2-stage
// cp.async ring. Per block:
//   S = Q K^T, dP = dO V^T                 wgmma, both operands in shared memory
//   P = exp2(S scale_log2 - lse_log2), dS = P (dP - delta)      registers
//   dQ += dS K                             wgmma, A = dS from registers, K as an MN-major B
// dQ (fp32 registers) is written once, times softmax_scale.
#pragma once

#include <cstdint>

#include "flash_bwd_common.cuh"
#include "flash_fwd_common.cuh"
#include "tile_size.h"

namespace jzyfa {

template <int kHeadDim>
struct BwdDqTile : BwdTileBase<kHeadDim> {
  using Base = BwdTileBase<kHeadDim>;
  using Base::kSize;
  using Base::kStages;
  static constexpr int kBlockM = kSize.dq_block_m;  // query rows per tile
  static constexpr int kBlockN = kSize.dq_block_n;  // keys per block
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKBytes = kBlockN * kHeadDim * 2;
  static constexpr int kStageBytes = 2 * kKBytes;  // K, V
  static constexpr int kSmemBytes = 2 * kQBytes + kStages * kStageBytes;
  static constexpr int kDynamicSmemBytes = kSmemBytes + Base::kSmemAlign;
  static_assert(kBlockN == 64, "K's MN-major B operand assumes 64-row slices");
  static_assert(kDynamicSmemBytes <= 227 * 1024);
  // Every operand starts 1024-byte aligned (the 128-byte swizzle's period).
  static_assert(kQBytes % Base::kSmemAlign == 0 && kStageBytes % Base::kSmemAlign == 0);
};

template <typename Element, int kHeadDim>
__device__ __forceinline__ void BwdDqTiles(const BwdArgs& args) {
  using Tile = BwdDqTile<kHeadDim>;
  constexpr int kBlockN = Tile::kBlockN;
  constexpr int kThreads = Tile::Base::kThreads;
  extern __shared__ uint8_t smem_raw[];
  __shared__ int claimed;
  const uint32_t smem_base = AlignedSmemBase(smem_raw);
  const uint32_t smem_q = smem_base, smem_do = smem_base + Tile::kQBytes;
  auto smem_stage = [&](int stage) { return smem_base + 2 * Tile::kQBytes + stage * Tile::kStageBytes; };

  const BwdThread me;
  const int warpgroup = me.warpgroup, lane = me.lane;
  const int m_blocks = (args.seqlen_q + Tile::kBlockM - 1) / Tile::kBlockM;
  const int64_t q_row_stride = static_cast<int64_t>(args.heads_q) * kHeadDim;
  const int64_t kv_row_stride = static_cast<int64_t>(args.heads_kv) * kHeadDim;
  const Element* k = static_cast<const Element*>(args.k);
  const Element* v = static_cast<const Element*>(args.v);
  const int group = args.heads_q / args.heads_kv;

  for (;;) {
    const int tile = ClaimTile(&args.tile_counter[1], &claimed);
    if (tile >= args.num_tiles) break;
    const int pairs = args.batch * args.heads_q;
    const int m_block = m_blocks - 1 - tile / pairs;
    const BwdSequence seq = SequenceOf(args, (tile % pairs) / args.heads_q);
    const int head = tile % args.heads_q;
    const int kv_head = head / group;
    const int m_start = m_block * Tile::kBlockM;
    if (m_start >= seq.len_q) continue;  // varlen: past this sequence's queries
    const int diagonal = seq.diagonal();
    // The key blocks with a key one of the tile's rows sees.
    int n_first, n_last;
    BlockRange(int64_t{m_start} + diagonal - args.window_left,
               int64_t{m_start} + Tile::kBlockM - 1 + diagonal + args.window_right, seq.len_k,
               kBlockN, &n_first, &n_last);
    const int n_blocks = n_last - n_first + 1;

    const int64_t q_row0 = (seq.q_offset + m_start) * args.heads_q + head;
    const int64_t kv_row0 = seq.k_offset * args.heads_kv + kv_head;
    auto load_block = [&](int block, int stage) {
      const int key_start = (n_first + block) * kBlockN;
      const int64_t row0 = kv_row0 + static_cast<int64_t>(key_start) * args.heads_kv;
      LoadRowsSw128<kBlockN, kHeadDim, kThreads>(smem_stage(stage), k + row0 * kHeadDim,
                                                 kv_row_stride, seq.len_k - key_start);
      LoadRowsSw128<kBlockN, kHeadDim, kThreads>(smem_stage(stage) + Tile::kKBytes,
                                                 v + row0 * kHeadDim, kv_row_stride,
                                                 seq.len_k - key_start);
    };
    if (n_blocks > 0) {
      const int valid = seq.len_q - m_start;
      LoadRowsSw128<Tile::kBlockM, kHeadDim, kThreads>(
          smem_q, static_cast<const Element*>(args.q) + q_row0 * kHeadDim, q_row_stride, valid);
      LoadRowsSw128<Tile::kBlockM, kHeadDim, kThreads>(
          smem_do, static_cast<const Element*>(args.dout) + q_row0 * kHeadDim, q_row_stride, valid);
      load_block(0, 0);
      CpAsyncCommit();
    }
    // This thread's rows: row and row + 8; their lse (log2 domain) and delta.
    const int row = m_start + warpgroup * 64 + me.row_in_warpgroup;
    const int64_t lse_row0 = seq.lse_offset + head * seq.lse_head_stride;
    float lse_log2[2], delta[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const bool valid = row + 8 * h < seq.len_q;
      lse_log2[h] = valid ? LseLog2(args.lse[lse_row0 + row + 8 * h]) : INFINITY;
      delta[h] = valid ? args.delta[lse_row0 + row + 8 * h] : 0.f;
    }
    const uint32_t my_q = smem_q + warpgroup * Tile::Base::kGroupBytes;
    const uint32_t my_do = smem_do + warpgroup * Tile::Base::kGroupBytes;

    float dq[kHeadDim / 2];
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) dq[i] = 0.f;

    for (int block = 0; block < n_blocks; ++block) {
      const int stage = block % 2;
      if (block + 1 < n_blocks) load_block(block + 1, stage ^ 1);
      CpAsyncCommit();
      CpAsyncWait<1>();
      __syncthreads();
      const uint32_t sk = smem_stage(stage), sv = sk + Tile::kKBytes;
      float s[kBlockN / 2], dp[kBlockN / 2];
      IssueQK<Element, kBlockN, kHeadDim, Tile::Base::kSliceBytes, Tile::Base::kSliceBytes, 0>(s, my_q, sk, 0);
      IssueQK<Element, kBlockN, kHeadDim, Tile::Base::kSliceBytes, Tile::Base::kSliceBytes, 0>(dp, my_do, sv, 0);
      ptx::wgmma_wait_group<0>();
      FenceRegisters(s);
      FenceRegisters(dp);
      const int key_start = (n_first + block) * kBlockN, key_last = key_start + kBlockN - 1;
      const bool needs_mask = key_last >= seq.len_k ||
                              key_last - (m_start + diagonal) > args.window_right ||
                              m_start + Tile::kBlockM - 1 + diagonal - key_start > args.window_left;
#pragma unroll
      for (int c = 0; c < kBlockN / 8; ++c) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e >> 1;
          float p = ptx::ex2_approx(fmaf(s[4 * c + e], args.scale_log2, -lse_log2[h]));
          if (needs_mask) {
            const int key = key_start + 8 * c + 2 * (lane % 4) + (e & 1);
            const bool visible = key < seq.len_k && KeyVisible(args, key, row + 8 * h + diagonal);
            if (!visible) p = 0.f;
          }
          dp[4 * c + e] = p * (dp[4 * c + e] - delta[h]);
        }
      }
      uint32_t ds_frag[kBlockN / 16][4];
      PackFragments<Element, kBlockN>(dp, ds_frag);
      IssueRegTimesSmem<Element, kHeadDim, kBlockN, Tile::Base::kSliceBytes>(dq, ds_frag, sk);
      ptx::wgmma_wait_group<0>();
      FenceRegisters(dq);
      __syncthreads();
    }
    const int64_t dq_row0 = seq.q_offset * args.heads_q + head;
    StoreAccumulator<Element, kHeadDim>(dq, static_cast<Element*>(args.dq) + dq_row0 * kHeadDim,
                                        q_row_stride, row, seq.len_q, args.scale);
  }
}

}  // namespace jzyfa
