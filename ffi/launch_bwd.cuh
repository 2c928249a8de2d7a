// The backward launch of one head dim: the tensor maps, the varlen gradients zeroed, then the dK/dV
// kernel and the dQ kernel on the same stream (independent of each other; both read only the inputs),
// each on a persistent grid with its own tile counter.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "bwd_kernel.cuh"
#include "dispatch.h"
#include "flash_bwd.h"
#include "launch_utils.h"

namespace jzyfa {

// One backward kernel on its persistent grid (its tile counter zeroed first).
template <typename Mainloop, typename Args>
std::string LaunchBwdKernel(const CUtensorMap (&maps)[4], const Args& args, const char* what,
                            cudaStream_t stream) {
  constexpr auto kernel = BwdKernel<Mainloop, Args>;
  constexpr int kSmem = Mainloop::Tile::kDynamicSmemBytes;
  const DeviceInfo* info = nullptr;
  std::string error = PrepareLaunch<kernel>(kSmem, &info);
  if (!error.empty()) return error;
  int grid = 0;
  error = StartTileQueue(args.tile_counter, args.num_tiles, info->sm_count, stream, &grid);
  if (!error.empty() || grid == 0) return error;
  kernel<<<grid, Mainloop::kThreads, kSmem, stream>>>(maps[0], maps[1], maps[2], maps[3], args);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? "" : CudaError(what, err);
}

template <typename Element, int kHeadDimQK, int kHeadDimV>
std::string LaunchBwdTyped(const BwdParams& p, const MaskPlan& mask, cudaStream_t stream) {
  using DkdvMainloop = BwdDkdvMainloop<Element, kHeadDimQK, kHeadDimV>;
  using DqMainloop = BwdDqMainloop<Element, kHeadDimQK, kHeadDimV>;
  BwdArgs args{};
  args.lse = p.lse;
  args.delta = p.delta;
  args.dq = p.dq;
  args.dk = p.dk;
  args.dv = p.dv;
  args.batch = static_cast<int>(p.batch);
  args.seqlen_q = static_cast<int>(p.seqlen_q);
  args.seqlen_k = static_cast<int>(p.seqlen_k);
  args.heads_q = static_cast<int>(p.heads_q);
  args.heads_kv = static_cast<int>(p.heads_kv);
  args.cu_seqlens_q = p.cu_seqlens_q;
  args.cu_seqlens_k = p.cu_seqlens_k;
  args.total_q = static_cast<int>(p.total_q);
  args.scale = p.softmax_scale;
  // Softcap c: P from t = tanh(s / c) with c log2(e) as the scale, as in the forward (softcap.cuh).
  const SoftcapScales scales = SoftcapScalesOf(p.softmax_scale, p.softcap);
  args.scale_log2 = scales.scale_log2;
  args.softcap_tanh_scale = scales.tanh_scale;
  // The resolved mask as window sides: none (-1, -1), causal (-1, 0) or a window.
  const bool windowed = mask.windowed;
  args.window_left = windowed && mask.window_left >= 0 ? mask.window_left : kBwdNoBound;
  args.window_right = windowed ? (mask.window_right >= 0 ? mask.window_right : kBwdNoBound)
                               : (mask.causal ? 0 : kBwdNoBound);

  // Tensor maps in boxes of 64 rows x 64 columns: dense [B, S, H, D]; a varlen pack one batch of
  // its total tokens.
  const bool bf16 = p.element_type == ElementType::kBF16;
  const int64_t map_batch = p.varlen ? 1 : p.batch;
  const int64_t rows_q = p.varlen ? p.total_q : p.seqlen_q, rows_k = p.varlen ? p.total_k : p.seqlen_k;
  CUtensorMap maps[4];  // q, k, v, dout
  std::string error;
  if (!EncodeRowMap16(&maps[0], p.q, bf16, map_batch, rows_q, p.heads_q, kHeadDimQK, 64, &error) ||
      !EncodeRowMap16(&maps[1], p.k, bf16, map_batch, rows_k, p.heads_kv, kHeadDimQK, 64, &error) ||
      !EncodeRowMap16(&maps[2], p.v, bf16, map_batch, rows_k, p.heads_kv, kHeadDimV, 64, &error) ||
      !EncodeRowMap16(&maps[3], p.dout, bf16, map_batch, rows_q, p.heads_q, kHeadDimV, 64, &error)) {
    return error;
  }

  if (p.varlen) {
    // Tokens outside every sequence (after cu_seqlens[num_seqs], before cu_seqlens[0]) belong to no
    // tile: their gradients are 0. The kernels overwrite every token of a sequence.
    const size_t q_bytes = static_cast<size_t>(p.total_q * p.heads_q * kHeadDimQK) * sizeof(Element);
    const size_t k_bytes = static_cast<size_t>(p.total_k * p.heads_kv * kHeadDimQK) * sizeof(Element);
    const size_t v_bytes = static_cast<size_t>(p.total_k * p.heads_kv * kHeadDimV) * sizeof(Element);
    for (auto [ptr, bytes] : {std::pair{p.dq, q_bytes}, {p.dk, k_bytes}, {p.dv, v_bytes}}) {
      cudaError_t err = cudaMemsetAsync(ptr, 0, bytes, stream);
      if (err != cudaSuccess) return CudaError("zeroing the varlen gradients", err);
    }
  }
  BwdDkdvArgs dkdv{args};
  dkdv.tile_counter = p.tile_counters;
  constexpr int kKeysPerTile = DkdvMainloop::Tile::kBlockM;
  dkdv.num_tiles = static_cast<int>((p.seqlen_k + kKeysPerTile - 1) / kKeysPerTile * p.batch * p.heads_kv);
  error = LaunchBwdKernel<DkdvMainloop>(maps, dkdv, "launching the dK/dV kernel", stream);
  if (!error.empty()) return error;
  BwdDqArgs dq{args};
  dq.tile_counter = p.tile_counters + 1;
  constexpr int kRowsPerTile = DqMainloop::Tile::kBlockM;
  dq.m_tiles = static_cast<int>((p.seqlen_q + kRowsPerTile - 1) / kRowsPerTile);
  dq.num_tiles = static_cast<int>(dq.m_tiles * p.batch * p.heads_q);
  return LaunchBwdKernel<DqMainloop>(maps, dq, "launching the dQ kernel", stream);
}

template <int kHeadDimQK, int kHeadDimV>
std::string LaunchBwdInstance(const BwdParams& p, const MaskPlan& mask, cudaStream_t stream) {
  return p.element_type == ElementType::kBF16
             ? LaunchBwdTyped<__nv_bfloat16, kHeadDimQK, kHeadDimV>(p, mask, stream)
             : LaunchBwdTyped<__half, kHeadDimQK, kHeadDimV>(p, mask, stream);
}

}  // namespace jzyfa
