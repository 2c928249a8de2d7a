// What the Hopper forward kernels (16-bit and FP8) share: the persistent grid's tile order,
// the K/V ring's positions, the shared-memory barriers and the ping-pong barrier ids.
#pragma once

#include <cstdint>

namespace jzyfa {

template <int kStages>
struct FwdBarriers {
  // q_full: this tile's index is in `tile` and its Q has landed. q_empty: both consumers
  // have read the index and finished their last Q K^T (one arrival per consumer warp).
  uint64_t q_full;
  uint64_t q_empty;
  uint64_t k_full[kStages];
  uint64_t v_full[kStages];
  // K and V stages are released separately: K as soon as S = Q K^T has landed, V once
  // P V has. A shared release (after P V) left the next K load no time to arrive.
  uint64_t k_empty[kStages];  // one arrival per consumer warp
  uint64_t v_empty[kStages];
  int tile;  // the tile the consumers work on next; >= num_tiles: no more work
};

// Named barriers 1 and 2: consumer c may issue its GEMMs once barrier 1 + c completes.
constexpr int kPingPongBarrier = 1;

// One tile: its rows and how many key blocks they need.
struct FwdWork {
  int batch, head, kv_head, q_start, diagonal, num_blocks;
};

// Tile order: heads fastest, then query tiles (longest first: under a causal mask the last
// tiles see the most keys), then batch.
// Args: any launch-argument struct with the fields read here.
template <int kBlockM, int kBlockN, typename Args>
__device__ __forceinline__ FwdWork PlanTile(int tile, const Args& args) {
  FwdWork w;
  w.head = tile % args.heads_q;
  const int rest = tile / args.heads_q;
  w.q_start = (args.m_tiles - 1 - rest % args.m_tiles) * kBlockM;
  w.batch = rest / args.m_tiles;
  w.kv_head = w.head / (args.heads_q / args.heads_kv);
  // Bottom-right causal alignment: query i sees keys j <= i + diagonal.
  w.diagonal = args.seqlen_k - args.seqlen_q;
  const int q_last = min(w.q_start + kBlockM, args.seqlen_q) - 1;
  const int kv_end = args.causal ? min(args.seqlen_k, q_last + w.diagonal + 1) : args.seqlen_k;
  w.num_blocks = kv_end > 0 ? (kv_end + kBlockN - 1) / kBlockN : 0;
  return w;
}

// Position of the ring's `n`-th block since the launch: its stage and the parity of
// that stage's barrier phase.
template <int kStages>
struct RingSlot {
  int stage;
  uint32_t parity;
  __device__ __forceinline__ explicit RingSlot(uint32_t n)
      : stage(static_cast<int>(n % kStages)), parity((n / kStages) & 1) {}
};

}  // namespace jzyfa
