// precision="int8"'s quantization on the device (ffi/int8_quantize.h; jzyfa.int8_quant.int8_quantize_qkv
// is the same in XLA ops). Two launches:
// - KeyStatsKernel, one block per (512-key chunk, batch, KV head): each chunk's column sums of k and
//   maximum of |v| into the workspace (each thread sums its column's tokens in order: deterministic);
// - QuantizeKernel, one block per 128-token tile of one head of q, k or v: a thread holds half a token
//   row (64 values). k first loses its mean (the chunks' sums added in order, over seqlen_k); q and k are
//   rotated when asked (signs, then a 128-point Walsh-Hadamard transform: 6 butterfly stages in
//   registers, the 7th with the partner thread, then 1/sqrt(128)), take the tile's largest magnitude
//   for their scale (amax / 127) and round to nearest even into int8; v is divided by its power-of-two
//   descale (from the chunks' maxima) and rounded to e4m3.
// q and v are read once, k twice; each result is written once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "int8_quantize.h"
#include "launch_utils.h"

namespace jzyfa {
namespace {

constexpr int kHeadDim = 128;
constexpr int kThreads = 256;            // QuantizeKernel: two per token row of a 128-token tile
constexpr int kHalf = kHeadDim / 2;      // values per thread
constexpr int kStatsColumns = kHeadDim + 1;  // a chunk's workspace entry: 128 key sums, |v| maximum
constexpr float kInt8Max = 127.f;
constexpr float kFp8Max = 448.f;

template <typename Element>
__device__ __forceinline__ float ToFloat(Element x) {
  if constexpr (std::is_same_v<Element, __nv_bfloat16>) {
    return __bfloat162float(x);
  } else {
    return __half2float(x);
  }
}

__device__ __forceinline__ float BlockMax(float x, float* shared) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, offset));
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = x;
  __syncthreads();
  float m = shared[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) m = fmaxf(m, shared[w]);
  return m;
}

// Smallest power of two d with amax / d <= 448; 1 where amax is 0 (jzyfa.quantize's rule).
__device__ __forceinline__ float PowerOfTwoDescale(float amax) {
  if (!(amax > 0.f)) return 1.f;
  int exponent = 0;
  const float mantissa = frexpf(amax / kFp8Max, &exponent);
  if (mantissa == 0.5f) --exponent;
  return ldexpf(1.f, exponent);
}

struct Shapes {
  int batch, seqlen_q, seqlen_k, heads_q, heads_kv, q_blocks, k_blocks, chunks;
};

template <typename Element>
__global__ void __launch_bounds__(kThreads) KeyStatsKernel(const Element* k, const Element* v, float* workspace,
                                                          Shapes s) {
  const int chunk = blockIdx.x, pair = blockIdx.y;  // pair = batch * heads_kv + head
  const int batch = pair / s.heads_kv, head = pair % s.heads_kv;
  const int column = threadIdx.x % kHeadDim, parity = threadIdx.x / kHeadDim;
  const int first = chunk * kInt8KeyMeanChunk;
  const int last = min(first + kInt8KeyMeanChunk, s.seqlen_k);
  float sum = 0.f, amax = 0.f;
  for (int token = first + parity; token < last; token += 2) {
    const int64_t at = ((static_cast<int64_t>(batch) * s.seqlen_k + token) * s.heads_kv + head) * kHeadDim + column;
    sum += ToFloat(k[at]);
    amax = fmaxf(amax, fabsf(ToFloat(v[at])));
  }
  __shared__ float sums[2][kHeadDim];
  __shared__ float maxima[kThreads / 32];
  sums[parity][column] = sum;
  amax = BlockMax(amax, maxima);  // its __syncthreads orders the sums too
  float* entry = workspace + (static_cast<int64_t>(pair) * s.chunks + chunk) * kStatsColumns;
  if (threadIdx.x < kHeadDim) entry[column] = sums[0][column] + sums[1][column];
  if (threadIdx.x == 0) entry[kHeadDim] = amax;
}

