// The backward call's validation and dispatch into its head dim's instantiation (kBwdKernels).
#include "flash_bwd.h"

#include <cmath>
#include <string>

#include "dispatch.h"

namespace jzyfa {
namespace {

std::string Str(int64_t x) { return std::to_string(x); }

template <size_t I = 0>
std::string DispatchBwd(const BwdParams& p, const MaskPlan& mask, cudaStream_t stream) {
  constexpr size_t kGroups = sizeof(kBwdKernels) / sizeof(kBwdKernels[0]);
  if constexpr (I == kGroups) {
    return "no backward kernel for head dims " + Str(p.head_dim) + "/" + Str(p.head_dim_v);
  } else {
    constexpr BwdKernelGroup kGroup = kBwdKernels[I];
    if (kGroup.head_dim_qk == p.head_dim && kGroup.head_dim_v == p.head_dim_v) {
      return LaunchBwdInstance<kGroup.head_dim_qk, kGroup.head_dim_v>(p, mask, stream);
    }
    return DispatchBwd<I + 1>(p, mask, stream);
  }
}

}  // namespace

std::string ValidateBwd(const BwdParams& p, MaskPlan* mask) {
  if (p.element_type == ElementType::kE4M3) return "FP8 calls have no backward";
  if (!(p.softcap >= 0.f) || !std::isfinite(p.softcap)) {
    return "softcap must be 0 (none) or a positive finite number";
  }
  if (p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0) {
    return "heads_q (" + Str(p.heads_q) + ") must be a multiple of heads_kv (" + Str(p.heads_kv) + ")";
  }
  std::string error =
      ResolveMask(p.causal, p.window_left, p.window_right, p.seqlen_q, p.seqlen_k, mask);
  if (!error.empty()) return error;
  if (!HasBwdKernel(static_cast<int>(p.head_dim), static_cast<int>(p.head_dim_v), mask->kind(),
                    p.varlen ? Layout::kVarlen : Layout::kDense)) {
    return "no backward kernel for head dims (q and k / v) " + Str(p.head_dim) + "/" + Str(p.head_dim_v) +
           " (served: 64/64, 128/128, 256/256 and 192/128)";
  }
  if (p.varlen && (p.seqlen_q < 0 || p.seqlen_k < 0 || p.total_q >= (int64_t{1} << 31) ||
                   p.total_k >= (int64_t{1} << 31))) {
    return "varlen: max_seqlen_q and max_seqlen_k must be >= 0 and the token counts below 2^31";
  }
  constexpr int64_t kLimit = int64_t{1} << 30;
  if (p.seqlen_q + p.seqlen_k > kLimit) {
    return "seqlen_q + seqlen_k must be <= 2^30, got " + Str(p.seqlen_q + p.seqlen_k);
  }
  // Tile counts and element offsets in int32 where the kernels keep them.
  if (p.batch * p.heads_q * (p.seqlen_q + 63) / 64 > kLimit ||
      p.batch * p.heads_kv * (p.seqlen_k + 63) / 64 > kLimit) {
    return "too many tiles for the backward kernels' int32 counters";
  }
  return "";
}

std::string LaunchBwd(const BwdParams& p, const MaskPlan& mask, cudaStream_t stream) {
  return DispatchBwd(p, mask, stream);
}

}  // namespace jzyfa
