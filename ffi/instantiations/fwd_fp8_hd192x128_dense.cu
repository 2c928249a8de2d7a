// The forward instantiations of kFwdKernels' rows (fp8, head dims (192, 128), dense), every mask.
#include "launch_fwd.cuh"

namespace jzyfa {

template std::string LaunchFwdInstance<Family::kFp8, 192, 128, Layout::kDense>(const FwdParams&,
                                                                      const MaskPlan&,
                                                                      cudaStream_t);

}  // namespace jzyfa
