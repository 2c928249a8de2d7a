// The forward launch of a validated call: its group of kFwdKernels, then that group's instantiation
// (dispatch.h; each group is compiled by one file of ffi/instantiations/).
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
        constexpr FwdKernelGroup group = kFwdKernels[decltype(index)::value];
        return LaunchFwdInstance<group.family, group.head_dim_qk, group.head_dim_v, group.layout>(
            p, mask, stream);
      },
      [] { return std::string("no kernel instantiation serves this call (ValidateFwd admits none)"); });
}

}  // namespace jzyfa
