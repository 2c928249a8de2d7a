// The backward instantiation of head dim 256 (kBwdKernels' two groups of it: dense and varlen, the
// layout being a runtime argument), every mask, bf16 and f16.
#include "launch_bwd.cuh"

namespace jzyfa {

template std::string LaunchBwdInstance<256, 256>(const BwdParams&, const MaskPlan&, cudaStream_t);

}  // namespace jzyfa
