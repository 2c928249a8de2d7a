// The backward's dQ kernel (16-bit inputs, dense or varlen; no mask, causal or a sliding window), on
// the skeleton of flash_bwd_common.cuh. A tile is 128 query rows of one (query block, query head,
// batch row or sequence), the last query blocks first (causal: they see the most keys), heads fastest;
// Q and dO land once, the key blocks the rows see stream K and V. Consumer c owns rows 64c .. 64c + 63;
// with split columns (head dim 256) a tile is 64 rows and each consumer holds half of dQ's columns.
// Per block:
//   S = Q K^T, dP = dO V^T                 wgmma from shared memory
//   P = exp2(S scale_log2 - lse_log2)      registers; masked keys give 0
//   dS = P (dP - delta)
//   dQ += dS K                             wgmma, A = dS from registers, K as the MN-major B operand
// dQ (fp32 registers, the whole tile) is written once, times softmax_scale: deterministic.
#pragma once

#include <cstdint>
#include <type_traits>

#include "flash_bwd_common.cuh"

namespace jzyfa {

struct BwdDqArgs : BwdArgs {
  int m_tiles;  // query tiles per (batch row or sequence, head): ceil(seqlen_q / 128)
};

// A dQ tile: its sequence, head and rows, and the key blocks they see (n_first .. + num_blocks - 1).
struct BwdDqWork {
  BwdSequence seq;
  BwdMapRows rows;
  int head, kv_head, q_start, n_first;
  int num_blocks;
};

template <int kBlockM, int kBlockN>
__device__ __forceinline__ BwdDqWork PlanTile(int tile, const BwdDqArgs& args) {
  int heads_q = args.heads_q, batch = args.batch;
  asm volatile("" : "+r"(heads_q), "+r"(batch));
  BwdDqWork w;
  const int pairs = batch * heads_q;
  const int m_index = tile / pairs;
  const int index = (tile - m_index * pairs) / heads_q;
  w.head = tile % heads_q;
  w.kv_head = w.head / (heads_q / args.heads_kv);
  w.seq = SequenceOf(args, index);
  w.rows = MapRowsOf(args, w.seq, index);
  w.q_start = (args.m_tiles - 1 - m_index) * kBlockM;
  // The key blocks with a key one of the tile's rows sees; none past this sequence's rows (varlen).
  int n_last;
  BlockRange(int64_t{w.q_start} + w.seq.diagonal() - args.window_left,
             int64_t{w.q_start} + kBlockM - 1 + w.seq.diagonal() + args.window_right, w.seq.len_k,
             kBlockN, &w.n_first, &n_last);
  w.num_blocks = w.q_start < w.seq.len_q ? n_last - w.n_first + 1 : 0;
  return w;
}

template <typename Element, int kHeadDimQK, int kHeadDimV>
struct BwdDqMainloop {
  using Tile = BwdTile<kHeadDimQK, kHeadDimV, BwdKernelKind::kDq>;
  using Smem = BwdSmem<Tile>;
  static constexpr int kThreads = Tile::kThreads;

