// precision="int8"'s quantization on the device (ffi/int8_quantize.h; jzyfa.int8_quant.int8_quantize_qkv
// is the same in XLA ops). Two launches:
// - KeyStatsKernel, one block per (512-key chunk, batch, KV head): each chunk's column sums of k and
//   maximum of |v| into the workspace. A thread reads 16-byte pieces (8 columns) of every 16th token,
//   several in flight; the 16 partial sums of a column are then added in a fixed order (deterministic);
// - KeyMeanKernel, one block per (batch, KV head): the key mean (the chunks' sums added in order,
//   over seqlen_k) and v's power-of-two descale (from the chunks' maxima);
// - QuantizeKernel, one block per 128-token tile of one head of q, k or v: four threads share a token
//   row (32 values each). k first loses its mean; q and
//   k are rotated when asked (signs, then a 128-point Walsh-Hadamard transform: 5 butterfly stages in
//   registers, the 6th and 7th with the partner threads, then 1/sqrt(128)), take the tile's largest
//   magnitude for their scale (amax / 127) and round to nearest even into int8; v is divided by its
//   descale and rounded to e4m3. Few registers per thread (no division's slow-path call, which
//   spills what is live around it) let two blocks share an SM, so one block's loads overlap the
//   other's arithmetic and stores.
// q is read once, k and v twice (statistics, then quantization); each result is written once.
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
constexpr int kLanesPerRow = 4;                            // QuantizeKernel: threads per token row
constexpr int kThreads = kInt8QuantizeBlock * kLanesPerRow;  // one 128-token tile per block
constexpr int kQuantizeBlocksPerSm = 2;                     // caps the registers at 64
constexpr int kValues = kHeadDim / kLanesPerRow;           // values per thread
constexpr int kStatsThreads = 256;
constexpr int kPiece = 8;                                  // KeyStatsKernel: columns per 16-byte load
constexpr int kPiecesPerRow = kHeadDim / kPiece;
constexpr int kStatsPhases = kStatsThreads / kPiecesPerRow;  // tokens read at once by a block
constexpr int kStatsUnroll = 4;                             // loads in flight per thread and tensor
constexpr int kStatsColumns = kHeadDim + 1;  // a chunk's workspace entry: 128 key sums, |v| maximum
constexpr float kInt8Max = 127.f;
constexpr float kFp8Max = 448.f;

// The maximum over a block of `threads` threads; `shared` holds one float per warp.
template <int threads>
__device__ __forceinline__ float BlockMax(float x, float* shared) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, offset));
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = x;
  __syncthreads();
  float m = shared[0];
#pragma unroll
  for (int w = 1; w < threads / 32; ++w) m = fmaxf(m, shared[w]);
  return m;
}

// Eight 16-bit elements (one 16-byte load) as floats; bit operations on the words keep them in
// registers (a pointer into a local would put them on the stack).
template <typename Element>
__device__ __forceinline__ void Unpack(const uint4& raw, float* x) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if constexpr (std::is_same_v<Element, __nv_bfloat16>) {  // bf16 is float's upper half
      x[2 * j] = __uint_as_float(words[j] << 16);
      x[2 * j + 1] = __uint_as_float(words[j] & 0xffff0000u);
    } else {
      x[2 * j] = __half2float(__ushort_as_half(static_cast<unsigned short>(words[j] & 0xffffu)));
      x[2 * j + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(words[j] >> 16)));
    }
  }
}

// Sixteen bytes as one 16-byte word, byte i of the result = bytes[i].
__device__ __forceinline__ uint4 Pack16(const uint32_t (&bytes)[16]) {
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    w[j] = bytes[4 * j] | (bytes[4 * j + 1] << 8) | (bytes[4 * j + 2] << 16) | (bytes[4 * j + 3] << 24);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Smallest power of two d with amax / d <= 448; 1 where amax is 0 (jzyfa.quantize's rule).
__device__ __forceinline__ float PowerOfTwoDescale(float amax) {
  if (!(amax > 0.f)) return 1.f;
  int exponent = 0;
  const float mantissa = frexpf(amax / kFp8Max, &exponent);
  if (mantissa == 0.5f) --exponent;
  return ldexpf(1.f, exponent);
}

// a / b rounded to nearest even, without the division's slow-path call: an approximate reciprocal,
// one Newton step and one correction of the quotient (the fast path of IEEE division). Correctly
// rounded while a, b and a / b are normal floats away from overflow, as the INT8 scales' 127 / amax
// and amax / 127 are for magnitudes between 2^-100 and 2^100.
__device__ __forceinline__ float DivideNearest(float a, float b) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b));
  r = __fmaf_rn(__fmaf_rn(-b, r, 1.f), r, r);
  const float q = a * r;
  return __fmaf_rn(__fmaf_rn(-b, q, a), r, q);
}

