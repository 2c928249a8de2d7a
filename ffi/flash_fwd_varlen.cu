// Launch planning for the 16-bit forward kernel over packed variable-length batches: validation,
// tensor maps over the packed tensors, the persistent grid, and the instantiations (bf16/f16 x
// head dim 64/128). The kernel is flash_fwd_kernel.cuh's, with VarlenFwdArgs.
//
// A TMA-store epilogue would write whole 64-row boxes, past a sequence's end into the next one,
// so the varlen kernel always stores O from registers, whatever the build picks for dense calls.
#undef JZYFA_EPILOGUE_TMA
#define JZYFA_EPILOGUE_TMA 0

#include <cuda.h>
#include <cuda_runtime.h>

#include <cmath>
#include <string>
#include <type_traits>

#include "flash_fwd.h"
#include "flash_fwd_kernel.cuh"
#include "launch_utils.h"

namespace jzyfa {
namespace {

// The plain varlen kernel, or the sliding-window one.
template <typename Element, int kHeadDim, bool kWindow>
constexpr auto VarlenKernel() {
  if constexpr (kWindow) {
    return FlashFwdVarlenWindowKernel<Element, kHeadDim>;
  } else {
    return FlashFwdVarlenKernel<Element, kHeadDim>;
  }
}

template <typename Element, int kHeadDim, bool kWindow>
std::string Launch(const FlashFwdVarlenParams& p, const MaskPlan& mask, cudaStream_t stream) {
  using Tile = FwdTile<kHeadDim>;
  constexpr auto kernel = VarlenKernel<Element, kHeadDim, kWindow>();
  const DeviceInfo* info = nullptr;
  std::string error = PrepareLaunch<kernel>(Tile::kDynamicSmemBytes, &info);
  if (!error.empty()) return error;

  CUtensorMap tmap_q, tmap_k, tmap_v;
  // Packed [total, heads, head_dim] tensors as batches of one; tokens past the end read as zeros.
  const bool bf16 = p.element_type == ElementType::kBF16;
  if (!EncodeRowMap16(&tmap_q, p.q, bf16, 1, p.total_q, p.heads_q, kHeadDim,
                      Tile::kRowsPerConsumer, &error) ||
      !EncodeRowMap16(&tmap_k, p.k, bf16, 1, p.total_k, p.heads_kv, kHeadDim, Tile::kBlockN,
                      &error) ||
      !EncodeRowMap16(&tmap_v, p.v, bf16, 1, p.total_k, p.heads_kv, kHeadDim, Tile::kBlockN,
                      &error)) {
    return error;
  }
  std::conditional_t<kWindow, WindowedArgs<VarlenFwdArgs>, VarlenFwdArgs> args;
  args.out = p.out;
  args.lse = p.lse;
  args.tile_counter = p.tile_counter;
  SetVarlenGeometry(args, p, mask.causal, Tile::kBlockM);  // with the tail "sequence"
  args.scale_log2 = p.softmax_scale * 1.4426950408889634f;
  if constexpr (kWindow) {
    args.window_left = mask.window_left;
    args.window_right = mask.window_right;
  }

  int grid = 0;
  error = StartTileQueue(p.tile_counter, args.num_tiles, info->sm_count, stream, &grid);
  if (!error.empty()) return error;
  kernel<<<grid, Tile::kThreads, Tile::kDynamicSmemBytes, stream>>>(tmap_q, tmap_k, tmap_v, args);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return CudaError("launching the jzyfa varlen forward kernel", err);
  return "";
}

}  // namespace

std::string ValidateFlashFwdVarlen(const FlashFwdVarlenParams& p) {
  if (p.num_seqs < 1) {
    return "cu_seqlens_q and cu_seqlens_k need at least 2 entries (num_seqs + 1), got " +
           std::to_string(p.num_seqs + 1);
  }
  if (p.total_q < 1 || p.total_k < 1) {
    return "q and k need at least one token (total_q = " + std::to_string(p.total_q) +
           ", total_k = " + std::to_string(p.total_k) + ")";
  }
  if (p.heads_q < 1 || p.heads_kv < 1) return "q, k and v need at least one head";
  if (p.max_seqlen_q < 1 || p.max_seqlen_k < 1) {
    return "max_seqlen_q and max_seqlen_k must be at least 1";
  }
  if (p.head_dim != 64 && p.head_dim != 128) {
    // Head dim 256 has a dense instantiation only (flash_fwd.cu), none built or tested for varlen.
    return "head_dim must be 64 or 128 for the jzyfa varlen kernel (256: dense batches only), " +
           std::string("got ") + std::to_string(p.head_dim);
  }
  if (p.heads_q % p.heads_kv != 0) {
    return "heads of q (" + std::to_string(p.heads_q) + ") must be a multiple of heads of k/v (" +
           std::to_string(p.heads_kv) + ")";
  }
  // Token indices, TMA coordinates and tile indices are int32, with room to spare.
  constexpr int64_t kLimit = int64_t{1} << 30;
  if (p.total_q > kLimit || p.total_k > kLimit || p.max_seqlen_q > kLimit ||
      p.max_seqlen_k > kLimit || p.heads_q > kLimit) {
    return "total_q, total_k, max_seqlen_q, max_seqlen_k and heads must be at most 2^30";
  }
  const int64_t tiles = (p.num_seqs + 1) * ((p.max_seqlen_q + 127) / 128) * p.heads_q;
  if (tiles > kLimit) {
    return "(num_seqs + 1) x ceil(max_seqlen_q / 128) x heads_q must be at most 2^30, got " +
           std::to_string(tiles);
  }
  if (p.cu_seqlens_q == nullptr || p.cu_seqlens_k == nullptr) return "cu_seqlens are missing";
  if (p.tile_counter == nullptr) return "the tile counter scratch buffer is missing";
  if (!(p.softmax_scale > 0.f) || !std::isfinite(p.softmax_scale)) {
    return "softmax_scale must be a positive finite number";
  }
  MaskPlan mask;
  const std::string error = ResolveMask(p.causal, p.window_left, p.window_right, p.max_seqlen_q,
                                        p.max_seqlen_k, &mask);
  if (!error.empty()) return error;
  // The windowed kernel's positions, keys and bounds stay below 2^30 in magnitude (int32 masks).
  if (mask.windowed && p.total_q + p.total_k > (int64_t{1} << 30)) {
    return "sliding windows need total_q + total_k <= 2^30, got " +
           std::to_string(p.total_q + p.total_k);
  }
  return "";
}

std::string LaunchFlashFwdVarlen(const FlashFwdVarlenParams& p, cudaStream_t stream) {
  std::string error = ValidateFlashFwdVarlen(p);
  if (!error.empty()) return error;
  // Bounds over the longest sequences: a bound that excludes no key of those excludes none of a
  // shorter one either. (Sequences longer than the maxima break the contract; they stay in range.)
  MaskPlan mask;
  error = ResolveMask(p.causal, p.window_left, p.window_right, p.max_seqlen_q, p.max_seqlen_k,
                      &mask);
  if (!error.empty()) return error;
  const bool bf16 = p.element_type == ElementType::kBF16;
  if (mask.windowed) {
    if (p.head_dim == 64) {
      return bf16 ? Launch<__nv_bfloat16, 64, true>(p, mask, stream)
                  : Launch<__half, 64, true>(p, mask, stream);
    }
    return bf16 ? Launch<__nv_bfloat16, 128, true>(p, mask, stream)
                : Launch<__half, 128, true>(p, mask, stream);
  }
  if (p.head_dim == 64) {
    return bf16 ? Launch<__nv_bfloat16, 64, false>(p, mask, stream)
                : Launch<__half, 64, false>(p, mask, stream);
  }
  return bf16 ? Launch<__nv_bfloat16, 128, false>(p, mask, stream)
              : Launch<__half, 128, false>(p, mask, stream);
}

}  // namespace jzyfa
