// Host-side interface of the Hopper forward attention kernels: one parameter type for every forward
// call (16-bit and FP8, dense and varlen), its validation, the mask and key-block rules, and the
// launch. Plain C++ (no CUDA language features) so that the XLA FFI handler, compiled by the host
// compiler, can include it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tile_size.h"

namespace jzyfa {

enum class ElementType { kBF16, kF16, kE4M3, kS8 };  // kS8: int8 q and k, e4m3 v

// One forward call. The kernel (kFwdKernels' row) is chosen by (family, head dims, resolved mask,
// layout); the grouped fields below are read only where their group applies.
//
// Dense (varlen false), row-major:
//   q [batch, seqlen_q, heads_q, head_dim]; k [batch, seqlen_k, heads_kv, head_dim];
//   v [batch, seqlen_k, heads_kv, head_dim_v] or, FP8 v_transposed, V^T [batch, heads_kv, 128,
//   vt_keys = seqlen_k rounded up to 32] (keys permuted inside each 32-key group: jzyfa/fp8_layout.py,
//   fp8_value_operand.cu); out [batch, seqlen_q, heads_q, head_dim_v]; lse [batch, heads_q, seqlen_q].
// Varlen (packed): q [total_q, heads_q, head_dim]; k [total_k, heads_kv, head_dim]; v [total_k,
//   heads_kv, head_dim_v] or, FP8 v_transposed, V^T [heads_kv, 128, vt_keys = Fp8VarlenValueKeys]
//   (sequence s's keys from column roundup32(cu_seqlens_k[s]) + 32 s); out [total_q, heads_q,
//   head_dim_v]; lse [heads_q, total_q]; cu_seqlens_q / cu_seqlens_k int32 [num_seqs + 1] on the
//   device, never read by the host. Causal masks are bottom-right per sequence; tokens of no sequence
//   get O = 0 and LSE = -inf; sequences must be at most max_seqlen_q / max_seqlen_k tokens long.
// lse is float32, natural log. out has q's dtype (bf16 for FP8). tile_counter: one int32 of device
// scratch the launch zeroes and the persistent kernel claims tiles from.
struct FwdParams {
  // Every call.
  ElementType element_type = ElementType::kBF16;  // q's, k's and v's
  bool varlen = false;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;
  int32_t* tile_counter = nullptr;
  int64_t heads_q = 0;
  int64_t heads_kv = 0;
  int64_t head_dim = 0;    // q's and k's
  int64_t head_dim_v = 0;  // v's and out's
  float softmax_scale = 1.0f;
  float softcap = 0.0f;  // c > 0: scores c tanh(s / c) (16-bit kernels); 0: none
  bool causal = false;  // bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q
  // Sliding window (left, right): query i, at position i + seqlen_k - seqlen_q, sees key j iff
  // pos - left <= j <= pos + right; -1 leaves a side unbounded; with `causal` the right bound is 0
  // (ResolveMask). Windows that come down to causal or none run the plain kernels.
  int64_t window_left = -1;
  int64_t window_right = -1;
  // Keys per block: 0, the launch's rule (Fp8KeyBlock; the 16-bit tiles' own); 128 or 192 force it
  // where the instantiation exists (ValidateFwd refuses it elsewhere).
  int64_t key_block = 0;

  // Dense.
  int64_t batch = 0;
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;

  // Varlen.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  int64_t num_seqs = 0;
  int64_t total_q = 0;
  int64_t total_k = 0;
  int64_t max_seqlen_q = 0;
  int64_t max_seqlen_k = 0;

  // FP8.
  const float* descale_q = nullptr;  // float32 on the device: one value, or one per (batch or
  const float* descale_k = nullptr;  // sequence, KV head). INT8: q_scale [batch, heads_q,
  const float* descale_v = nullptr;  // ceil(seqlen_q / 128)] and k_scale [batch, heads_kv,
                                     // ceil(seqlen_k / 128)], descale_v per (batch, KV head)
  int64_t descale_count = 1;  // 1 or (batch or num_seqs) * heads_kv, the same for all three (INT8: v's)
  bool lean_p = true;         // P's e4m3 codes from one FFMA; false: ex2 rounded to e4m3 (dense only)
  bool v_transposed = false;  // v is V^T (above), not V as it is
  int64_t vt_keys = 0;        // v_transposed: V^T's key columns

  Family family() const {
    return element_type == ElementType::kE4M3 ? Family::kFp8
           : element_type == ElementType::kS8 ? Family::kInt8
                                              : Family::k16Bit;
  }
  Layout layout() const { return varlen ? Layout::kVarlen : Layout::kDense; }
};

// vt's key columns for a varlen FP8 call (FwdParams, v_transposed).
inline int64_t Fp8VarlenValueKeys(int64_t total_k, int64_t num_seqs) {
  return (total_k + 31) / 32 * 32 + 32 * (num_seqs + 1);
}

// The mask a launch runs with: none, causal (the plain kernels), or a sliding window (the windowed
// kernels, bounds in 0..2^30 or -1).
struct MaskPlan {
  bool causal = false;
  bool windowed = false;
  int window_left = -1;
  int window_right = -1;
  MaskKind kind() const {
    return windowed ? MaskKind::kWindow : causal ? MaskKind::kCausal : MaskKind::kNone;
  }
};

// The plan for `causal` and the window (left, right) over queries of at most seqlen_q and keys of
// at most seqlen_k tokens: (-1, -1) leaves `causal` as it is; otherwise causal sets the right bound
// to 0, bounds that exclude no key (left >= seqlen_k - 1, right >= seqlen_q - 1) become -1, and
// what is left is none, causal (-1, 0) or a window. Returns an error for bounds below -1, and for a
// window over seqlen_q + seqlen_k > 2^30 tokens (the windowed kernels compute positions in int32).
std::string ResolveMask(bool causal, int64_t window_left, int64_t window_right, int64_t seqlen_q,
                        int64_t seqlen_k, MaskPlan* plan);

// Keys per block of the FP8 kernel a call runs with when it leaves key_block to the launch (0):
// 192 for the dense, unwindowed head-dim-128 kernel with V^T from memory when its rows see many
// keys, else 128. Its emulation must use the same blocks. Window bounds -1 for none.
int Fp8KeyBlock(bool v_transposed, int64_t head_dim, bool causal, int64_t window_left,
                int64_t window_right, int64_t seqlen_q, int64_t seqlen_k);

// Checks everything the kernels need of a call (shapes, head dims, limits, the mask, key_block),
// the one place that does: empty when it can run, else a message naming the offending argument.
// Fills *mask with the resolved mask and, for FP8, sets p->key_block to the block the launch runs.
std::string ValidateFwd(FwdParams* p, MaskPlan* mask);

// Returns an empty string when the current device can run the kernels (sm_90), else why not.
std::string CheckDeviceSupport();

// Enqueues the kernel of a validated call (ValidateFwd) and the zeroing of its tile counter on
// `stream` (dispatch.cc). Returns an empty string on success, else the error (tensor-map encoding
// or launch).
std::string LaunchFwd(const FwdParams& p, const MaskPlan& mask, cudaStream_t stream);

// The consumer-loop timestamps of the last runs (tools/measure/timeline.h, tools/kernel_timeline.py),
// [cta][consumer][iteration][event] SM clocks, zeroed after reading; an error unless the build
// records them.
std::string ReadFwdTimeline(std::vector<uint64_t>* out);

}  // namespace jzyfa
