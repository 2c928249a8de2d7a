// The FP8 attention kernel's V operand, built on the device: V e4m3 [B, Sk, Hkv, D] ->
// V^T [B, Hkv, D, Sk'] (D = 64, 128 or 256: KernelHeadDim), keys padded with zeros to Sk' (a multiple of 32) and permuted
// inside each 32-key group (jzyfa/fp8_layout.py: column k of group g holds key 32 g + physical_key(k)).
//
// A tile transpose staged in shared memory, one block of 8 warps per (batch, KV head, 128-key
// tile), so that every global access is a whole row (D bytes of V, 128 of V^T) moved by consecutive
// lanes:
// - load: the tile's 128 key rows (D bytes each) as 16-byte pieces into in_tile[key][D bytes];
//   keys past Sk are zeros (not read);
// - transpose: warp w takes 16 keys of 32-key group w / 2 (half w % 2), lane l the head-dim
//   bytes 4l .. 4l+3 of each (lanes l < D / 4; 16 conflict-free 4-byte shared loads), transposes the 4 x 16 bytes
//   with PRMT (the permutation is in which bytes it picks) and writes 16 bytes to each of its four
//   rows of out_tile[head dim][128 keys], the 16-byte chunk index XOR-swizzled so that no two of
//   the 8 lanes of a store phase share banks;
// - store: out_tile's D rows, each 128 contiguous bytes of a V^T row (32, 64 or 96 in the last
//   tile of a row when Sk' is not a multiple of 128).
// Every byte of V is read once and every byte of V^T written once, in whole 32-byte sectors.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>

#include "fp8_value_operand.h"
#include "launch_utils.h"

