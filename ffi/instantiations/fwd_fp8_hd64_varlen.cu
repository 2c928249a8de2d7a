// The forward instantiations of one group of kFwdKernels (fp8, head dims (64, 64), varlen): every
// mask it serves.
#include "launch_fwd.cuh"

namespace jzyfa {

template std::string LaunchFwdInstance<Family::kFp8, 64, 64, Layout::kVarlen>(const FwdParams&,
                                                                    const MaskPlan&,
                                                                    cudaStream_t);

}  // namespace jzyfa
