// The forward instantiations of one group of kFwdKernels (int8, head dims (128, 128), varlen): every
// mask it serves.
#include "launch_fwd.cuh"

namespace jzyfa {

template std::string LaunchFwdInstance<Family::kInt8, 128, 128, Layout::kVarlen>(const FwdParams&,
                                                                       const MaskPlan&,
                                                                       cudaStream_t);

}  // namespace jzyfa
