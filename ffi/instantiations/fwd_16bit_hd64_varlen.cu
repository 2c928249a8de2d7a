// The forward instantiations of kFwdKernels' rows (16bit, head dims (64, 64), varlen), every mask.
#include "launch_fwd.cuh"

namespace jzyfa {

template std::string LaunchFwdInstance<Family::k16Bit, 64, 64, Layout::kVarlen>(const FwdParams&,
                                                                      const MaskPlan&,
                                                                      cudaStream_t);

}  // namespace jzyfa
