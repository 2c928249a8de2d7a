// The forward launch of a validated call: its kFwdKernels row, then that row's instantiation group
// (dispatch.h; the groups are compiled in ffi/instantiations/).
#include "dispatch.h"

#include <string>

#include "flash_fwd.h"
#include "tile_size.h"

namespace jzyfa {

std::string LaunchFwd(const FwdParams& p, const MaskPlan& mask, cudaStream_t stream) {
  return FwdKernelSwitch(
      p.family(), static_cast<int>(p.head_dim), static_cast<int>(p.head_dim_v), mask.kind(),
      p.layout(),
      [&](auto index) {
        constexpr FwdKernelRow row = kFwdKernels[decltype(index)::value];
        return LaunchFwdInstance<row.family, row.head_dim_qk, row.head_dim_v, row.layout>(p, mask,
                                                                                       stream);
      },
      [] { return std::string("no kernel instantiation serves this call (ValidateFwd admits none)"); });
}

}  // namespace jzyfa