// x / d for d a power of two (normal or subnormal), exactly as the division rounds: x times 2^-e
// (one product, where 2^-e is a float), or x times 2^64 (exact) and then 2^(-e-64) for tiny d.
struct PowerOfTwoDivisor {
  float first, second;
  __device__ __forceinline__ explicit PowerOfTwoDivisor(float d) {
    const uint32_t bits = __float_as_uint(d);
    const int e = (bits >> 23) != 0 ? static_cast<int>(bits >> 23) - 127 : 31 - __clz(bits) - 149;
    const bool tiny = e < -126;
    first = tiny ? 0x1p64f : 1.f;
    second = __uint_as_float(static_cast<uint32_t>(127 - e - (tiny ? 64 : 0)) << 23);
  }
  __device__ __forceinline__ float Divide(float x) const { return x * first * second; }
};

struct Shapes {
  int batch, seqlen_q, seqlen_k, heads_q, heads_kv, q_blocks, k_blocks, chunks;
};

template <typename Element>
__global__ void __launch_bounds__(kStatsThreads) KeyStatsKernel(const Element* k, const Element* v,
                                                               float* workspace, Shapes s) {
  const int chunk = blockIdx.x, pair = blockIdx.y;  // pair = batch * heads_kv + head
  const int batch = pair / s.heads_kv, head = pair % s.heads_kv;
  const int piece = threadIdx.x % kPiecesPerRow, phase = threadIdx.x / kPiecesPerRow;
  const int first = chunk * kInt8KeyMeanChunk;
  const int last = min(first + kInt8KeyMeanChunk, s.seqlen_k);
  const int64_t row_stride = static_cast<int64_t>(s.heads_kv) * kHeadDim;
  const int64_t base = (static_cast<int64_t>(batch) * s.seqlen_k * s.heads_kv + head) * kHeadDim + piece * kPiece;
  float sum[kPiece] = {}, amax = 0.f;
  for (int token = first + phase; token < last; token += kStatsPhases * kStatsUnroll) {
    uint4 raw_k[kStatsUnroll], raw_v[kStatsUnroll];
#pragma unroll
    for (int u = 0; u < kStatsUnroll; ++u) {  // all loads first: kStatsUnroll of each in flight
      const int t = token + u * kStatsPhases;
      raw_k[u] = raw_v[u] = make_uint4(0, 0, 0, 0);  // zeros add nothing to a sum or a maximum
      if (t < last) {
        raw_k[u] = *reinterpret_cast<const uint4*>(k + base + t * row_stride);
        raw_v[u] = *reinterpret_cast<const uint4*>(v + base + t * row_stride);
      }
    }
#pragma unroll
    for (int u = 0; u < kStatsUnroll; ++u) {  // tokens in order: this thread's sums are sequential
      float x[kPiece];
      Unpack<Element>(raw_k[u], x);
#pragma unroll
      for (int j = 0; j < kPiece; ++j) sum[j] += x[j];
      Unpack<Element>(raw_v[u], x);
#pragma unroll
      for (int j = 0; j < kPiece; ++j) amax = fmaxf(amax, fabsf(x[j]));
    }
  }
  __shared__ float sums[kStatsPhases][kHeadDim];
  __shared__ float maxima[kStatsThreads / 32];
#pragma unroll
  for (int j = 0; j < kPiece; ++j) sums[phase][piece * kPiece + j] = sum[j];
  amax = BlockMax<kStatsThreads>(amax, maxima);  // its __syncthreads orders the sums too
  float* entry = workspace + (static_cast<int64_t>(pair) * s.chunks + chunk) * kStatsColumns;
  if (threadIdx.x < kHeadDim) {
    float total = sums[0][threadIdx.x];
#pragma unroll
    for (int ph = 1; ph < kStatsPhases; ++ph) total += sums[ph][threadIdx.x];
    entry[threadIdx.x] = total;
  }
  if (threadIdx.x == 0) entry[kHeadDim] = amax;
}