// One thread's 64 values (half `half` of a token row): x = the element's float (0 past the tensor's
// tokens), v of the 128-point transform in place over all 128 with the partner thread (threadIdx ^ 1).
__device__ __forceinline__ void Rotate(float (&x)[kHalf], const float* signs, int half) {
#pragma unroll
  for (int i = 0; i < kHalf; ++i) x[i] *= signs[half * kHalf + i];
#pragma unroll
  for (int stride = 1; stride < kHalf; stride *= 2) {
#pragma unroll
    for (int i = 0; i < kHalf; ++i) {
      if ((i & stride) == 0) {
        const float a = x[i], b = x[i + stride];
        x[i] = a + b;
        x[i + stride] = a - b;
      }
    }
  }
  constexpr float kNorm = 0.08838834764831845f;  // 1 / sqrt(128)
#pragma unroll
  for (int i = 0; i < kHalf; ++i) {
    const float other = __shfl_xor_sync(0xffffffff, x[i], 1);
    x[i] = (half == 0 ? x[i] + other : other - x[i]) * kNorm;
  }
}

template <typename Element>
__global__ void __launch_bounds__(kThreads) QuantizeKernel(Int8QuantizeParams p, Shapes s) {
  const int q_tiles = s.q_blocks * s.heads_q, k_tiles = s.k_blocks * s.heads_kv;
  const int batch = blockIdx.y;
  int tile = blockIdx.x, which = 0;  // 0: q, 1: k, 2: v
  if (tile >= q_tiles) {
    tile -= q_tiles;
    which = 1 + tile / k_tiles;
    tile %= k_tiles;
  }
  const int heads = which == 0 ? s.heads_q : s.heads_kv, blocks = which == 0 ? s.q_blocks : s.k_blocks;
  const int seqlen = which == 0 ? s.seqlen_q : s.seqlen_k;
  const int head = tile % heads, block = tile / heads;
  const int row = threadIdx.x / 2, half = threadIdx.x % 2, token = block * kInt8QuantizeBlock + row;
  const bool valid = token < seqlen;
  const int64_t at = ((static_cast<int64_t>(batch) * seqlen + token) * heads + head) * kHeadDim + half * kHalf;
  const Element* src = static_cast<const Element*>(which == 0 ? p.q : which == 1 ? p.k : p.v);
  const int64_t pair = static_cast<int64_t>(batch) * s.heads_kv + head;  // k and v: the stats' entry
  const float* stats = p.workspace + pair * s.chunks * kStatsColumns;

  __shared__ float mean[kHeadDim];
  __shared__ float signs[kHeadDim];  // the rotation's, read 64 times per thread
  __shared__ float maxima[kThreads / 32];
  if (p.rotate && which < 2 && threadIdx.x < kHeadDim) signs[threadIdx.x] = p.signs[threadIdx.x];
  if (which == 1 && threadIdx.x < kHeadDim) {
    float sum = 0.f;
    for (int c = 0; c < s.chunks; ++c) sum += stats[c * kStatsColumns + threadIdx.x];
    mean[threadIdx.x] = sum / static_cast<float>(seqlen);
    if (block == 0) p.key_mean[pair * kHeadDim + threadIdx.x] = mean[threadIdx.x];
  }
  __syncthreads();

  float x[kHalf];
#pragma unroll
  for (int i = 0; i < kHalf; i += 8) {
    uint4 raw = make_uint4(0, 0, 0, 0);
    if (valid) raw = *reinterpret_cast<const uint4*>(src + at + i);
    const Element* e = reinterpret_cast<const Element*>(&raw);
#pragma unroll
    for (int j = 0; j < 8; ++j) x[i + j] = ToFloat(e[j]);
  }
  if (which == 1) {
#pragma unroll
    for (int i = 0; i < kHalf; ++i) x[i] = valid ? x[i] - mean[half * kHalf + i] : 0.f;
  }

  if (which == 2) {  // v: e4m3 with the (batch, KV head)'s power-of-two descale
    float amax = 0.f;
    for (int c = 0; c < s.chunks; ++c) amax = fmaxf(amax, stats[c * kStatsColumns + kHeadDim]);
    const float descale = PowerOfTwoDescale(amax);
    if (block == 0 && threadIdx.x == 0) p.descale_v[pair] = descale;
    if (!valid) return;
    uint8_t codes[kHalf];
#pragma unroll
    for (int i = 0; i < kHalf; ++i) {
      const float scaled = fminf(fmaxf(x[i] / descale, -kFp8Max), kFp8Max);
      codes[i] = __nv_fp8_e4m3(scaled).__x;
    }
    uint8_t* dst = static_cast<uint8_t*>(p.v8) + at;
#pragma unroll
    for (int i = 0; i < kHalf; i += 16) *reinterpret_cast<uint4*>(dst + i) = *reinterpret_cast<const uint4*>(codes + i);
    return;
  }

  if (p.rotate) Rotate(x, signs, half);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kHalf; ++i) amax = fmaxf(amax, fabsf(x[i]));
  amax = BlockMax(amax, maxima);
  const bool nonzero = amax > 0.f;
  const float inverse = nonzero ? kInt8Max / amax : 1.f, scale = nonzero ? amax / kInt8Max : 1.f;
  if (threadIdx.x == 0) {
    float* scales = which == 0 ? p.q_scale : p.k_scale;
    scales[(static_cast<int64_t>(batch) * heads + head) * blocks + block] = scale;
  }
  if (!valid) return;
  int8_t values[kHalf];
