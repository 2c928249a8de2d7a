// Measuring build (-DJZYFA_MEASURE=fp8_register_epilogue, force-included into every CUDA translation unit):
// every FP8 kernel storing O from registers, for A/B against the TMA-store epilogue.
#pragma once

#include "measure_variant.h"

namespace jzyfa {

template <>
struct MeasureVariant<0> : ProductVariant {
  static constexpr bool kFp8EpilogueTma = false;
};

}  // namespace jzyfa
