// What the Hopper forward kernels (16-bit and FP8) share: the persistent grid's tile order,
// the K/V ring's positions, the shared-memory barriers and the ping-pong barrier ids.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <type_traits>

#include "sm90_mma.cuh"

namespace jzyfa {

// The registers a CTA of `threads` threads owns on Hopper with one CTA per SM (__launch_bounds__(
// threads, 1)): ptxas gives each thread at most 65536 / threads, in multiples of 8, and setmaxnreg
// only moves registers inside this pool. Producer and consumer budgets must fit in it, or a
// consumer's setmaxnreg.inc waits forever (384 threads: 168 each, 64512, not 65536).
constexpr int CtaRegisterPool(int threads) { return (65536 / threads) / 8 * 8 * threads; }

// kQBuffers: Q tiles (and tile indices) in flight. With 2, round r of the tile loop uses buffer r % 2
// (RingSlot<2>(r)), so the producer loads the next tile's Q, and its first K, while the consumers
// still run this one (the FP8 kernel: docs/fp8.md 10.24).
template <int kStages, int kQBuffers = 1>
struct FwdBarriers {
  // q_full: this tile's index is in `tile` and its Q has landed. q_empty: both consumers
  // have read the index and finished their last Q K^T (one arrival per consumer warp).
  uint64_t q_full[kQBuffers];
  uint64_t q_empty[kQBuffers];
  uint64_t k_full[kStages];
  uint64_t v_full[kStages];
  // K and V stages are released separately: K as soon as S = Q K^T has landed, V once
  // P V has. A shared release (after P V) left the next K load no time to arrive.
  uint64_t k_empty[kStages];  // one arrival per consumer warp
  uint64_t v_empty[kStages];
  int tile[kQBuffers];  // the tile of the round; >= num_tiles: no more work
};

// Named barriers 1 and 2: consumer c may issue its GEMMs once barrier 1 + c completes.
constexpr int kPingPongBarrier = 1;
// Named barriers 3 and 4: consumer c's 128 threads around its epilogue's shared-memory O tile.
constexpr int kEpilogueBarrier = 3;

// A consumer warpgroup's ping-pong turns on the tensor cores and its releases, as both mainloops take
// them: consumer c issues GEMMs after named barrier (kPingPongBarrier + c) completes, then lets the other
// go. Both take the same turns (num_blocks + 1 per tile), consumer 0 first: consumer 1 opens consumer
// 0's first turn (Open), and consumer 0 absorbs consumer 1's last hand-over before it exits (Close), so
// no arrival dangles. Each warp's wait_group covered its warpgroup's wgmma, so one lane per warp
// arrives on an empty barrier (Release).
struct PingPong {
  int consumer;
  int lane;
  __device__ __forceinline__ void Open() const {
    if (consumer == 1) ptx::named_barrier_arrive(kPingPongBarrier + 0, 256);
  }
  __device__ __forceinline__ void Begin() const {
    ptx::named_barrier_sync(kPingPongBarrier + consumer, 256);
  }
  __device__ __forceinline__ void End() const {
    ptx::named_barrier_arrive(kPingPongBarrier + (1 - consumer), 256);
  }
  __device__ __forceinline__ void Release(uint64_t& empty) const {
    if (lane == 0) ptx::mbarrier_arrive(SmemAddress(&empty));
  }
};

// S = Q K^T on wgmma from shared memory, both operands in 128-byte swizzle rows (64-byte ones where the
// whole head dim is 64 bytes: FP8 head dim 64): k-steps of 32 bytes (16 bf16/f16 columns, 32 e4m3 or
// int8 ones), four per 128-byte slice of the head dim. Accumulator: float,
// or uint32_t for int8 (exact int32 sums). Q's descriptor is buffer 0's
// plus the buffer's offset (>> 4: the address field's unit), so that the descriptors stay loop-invariant
// values and the buffer costs one add per k-step.
template <typename Element, int kBlockN, int kHeadDimQK, int kQSliceBytes, int kKSliceBytes,
          int kQBytes, typename Accumulator>
__device__ __forceinline__ void IssueQK(Accumulator (&s)[kBlockN / 2], uint32_t smem_q, uint32_t smem_k,
                                        int q_buffer) {
  constexpr int kRowBytes = kHeadDimQK * static_cast<int>(sizeof(Element)) < 128 ? 64 : 128;
  constexpr int kStepsPerSlice = kRowBytes / 32;
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kHeadDimQK * static_cast<int>(sizeof(Element)) / 32; ++kk) {
    const uint32_t column = (kk % kStepsPerSlice) * 32;  // bytes into the slice's rows
    const uint64_t desc_q =
        SmemDescSwizzled<kRowBytes>(smem_q + (kk / kStepsPerSlice) * kQSliceBytes + column, 16) +
        static_cast<uint32_t>(q_buffer * (kQBytes >> 4));
    const uint64_t desc_k =
        SmemDescSwizzled<kRowBytes>(smem_k + (kk / kStepsPerSlice) * kKSliceBytes + column, 16);
    if (kk == 0) {
      ptx::Wgmma<Element, kBlockN>::ss_zero(s, desc_q, desc_k);
    } else {
      ptx::Wgmma<Element, kBlockN>::ss(s, desc_q, desc_k, 1);
    }
  }
  ptx::wgmma_commit_group();
}

