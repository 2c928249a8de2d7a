// Measuring build (-DJZYFA_MEASURE=prmt_transpose, force-included into every CUDA translation
// unit): the FP8 staged kernels transpose V's tiles with PRMT (Fp8TransposeLane) instead of LDSM.T
// / STSM, the transpose the matrix one replaced (measured 1-3.5% slower, docs/benchmarks.md).
#pragma once

#include "measure_variant.h"

namespace jzyfa {

template <>
struct MeasureVariant<0> : ProductVariant {
  static constexpr bool kFp8PrmtTranspose = true;
};

}  // namespace jzyfa
