// Host-side interface of the Hopper forward attention kernel. Plain C++ (no CUDA
// language features) so that the XLA FFI handler, compiled by the host compiler, can
// include it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

namespace jzyfa {

enum class ElementType { kBF16, kF16 };

// MLA's head dims, the one unequal pair the 16-bit kernels serve: q and k 192, v and out 128.
constexpr int kMlaHeadDimQK = 192;
constexpr int kMlaHeadDimV = 128;

// One forward call. Tensors are dense row-major:
//   q: [batch, seqlen_q, heads_q, head_dim]; k: [batch, seqlen_k, heads_kv, head_dim];
//   v: [batch, seqlen_k, heads_kv, head_dim_v]; out: [batch, seqlen_q, heads_q, head_dim_v];
//   lse: [batch, heads_q, seqlen_q] float32, natural log.
//   (head_dim, head_dim_v): (64, 64), (128, 128), (256, 256) or MLA's (192, 128).
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
  int64_t head_dim = 0;    // q's and k's
  int64_t head_dim_v = 0;  // v's and out's
  float softmax_scale = 1.0f;
  bool causal = false;  // bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q
  // Sliding window (left, right): query i, at position i + seqlen_k - seqlen_q, sees key j iff
  // pos - left <= j <= pos + right; -1 leaves a side unbounded; with `causal` the right bound is 0
  // (ResolveMask). Windows that come down to causal or none run the plain kernels.
  int64_t window_left = -1;
  int64_t window_right = -1;
  ElementType element_type = ElementType::kBF16;
};

// One FP8 forward call (head dim 128, or MLA's 192 for q and k with 128 for v and out, causal or no
// mask): q [batch, seqlen_q, heads_q, head_dim], k [batch, seqlen_k, heads_kv, head_dim] and v
// e4m3: v [batch, seqlen_k, heads_kv, head_dim_v] (the kernel transposes V's tiles in shared
// memory) or, v_transposed, V^T [batch, heads_kv, 128, seqlen_k_padded] with keys padded to a
// multiple of 32 and permuted inside each 32-key group (jzyfa/fp8_layout.py, fp8_value_operand.cu);
// descales float32, each one value or one per (batch, KV head); out bf16 [batch, seqlen_q, heads_q,
// head_dim_v]; lse and tile_counter as for FlashFwdParams.
struct FlashFwdFp8Params {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const float* descale_q = nullptr;
  const float* descale_k = nullptr;
  const float* descale_v = nullptr;
  int64_t descale_count = 1;  // 1 or batch * heads_kv, the same for all three
  void* out = nullptr;
  float* lse = nullptr;
  int32_t* tile_counter = nullptr;
  int64_t batch = 0;
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  int64_t seqlen_k_padded = 0;  // v_transposed: V^T's key columns
  int64_t heads_q = 0;
  int64_t heads_kv = 0;
  int64_t head_dim = 0;    // q's and k's
  int64_t head_dim_v = 0;  // v's (V^T's rows) and out's
  bool v_transposed = false;  // v is V^T (above), not V as it is
  float softmax_scale = 1.0f;
  bool causal = false;
  int64_t window_left = -1;  // as in FlashFwdParams (dense batches)
  int64_t window_right = -1;
  bool lean_p = true;  // P's e4m3 codes from one FFMA; false: ex2 rounded to e4m3
};

// One forward call over a packed variable-length batch (bf16/f16, head dims as in FlashFwdParams):
// q [total_q, heads_q, head_dim]; k [total_k, heads_kv, head_dim]; v [total_k, heads_kv,
// head_dim_v]; out [total_q, heads_q, head_dim_v]; cu_seqlens_q and
// cu_seqlens_k int32 [num_seqs + 1] on the device (sequence s: q tokens cu_seqlens_q[s] ..
// cu_seqlens_q[s + 1], likewise k/v), never read by the host; lse [heads_q, total_q] float32.
// Causal masks are bottom-right per sequence. Tokens of no sequence (past cu_seqlens_q[num_seqs],
// or before cu_seqlens_q[0]) get O = 0 and LSE = -inf. Sequences must be at most max_seqlen_q
// query tokens long (longer ones leave rows unwritten); tile_counter as for FlashFwdParams.
struct FlashFwdVarlenParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  void* out = nullptr;
  float* lse = nullptr;
  int32_t* tile_counter = nullptr;
  int64_t num_seqs = 0;
  int64_t total_q = 0;
  int64_t total_k = 0;
  int64_t max_seqlen_q = 0;
  int64_t max_seqlen_k = 0;
  int64_t heads_q = 0;
  int64_t heads_kv = 0;
  int64_t head_dim = 0;    // q's and k's
  int64_t head_dim_v = 0;  // v's and out's
  float softmax_scale = 1.0f;
  bool causal = false;
  int64_t window_left = -1;  // as in FlashFwdParams, per sequence
  int64_t window_right = -1;
  ElementType element_type = ElementType::kBF16;
};