// The TMA-store epilogue of one consumer warpgroup (64 rows): O goes into the consumer's tile in
// shared memory, laid out as the TMA store box wants it (64-column slices of 16-bit elements,
// kSliceBytes each, 128-byte swizzle: 16-byte chunk c of row r at chunk c ^ (r % 8)), then one
// thread stores it with TMA, which also drops rows past the tensor's end. The consumers hand O to
// the store and move on to the next tile, where plain global stores from registers would hold them
// until every store has issued (measured +2-10% at hd128, docs/benchmarks.md).
template <int kHeadDimV, int kSliceBytes>
struct TmaEpilogue {
  uint8_t* tile;       // this consumer's O tile (generic address)
  uint32_t tile_addr;  // the same, as a shared-memory address
  int consumer;
  bool store_thread;   // the consumer's first thread issues the stores

  __device__ __forceinline__ TmaEpilogue(uint8_t* tile, uint32_t tile_addr, int consumer)
      : tile(tile), tile_addr(tile_addr), consumer(consumer), store_thread(threadIdx.x % 128 == 0) {}

  // Before the first write: the previous tile's store has read the tile.
  __device__ __forceinline__ void Begin() const {
    if (store_thread) ptx::tma_store_wait_read<0>();
    ptx::named_barrier_sync(kEpilogueBarrier + consumer, 128);
  }

  // Row tile_row of the tile: this thread's column pairs 8 c + quad_col (accumulator values
  // 4 c + 2 h and 4 c + 2 h + 1 of a wgmma m64nN result) times inv.
  template <typename Element, int kValues>
  __device__ __forceinline__ void WriteRow(const float (&o)[kValues], int h, int tile_row,
                                           int quad_col, float inv) const {
#pragma unroll
    for (int c = 0; c < kHeadDimV / 8; ++c) {
      const int chunk = (c % 8) ^ (tile_row % 8);
      *reinterpret_cast<uint32_t*>(tile + (c / 8) * kSliceBytes + tile_row * 128 + chunk * 16 +
                                   quad_col * 2) =
          PackPair<Element>(o[4 * c + 2 * h] * inv, o[4 * c + 2 * h + 1] * inv);
    }
  }

  // After the last write: every thread's writes are visible to the async proxy, then one store per
  // 64-column slice at (rows_start, head, batch).
  __device__ __forceinline__ void Store(const CUtensorMap* tmap_o, int rows_start, int head,
                                        int batch) const {
    ptx::fence_proxy_async_shared();  // the tile's writes, before the async proxy reads them
    ptx::named_barrier_sync(kEpilogueBarrier + consumer, 128);
    if (store_thread) {
      for (int s = 0; s < kHeadDimV / 64; ++s)
        ptx::tma_store_4d(tmap_o, tile_addr + s * kSliceBytes, s * 64, rows_start, head, batch);
      ptx::tma_store_commit();
    }
  }

