// The backward custom call's parameters, validation and launch (ffi/flash_bwd.cc), and the launch of
// one head dim's kernels (ffi/launch_bwd.cuh, instantiated per group of kBwdKernels in
// ffi/instantiations/bwd_16bit_hd*.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "flash_fwd.h"
#include "tile_size.h"

namespace jzyfa {

struct BwdParams {
  ElementType element_type = ElementType::kBF16;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* dout = nullptr;
  const float* lse = nullptr;
  const float* delta = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  int32_t* tile_counters = nullptr;  // int32 [2]
  int64_t batch = 0;
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  int64_t heads_q = 0;
  int64_t heads_kv = 0;
  int64_t head_dim = 0;    // q's and k's
  int64_t head_dim_v = 0;  // v's and dout's
  float softmax_scale = 1.0f;
  float softcap = 0.0f;  // c > 0: the forward capped scores to c tanh(s / c); 0: none
  bool causal = false;
  int64_t window_left = -1;
  int64_t window_right = -1;
  bool varlen = false;
  // varlen: q, dout, dq [total_q, heads_q, D], k, v, dk, dv [total_k, heads_kv, D], lse and delta
  // [heads_q, total_q]; sequence s holds tokens cu_seqlens_q[s] .. cu_seqlens_q[s + 1] (likewise k).
  // batch, seqlen_q and seqlen_k are then num_seqs, max_seqlen_q and max_seqlen_k.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  int64_t total_q = 0;
  int64_t total_k = 0;
};

// Why the call cannot run, or "" (sets the resolved mask in *mask).
std::string ValidateBwd(const BwdParams& p, MaskPlan* mask);

std::string LaunchBwd(const BwdParams& p, const MaskPlan& mask, cudaStream_t stream);

template <int kHeadDimQK, int kHeadDimV>
std::string LaunchBwdInstance(const BwdParams& p, const MaskPlan& mask, cudaStream_t stream);

}  // namespace jzyfa
