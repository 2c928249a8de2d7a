// The backward instantiations of one group of kBwdKernels (16bit, head dim 64, dense): causal and no
// mask, bf16 and f16.
#include "launch_bwd.cuh"

namespace jzyfa {

template std::string LaunchBwdInstance<64>(const BwdParams&, const MaskPlan&, cudaStream_t);

}  // namespace jzyfa
