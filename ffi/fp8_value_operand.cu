// The FP8 attention kernel's V operand, built on the device: V e4m3 [B, Sk, Hkv, 128] ->
// V^T [B, Hkv, 128, Sk'], keys padded with zeros to Sk' (a multiple of 32) and permuted inside
// each 32-key group (jzyfa/fp8_layout.py: column k of group g holds key 32 g + physical_key(k)).
//
// One warp per (batch, KV head, 32-key group); lane l owns head-dim bytes 4l .. 4l+3. Each load
// instruction of the warp reads one 128-byte key row (coalesced); each lane then holds a 4 x 32
// byte tile (its four head-dim rows x the group's keys), transposes it with PRMT in registers and
// writes each of its rows as 32 contiguous bytes (two 16-byte stores: a whole sector). No shared
// memory, no synchronization; every byte of V is read once and every byte of V^T written once.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>

#include "fp8_value_operand.h"
#include "launch_utils.h"

namespace jzyfa {
namespace {

constexpr int kHeadDim = 128;  // bytes of one e4m3 key row: one 4-byte word per lane
constexpr int kKeyGroup = 32;  // the k of one FP8 wgmma: the permutation repeats every 32 keys
constexpr int kWarpsPerBlock = 8;
static_assert(kHeadDim == 4 * 32, "one 4-byte word of each key row per lane");

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

// Warps in (batch, head, group) order, group fastest: a block's warps write 8 adjacent 32-byte
// pieces of every V^T row it touches.
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    Fp8ValueOperandKernel(const uint32_t* __restrict__ v, uint8_t* __restrict__ vt,
                          int64_t seqlen_k, int64_t seqlen_k_padded, int64_t heads_kv,
                          int64_t num_warps) {
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (warp >= num_warps) return;
  const int lane = threadIdx.x % 32;
  const int64_t groups = seqlen_k_padded / kKeyGroup;
  const int64_t group = warp % groups;
  const int64_t batch_head = warp / groups;  // batch * heads_kv + head
  const int64_t batch = batch_head / heads_kv, head = batch_head % heads_kv;
  const int64_t key0 = group * kKeyGroup;

  // w[j] = v[batch, key0 + j, head, 4 lane .. 4 lane + 3]; keys past seqlen_k are zeros.
  constexpr int kRowWords = kHeadDim / 4;
  const int64_t key_stride = heads_kv * kRowWords;  // in words
  const uint32_t* src = v + ((batch * seqlen_k + key0) * heads_kv + head) * kRowWords + lane;
  const int valid = static_cast<int>(min(seqlen_k - key0, int64_t{kKeyGroup}));  // 1 .. 32
  uint32_t w[kKeyGroup];
#pragma unroll
  for (int j = 0; j < kKeyGroup; ++j) {
    w[j] = j < valid ? __ldcs(src) : 0u;  // read once: evict-first
    src += key_stride;
  }

  // Row d = 4 lane + e of V^T, columns key0 .. key0 + 31.
  uint8_t* dst = vt + (batch_head * kHeadDim + 4 * lane) * seqlen_k_padded + key0;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    // Output word i of this half (columns 16 half + 4i + {0..3}) holds, per physical_key, keys
    // 16 half + 2i + {0, 1, 8, 9}.
    uint32_t words[4][4];  // [i][e]
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int a = 16 * half + 2 * i;
      Transpose4x4(w[a], w[a + 1], w[a + 8], w[a + 9], words[i]);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const uint4 piece = make_uint4(words[0][e], words[1][e], words[2][e], words[3][e]);
      *reinterpret_cast<uint4*>(dst + e * seqlen_k_padded + 16 * half) = piece;
    }
  }
}

}  // namespace

std::string ValidateFp8ValueOperand(const Fp8ValueOperandParams& p) {
  if (p.batch < 0 || p.seqlen_k < 0 || p.heads_kv < 0) {
    return "v's batch, seq_k and heads_kv must not be negative";
  }
  if (p.head_dim != kHeadDim) {
    return "v's head_dim must be 128 for the jzyfa FP8 kernel's V operand, got " +
           std::to_string(p.head_dim);
  }
  const int64_t padded = (p.seqlen_k + kKeyGroup - 1) / kKeyGroup * kKeyGroup;
  if (p.seqlen_k_padded != padded) {
    return "vt must hold seq_k rounded up to a multiple of 32 keys (" + std::to_string(padded) +
           "), got " + std::to_string(p.seqlen_k_padded);
  }
  // One warp per 32-key group of each (batch, head): their count must fit the grid's x extent
  // (blocks of 8 warps), which also keeps every byte offset far inside int64.
  const int64_t max_warps = int64_t{INT_MAX} * kWarpsPerBlock;
  const int64_t groups = padded / kKeyGroup;
  if ((p.batch > 0 && p.heads_kv > max_warps / p.batch) ||
      (p.batch * p.heads_kv > 0 && groups > max_warps / (p.batch * p.heads_kv))) {
    return "v is too large for the jzyfa V-operand kernel: batch * heads_kv * ceil(seq_k / 32) "
           "must be at most 2^34 - 8";
  }
  return "";
}

std::string LaunchFp8ValueOperand(const Fp8ValueOperandParams& p, cudaStream_t stream) {
  std::string error = ValidateFp8ValueOperand(p);
  if (!error.empty()) return error;
  const int64_t num_warps = p.batch * p.heads_kv * (p.seqlen_k_padded / kKeyGroup);
  if (num_warps == 0) return "";  // vt is empty: nothing to write
  if (p.v == nullptr || p.vt == nullptr) return "v and vt must be device buffers";
  const int64_t blocks = (num_warps + kWarpsPerBlock - 1) / kWarpsPerBlock;
  Fp8ValueOperandKernel<<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, 0, stream>>>(
      static_cast<const uint32_t*>(p.v), static_cast<uint8_t*>(p.vt), p.seqlen_k,
      p.seqlen_k_padded, p.heads_kv, num_warps);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return CudaError("launching the jzyfa FP8 V-operand kernel", err);
  return "";
}

}  // namespace jzyfa
