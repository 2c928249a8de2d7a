// The forward instantiations of one group of kFwdKernels (fp8, head dims (256, 256), varlen): every
// mask it serves.
#include "launch_fwd.cuh"

namespace jzyfa {

template std::string LaunchFwdInstance<Family::kFp8, 256, 256, Layout::kVarlen>(const FwdParams&,
                                                                    const MaskPlan&,
                                                                    cudaStream_t);

}  // namespace jzyfa
