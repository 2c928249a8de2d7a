// The forward kernels: one __global__ template per argument kind over a mainloop (Fwd16Mainloop,
// Fp8Mainloop), and the launch both families share (LaunchFwdKernel). Dense calls pass O's tensor map
// last, for the tiles with the TMA-store epilogue (the others leave it unused); varlen calls store O
// from registers and take none. The families' launches (launch_fwd_16bit.cuh, launch_fwd_fp8.cuh)
// give the tile, the Q/K/V maps and their own arguments; ffi/instantiations/ instantiates them.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "flash_fwd.h"
#include "flash_fwd_common.cuh"
#include "launch_utils.h"

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

template <typename Mainloop, typename Args>
constexpr auto FwdKernelFor() {
  if constexpr (kIsVarlen<Args>) {
    return FwdVarlenKernel<Mainloop, Args>;
  } else {
    return FwdKernel<Mainloop, Args>;
  }
}

// One launch: the kernel's shared-memory opt-in; Q's, K's and V's tensor maps from
// encode_qkv(batch, seq_q, seq_k, q, k, v, &error) (dense tensors [batch, seq, heads, D]; packed varlen
// ones as batches of one, tokens past the end reading as zeros) and, dense, O's in Q's boxes (64 rows,
// v's head dim wide); the arguments (set_args adds the family's own); the persistent grid (CTA i starts
// on tile i and claims the rest from the zeroed counter).
template <typename Mainloop, typename Tile, typename Args, typename EncodeQKV, typename SetArgs>
std::string LaunchFwdKernel(const FwdParams& p, const MaskPlan& mask, float scale_log2,
                            cudaStream_t stream, EncodeQKV&& encode_qkv, SetArgs&& set_args) {
  constexpr bool kVarlen = kIsVarlen<Args>;
  constexpr auto kernel = FwdKernelFor<Mainloop, Args>();
  const DeviceInfo* info = nullptr;
  std::string error = PrepareLaunch<kernel>(Tile::kDynamicSmemBytes, &info);
  if (!error.empty()) return error;

  CUtensorMap tmap_q, tmap_k, tmap_v, tmap_o;
  if (!encode_qkv(kVarlen ? 1 : p.batch, kVarlen ? p.total_q : p.seqlen_q,
                  kVarlen ? p.total_k : p.seqlen_k, &tmap_q, &tmap_k, &tmap_v, &error)) {
    return error;
  }
  if (!kVarlen && !EncodeRowMap16(&tmap_o, p.out, p.element_type != ElementType::kF16, p.batch,
                                  p.seqlen_q, p.heads_q, p.head_dim_v, Tile::kRowsPerConsumer,
                                  &error)) {
    return error;
  }
  Args args{};
  args.out = static_cast<decltype(args.out)>(p.out);
  args.lse = p.lse;
  args.tile_counter = p.tile_counter;
  if constexpr (kVarlen) {
    SetVarlenGeometry(args, p, mask.causal, Tile::kBlockM);  // with the tail "sequence"
  } else {
    SetTileGeometry(args, p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, mask.causal,
                    Tile::kBlockM);
    SetTileGroups(args, info->sm_count, mask.window_left, mask.window_right, Tile::kBlockM);
  }
  args.scale_log2 = scale_log2;
  SetWindowArgs(args, mask.window_left, mask.window_right);
  set_args(args);

  int grid = 0;
  error = StartTileQueue(p.tile_counter, args.num_tiles, info->sm_count, stream, &grid);
  if (!error.empty()) return error;
  if constexpr (kVarlen) {
    kernel<<<grid, Tile::kThreads, Tile::kDynamicSmemBytes, stream>>>(tmap_q, tmap_k, tmap_v, args);
  } else {
    kernel<<<grid, Tile::kThreads, Tile::kDynamicSmemBytes, stream>>>(tmap_q, tmap_k, tmap_v, args,
                                                                       tmap_o);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return CudaError("launching the jzyfa forward kernel", err);
  return "";
}

}  // namespace jzyfa
