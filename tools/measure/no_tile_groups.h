// Measuring build (-DJZYFA_MEASURE=no_tile_groups, force-included into every CUDA translation
// unit): the dense kernels' previous tile order (each batch element a group: heads fastest, then
// query tiles longest first, then batch), for A/B against TileGroupPairs' groups.
#pragma once

#include "measure_variant.h"

namespace jzyfa {

template <>
struct MeasureVariant<0> : ProductVariant {
  static constexpr bool kTileGroups = false;
};

}  // namespace jzyfa
