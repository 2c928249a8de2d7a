// The backward's dK/dV kernel (16-bit inputs, dense or varlen; no mask, causal or a sliding window),
// on the skeleton of flash_bwd_common.cuh. A tile is 128 keys of one (key block, KV head, batch row or
// sequence), key blocks in order (causal: the first key blocks see the most queries: longest first),
// (batch, KV head) pairs fastest so that concurrent CTAs share Q and dO in L2. K and V land once; the
// query blocks that see the tile (every query head of the KV head's group) stream Q and dO. Consumer c
// owns keys 64c .. 64c + 63 of the tile; with split columns (head dim 256, MLA: tile_size.h) a tile is
// 64 keys and each consumer holds some of dK's and dV's 64-column slices (BwdTile::Columns). Per block:
//   S^T = K Q^T, dP^T = V dO^T                     wgmma, both operands in shared memory (M = keys)
//   P^T = exp2(S^T scale_log2 - lse_log2)          registers; masked keys/queries give 0
//   dS^T = P^T (dP^T - delta)                      registers
//   dV += P^T dO, dK += dS^T Q                     wgmma, A = P^T / dS^T from registers
// dV and dK (fp32 registers, the whole tile) are written once, dK times softmax_scale. GQA sums the
// query heads inside the tile: no atomics, the result is bitwise deterministic.
#pragma once

#include <cstdint>
#include <type_traits>

#include "flash_bwd_common.cuh"

namespace jzyfa {

struct BwdDkdvArgs : BwdArgs {};

// Named barriers 3 and 4: consumer c's 128 threads after writing a block's lse and delta rows (1 and
// 2 are the consumers' turns).
constexpr int kBwdRowsBarrier = 3;

// A dK/dV tile: its sequence, KV head and keys, and the query blocks that see them. Step `block`
// streams query head kv_head * group + block / m_count, query block m_first + block % m_count.
struct BwdDkdvWork {
  BwdSequence seq;
  BwdMapRows rows;
  int kv_head, key_start, m_first, m_count;
  int first_head;       // kv_head * group: the group's first query head
  int first_query_row;  // the first query block's first row in the tensor maps
  int num_blocks;
};

template <int kBlockM, int kBlockN>
__device__ __forceinline__ BwdDkdvWork PlanTile(int tile, const BwdDkdvArgs& args) {
  // Opaque copies of the divisors: the producer's 56 registers keep no reciprocals across its loop.
  int heads_kv = args.heads_kv, heads_q = args.heads_q, batch = args.batch;
  asm volatile("" : "+r"(heads_kv), "+r"(heads_q), "+r"(batch));
  BwdDkdvWork w;
  const int pairs = batch * heads_kv;
  const int n_block = tile / pairs;
  const int index = (tile - n_block * pairs) / heads_kv;
  w.kv_head = tile % heads_kv;
  const int group = heads_q / heads_kv;
  w.first_head = w.kv_head * group;
  w.seq = SequenceOf(args, index);
  w.rows = MapRowsOf(args, w.seq, index);
  w.key_start = n_block * kBlockM;
  // The query blocks with a row that sees one of the tile's keys (position - window_left <= key <=
  // position + window_right); none past this sequence's keys (varlen).
  int m_last;
  BlockRange(int64_t{w.key_start} - args.window_right - w.seq.diagonal(),
             int64_t{w.key_start} + kBlockM - 1 + args.window_left - w.seq.diagonal(), w.seq.len_q,
             kBlockN, &w.m_first, &m_last);
  w.m_count = w.key_start < w.seq.len_k ? m_last - w.m_first + 1 : 0;
  w.num_blocks = w.m_count * group;
  w.first_query_row = w.rows.q_row0 + w.m_first * kBlockN;
  return w;
}

template <typename Element, int kHeadDimQK, int kHeadDimV>
struct BwdDkdvMainloop {
  using Tile = BwdTile<kHeadDimQK, kHeadDimV, BwdKernelKind::kDkdv>;
  using Smem = BwdSmem<Tile>;
  static constexpr int kThreads = Tile::kThreads;

