// Measuring build (-DJZYFA_MEASURE=nomask_176_keys, force-included into every CUDA translation
// unit): 176-key blocks in the dense 16-bit head-dim-128 kernels without a mask (one P buffer, O
// from registers; not yet measured: docs/fp8.md 10.27).
#pragma once

#include "measure_variant.h"

namespace jzyfa {

template <>
struct MeasureVariant<0> : ProductVariant {
  static constexpr int kNoMaskBlockN = 176;
};

}  // namespace jzyfa
