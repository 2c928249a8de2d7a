// The backward's two __global__ kernels over their mainloops (flash_bwd_dkdv.cuh, flash_bwd_dq.cuh):
// the tensor maps of q, k, v and dO (launch_bwd.cuh) and the kernel's arguments.
#pragma once

#include <cuda.h>

#include "flash_bwd_dkdv.cuh"
#include "flash_bwd_dq.cuh"

namespace jzyfa {

template <typename Mainloop, typename Args>
__global__ void __launch_bounds__(Mainloop::kThreads, 1)
    BwdKernel(const __grid_constant__ CUtensorMap tmap_q, const __grid_constant__ CUtensorMap tmap_k,
              const __grid_constant__ CUtensorMap tmap_v, const __grid_constant__ CUtensorMap tmap_do,
              const Args args) {
  const CUtensorMap* const maps[4] = {&tmap_q, &tmap_k, &tmap_v, &tmap_do};
  if (threadIdx.x == 0) {
    for (const CUtensorMap* map : maps) ptx::prefetch_tensor_map(map);
  }
  Mainloop::Run(maps, args);
}

}  // namespace jzyfa