  // At the kernel's end: shared memory must outlive the stores.
  __device__ __forceinline__ static void Finish() {
    if (threadIdx.x % 128 == 0) ptx::tma_store_wait<0>();
  }
};

struct VarlenFwdArgs;

// Launches of packed variable-length batches: VarlenFwdArgs (below) and what derives from it (the FP8
// kernel's Fp8VarlenArgs, the windows WindowedArgs<...>).
template <typename Args>
constexpr bool kIsVarlen = std::is_base_of_v<VarlenFwdArgs, Args>;

// A sliding window's launch: the dense or varlen arguments (16-bit: FwdArgs, VarlenFwdArgs; FP8:
// Fp8Args) plus the window (left, right) on bottom-right positions (query row i at
// i + seqlen_k - seqlen_q sees keys pos - left .. pos + right; -1: that side unbounded), each at
// most 2^30, with the base's causal flag 0. Its instantiations are kernels of their own
// (FwdKernel / FwdVarlenKernel over WindowedArgs<...>), so the code of the others does not change.
template <typename Base>
struct WindowedArgs : Base {
  int window_left;
  int window_right;
};

template <typename Args>
constexpr bool kHasWindow = false;
template <typename Base>
constexpr bool kHasWindow<WindowedArgs<Base>> = true;

// A launch's window bounds into its arguments: a windowed launch's (left, right); nothing otherwise.
template <typename Args>
void SetWindowArgs(Args& args, int left, int right) {
  if constexpr (kHasWindow<Args>) {
    args.window_left = left;
    args.window_right = right;
  }
}

// One tile: its rows and how many key blocks they need.
struct FwdWork {
  int batch, head, kv_head, q_start, diagonal, num_blocks;
};

// A tile of a packed variable-length batch (the 16-bit kernel's varlen instantiation): where its
// sequence starts in the packed q and k, and its lengths. `batch` is the sequence; the tail, the
// tokens of no sequence, is sequence num_seqs with no keys, its rows repeating every row_stride (0
// for real sequences) so that its few tiles cover a tail of any length.
struct VarlenWork : FwdWork {
  int q_offset, k_offset, len_q, len_k, row_stride;
};

// A sliding window's tile (the 16-bit kernel's windowed instantiations): the tile's keys are blocks
// first_block .. first_block + num_blocks - 1, not 0 .. num_blocks - 1. The K/V ring counts blocks
// as before (num_blocks per tile); only the keys a block holds move.
template <typename Work>
struct WindowWork : Work {
  int first_block;
};

// The key blocks rows q_first..q_last (q_first <= q_last) need under the window (left, right) on
// bottom-right positions (row i at i + diagonal sees keys pos - left .. pos + right; -1: that side
// unbounded), clipped to seqlen_k keys: first_block and the count (0: no row sees a key). int32:
// the launch keeps lengths and bounds below 2^30 (seqlen_q + seqlen_k <= 2^30).
template <int kBlockN>
__device__ __forceinline__ void WindowBlocks(int q_first, int q_last, int diagonal, int seqlen_k,
                                             int left, int right, int& first_block,
                                             int& num_blocks) {
  const int kv_begin = left < 0 ? 0 : max(q_first + diagonal - left, 0);
  const int kv_end = right < 0 ? seqlen_k : min(q_last + diagonal + right + 1, seqlen_k);
  if (kv_end <= kv_begin) {
    first_block = 0;
    num_blocks = 0;
    return;
  }
  first_block = kv_begin / kBlockN;
  num_blocks = (kv_end + kBlockN - 1) / kBlockN - first_block;
}

