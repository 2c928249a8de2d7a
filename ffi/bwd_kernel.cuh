// The backward's two __global__ kernels over their tile loops (flash_bwd_dkdv.cuh, flash_bwd_dq.cuh).
#pragma once

#include "flash_bwd_dkdv.cuh"
#include "flash_bwd_dq.cuh"

namespace jzyfa {

template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(BwdDkdvTile<kHeadDim>::Base::kThreads, 1) BwdDkdvKernel(const BwdArgs args) {
  BwdDkdvTiles<Element, kHeadDim>(args);
}

template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(BwdDqTile<kHeadDim>::Base::kThreads, 1) BwdDqKernel(const BwdArgs args) {
  BwdDqTiles<Element, kHeadDim>(args);
}

}  // namespace jzyfa
