// Measuring build (-DJZYFA_MEASURE=softmax_ablation, force-included into every CUDA translation
// unit): the softmax out of the 16-bit kernels (P = the scaled scores, masked keys 0, no maximum,
// exponential, row sum or rescale): what the tensor work, loads and schedule alone reach. Results
// wrong.
#pragma once

#include "measure_variant.h"

namespace jzyfa {

template <>
struct MeasureVariant<0> : ProductVariant {
  static constexpr bool kSoftmaxAblation = true;
};

}  // namespace jzyfa