// A sliding window's mask on S in a wgmma m64nN accumulator (both kernels' layout: this thread's
// values 4c + 2h + e at row first_row + 8h, key key_start + 8c + 2 (lane % 4) + e), before the
// softmax step, which then masks nothing: row i, at i + diagonal, sees keys pos - left ..
// pos + right (-1: unbounded) below seqlen_k; the others get -inf. The bounds are worked out once
// per row, as the thread's visible columns lo <= 8c + e < hi (counted from its first column
// key_start + 2 (lane % 4)), so an element costs two compares with constants: fewer live values
// than the 16-bit kernel's per-key MaskWindow, which spills the consumers at their 232 registers
// (FP8's; 16-bit at head dim 256 and MLA's). A block where a row sees no key leaves that row's
// state as it was (block max -inf); a row that sees none at all ends with O = 0, LSE = -inf. No
// overflow: the launch keeps seqlen_q + seqlen_k <= 2^30, so |pos| and the bounds stay below 2^30.
template <int kBlockN>
__device__ __forceinline__ void MaskWindowByRowBounds(float (&s)[kBlockN / 2], int key_start,
                                                      int first_row, int lane, int seqlen_k,
                                                      int diagonal, int left, int right) {
  const int first_key = key_start + 2 * (lane % 4);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int pos = first_row + 8 * h + diagonal;
    const int lo = (left < 0 ? 0 : pos - left) - first_key;
    const int hi = (right < 0 ? seqlen_k : min(pos + right + 1, seqlen_k)) - first_key;
#pragma unroll
    for (int c = 0; c < kBlockN / 8; ++c)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int column = 8 * c + e;
        if (!(lo <= column && column < hi)) s[4 * c + 2 * h + e] = -INFINITY;
      }
  }
}

// Tile order: the (batch, head) pairs in equal groups of args.group_pairs; inside a group, query
// tiles longest first (under a causal mask the last tiles see the most keys), the group's pairs
// fastest. Concurrent CTAs then work on few heads and walk their keys together, so K/V blocks come
// from L2 more often than from HBM; groups are large enough that the last one still balances the
// CTAs' work (TileGroupPairs, launch_utils.h).
// Args: any launch-argument struct with the fields read here.
template <int kBlockM, int kBlockN, typename Args>
__device__ __forceinline__ FwdWork PlanTile(int tile, const Args& args) {
  FwdWork w;
  // Opaque copies of the divisors: ptxas then works out the divisions' reciprocals per tile instead
  // of keeping them live across the producer's loop (its 40 registers have none to spare).
  int group_pairs = args.group_pairs, m_tiles = args.m_tiles, heads_q = args.heads_q;
  asm volatile("" : "+r"(group_pairs), "+r"(m_tiles), "+r"(heads_q));
  const int group_tiles = group_pairs * m_tiles;
  const int group = tile / group_tiles;
  const int within = tile - group * group_tiles;
  const int q_index = within / group_pairs;
  const int pair = group * group_pairs + (within - q_index * group_pairs);
  w.head = pair % heads_q;
  w.batch = pair / heads_q;
  w.q_start = (m_tiles - 1 - q_index) * kBlockM;
  w.kv_head = w.head / (args.heads_q / args.heads_kv);
  // Bottom-right causal alignment: query i sees keys j <= i + diagonal.
  w.diagonal = args.seqlen_k - args.seqlen_q;
  const int q_last = min(w.q_start + kBlockM, args.seqlen_q) - 1;
  const int kv_end = args.causal ? min(args.seqlen_k, q_last + w.diagonal + 1) : args.seqlen_k;
  w.num_blocks = kv_end > 0 ? (kv_end + kBlockN - 1) / kBlockN : 0;
  return w;
}