namespace jzyfa {
namespace {

constexpr int kKeyGroup = 32;   // the k of one FP8 wgmma: the permutation repeats every 32 keys
constexpr int kTileKeys = 128;  // keys per block: four 32-key groups
constexpr int kThreads = 256;   // 8 warps: two per 32-key group
constexpr int kChunks = 8;      // 16-byte pieces of a V^T tile row (128 keys)
static_assert(kTileKeys == 16 * kChunks, "V^T tile rows of 128 bytes");
static_assert(kThreads / 32 == 2 * (kTileKeys / kKeyGroup), "two warps per 32-key group");
// The head dims (bytes of one e4m3 key row, rows of V^T) the kernel takes: at most one 4-byte word
// of each key row per lane.
constexpr bool IsValueOperandHeadDim(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }
// Head dim 256 is head dim 128 over twice the heads: V [B, Sk, H, 256] is V [B, Sk, 2H, 128] and
// V^T [B, H, 256, Sk'] is V^T [B, 2H, 128, Sk'] (head h's rows 128..255 are head 2h + 1's), both as
// they lie in memory.
constexpr int64_t KernelHeadDim(int64_t head_dim) { return head_dim == 256 ? 128 : head_dim; }
constexpr int64_t KernelHeads(int64_t head_dim, int64_t heads_kv) {
  return head_dim == 256 ? 2 * heads_kv : heads_kv;
}

// rows[e] = byte e of w0, w1, w2, w3 (w0's in the lowest byte): a 4 x 4 byte transpose.
__device__ __forceinline__ void Transpose4x4(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3,
                                             uint32_t (&rows)[4]) {
  const uint32_t lo01 = __byte_perm(w0, w1, 0x5140);  // w0.0 w1.0 w0.1 w1.1
  const uint32_t hi01 = __byte_perm(w0, w1, 0x7362);  // w0.2 w1.2 w0.3 w1.3
  const uint32_t lo23 = __byte_perm(w2, w3, 0x5140);
  const uint32_t hi23 = __byte_perm(w2, w3, 0x7362);
  rows[0] = __byte_perm(lo01, lo23, 0x5410);  // w0.0 w1.0 w2.0 w3.0
  rows[1] = __byte_perm(lo01, lo23, 0x7632);
  rows[2] = __byte_perm(hi01, hi23, 0x5410);
  rows[3] = __byte_perm(hi01, hi23, 0x7632);
}

// Where 16-byte chunk `chunk` of out_tile's row `row` is kept: the 8 lanes of a transpose store
// phase (rows 4l + e, l = 0..7) write one chunk index each to 8 different bank quads.
__device__ __forceinline__ unsigned SwizzledChunk(unsigned row, unsigned chunk) {
  return chunk ^ ((row >> 2) & (kChunks - 1));
}

// Blocks in (batch, head, tile) order, tile fastest: adjacent blocks write adjacent 128-byte
// pieces of the same V^T rows. The grid has at most INT_MAX blocks (ValidateFp8ValueOperand), so
// tiles and heads_kv fit in 32 bits; offsets are 64-bit. kHeadDim: bytes of a key row (64 or 128).
template <int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    Fp8ValueOperandKernel(const uint4* __restrict__ v, uint4* __restrict__ vt, int64_t seqlen_k,
                          int64_t seqlen_k_padded, unsigned heads_kv, unsigned tiles) {
  static_assert(IsValueOperandHeadDim(kHeadDim), "one 4-byte word of each key row per lane");
  constexpr int kInChunks = kHeadDim / 16;  // 16-byte pieces of a key row
  __shared__ uint4 in_tile[kTileKeys][kInChunks];  // [key][16-byte piece of the head dim]
  __shared__ uint4 out_tile[kHeadDim][kChunks];    // [head-dim row][swizzled 16-byte piece of keys]
  const unsigned tile = blockIdx.x % tiles, batch_head = blockIdx.x / tiles;
  const unsigned batch = batch_head / heads_kv, head = batch_head % heads_kv;
  const int64_t key0 = int64_t{tile} * kTileKeys;
  const unsigned thread = threadIdx.x;

  // Load: thread t moves 16-byte piece t % kInChunks of key rows key0 + t / kInChunks + j
  // kLoadRows (kInChunks consecutive lanes per key row); keys past seqlen_k are zeros.
  constexpr int kLoadRows = kThreads / kInChunks;
  constexpr int kLoads = kTileKeys / kLoadRows;
  const unsigned in_piece = thread % kInChunks, first_key_row = thread / kInChunks;
  const int64_t key_stride = int64_t{heads_kv} * kInChunks;  // in 16-byte pieces
  const uint4* src =
      v + ((batch * seqlen_k + key0 + first_key_row) * heads_kv + head) * kInChunks + in_piece;
  const int64_t keys_left = seqlen_k - key0 - first_key_row;  // key0 < Sk since Sk' - Sk < 32
  uint4 pieces[kLoads];
#pragma unroll
  for (int j = 0; j < kLoads; ++j) {
    pieces[j] = make_uint4(0u, 0u, 0u, 0u);
    if (kLoadRows * j < keys_left) {
      pieces[j] = __ldcs(src + kLoadRows * j * key_stride);  // read once: evict-first
    }
  }
#pragma unroll
  for (int j = 0; j < kLoads; ++j) {
    in_tile[first_key_row + kLoadRows * j][in_piece] = pieces[j];
  }
  __syncthreads();

  // Transpose: warp (group, half) builds columns 32 group + 16 half .. + 15 of the tile, lane
  // the rows 4 lane .. 4 lane + 3. Word i of those 16 columns (columns 16 half + 4i + {0..3} of
  // the group) holds, per physical_key, keys 16 half + 2i + {0, 1, 8, 9}.
  const unsigned warp = thread / 32, lane = thread % 32;
  const unsigned group = warp / 2, half = warp % 2;
  const unsigned first_key = kKeyGroup * group + 16 * half;
  const uint32_t* in_words = reinterpret_cast<const uint32_t*>(in_tile);
  if (lane < kHeadDim / 4) {
    uint32_t w[16];  // w[j] = head-dim bytes 4 lane .. 4 lane + 3 of key first_key + j
#pragma unroll
    for (int j = 0; j < 16; ++j) w[j] = in_words[(first_key + j) * (kHeadDim / 4) + lane];
    uint32_t words[4][4];  // [i][e]
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      Transpose4x4(w[2 * i], w[2 * i + 1], w[2 * i + 8], w[2 * i + 9], words[i]);
    }
    const unsigned chunk = 2 * group + half;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const unsigned row = 4 * lane + e;
      out_tile[row][SwizzledChunk(row, chunk)] =
          make_uint4(words[0][e], words[1][e], words[2][e], words[3][e]);
    }
  }
  __syncthreads();

