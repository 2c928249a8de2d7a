// LaunchFwdInstance (dispatch.h) for every family: the definition the files of ffi/instantiations/
// instantiate, one (family, head dims, layout) group each.
#pragma once

#include "dispatch.h"
#include "launch_fwd_16bit.cuh"
#include "launch_fwd_fp8.cuh"

namespace jzyfa {

template <Family kFamily, int kHeadDimQK, int kHeadDimV, Layout kLayout>
std::string LaunchFwdInstance(const FwdParams& p, const MaskPlan& mask, cudaStream_t stream) {
  if constexpr (kFamily == Family::kFp8) {
    static_assert(kHeadDimV == Fp8TileT<kHeadDimQK, false>::kHeadDimV, "the FP8 tiles' v head dim is their own");
    return LaunchFp8<kHeadDimQK, kLayout>(p, mask, stream);
  } else if constexpr (kFamily == Family::kInt8) {
    static_assert(kHeadDimV == Fp8TileT<kHeadDimQK, false>::kHeadDimV, "the INT8 tiles: the FP8 tiles' head dims");
    return LaunchInt8<kHeadDimQK, kLayout>(p, mask, stream);
  } else {
    return Launch16<kHeadDimQK, kHeadDimV, kLayout>(p, mask, stream);
  }
}

}  // namespace jzyfa
