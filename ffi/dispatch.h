// Dispatch of a validated forward call into its instantiation: switch helpers from runtime values to
// template arguments, and the launch of one (family, head dims, layout) group of kFwdKernels,
// which launch_fwd.cuh defines and one file of ffi/instantiations/ instantiates per group (so the
// build compiles them in parallel). Inside a group the mask (plain or windowed), P (lean or exact),
// V's layout and the key block are switched at run time (launch_fwd_16bit.cuh, launch_fwd_fp8.cuh).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>

#include "flash_fwd.h"
#include "tile_size.h"

namespace jzyfa {

template <Family kFamily, int kHeadDimQK, int kHeadDimV, Layout kLayout>
std::string LaunchFwdInstance(const FwdParams& p, const MaskPlan& mask, cudaStream_t stream);

// A type as a value (the element type and tile switches pass it to generic lambdas).
template <typename T>
struct TypeTag {
  using type = T;
};

// f(std::true_type{}) or f(std::false_type{}).
template <typename F>
decltype(auto) BoolSwitch(bool value, F&& f) {
  return value ? f(std::true_type{}) : f(std::false_type{});
}

// f(std::integral_constant<int, V>{}) for the first of kValues equal to `value`; `otherwise()` when
// none is.
template <int... kValues, typename F, typename Otherwise>
decltype(auto) IntSwitch(int value, F&& f, Otherwise&& otherwise) {
  using Result = decltype(otherwise());
  Result result{};
  const bool found = ((value == kValues ? (result = f(std::integral_constant<int, kValues>{}), true)
                                        : false) ||
                      ...);
  return found ? result : otherwise();
}

// f(std::integral_constant<size_t, I>{}) for the group I of kFwdKernels that serves (family, head
// dims, mask, layout); `otherwise()` when none does.
template <size_t I = 0, typename F, typename Otherwise>
decltype(auto) FwdKernelSwitch(Family family, int head_dim_qk, int head_dim_v, MaskKind mask,
                               Layout layout, F&& f, Otherwise&& otherwise) {
  if constexpr (I == kNumFwdKernelGroups) {
    return otherwise();
  } else {
    constexpr FwdKernelGroup group = kFwdKernels[I];
    if (group.family == family && group.head_dim_qk == head_dim_qk &&
        group.head_dim_v == head_dim_v && group.layout == layout &&
        (group.masks & MaskBit(mask)) != 0) {
      return f(std::integral_constant<size_t, I>{});
    }
    return FwdKernelSwitch<I + 1>(family, head_dim_qk, head_dim_v, mask, layout,
                                  std::forward<F>(f), std::forward<Otherwise>(otherwise));
  }
}

}  // namespace jzyfa
