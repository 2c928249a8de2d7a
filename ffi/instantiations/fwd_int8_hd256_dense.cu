// The forward instantiations of one group of kFwdKernels (int8, head dims (256, 256), dense): every
// mask it serves.
#include "launch_fwd.cuh"

namespace jzyfa {

template std::string LaunchFwdInstance<Family::kInt8, 256, 256, Layout::kDense>(const FwdParams&,
                                                                       const MaskPlan&,
                                                                       cudaStream_t);

}  // namespace jzyfa
