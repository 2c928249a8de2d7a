// Softcap (Gemma 2): each scaled score s becomes c tanh(s / c). The kernels turn a block's raw
// scores x (q.k, before the softmax scale) into t = tanh(x * softmax_scale / c) in place and run the
// softmax with c log2(e) as its log2-domain scale; the backward multiplies dS by dt/ds = 1 - t^2.
#pragma once

#include "sm90_mma.cuh"

namespace jzyfa {

// tanh(x) from y = 2 log2(e) x as 1 - 2 / (2^y + 1): two MUFU operations, absolute error ~1e-7 over
// the whole range (2^y = inf gives 1, 0 gives -1). tanh.approx.f32's relative error of 2^-11 would
// move a capped score c t by up to c / 2048: 0.02 at c = 50, a 2% error in exp(score).
__device__ __forceinline__ float TanhOfHalfLog2Arg(float y) {
  return 1.f - __fdividef(2.f, ptx::ex2_approx(y) + 1.f);
}

// The launches' scales (host): the softmax's log2-domain scale, softmax_scale log2(e), or c log2(e)
// with a softcap c > 0; and CapScores' tanh_scale, 2 log2(e) softmax_scale / c (0: no softcap).
struct SoftcapScales {
  float scale_log2;
  float tanh_scale;
};

inline SoftcapScales SoftcapScalesOf(float softmax_scale, float softcap) {
  constexpr float kLog2e = 1.4426950408889634f;
  if (!(softcap > 0.f)) return SoftcapScales{softmax_scale * kLog2e, 0.f};
  return SoftcapScales{softcap * kLog2e, 2.f * kLog2e * softmax_scale / softcap};
}

// s[i] <- tanh(s[i] * tanh_scale / (2 log2 e)); tanh_scale = 2 log2(e) softmax_scale / c.
template <int kN>
__device__ __forceinline__ void CapScores(float (&s)[kN], float tanh_scale) {
#pragma unroll
  for (int i = 0; i < kN; ++i) s[i] = TanhOfHalfLog2Arg(s[i] * tanh_scale);
}

}  // namespace jzyfa
