// Host-side interface of precision="int8"'s quantization on the device (ffi/int8_quantize.cu): what
// jzyfa.int8_quant.int8_quantize_qkv computes in XLA ops, in two launches that read q and v once and
// k twice. Plain C++ so that the XLA FFI handler, compiled by the host compiler, can include it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace jzyfa {

// Tokens per INT8 scale block (jzyfa.int8_quant.INT8_BLOCK) and per partial sum of the key mean
// (jzyfa.int8_quant.KEY_MEAN_CHUNK: the workspace holds one partial per chunk).
constexpr int kInt8QuantizeBlock = 128;
constexpr int kInt8KeyMeanChunk = 512;

// q [B, Sq, Hq, 128], k [B, Sk, Hkv, 128], v [B, Sk, Hkv, 128], bf16 or f16 (`bf16`), dense row-major.
// Results: q8 [B, Sq, Hq, 128] and k8 int8, q_scale [B, Hq, ceil(Sq / 128)] and k_scale [B, Hkv,
// ceil(Sk / 128)] float32, v8 e4m3 [B, Sk, Hkv, 128], descale_v [B, Hkv] (powers of two), key_mean
// [B, Hkv, 128] float32; workspace float32 [B, Hkv, ceil(Sk / 512), 129]: each chunk's key sums and
// |v| maximum. signs: float32 [128] (+-1), the Hadamard rotation's (read only when `rotate`).
struct Int8QuantizeParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const float* signs = nullptr;
  int8_t* q8 = nullptr;
  int8_t* k8 = nullptr;
  void* v8 = nullptr;
  float* q_scale = nullptr;
  float* k_scale = nullptr;
  float* descale_v = nullptr;
  float* key_mean = nullptr;
  float* workspace = nullptr;
  bool bf16 = true;
  bool rotate = false;
  int64_t batch = 0;
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  int64_t heads_q = 0;
  int64_t heads_kv = 0;
  int64_t head_dim = 0;
};

// Empty when the kernels serve these shapes, else a message naming the offending argument.
std::string ValidateInt8Quantize(const Int8QuantizeParams& params);

// Enqueues both kernels on `stream`. Returns an empty string on success, else the error.
std::string LaunchInt8Quantize(const Int8QuantizeParams& params, cudaStream_t stream);

}  // namespace jzyfa