// One FP8 forward call over a packed variable-length batch (head dim 128): the fields of
// FlashFwdVarlenParams, with q, k and v e4m3 and out bf16, plus the descales, float32, each one
// value or one per (sequence, KV head). v is V as it is, [total_k, heads_kv, 128] (the kernel
// transposes its tiles in shared memory), or, v_transposed, V^T e4m3 [heads_kv, 128, vt_keys]:
// sequence s's keys from column roundup32(cu_seqlens_k[s]) + 32 s, permuted inside each 32-key
// group, zeros between sequences, vt_keys = Fp8VarlenValueKeys(total_k, num_seqs)
// (jzyfa/fp8_layout.py, fp8_varlen_value_operand). P is always lean (FlashFwdFp8Params::lean_p).
struct FlashFwdFp8VarlenParams : FlashFwdVarlenParams {
  const float* descale_q = nullptr;
  const float* descale_k = nullptr;
  const float* descale_v = nullptr;
  int64_t descale_count = 1;  // 1 or num_seqs * heads_kv, the same for all three
  bool v_transposed = false;  // v is V^T (above), not V as it is
  int64_t vt_keys = 0;        // v_transposed: V^T's key columns
};

// vt's key columns for a varlen FP8 call (FlashFwdFp8VarlenParams, v_transposed).
inline int64_t Fp8VarlenValueKeys(int64_t total_k, int64_t num_seqs) {
  return (total_k + 31) / 32 * 32 + 32 * (num_seqs + 1);
}

// The mask a launch (16-bit or FP8) runs with: causal or not (the plain kernels), or a sliding
// window (the windowed kernels, bounds in 0..2^30 or -1).
struct MaskPlan {
  bool causal = false;
  bool windowed = false;
  int window_left = -1;
  int window_right = -1;
};

// The plan for `causal` and the window (left, right) over queries of at most seqlen_q and keys of
// at most seqlen_k tokens: (-1, -1) leaves `causal` as it is; otherwise causal sets the right bound
// to 0, bounds that exclude no key (left >= seqlen_k - 1, right >= seqlen_q - 1) become -1, and
// what is left is none, causal (-1, 0) or a window. Returns an error for bounds below -1, and for a
// window over seqlen_q + seqlen_k > 2^30 tokens (the windowed kernels compute positions in int32).
std::string ResolveMask(bool causal, int64_t window_left, int64_t window_right, int64_t seqlen_q,
                        int64_t seqlen_k, MaskPlan* plan);

// Empty when the 16-bit kernels have an instantiation for q/k head dim `head_dim` and v head dim
// `head_dim_v`, else why not; `kernel` names the kernel in the message.
std::string CheckHeadDims(int64_t head_dim, int64_t head_dim_v, const std::string& kernel);

// Checks what the kernel can run; returns an empty string when it can, else a message
// naming the offending argument.
std::string ValidateFlashFwd(const FlashFwdParams& params);

// Returns an empty string when the current device can run the kernels (sm_90), else why not.
std::string CheckDeviceSupport();

// Enqueues the forward kernel (and the zeroing of its tile counter) on `stream`. Returns an empty string on success, else the
// error (validation, tensor-map encoding or launch).
std::string LaunchFlashFwd(const FlashFwdParams& params, cudaStream_t stream);

// The same for variable-length batches (ffi/flash_fwd_varlen.cu).
std::string ValidateFlashFwdVarlen(const FlashFwdVarlenParams& params);
std::string LaunchFlashFwdVarlen(const FlashFwdVarlenParams& params, cudaStream_t stream);

// The same for the FP8 kernel.
std::string ValidateFlashFwdFp8(const FlashFwdFp8Params& params);
std::string LaunchFlashFwdFp8(const FlashFwdFp8Params& params, cudaStream_t stream);
// Keys per block of the FP8 kernel that LaunchFlashFwdFp8 runs for `params` now (128, or 192 for the
// unwindowed head-dim-128 kernel with V^T from memory when its rows see many keys or
// JZYFA_FP8_KEY_BLOCK=192): its emulation must use the same blocks. Reads the head dims, mask,
// sequence lengths and V layout only.
int Fp8KeyBlock(const FlashFwdFp8Params& params);

// The same for the FP8 kernel over packed variable-length batches (ffi/flash_fwd_fp8_varlen.cu).
std::string ValidateFlashFwdFp8Varlen(const FlashFwdFp8VarlenParams& params);
std::string LaunchFlashFwdFp8Varlen(const FlashFwdFp8VarlenParams& params, cudaStream_t stream);

// The consumer-loop timestamps of the last runs (ffi/kernel_timeline.cuh, tools/kernel_timeline.py),
// [cta][consumer][iteration][event] SM clocks, zeroed after reading; an error unless built with
// -DJZYFA_TIMELINE=1.
std::string ReadFlashFwdTimeline(std::vector<uint64_t>* out);
std::string ReadFlashFwdFp8Timeline(std::vector<uint64_t>* out);

}  // namespace jzyfa
