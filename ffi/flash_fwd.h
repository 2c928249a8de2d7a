// Host-side interface of the Hopper forward attention kernel. Plain C++ (no CUDA
// language features) so that the XLA FFI handler, compiled by the host compiler, can
// include it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace jzyfa {

enum class ElementType { kBF16, kF16 };

// One forward call. Tensors are dense row-major:
//   q, out: [batch, seqlen_q, heads_q, head_dim]; k, v: [batch, seqlen_k, heads_kv, head_dim];
//   lse: [batch, heads_q, seqlen_q] float32, natural log.
//   tile_counter: one int32 of device scratch the launch zeroes and the kernel's tile
//   scheduler counts in (the caller owns it so that concurrent launches never share one).
struct FlashFwdParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;
  int32_t* tile_counter = nullptr;
  int64_t batch = 0;
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  int64_t heads_q = 0;
  int64_t heads_kv = 0;
  int64_t head_dim = 0;
  float softmax_scale = 1.0f;
  bool causal = false;  // bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q
  ElementType element_type = ElementType::kBF16;
};

// Checks what the kernel can run; returns an empty string when it can, else a message
// naming the offending argument.
std::string ValidateFlashFwd(const FlashFwdParams& params);

// Returns an empty string when the current device can run the kernels (sm_90), else why not.
std::string CheckDeviceSupport();

// Enqueues the forward kernel (and the zeroing of its tile counter) on `stream`. Returns an empty string on success, else the
// error (validation, tensor-map encoding or launch).
std::string LaunchFlashFwd(const FlashFwdParams& params, cudaStream_t stream);

}  // namespace jzyfa