// A windowed tile: the base's tile (all keys of its sequence or batch element, or none) narrowed to the key blocks
// its rows' windows reach. The tile order stays the base's, longest first for causal masks, which
// for windows is only roughly longest first (every tile of a narrow window has about equal work).
template <int kBlockM, int kBlockN, typename Base>
__device__ __forceinline__ auto PlanTile(int tile, const WindowedArgs<Base>& args) {
  using Work = decltype(PlanTile<kBlockM, kBlockN>(tile, static_cast<const Base&>(args)));
  // The divisors pass through an opaque move, so ptxas recomputes the divisions' reciprocals per
  // tile instead of keeping them across the producer's loop: the windowed producer then fits in
  // its 40 registers (CtaRegisterPool leaves none to spare). The varlen base needs it here; the
  // dense base's PlanTile makes its own divisors opaque as well (heads_kv only through this one).
  Base base = args;
  asm volatile("" : "+r"(base.heads_q), "+r"(base.heads_kv), "+r"(base.m_tiles));
  WindowWork<Work> w;
  static_cast<Work&>(w) = PlanTile<kBlockM, kBlockN>(tile, base);
  w.first_block = 0;
  if (w.num_blocks > 0) {  // some key, and the tile's first row is a real one
    int seqlen_q, seqlen_k;
    if constexpr (kIsVarlen<Base>) {
      seqlen_q = w.len_q;
      seqlen_k = w.len_k;
    } else {
      seqlen_q = args.seqlen_q;
      seqlen_k = args.seqlen_k;
    }
    WindowBlocks<kBlockN>(w.q_start, min(w.q_start + kBlockM, seqlen_q) - 1, w.diagonal, seqlen_k,
                          args.window_left, args.window_right, w.first_block, w.num_blocks);
    if constexpr (kIsVarlen<Base>) {
      // Varlen: the sequence's keys are taken to start at the tile's first block (k_offset, len_k
      // and the diagonal in that frame): the producer holds no first_block.
      const int first_key = w.first_block * kBlockN;
      w.k_offset += first_key;
      w.len_k -= first_key;
      w.diagonal -= first_key;
      w.first_block = 0;
    }
  }
  return w;
}

// Runtime arguments of a varlen launch: q [total_q, heads_q, D] and k, v [total_k, heads_kv, D]
// packed, sequence s holding tokens cu_seqlens_q[s]..cu_seqlens_q[s + 1] of q (likewise of k, v).
// The offsets live on the device and are read per tile; the host never reads them.
struct VarlenFwdArgs {
  void* out;          // [total_q, heads_q, D]
  float* lse;         // [heads_q, total_q]
  int* tile_counter;  // as in FwdArgs
  int num_tiles;      // (num_seqs + 1) * m_tiles * heads_q: the last "sequence" is the tail
  int m_tiles;        // ceil(max_seqlen_q / kBlockM)
  int num_seqs;
  int total_q;
  int heads_q;
  int heads_kv;
  float scale_log2;
  int causal;
  float softcap_tanh_scale;  // as in FwdArgs
  const int* cu_seqlens_q;  // [num_seqs + 1]
  const int* cu_seqlens_k;  // [num_seqs + 1]
};

// The varlen tile order is the dense one with sequences as the batch: heads fastest, then query
// tiles from the last (of max_seqlen_q) to the first, then sequences. With unequal lengths the
// first query tiles are no longer the longest ones (a short sequence's last tiles are empty, and
// cost one empty round each); the order stays simple. Lengths are clamped at 0, so bad offsets
// give empty tiles, never out-of-range work; the epilogue checks every token it writes.
template <int kBlockM, int kBlockN>
__device__ __forceinline__ VarlenWork PlanTile(int tile, const VarlenFwdArgs& args) {
  VarlenWork w;
  w.head = tile % args.heads_q;
  const int rest = tile / args.heads_q;
  w.q_start = (args.m_tiles - 1 - rest % args.m_tiles) * kBlockM;
  w.batch = rest / args.m_tiles;
  w.kv_head = w.head / (args.heads_q / args.heads_kv);
  if (w.batch < args.num_seqs) {
    w.q_offset = args.cu_seqlens_q[w.batch];
    w.len_q = max(args.cu_seqlens_q[w.batch + 1] - w.q_offset, 0);
    w.k_offset = args.cu_seqlens_k[w.batch];
    w.len_k = max(args.cu_seqlens_k[w.batch + 1] - w.k_offset, 0);
    w.row_stride = 0;
    w.diagonal = w.len_k - w.len_q;
    const int q_last = min(w.q_start + kBlockM, w.len_q) - 1;
    const int kv_end = w.q_start >= w.len_q ? 0
                       : args.causal        ? min(w.len_k, q_last + w.diagonal + 1)
                                            : w.len_k;
    w.num_blocks = kv_end > 0 ? (kv_end + kBlockN - 1) / kBlockN : 0;
  } else {
    // The tail: the tokens of no sequence, past cu_seqlens_q[num_seqs] and then (wrapping around)
    // before cu_seqlens_q[0]; no keys, so O = 0 and LSE = -inf.
    // (Clamped to total_q tokens, whatever the offsets hold.)
    w.q_offset = args.cu_seqlens_q[args.num_seqs];
    w.len_q = min(max(args.total_q - w.q_offset, 0) + max(args.cu_seqlens_q[0], 0), args.total_q);
    w.k_offset = 0;
    w.len_k = 0;
    w.row_stride = args.m_tiles * kBlockM;
    w.diagonal = 0;
    w.num_blocks = 0;
  }
  return w;
}

