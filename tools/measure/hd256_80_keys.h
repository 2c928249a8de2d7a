// Measuring build (-DJZYFA_MEASURE=hd256_80_keys, force-included into every CUDA translation unit):
// 80-key blocks in the dense 16-bit kernels at head dim 256, causal or no mask (consumers at 240
// registers, producer 24; not yet measured: docs/benchmarks.md).
#pragma once

#include "measure_variant.h"

namespace jzyfa {

template <>
struct MeasureVariant<0> : ProductVariant {
  static constexpr int kHd256BlockN = 80;
};

}  // namespace jzyfa