// The key mean and v's descale of one (batch, KV head) from its chunks' entries, in chunk order.
__global__ void __launch_bounds__(kHeadDim) KeyMeanKernel(Int8QuantizeParams p, Shapes s) {
  const int64_t pair = blockIdx.x;  // batch * heads_kv + head
  const float* stats = p.workspace + pair * s.chunks * kStatsColumns;
  float sum = 0.f, amax = 0.f;
  for (int c = 0; c < s.chunks; ++c) sum += stats[c * kStatsColumns + threadIdx.x];
  p.key_mean[pair * kHeadDim + threadIdx.x] = sum / static_cast<float>(s.seqlen_k);
  if (threadIdx.x == 0) {
    for (int c = 0; c < s.chunks; ++c) amax = fmaxf(amax, stats[c * kStatsColumns + kHeadDim]);
    p.descale_v[pair] = PowerOfTwoDescale(amax);
  }
}

// One butterfly stage across threads: this thread holds the lower (`lower`) or upper element of
// each pair, the partner thread (threadIdx ^ `lane_mask`) the other. The lower gets a + b, the upper
// a - b, as the stages in registers compute them.
__device__ __forceinline__ void ButterflyWithPartner(float (&x)[kValues], int lane_mask, bool lower) {
#pragma unroll
  for (int i = 0; i < kValues; ++i) {
    const float other = __shfl_xor_sync(0xffffffff, x[i], lane_mask);
    x[i] = lower ? x[i] + other : other - x[i];
  }
}

// One thread's 32 values (quarter `lane` of a token row): x = the element's float (0 past the
// tensor's tokens), rotated in place: the 128-point transform over the row's four threads. Bit i of
// `negative` says the rotation's sign of value i is -1: flipping the sign bit is the product by -1,
// and one register holds all 32 signs.
__device__ __forceinline__ void Rotate(float (&x)[kValues], uint32_t negative, int lane) {
#pragma unroll
  for (int i = 0; i < kValues; ++i) x[i] = __int_as_float(__float_as_int(x[i]) ^ (((negative >> i) & 1u) << 31));
#pragma unroll
  for (int stride = 1; stride < kValues; stride *= 2) {
#pragma unroll
    for (int i = 0; i < kValues; ++i) {
      if ((i & stride) == 0) {
        const float a = x[i], b = x[i + stride];
        x[i] = a + b;
        x[i + stride] = a - b;
      }
    }
  }
  ButterflyWithPartner(x, 1, (lane & 1) == 0);  // stride 32
  ButterflyWithPartner(x, 2, (lane & 2) == 0);  // stride 64
  constexpr float kNorm = 0.08838834764831845f;  // 1 / sqrt(128)
#pragma unroll
  for (int i = 0; i < kValues; ++i) x[i] *= kNorm;
}

// Where one thread's 32 values of a tile lie: quarter `lane` of token `token`'s row in head `head`.
struct TileThread {
  int64_t at;  // the first value's element offset in q, k or v ([B, S, H, 128]) and in its result
  int lane;
  bool valid;  // token < seqlen: rows past the tensor read as zeros and store nothing
  __device__ __forceinline__ TileThread(int batch, int block, int head, int heads, int seqlen) {
    const int row = threadIdx.x / kLanesPerRow, token = block * kInt8QuantizeBlock + row;
    lane = threadIdx.x % kLanesPerRow;
    valid = token < seqlen;
    at = ((static_cast<int64_t>(batch) * seqlen + token) * heads + head) * kHeadDim + lane * kValues;
  }
};

template <typename Element>
__device__ __forceinline__ void LoadValues(const Element* src, const TileThread& t, float (&x)[kValues]) {
  uint4 raw[kValues / kPiece];
#pragma unroll
  for (int i = 0; i < kValues / kPiece; ++i) {
    raw[i] = make_uint4(0, 0, 0, 0);
    if (t.valid) raw[i] = *reinterpret_cast<const uint4*>(src + t.at + i * kPiece);
  }
#pragma unroll
  for (int i = 0; i < kValues / kPiece; ++i) Unpack<Element>(raw[i], x + i * kPiece);
}

// v: e4m3 codes of x / descale (the (batch, KV head)'s power of two); no reduction over the tile.
template <typename Element>
__device__ __forceinline__ void QuantizeValueTile(const Int8QuantizeParams& p, const TileThread& t, int64_t pair) {
  if (!t.valid) return;
  float x[kValues];
  LoadValues(static_cast<const Element*>(p.v), t, x);
  const PowerOfTwoDivisor descale(p.descale_v[pair]);
  uint8_t* dst = static_cast<uint8_t*>(p.v8) + t.at;
#pragma unroll
  for (int i = 0; i < kValues; i += 16) {
    uint32_t codes[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      codes[j] = __nv_fp8_e4m3(fminf(fmaxf(descale.Divide(x[i + j]), -kFp8Max), kFp8Max)).__x;
    }
    *reinterpret_cast<uint4*>(dst + i) = Pack16(codes);
  }
}

