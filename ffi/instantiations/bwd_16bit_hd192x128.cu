// The backward instantiation of MLA's head dims, q and k 192, v 128 (kBwdKernels' two groups of them:
// dense and varlen, the layout being a runtime argument), every mask, bf16 and f16.
#include "launch_bwd.cuh"

namespace jzyfa {

template std::string LaunchBwdInstance<kMlaHeadDimQK, kMlaHeadDimV>(const BwdParams&, const MaskPlan&,
                                                                    cudaStream_t);

}  // namespace jzyfa
