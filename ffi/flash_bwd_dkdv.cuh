// The backward's dK/dV kernel (16-bit inputs, dense or varlen; no mask, causal or a sliding window).
// A persistent grid claims tiles of 128 keys of one (key block, KV head, batch or sequence), key
// blocks in order (causal: the first key blocks see the most queries: longest first). Two warpgroups own 64 keys each. K and V are loaded
// once; the query blocks that see the tile (every query head of the KV head's group) stream Q, dO,
// lse and delta through a 2-stage cp.async ring. Per block, per warpgroup:
//   S^T = K Q^T, dP^T = V dO^T                     wgmma, both operands in shared memory (M = keys)
//   P^T = exp2(S^T scale_log2 - lse_log2)          registers; masked keys/queries give 0
//   dS^T = P^T (dP^T - delta)                      registers
//   dV += P^T dO, dK += dS^T Q                     wgmma, A = P^T / dS^T from registers
// dV and dK (fp32 registers, the whole loop) are written once, dK times softmax_scale. GQA sums the
// query heads inside the tile: no atomics, the result is bitwise deterministic.
#pragma once

#include <cstdint>

#include "flash_bwd_common.cuh"
#include "flash_fwd_common.cuh"
#include "tile_size.h"

namespace jzyfa {

template <int kHeadDim>
struct BwdDkdvTile : BwdTileBase<kHeadDim> {
  using Base = BwdTileBase<kHeadDim>;
  using Base::kSize;
  using Base::kStages;
  static constexpr int kBlockN = kSize.dkdv_block_n;  // keys per tile
  static constexpr int kBlockM = kSize.dkdv_block_m;  // query rows per block
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  // Q, dO, lse, delta; rounded up so that every stage's Q and dO start 1024-byte aligned (the 128-byte
  // swizzle's period: wgmma's descriptors and LoadRowsSw128 agree on the pattern only there).
  static constexpr int kStageBytes =
      (2 * kQBytes + 2 * kBlockM * 4 + Base::kSmemAlign - 1) / Base::kSmemAlign * Base::kSmemAlign;
  static constexpr int kSmemBytes = 2 * kKVBytes + kStages * kStageBytes;
  static constexpr int kDynamicSmemBytes = kSmemBytes + Base::kSmemAlign;
  static_assert(kBlockM == 64, "S^T's N and the A fragments assume 64 query rows per block");
  static_assert(kDynamicSmemBytes <= 227 * 1024);
  static_assert(kKVBytes % Base::kSmemAlign == 0 && kQBytes % Base::kSmemAlign == 0);
};

template <typename Element, int kHeadDim>
__device__ __forceinline__ void BwdDkdvTiles(const BwdArgs& args) {
  using Tile = BwdDkdvTile<kHeadDim>;
  constexpr int kBlockM = Tile::kBlockM;
  constexpr int kThreads = Tile::Base::kThreads;
  extern __shared__ uint8_t smem_raw[];
  __shared__ int claimed;
  const uint32_t smem_base = AlignedSmemBase(smem_raw);
  const uint32_t smem_k = smem_base, smem_v = smem_base + Tile::kKVBytes;
  auto smem_stage = [&](int stage) { return smem_base + 2 * Tile::kKVBytes + stage * Tile::kStageBytes; };
  const uint8_t* smem_generic = smem_raw + (smem_base - SmemAddress(smem_raw));

  const BwdThread me;
  const int warpgroup = me.warpgroup, lane = me.lane;
  const int group = args.heads_q / args.heads_kv;
  const int64_t q_row_stride = static_cast<int64_t>(args.heads_q) * kHeadDim;
  const int64_t kv_row_stride = static_cast<int64_t>(args.heads_kv) * kHeadDim;
  const Element* q = static_cast<const Element*>(args.q);
  const Element* dout = static_cast<const Element*>(args.dout);

  for (;;) {
    const int tile = ClaimTile(&args.tile_counter[0], &claimed);
    if (tile >= args.num_tiles) break;
    const int pairs = args.batch * args.heads_kv;
    const int n_block = tile / pairs;
    const BwdSequence seq = SequenceOf(args, (tile % pairs) / args.heads_kv);
    const int kv_head = tile % args.heads_kv;
    const int key_start = n_block * Tile::kBlockN;
    if (key_start >= seq.len_k) continue;  // varlen: past this sequence's keys
    const int diagonal = seq.diagonal();
    // The query blocks with a row that sees one of the tile's keys (position - window_left <= key <=
    // position + window_right).
    int m_first, m_last;
    BlockRange(int64_t{key_start} - args.window_right - diagonal,
               int64_t{key_start} + Tile::kBlockN - 1 + args.window_left - diagonal, seq.len_q,
               kBlockM, &m_first, &m_last);
    const int m_count = m_last - m_first + 1;
    const int iterations = m_count * group;

    float dv[kHeadDim / 2], dk[kHeadDim / 2];
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) dv[i] = dk[i] = 0.f;

    auto load_block = [&](int it, int stage) {
      const int head = kv_head * group + it / m_count;
      const int m_start = (m_first + it % m_count) * kBlockM;
      const int64_t row0 = (seq.q_offset + m_start) * args.heads_q + head;
      const int valid = seq.len_q - m_start;
      const uint32_t base = smem_stage(stage);
      LoadRowsSw128<kBlockM, kHeadDim, kThreads>(base, q + row0 * kHeadDim, q_row_stride, valid);
      LoadRowsSw128<kBlockM, kHeadDim, kThreads>(base + Tile::kQBytes, dout + row0 * kHeadDim,
                                                 q_row_stride, valid);
      const int64_t lse_row = seq.lse_offset + head * seq.lse_head_stride + m_start;
      LoadRowFloats<kBlockM>(base + 2 * Tile::kQBytes, args.lse + lse_row, valid, threadIdx.x);
      LoadRowFloats<kBlockM>(base + 2 * Tile::kQBytes + kBlockM * 4, args.delta + lse_row, valid,
                             threadIdx.x - 128);
    };

    if (iterations > 0) {
      const int64_t kv_row0 = (seq.k_offset + key_start) * args.heads_kv + kv_head;
      const int valid_keys = seq.len_k - key_start;
      LoadRowsSw128<Tile::kBlockN, kHeadDim, kThreads>(
          smem_k, static_cast<const Element*>(args.k) + kv_row0 * kHeadDim, kv_row_stride, valid_keys);
      LoadRowsSw128<Tile::kBlockN, kHeadDim, kThreads>(
          smem_v, static_cast<const Element*>(args.v) + kv_row0 * kHeadDim, kv_row_stride, valid_keys);
      load_block(0, 0);
      CpAsyncCommit();
    }
    // This thread's keys (rows of S^T): key_row and key_row + 8.
    const int key_row = key_start + warpgroup * 64 + me.row_in_warpgroup;
    const uint32_t my_k = smem_k + warpgroup * Tile::Base::kGroupBytes;
    const uint32_t my_v = smem_v + warpgroup * Tile::Base::kGroupBytes;

    for (int it = 0; it < iterations; ++it) {
      const int stage = it % 2;
      if (it + 1 < iterations) load_block(it + 1, stage ^ 1);
      CpAsyncCommit();
      CpAsyncWait<1>();
      __syncthreads();
      const uint32_t sq = smem_stage(stage), sdo = sq + Tile::kQBytes;
      const float* s_lse = reinterpret_cast<const float*>(smem_generic + (sq - smem_base) + 2 * Tile::kQBytes);
      const float* s_delta = s_lse + kBlockM;
      const int m_start = (m_first + it % m_count) * kBlockM;

      float s[kBlockM / 2], dp[kBlockM / 2];
      IssueQK<Element, kBlockM, kHeadDim, Tile::Base::kSliceBytes, Tile::Base::kSliceBytes, 0>(s, my_k, sq, 0);
      IssueQK<Element, kBlockM, kHeadDim, Tile::Base::kSliceBytes, Tile::Base::kSliceBytes, 0>(dp, my_v, sdo, 0);
      ptx::wgmma_wait_group<0>();
      FenceRegisters(s);
      FenceRegisters(dp);

      const int key_last = key_start + Tile::kBlockN - 1;
      const bool needs_mask = key_last >= seq.len_k || m_start + kBlockM > seq.len_q ||
                              key_last - (m_start + diagonal) > args.window_right ||
                              m_start + kBlockM - 1 + diagonal - key_start > args.window_left;
#pragma unroll
      for (int c = 0; c < kBlockM / 8; ++c) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = 8 * c + 2 * (lane % 4) + (e & 1);  // query row in the block
          float p = ptx::ex2_approx(fmaf(s[4 * c + e], args.scale_log2, -LseLog2(s_lse[col])));
          if (needs_mask) {
            const int key = key_row + 8 * (e >> 1), query = m_start + col;
            const bool visible =
                key < seq.len_k && query < seq.len_q && KeyVisible(args, key, query + diagonal);
            if (!visible) p = 0.f;
          }
          s[4 * c + e] = p;
          dp[4 * c + e] = p * (dp[4 * c + e] - s_delta[col]);
        }
      }
      uint32_t p_frag[kBlockM / 16][4], ds_frag[kBlockM / 16][4];
      PackFragments<Element, kBlockM>(s, p_frag);
      PackFragments<Element, kBlockM>(dp, ds_frag);
      IssueRegTimesSmem<Element, kHeadDim, kBlockM, Tile::Base::kSliceBytes>(dv, p_frag, sdo);
      IssueRegTimesSmem<Element, kHeadDim, kBlockM, Tile::Base::kSliceBytes>(dk, ds_frag, sq);
      ptx::wgmma_wait_group<0>();
      FenceRegisters(dv);
      FenceRegisters(dk);
      __syncthreads();  // the stage is free for the load two blocks on
    }

    const int64_t out_row0 = seq.k_offset * args.heads_kv + kv_head;
    StoreAccumulator<Element, kHeadDim>(dv, static_cast<Element*>(args.dv) + out_row0 * kHeadDim,
                                        kv_row_stride, key_row, seq.len_k, 1.f);
    StoreAccumulator<Element, kHeadDim>(dk, static_cast<Element*>(args.dk) + out_row0 * kHeadDim,
                                        kv_row_stride, key_row, seq.len_k, args.scale);
  }
}

}  // namespace jzyfa
