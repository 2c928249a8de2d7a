// The forward instantiations of kFwdKernels' rows (16bit, head dims (128, 128), varlen), every mask.
#include "launch_fwd.cuh"

namespace jzyfa {

template std::string LaunchFwdInstance<Family::k16Bit, 128, 128, Layout::kVarlen>(const FwdParams&,
                                                                      const MaskPlan&,
                                                                      cudaStream_t);

}  // namespace jzyfa
