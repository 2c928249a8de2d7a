// The forward instantiations of kFwdKernels' rows (fp8, head dims (128, 128), varlen), every mask.
#include "launch_fwd.cuh"

namespace jzyfa {

template std::string LaunchFwdInstance<Family::kFp8, 128, 128, Layout::kVarlen>(const FwdParams&,
                                                                      const MaskPlan&,
                                                                      cudaStream_t);

}  // namespace jzyfa
