// The forward kernels: one __global__ template per argument kind over a mainloop (Fwd16Mainloop,
// Fp8Mainloop), instantiated by the launches (launch_fwd_16bit.cuh, launch_fwd_fp8.cuh) from the
// files of ffi/instantiations/. Dense calls pass O's tensor map last, for the tiles with the
// TMA-store epilogue (the others leave it unused); varlen calls store O from registers and take none.
#pragma once

#include <cuda.h>

namespace jzyfa {

template <typename Mainloop, typename Args>
__global__ void __launch_bounds__(Mainloop::kThreads, 1)
    FwdKernel(const __grid_constant__ CUtensorMap tmap_q, const __grid_constant__ CUtensorMap tmap_k,
              const __grid_constant__ CUtensorMap tmap_v, const Args args,
              const __grid_constant__ CUtensorMap tmap_o) {
  Mainloop::Run(tmap_q, tmap_k, tmap_v, &tmap_o, args);
}

template <typename Mainloop, typename Args>
__global__ void __launch_bounds__(Mainloop::kThreads, 1)
    FwdVarlenKernel(const __grid_constant__ CUtensorMap tmap_q,
                    const __grid_constant__ CUtensorMap tmap_k,
                    const __grid_constant__ CUtensorMap tmap_v, const Args args) {
  Mainloop::Run(tmap_q, tmap_k, tmap_v, nullptr, args);
}

}  // namespace jzyfa
