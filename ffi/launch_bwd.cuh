// The backward launch of one head dim: zero both tile counters (and, varlen, the gradients), then the
// dK/dV kernel and the dQ kernel on the same stream (independent of each other; both read only the
// inputs).
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "bwd_kernel.cuh"
#include "dispatch.h"
#include "flash_bwd.h"
#include "launch_utils.h"

namespace jzyfa {

template <typename Element, int kHeadDim>
std::string LaunchBwdTyped(const BwdParams& p, const MaskPlan& mask, cudaStream_t stream) {
  using DkdvTile = BwdDkdvTile<kHeadDim>;
  using DqTile = BwdDqTile<kHeadDim>;
  constexpr auto dkdv_kernel = BwdDkdvKernel<Element, kHeadDim>;
  constexpr auto dq_kernel = BwdDqKernel<Element, kHeadDim>;
  BwdArgs args{};
  args.q = p.q;
  args.k = p.k;
  args.v = p.v;
  args.dout = p.dout;
  args.lse = p.lse;
  args.delta = p.delta;
  args.dq = p.dq;
  args.dk = p.dk;
  args.dv = p.dv;
  args.tile_counter = p.tile_counters;
  args.batch = static_cast<int>(p.batch);
  args.seqlen_q = static_cast<int>(p.seqlen_q);
  args.seqlen_k = static_cast<int>(p.seqlen_k);
  args.heads_q = static_cast<int>(p.heads_q);
  args.heads_kv = static_cast<int>(p.heads_kv);
  args.cu_seqlens_q = p.cu_seqlens_q;
  args.cu_seqlens_k = p.cu_seqlens_k;
  args.total_q = static_cast<int>(p.total_q);
  args.scale = p.softmax_scale;
  args.scale_log2 = p.softmax_scale * 1.4426950408889634f;
  // The resolved mask as window sides: none (-1, -1), causal (-1, 0) or a window.
  const bool windowed = mask.windowed;
  args.window_left = windowed && mask.window_left >= 0 ? mask.window_left : kBwdNoBound;
  args.window_right = windowed ? (mask.window_right >= 0 ? mask.window_right : kBwdNoBound)
                               : (mask.causal ? 0 : kBwdNoBound);

  const DeviceInfo* info = nullptr;
  std::string error = PrepareLaunch<dkdv_kernel>(DkdvTile::kDynamicSmemBytes, &info);
  if (!error.empty()) return error;
  error = PrepareLaunch<dq_kernel>(DqTile::kDynamicSmemBytes, &info);
  if (!error.empty()) return error;

  if (p.varlen) {
    // Tokens outside every sequence (after cu_seqlens[num_seqs], before cu_seqlens[0]) belong to no
    // tile: their gradients are 0. The kernels overwrite every token of a sequence.
    const size_t q_bytes = static_cast<size_t>(p.total_q * p.heads_q * kHeadDim) * sizeof(Element);
    const size_t kv_bytes = static_cast<size_t>(p.total_k * p.heads_kv * kHeadDim) * sizeof(Element);
    for (auto [ptr, bytes] : {std::pair{p.dq, q_bytes}, {p.dk, kv_bytes}, {p.dv, kv_bytes}}) {
      cudaError_t err = cudaMemsetAsync(ptr, 0, bytes, stream);
      if (err != cudaSuccess) return CudaError("zeroing the varlen gradients", err);
    }
  }
  BwdArgs dkdv = args;
  dkdv.num_tiles = static_cast<int>((p.seqlen_k + DkdvTile::kBlockN - 1) / DkdvTile::kBlockN *
                                    p.batch * p.heads_kv);
  int grid = 0;
  error = StartTileQueue(p.tile_counters, dkdv.num_tiles, info->sm_count, stream, &grid);
  if (!error.empty()) return error;
  if (grid > 0) {
    dkdv_kernel<<<grid, DkdvTile::Base::kThreads, DkdvTile::kDynamicSmemBytes, stream>>>(dkdv);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return CudaError("launching the dK/dV kernel", err);
  }
  BwdArgs dq = args;
  dq.num_tiles = static_cast<int>((p.seqlen_q + DqTile::kBlockM - 1) / DqTile::kBlockM * p.batch *
                                  p.heads_q);
  error = StartTileQueue(p.tile_counters + 1, dq.num_tiles, info->sm_count, stream, &grid);
  if (!error.empty()) return error;
  if (grid > 0) {
    dq_kernel<<<grid, DqTile::Base::kThreads, DqTile::kDynamicSmemBytes, stream>>>(dq);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return CudaError("launching the dQ kernel", err);
  }
  return "";
}

template <int kHeadDim>
std::string LaunchBwdInstance(const BwdParams& p, const MaskPlan& mask, cudaStream_t stream) {
  return p.element_type == ElementType::kBF16
             ? LaunchBwdTyped<__nv_bfloat16, kHeadDim>(p, mask, stream)
             : LaunchBwdTyped<__half, kHeadDim>(p, mask, stream);
}

}  // namespace jzyfa