  // Store: thread t moves 16-byte piece t % 8 of V^T rows t / 8 + 32 j of (batch, head) (8
  // consecutive lanes per 128-byte row), columns key0 .. key0 + 127; columns past Sk' (only in a
  // row's last tile) are not written.
  constexpr int kStoreRows = kThreads / kChunks;
  constexpr int kStores = kHeadDim / kStoreRows;
  const unsigned piece = thread % kChunks, first_row = thread / kChunks;
  const int64_t row_stride = seqlen_k_padded / 16;  // in 16-byte pieces: Sk' is a multiple of 32
  uint4* dst = vt + (int64_t{batch_head} * kHeadDim + first_row) * row_stride + key0 / 16 + piece;
  if (piece < (seqlen_k_padded - key0) / 16) {  // 2, 4, 6 or 8 and more pieces left in the row
#pragma unroll
    for (int j = 0; j < kStores; ++j) {
      const unsigned row = first_row + kStoreRows * j;
      dst[kStoreRows * j * row_stride] = out_tile[row][SwizzledChunk(row, piece)];
    }
  }
}

}  // namespace

std::string ValidateFp8ValueOperand(const Fp8ValueOperandParams& p) {
  if (p.batch < 0 || p.seqlen_k < 0 || p.heads_kv < 0) {
    return "v's batch, seq_k and heads_kv must not be negative";
  }
  if (!IsValueOperandHeadDim(KernelHeadDim(p.head_dim))) {
    return "v's head_dim must be 64, 128 or 256 for the jzyfa FP8 kernel's V operand, got " +
           std::to_string(p.head_dim);
  }
  const int64_t heads = KernelHeads(p.head_dim, p.heads_kv);
  const int64_t padded = (p.seqlen_k + kKeyGroup - 1) / kKeyGroup * kKeyGroup;
  if (p.seqlen_k_padded != padded) {
    return "vt must hold seq_k rounded up to a multiple of 32 keys (" + std::to_string(padded) +
           "), got " + std::to_string(p.seqlen_k_padded);
  }
  // One block per 128-key tile of each (batch, head): their count must fit the grid's x extent,
  // which also keeps every byte offset far inside int64 (V and V^T under 2^45 bytes).
  const int64_t max_blocks = INT_MAX;
  const int64_t tiles = (padded + kTileKeys - 1) / kTileKeys;
  if ((p.batch > 0 && heads > max_blocks / p.batch) ||
      (p.batch * heads > 0 && tiles > max_blocks / (p.batch * heads))) {
    return "v is too large for the jzyfa V-operand kernel: batch * heads_kv * ceil(seq_k / 128) "
           "(heads_kv doubled at head dim 256) must be at most 2^31 - 1";
  }
  return "";
}

std::string LaunchFp8ValueOperand(const Fp8ValueOperandParams& p, cudaStream_t stream) {
  std::string error = ValidateFp8ValueOperand(p);
  if (!error.empty()) return error;
  const int64_t tiles = (p.seqlen_k_padded + kTileKeys - 1) / kTileKeys;
  const int64_t heads = KernelHeads(p.head_dim, p.heads_kv);
  const int64_t blocks = p.batch * heads * tiles;
  if (blocks == 0) return "";  // vt is empty: nothing to write
  if (p.v == nullptr || p.vt == nullptr) return "v and vt must be device buffers";
  if (reinterpret_cast<uintptr_t>(p.v) % 16 != 0 || reinterpret_cast<uintptr_t>(p.vt) % 16 != 0) {
    return "v and vt must be 16-byte aligned";  // XLA's buffers are
  }
  auto* const kernel =
      KernelHeadDim(p.head_dim) == 64 ? Fp8ValueOperandKernel<64> : Fp8ValueOperandKernel<128>;
  kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const uint4*>(p.v), static_cast<uint4*>(p.vt), p.seqlen_k, p.seqlen_k_padded,
      static_cast<unsigned>(heads), static_cast<unsigned>(tiles));
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return CudaError("launching the jzyfa FP8 V-operand kernel", err);
  return "";
}

}  // namespace jzyfa