// Calls store(token) (int64) for each packed token that row `row` of a varlen tile (`rows`, its
// VarlenWork) stands for: the token q_offset + row of its sequence if row < len_q; for the tail,
// every row_stride-th row from `row` on, wrapping around total_q. Every token is checked against
// total_q, so bad offsets never write out of range. (The 16-bit kernel has this loop inline: written
// through this helper, its verified kernels' registers moved.)
template <typename Work, typename Store>
__device__ __forceinline__ void ForEachVarlenToken(const Work& rows, int row, int total_q,
                                                   Store store) {
  for (int r = row; r < rows.len_q; r += rows.row_stride) {
    int64_t token = static_cast<int64_t>(rows.q_offset) + r;
    if (rows.row_stride != 0 && token >= total_q) token -= total_q;  // the tail
    if (token >= 0 && token < total_q) store(token);
    if (rows.row_stride == 0) break;
  }
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

// Thread 0 sets up the barriers (one arrival per consumer warp on the "empty" ones); every
// thread must pass a __syncthreads after it. v_full takes kVFullArrivals arrivals: 1 where a TMA
// load completes it (arrive + bytes), the transposing threads' count where they build V's operand
// (the FP8 kernel).
template <int kStages, int kConsumers, int kVFullArrivals = 1, int kQBuffers>
__device__ __forceinline__ void InitBarriers(FwdBarriers<kStages, kQBuffers>& bars) {
  if (threadIdx.x != 0) return;
  for (int b = 0; b < kQBuffers; ++b) {
    ptx::mbarrier_init(SmemAddress(&bars.q_full[b]), 1);
    ptx::mbarrier_init(SmemAddress(&bars.q_empty[b]), 4 * kConsumers);
  }
  for (int s = 0; s < kStages; ++s) {
    ptx::mbarrier_init(SmemAddress(&bars.k_full[s]), 1);
    ptx::mbarrier_init(SmemAddress(&bars.v_full[s]), kVFullArrivals);
    ptx::mbarrier_init(SmemAddress(&bars.k_empty[s]), 4 * kConsumers);
    ptx::mbarrier_init(SmemAddress(&bars.v_empty[s]), 4 * kConsumers);
  }
  ptx::fence_mbarrier_init();
}

// ProduceTiles' default for kernels whose V loads complete v_full: nothing to do at the end.
struct NoProducerFinish {
  __device__ __forceinline__ void operator()(uint32_t) const {}
};

// A tile's key blocks 1 .. num_blocks - 1: iteration(block, p_prev, p_next) issues the previous
// block's P V from p_prev and writes this block's P into p_next. Two P buffers alternate (a P V reads
// its registers while the next softmax writes the other), or one serves throughout (kOneBuffer: P
// packed once the P V that read it has landed).
template <bool kOneBuffer, typename Iteration, typename PBuffer>
__device__ __forceinline__ void ForLaterBlocks(int num_blocks, Iteration& iteration, PBuffer& p_even,
                                               PBuffer& p_odd) {
  for (int block = 1; block < num_blocks; block += 2) {
    if constexpr (kOneBuffer) {
      iteration(block, p_even, p_even);
      if (block + 1 < num_blocks) iteration(block + 1, p_even, p_even);
    } else {
      iteration(block, p_even, p_odd);
      if (block + 1 < num_blocks) iteration(block + 1, p_odd, p_even);
    }
  }
}

// The producer thread's loop: claims tiles from the counter, hands each to the consumers through
// `bars.tile` and q_full (of the round's Q buffer), and loads its Q and K/V blocks into the ring.
// The loads are the kernel's: load_q(work, buffer, bar) (buffer: the round's Q buffer),
// load_k(work, block, stage, bar), load_v(work, block, stage, bar) issue the TMA copies whose bytes
// (q_bytes, k_bytes, v_bytes) complete `bar`. V's bytes complete bars.v_full, or, where v_landed is
// given (the FP8 kernel: V lands in a staging buffer that other threads transpose into the stage),
// v_landed[stage]. finish(ring) runs once when the tiles run out, with the count of K/V blocks
// loaded since the launch, before the consumers are told to stop.
template <int kStages, int kBlockM, int kBlockN, typename Args, typename LoadQ, typename LoadK,
          typename LoadV, typename Finish = NoProducerFinish, int kQBuffers>
__device__ __forceinline__ void ProduceTiles(FwdBarriers<kStages, kQBuffers>& bars, const Args& args,
                                             uint32_t q_bytes, uint32_t k_bytes, uint32_t v_bytes,
                                             LoadQ load_q, LoadK load_k, LoadV load_v,
                                             uint64_t* v_landed = nullptr, Finish finish = {}) {
  uint32_t ring = 0;  // K/V blocks loaded since the launch
  int tile = blockIdx.x;
  for (int round = 0;; ++round) {
    // The round's index and Q buffer are reused once both consumers are done with the tile that
    // was in them (kQBuffers rounds ago).
    const RingSlot<kQBuffers> q_slot(round);
    const uint32_t q_full = SmemAddress(&bars.q_full[q_slot.stage]);
    if (round >= kQBuffers) {
      ptx::mbarrier_wait(SmemAddress(&bars.q_empty[q_slot.stage]), q_slot.parity ^ 1);
    }
    *reinterpret_cast<volatile int*>(&bars.tile[q_slot.stage]) = tile;
    if (tile >= args.num_tiles) {
      finish(ring);
      ptx::mbarrier_arrive(q_full);  // tells the consumers to stop
      return;
    }
    // Claim the next tile now: the atomic's latency hides behind this tile's loads.
    const int next_tile = gridDim.x + atomicAdd(args.tile_counter, 1);
    const auto work = PlanTile<kBlockM, kBlockN>(tile, args);  // FwdWork or a varlen kernel's
    tile = next_tile;
    if (work.num_blocks == 0) {
      ptx::mbarrier_arrive(q_full);  // nothing to load: the consumers write O = 0
      continue;
    }
    ptx::mbarrier_arrive_expect_tx(q_full, q_bytes);
    load_q(work, q_slot.stage, q_full);
    for (int block = 0; block < work.num_blocks; ++block, ++ring) {
      const RingSlot<kStages> slot(ring);
      // Refill a stage once both consumers released the block that was in it.
      const uint32_t k_full = SmemAddress(&bars.k_full[slot.stage]);
      const uint32_t v_full =
          SmemAddress(v_landed != nullptr ? &v_landed[slot.stage] : &bars.v_full[slot.stage]);
      if (ring >= kStages) ptx::mbarrier_wait(SmemAddress(&bars.k_empty[slot.stage]), slot.parity ^ 1);
      ptx::mbarrier_arrive_expect_tx(k_full, k_bytes);
      load_k(work, block, slot.stage, k_full);
      if (ring >= kStages) ptx::mbarrier_wait(SmemAddress(&bars.v_empty[slot.stage]), slot.parity ^ 1);
      ptx::mbarrier_arrive_expect_tx(v_full, v_bytes);
      load_v(work, block, slot.stage, v_full);
    }
  }
}

}  // namespace jzyfa