  // maps: q, k, v, dout. Tile operands K (0) and V (1); streamed Q (0) and dO (1).
  static __device__ __forceinline__ void Run(const CUtensorMap* const (&maps)[4], const BwdDkdvArgs& args) {
    auto load_tile = [&](const Smem& smem, const BwdDkdvWork& w, uint32_t bar) {
      LoadTileOperands(smem, maps[1], maps[2], bar, w.rows.k_row0 + w.key_start, w.kv_head, w.rows.batch);
    };
    // The producer streams a tile's steps in order (ProduceTiles: Q then dO of step 0, 1, ...): it
    // counts the step's query block and head instead of dividing (its 40 registers).
    int step_m = 0, step_head = 0, step_row = 0;
    auto load_stream = [&](const Smem& smem, const BwdDkdvWork& w, int block, int stage, int which,
                           uint32_t bar) {
      if (which == 0) {
        if (block == 0) {
          step_m = 0;
          step_head = w.first_head;
        } else if (++step_m == w.m_count) {
          step_m = 0;
          ++step_head;
        }
        step_row = w.first_query_row + step_m * kBwdRowsPerWarpgroup;
      }
      if (which == 0) {
        LoadOperand<kHeadDimQK>(smem.stream(stage, 0), maps[0], bar, step_row, step_head, w.rows.batch);
      } else {
        LoadOperand<kHeadDimV>(smem.stream(stage, 1), maps[3], bar, step_row, step_head, w.rows.batch);
      }
    };
    // Per consumer and stage: the block's 64 queries' lse (log2 domain; +inf past the sequence) then
    // their delta, written by the consumer's own threads: the softmax reads them without guards.
    __shared__ float query_rows[Tile::kConsumers][Tile::kStages][128];
    // Consumer columns c's code (WithConsumerColumns): dK's Columns(0, c) and dV's Columns(1, c).
    auto consume_tile_with = [&](auto columns, const Smem& smem, FwdBarriers<Tile::kStages, 1>& bars, int tile,
                                 uint32_t ring, const BwdThread& t) {
      constexpr int kDkColumns = Tile::Columns(0, decltype(columns)::value);
      constexpr int kDvColumns = Tile::Columns(1, decltype(columns)::value);
      const BwdDkdvWork work = PlanTile<Tile::kBlockM, Tile::kBlockN>(tile, args);
      const BwdSequence& seq = work.seq;
      const int diagonal = seq.diagonal();
      const int key_first = work.key_start + Tile::RowOffset(t.consumer);  // the consumer's 64 keys
      const int key_row = key_first + t.row();  // this thread's keys: +0, +8
      // The queries each of this thread's keys (key_row + 8h) sees: visible_from[h] .. visible_to[h]
      // (empty for a key past the sequence), worked out once a tile in int64, then clamped to int32.
      int visible_from[2], visible_to[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t key = key_row + 8 * h;
        visible_from[h] = static_cast<int>(max(key - diagonal - args.window_right, int64_t{0}));
        visible_to[h] = static_cast<int>(min(key - diagonal + args.window_left, int64_t{seq.len_q} - 1));
        if (key >= seq.len_k) visible_to[h] = -1;
      }
      float dk[kDkColumns / 2], dv[kDvColumns / 2];  // the consumer's columns
#pragma unroll
      for (int i = 0; i < kDkColumns / 2; ++i) dk[i] = 0.f;
#pragma unroll
      for (int i = 0; i < kDvColumns / 2; ++i) dv[i] = 0.f;
      // Step by step: query block m_first + m of head kv_head * group + (block / m_count), and its rows
      // of lse and delta (counters, not divisions: fewer live registers).
      int m = 0;
      int64_t lse_row0 = seq.lse_offset + int64_t{work.first_head} * seq.lse_head_stride;
      // Thread i of the consumer writes entry i of a block's rows: lse (i < 64) or delta of query i % 64.
      // Its raw value is loaded a block ahead, during the previous block's dV and dK GEMMs, where the
      // load's latency hides; the first block's here.
      const int row_entry = threadIdx.x % 128;
      auto load_row_entry = [&](int m_start, int64_t row0) {
        return RawQueryRow(row_entry < 64 ? args.lse : args.delta, row0, m_start + row_entry % 64,
                           seq.len_q, row_entry < 64 ? -INFINITY : 0.f);
      };
      float next_row_entry = load_row_entry(work.m_first * kBwdRowsPerWarpgroup, lse_row0);
      for (int block = 0; block < work.num_blocks; ++block) {
        const RingSlot<Tile::kStages> slot(ring + block);
        const int m_start = (work.m_first + m) * kBwdRowsPerWarpgroup;
        float* rows = query_rows[t.consumer][slot.stage];
        rows[row_entry] = row_entry < 64 ? LseLog2(next_row_entry) : next_row_entry;
        float s[32], dp[32];  // S^T and dP^T: [64 keys x 64 queries]
        IssueBlockScores<Element>(s, dp, smem, bars, slot, t.consumer, t.turns);
        // The rows are written (this buffer's last readers finished a block ago: they passed this
        // barrier of the block in between).
        ptx::named_barrier_sync(kBwdRowsBarrier + t.consumer, 128);
        // Masked where some (key, query) pair of the consumer's 64 keys x the block lies past a
        // sequence's end or outside the window.
        const int key_last = key_first + 63;
        const bool needs_mask = key_last >= seq.len_k || m_start + 64 > seq.len_q ||
                                key_last - (m_start + diagonal) > args.window_right ||
                                m_start + 63 + diagonal - key_first > args.window_left;
        // One copy of the softmax per (mask, softcap) and one branch a block: the per-element tests of
        // the mask only in the copies for blocks that need them (a test per element costs a branch
        // per element). Softcap: dS also takes dt/ds = 1 - t^2.
        auto softmax = [&](auto masked, auto capped_scores) {
#pragma unroll
          for (int c = 0; c < 8; ++c)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int query = m_start + 8 * c + 2 * (t.lane % 4) + e;  // columns are queries
              const float lse_log2 = rows[query - m_start], delta = rows[64 + query - m_start];
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const int i = 4 * c + 2 * h + e;
                // Softcap: the score is c * capped, capped = tanh(s / c), inline (a pass of its own spills).
                const float capped = decltype(capped_scores)::value
                                    ? TanhOfHalfLog2Arg(s[i] * args.softcap_tanh_scale) : s[i];
                float p = ptx::ex2_approx(fmaf(capped, args.scale_log2, -lse_log2));
                if constexpr (decltype(masked)::value) {
                  if (!(visible_from[h] <= query && query <= visible_to[h])) p = 0.f;
                }
                dp[i] = p * (dp[i] - delta);
                if constexpr (decltype(capped_scores)::value) dp[i] *= fmaf(-capped, capped, 1.f);
                s[i] = p;
              }
            }
        };
        SoftmaxCopy(needs_mask, args.softcap_tanh_scale != 0.f, softmax);
        uint32_t p_frag[4][4], ds_frag[4][4];
        PackFragments<Element, 64>(s, p_frag);
        PackFragments<Element, 64>(dp, ds_frag);
        // The next block's query block and head, and its row entry's load.
        if (++m == work.m_count) {
          m = 0;
          lse_row0 += seq.lse_head_stride;
        }
        if (block + 1 < work.num_blocks) {
          next_row_entry = load_row_entry((work.m_first + m) * kBwdRowsPerWarpgroup, lse_row0);
        }
        t.turns.Begin();
        // The consumer's columns of dO and Q: whole 64-column slices from its first.
        IssueRegTimesSmem<Element, kDvColumns, 64, Tile::kSliceBytes>(
            dv, p_frag, smem.stream(slot.stage, 1) + Tile::FirstColumn(1, t.consumer) / 64 * Tile::kSliceBytes);
        IssueRegTimesSmem<Element, kDkColumns, 64, Tile::kSliceBytes>(
            dk, ds_frag, smem.stream(slot.stage, 0) + Tile::FirstColumn(0, t.consumer) / 64 * Tile::kSliceBytes);
        t.turns.End();
        ptx::wgmma_wait_group<0>();
        FenceRegisters(dk);
        FenceRegisters(dv);
        t.Release(bars.k_empty[slot.stage]);
        t.Release(bars.v_empty[slot.stage]);
      }
      t.Release(bars.q_empty[0]);  // K and V are read: the producer may load the next tile's
      // The tile's place again (not kept live through the loop: its registers are the loop's).
      const BwdDkdvWork done = PlanTile<Tile::kBlockM, Tile::kBlockN>(tile, args);
      const int64_t out_row0 = done.seq.k_offset * args.heads_kv + done.kv_head;  // [tokens, heads] row
      const int warp_row = done.key_start + Tile::RowOffset(t.consumer) + 16 * t.warp;
      const uint32_t staging = smem.staging(4 * t.consumer + t.warp);
      StoreAccumulator<Element, kDvColumns>(
          dv, staging, static_cast<Element*>(args.dv) + out_row0 * kHeadDimV + Tile::FirstColumn(1, t.consumer),
          int64_t{args.heads_kv} * kHeadDimV, warp_row, done.seq.len_k, 1.f);
      StoreAccumulator<Element, kDkColumns>(
          dk, staging, static_cast<Element*>(args.dk) + out_row0 * kHeadDimQK + Tile::FirstColumn(0, t.consumer),
          int64_t{args.heads_kv} * kHeadDimQK, warp_row, done.seq.len_k, args.scale);
      return done.num_blocks;
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
