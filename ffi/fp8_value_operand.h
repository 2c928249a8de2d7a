// Host-side interface of the kernel that builds the FP8 attention kernel's V operand. Plain C++
// (no CUDA language features) so that the XLA FFI handler, compiled by the host compiler, can
// include it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace jzyfa {

// v e4m3 [batch, seqlen_k, heads_kv, D] -> vt e4m3 [batch, heads_kv, D, seqlen_k_padded], D 64, 128 or 256,
// both dense row-major, seqlen_k_padded = seqlen_k rounded up to a multiple of 32: V transposed,
// column k of key group g holding key 32 g + physical_key(k) (jzyfa/fp8_layout.py), appended keys
// zero. Bitwise what jzyfa.fp8_layout.fp8_value_operand computes.
struct Fp8ValueOperandParams {
  const void* v = nullptr;
  void* vt = nullptr;
  int64_t batch = 0;
  int64_t seqlen_k = 0;
  int64_t heads_kv = 0;
  int64_t head_dim = 0;
  int64_t seqlen_k_padded = 0;
};

// Empty when the kernel can build this operand, else a message naming the offending argument.
std::string ValidateFp8ValueOperand(const Fp8ValueOperandParams& params);

// Enqueues the kernel on `stream` (nothing when vt is empty). Returns an empty string on success,
// else the error (validation or launch).
std::string LaunchFp8ValueOperand(const Fp8ValueOperandParams& params, cudaStream_t stream);

}  // namespace jzyfa