  // maps: q, k, v, dout. Tile operands Q (0) and dO (1); streamed K (0) and V (1).
  static __device__ __forceinline__ void Run(const CUtensorMap* const (&maps)[4], const BwdDqArgs& args) {
    auto load_tile = [&](const Smem& smem, const BwdDqWork& w, uint32_t bar) {
      LoadTileOperands(smem, maps[0], maps[3], bar, w.rows.q_row0 + w.q_start, w.head, w.rows.batch);
    };
    auto load_stream = [&](const Smem& smem, const BwdDqWork& w, int block, int stage, int which,
                           uint32_t bar) {
      const int row = w.rows.k_row0 + (w.n_first + block) * Tile::kBlockN;
      if (which == 0) {
        LoadOperand<kHeadDimQK>(smem.stream(stage, 0), maps[1], bar, row, w.kv_head, w.rows.batch);
      } else {
        LoadOperand<kHeadDimV>(smem.stream(stage, 1), maps[2], bar, row, w.kv_head, w.rows.batch);
      }
    };
    auto consume_tile_with = [&](auto columns, const Smem& smem, FwdBarriers<Tile::kStages, 1>& bars, int tile,
                                 uint32_t ring, const BwdThread& t) {
      constexpr int kDqColumns = Tile::Columns(0, decltype(columns)::value);
      const BwdDqWork work = PlanTile<Tile::kBlockM, Tile::kBlockN>(tile, args);
      const BwdSequence& seq = work.seq;
      const int diagonal = seq.diagonal();
      const int rows_start = work.q_start + Tile::RowOffset(t.consumer);
      const int row = rows_start + t.row();  // this thread's rows: +0, +8
      const int64_t lse_row0 = seq.lse_offset + work.head * seq.lse_head_stride;
      float lse_log2[2], delta[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        lse_log2[h] = LseLog2At(args.lse + lse_row0, row + 8 * h, seq.len_q);
        delta[h] = DeltaAt(args.delta + lse_row0, row + 8 * h, seq.len_q);
      }
      float dq[kDqColumns / 2];  // the consumer's columns
#pragma unroll
      for (int i = 0; i < kDqColumns / 2; ++i) dq[i] = 0.f;
      for (int block = 0; block < work.num_blocks; ++block) {
        const RingSlot<Tile::kStages> slot(ring + block);
        float s[32], dp[32];  // S and dP: [64 rows x 64 keys]
        IssueBlockScores<Element>(s, dp, smem, bars, slot, t.consumer, t.turns);
        t.Release(bars.v_empty[slot.stage]);  // V is read (dP has landed)

        const int key_start = (work.n_first + block) * Tile::kBlockN, key_last = key_start + 63;
        const bool needs_mask = key_last >= seq.len_k ||
                                key_last - (rows_start + diagonal) > args.window_right ||
                                rows_start + 63 + diagonal - key_start > args.window_left;
        // One copy of the softmax per (mask, softcap) and one branch a block, as in the dK/dV kernel.
        auto softmax = [&](auto masked, auto capped_scores) {
#pragma unroll
          for (int c = 0; c < 8; ++c)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int i = 4 * c + e, h = e >> 1;
              // Softcap: the score is c * capped, capped = tanh(s / c), inline as in the dK/dV kernel.
              const float capped = decltype(capped_scores)::value
                                  ? TanhOfHalfLog2Arg(s[i] * args.softcap_tanh_scale) : s[i];
              float p = ptx::ex2_approx(fmaf(capped, args.scale_log2, -lse_log2[h]));
              if constexpr (decltype(masked)::value) {
                const int key = key_start + 8 * c + 2 * (t.lane % 4) + (e & 1);
                if (!(key < seq.len_k && KeyVisible(args, key, row + 8 * h + diagonal))) p = 0.f;
              }
              dp[i] = p * (dp[i] - delta[h]);
              if constexpr (decltype(capped_scores)::value) dp[i] *= fmaf(-capped, capped, 1.f);
            }
        };
        SoftmaxCopy(needs_mask, args.softcap_tanh_scale != 0.f, softmax);
        uint32_t ds_frag[4][4];
        PackFragments<Element, 64>(dp, ds_frag);
        t.turns.Begin();
        IssueRegTimesSmem<Element, kDqColumns, 64, Tile::kSliceBytes>(
            dq, ds_frag, smem.stream(slot.stage, 0) + Tile::FirstColumn(0, t.consumer) / 64 * Tile::kSliceBytes);
        t.turns.End();
        ptx::wgmma_wait_group<0>();
        FenceRegisters(dq);
        t.Release(bars.k_empty[slot.stage]);
      }
      t.Release(bars.q_empty[0]);  // Q and dO are read
      const int64_t out_row0 = seq.q_offset * args.heads_q + work.head;  // [tokens, heads] row
      StoreAccumulator<Element, kDqColumns>(
          dq, smem.staging(4 * t.consumer + t.warp),
          static_cast<Element*>(args.dq) + out_row0 * kHeadDimQK + Tile::FirstColumn(0, t.consumer),
          int64_t{args.heads_q} * kHeadDimQK, rows_start + 16 * t.warp, seq.len_q, args.scale);
      return work.num_blocks;
    };
    auto consume_tile = [&](const Smem& smem, FwdBarriers<Tile::kStages, 1>& bars, int tile, uint32_t ring,
                            const BwdThread& t) {
      return WithConsumerColumns<Tile>(
          t.consumer, [&](auto columns) { return consume_tile_with(columns, smem, bars, tile, ring, t); });
    };
    BwdTiles<Tile>(args, load_tile, load_stream, consume_tile);
  }
};

}  // namespace jzyfa