#pragma unroll
  for (int i = 0; i < kHalf; ++i) {
    values[i] = static_cast<int8_t>(fminf(fmaxf(rintf(x[i] * inverse), -kInt8Max), kInt8Max));
  }
  int8_t* dst = (which == 0 ? p.q8 : p.k8) + at;
#pragma unroll
  for (int i = 0; i < kHalf; i += 16) *reinterpret_cast<uint4*>(dst + i) = *reinterpret_cast<const uint4*>(values + i);
}

}  // namespace

std::string ValidateInt8Quantize(const Int8QuantizeParams& p) {
  if (p.head_dim != kHeadDim) return "head_dim must be 128, got " + std::to_string(p.head_dim);
  if (p.batch < 1 || p.seqlen_q < 1 || p.seqlen_k < 1 || p.heads_q < 1 || p.heads_kv < 1) {
    return "q, k and v need batch, sequence and head counts of at least 1";
  }
  if (p.batch > 65535) return "batch must be at most 65535, got " + std::to_string(p.batch);
  const int64_t q_blocks = (p.seqlen_q + kInt8QuantizeBlock - 1) / kInt8QuantizeBlock;
  const int64_t k_blocks = (p.seqlen_k + kInt8QuantizeBlock - 1) / kInt8QuantizeBlock;
  const int64_t limit = int64_t{1} << 30;
  if (q_blocks * p.heads_q + 2 * k_blocks * p.heads_kv > limit || p.batch * p.heads_kv > 65535) {
    return "too many tiles: ceil(seq_q / 128) * heads_q + 2 * ceil(seq_k / 128) * heads_kv must be at most "
           "2^30 and batch * heads_kv at most 65535";
  }
  if (p.rotate && p.signs == nullptr) return "rotate needs the signs operand";
  return "";
}

std::string LaunchInt8Quantize(const Int8QuantizeParams& p, cudaStream_t stream) {
  std::string error = ValidateInt8Quantize(p);
  if (!error.empty()) return error;
  Shapes s;
  s.batch = static_cast<int>(p.batch);
  s.seqlen_q = static_cast<int>(p.seqlen_q);
  s.seqlen_k = static_cast<int>(p.seqlen_k);
  s.heads_q = static_cast<int>(p.heads_q);
  s.heads_kv = static_cast<int>(p.heads_kv);
  s.q_blocks = static_cast<int>((p.seqlen_q + kInt8QuantizeBlock - 1) / kInt8QuantizeBlock);
  s.k_blocks = static_cast<int>((p.seqlen_k + kInt8QuantizeBlock - 1) / kInt8QuantizeBlock);
  s.chunks = static_cast<int>((p.seqlen_k + kInt8KeyMeanChunk - 1) / kInt8KeyMeanChunk);
  const dim3 stats_grid(s.chunks, s.batch * s.heads_kv);
  const dim3 tiles_grid(s.q_blocks * s.heads_q + 2 * s.k_blocks * s.heads_kv, s.batch);
  auto launch = [&](auto element) {
    using Element = decltype(element);
    KeyStatsKernel<Element><<<stats_grid, kThreads, 0, stream>>>(
        static_cast<const Element*>(p.k), static_cast<const Element*>(p.v), p.workspace, s);
    QuantizeKernel<Element><<<tiles_grid, kThreads, 0, stream>>>(p, s);
  };
  if (p.bf16) {
    launch(__nv_bfloat16{});
  } else {
    launch(__half{});
  }
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? "" : CudaError("launching the INT8 quantization", err);
}

}  // namespace jzyfa