// q or k (`smooth`: less the key mean of `pair`): rotated when asked, then int8 codes with the tile's
// scale amax / 127, written to `scale`.
template <typename Element, bool smooth>
__device__ __forceinline__ void QuantizeInt8Tile(const Int8QuantizeParams& p, const TileThread& t, const Element* src,
                                                 int8_t* codes_out, float* scale_out, int64_t pair) {
  __shared__ float mean[kHeadDim];
  __shared__ uint32_t negative_signs[kLanesPerRow];  // bit i of word w: the sign of value 32 w + i is -1
  __shared__ float maxima[kThreads / 32];
  if (p.rotate && threadIdx.x < 32) {
#pragma unroll
    for (int w = 0; w < kLanesPerRow; ++w) {
      const uint32_t bits = __ballot_sync(0xffffffff, p.signs[w * kValues + threadIdx.x] < 0.f);
      if (threadIdx.x == 0) negative_signs[w] = bits;
    }
  }
  if (smooth && threadIdx.x < kHeadDim) mean[threadIdx.x] = p.key_mean[pair * kHeadDim + threadIdx.x];
  __syncthreads();

  float x[kValues];
  LoadValues(src, t, x);
  if constexpr (smooth) {
#pragma unroll
    for (int i = 0; i < kValues; ++i) x[i] = t.valid ? x[i] - mean[t.lane * kValues + i] : 0.f;
  }
  if (p.rotate) Rotate(x, negative_signs[t.lane], t.lane);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kValues; ++i) amax = fmaxf(amax, fabsf(x[i]));
  amax = BlockMax<kThreads>(amax, maxima);
  const bool nonzero = amax > 0.f;
  const float inverse = nonzero ? DivideNearest(kInt8Max, amax) : 1.f;
  if (threadIdx.x == 0) *scale_out = nonzero ? DivideNearest(amax, kInt8Max) : 1.f;
  if (!t.valid) return;
  int8_t* dst = codes_out + t.at;
#pragma unroll
  for (int i = 0; i < kValues; i += 16) {
    uint32_t values[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int code = static_cast<int>(fminf(fmaxf(rintf(x[i + j] * inverse), -kInt8Max), kInt8Max));
      values[j] = static_cast<uint32_t>(code) & 0xffu;
    }
    *reinterpret_cast<uint4*>(dst + i) = Pack16(values);
  }
}

// Blocks [0, q tiles) take q's tiles, then k's, then v's; blockIdx.y is the batch row.
template <typename Element>
__global__ void __launch_bounds__(kThreads, kQuantizeBlocksPerSm) QuantizeKernel(Int8QuantizeParams p, Shapes s) {
  const int q_tiles = s.q_blocks * s.heads_q, k_tiles = s.k_blocks * s.heads_kv;
  const int batch = blockIdx.y;
  int tile = blockIdx.x;
  if (tile < q_tiles) {
    const int head = tile % s.heads_q, block = tile / s.heads_q;
    const TileThread t(batch, block, head, s.heads_q, s.seqlen_q);
    float* scale = p.q_scale + (static_cast<int64_t>(batch) * s.heads_q + head) * s.q_blocks + block;
    QuantizeInt8Tile<Element, false>(p, t, static_cast<const Element*>(p.q), p.q8, scale, 0);
    return;
  }
  tile -= q_tiles;
  const bool is_value = tile >= k_tiles;
  tile %= k_tiles;
  const int head = tile % s.heads_kv, block = tile / s.heads_kv;
  const TileThread t(batch, block, head, s.heads_kv, s.seqlen_k);
  const int64_t pair = static_cast<int64_t>(batch) * s.heads_kv + head;
  if (is_value) {
    QuantizeValueTile<Element>(p, t, pair);
  } else {
    float* scale = p.k_scale + pair * s.k_blocks + block;
    QuantizeInt8Tile<Element, true>(p, t, static_cast<const Element*>(p.k), p.k8, scale, pair);
  }
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
    KeyStatsKernel<Element><<<stats_grid, kStatsThreads, 0, stream>>>(
        static_cast<const Element*>(p.k), static_cast<const Element*>(p.v), p.workspace, s);
    KeyMeanKernel<<<s.batch * s.heads_kv, kHeadDim, 0, stream>>>(p, s);
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
