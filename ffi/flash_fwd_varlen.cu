// Launch planning for the 16-bit forward kernel over packed variable-length batches: validation,
// tensor maps over the packed tensors, the persistent grid, and the instantiations (bf16/f16 x
// head dims 64, 128, 256 and MLA's (192, 128), plain and windowed). The kernel is
// flash_fwd_kernel.cuh's, with VarlenFwdArgs.
//
// A TMA-store epilogue would write whole 64-row boxes, past a sequence's end into the next one,
// so the varlen kernel always stores O from registers, whatever the build picks for dense calls.
#undef JZYFA_EPILOGUE_TMA
#define JZYFA_EPILOGUE_TMA 0
// One Q buffer whatever the build asks for dense calls: with two (JZYFA_Q_PREFETCH), ptxas 13.0
// spilled in the varlen consumers.
#undef JZYFA_Q_PREFETCH
#define JZYFA_Q_PREFETCH 0

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

// The plain varlen kernel, or the sliding-window one; MLA's (two head dims), either.
template <typename Element, int kHeadDimQK, int kHeadDimV, bool kWindow>
constexpr auto VarlenKernel() {
  using Args = std::conditional_t<kWindow, WindowedArgs<VarlenFwdArgs>, VarlenFwdArgs>;
  if constexpr (kHeadDimQK != kHeadDimV) {
    return FlashFwdMlaVariantKernel<Element, kHeadDimQK, kHeadDimV, Args>;
  } else if constexpr (kWindow) {
    return FlashFwdVarlenWindowKernel<Element, kHeadDimQK>;
  } else {
    return FlashFwdVarlenKernel<Element, kHeadDimQK>;
  }
}

// One instantiation's launch (its tile fits in shared memory).
template <typename Element, int kHeadDimQK, int kHeadDimV, bool kWindow>
std::string LaunchTile(const FlashFwdVarlenParams& p, const MaskPlan& mask, cudaStream_t stream) {
  using Tile = FwdTile<kHeadDimQK, kHeadDimV>;
  constexpr auto kernel = VarlenKernel<Element, kHeadDimQK, kHeadDimV, kWindow>();
  const DeviceInfo* info = nullptr;
  std::string error = PrepareLaunch<kernel>(Tile::kDynamicSmemBytes, &info);
  if (!error.empty()) return error;

  CUtensorMap tmap_q, tmap_k, tmap_v;
  // Packed [total, heads, head_dim] tensors as batches of one; tokens past the end read as zeros.
  const bool bf16 = p.element_type == ElementType::kBF16;
  if (!EncodeRowMap16(&tmap_q, p.q, bf16, 1, p.total_q, p.heads_q, kHeadDimQK,
                      Tile::kRowsPerConsumer, &error) ||
      !EncodeRowMap16(&tmap_k, p.k, bf16, 1, p.total_k, p.heads_kv, kHeadDimQK, Tile::kBlockN,
                      &error) ||
      !EncodeRowMap16(&tmap_v, p.v, bf16, 1, p.total_k, p.heads_kv, kHeadDimV, Tile::kBlockN,
                      &error)) {
    return error;
  }
  std::conditional_t<kWindow, WindowedArgs<VarlenFwdArgs>, VarlenFwdArgs> args;
  args.out = p.out;
  args.lse = p.lse;
  args.tile_counter = p.tile_counter;
  SetVarlenGeometry(args, p, mask.causal, Tile::kBlockM);  // with the tail "sequence"
  args.scale_log2 = p.softmax_scale * 1.4426950408889634f;
  SetWindowArgs(args, mask.window_left, mask.window_right);

  int grid = 0;
  error = StartTileQueue(p.tile_counter, args.num_tiles, info->sm_count, stream, &grid);
  if (!error.empty()) return error;
  kernel<<<grid, Tile::kThreads, Tile::kDynamicSmemBytes, stream>>>(tmap_q, tmap_k, tmap_v, args);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return CudaError("launching the jzyfa varlen forward kernel", err);
  return "";
}

// q and k have head dim kHeadDimQK, v and out kHeadDimV.
template <typename Element, int kHeadDimQK, int kHeadDimV, bool kWindow>
std::string Launch(const FlashFwdVarlenParams& p, const MaskPlan& mask, cudaStream_t stream) {
  using Tile = FwdTile<kHeadDimQK, kHeadDimV>;
  if constexpr (!Tile::kFitsSharedMemory) {
    // Not instantiated: MLA in builds with -DJZYFA_KV_STAGES=3 (FwdTile).
    (void)p, (void)mask, (void)stream;
    return TileTooLarge<Tile>(kHeadDimQK, kHeadDimV, JZYFA_EPILOGUE_TMA);
  } else {
    return LaunchTile<Element, kHeadDimQK, kHeadDimV, kWindow>(p, mask, stream);
  }
}

// The instantiation for the validated head dims and element type, plain or windowed.
template <bool kWindow>
std::string LaunchHeadDims(const FlashFwdVarlenParams& p, const MaskPlan& mask,
                           cudaStream_t stream) {
  const bool bf16 = p.element_type == ElementType::kBF16;
  switch (p.head_dim) {
    case 64:
      return bf16 ? Launch<__nv_bfloat16, 64, 64, kWindow>(p, mask, stream)
                  : Launch<__half, 64, 64, kWindow>(p, mask, stream);
    case 256:
      return bf16 ? Launch<__nv_bfloat16, 256, 256, kWindow>(p, mask, stream)
                  : Launch<__half, 256, 256, kWindow>(p, mask, stream);
    case kMlaHeadDimQK:  // head_dim_v is kMlaHeadDimV (ValidateFlashFwdVarlen)
      return bf16 ? Launch<__nv_bfloat16, kMlaHeadDimQK, kMlaHeadDimV, kWindow>(p, mask, stream)
                  : Launch<__half, kMlaHeadDimQK, kMlaHeadDimV, kWindow>(p, mask, stream);
    default:
      return bf16 ? Launch<__nv_bfloat16, 128, 128, kWindow>(p, mask, stream)
                  : Launch<__half, 128, 128, kWindow>(p, mask, stream);
  }
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
  const std::string head_dims = CheckHeadDims(p.head_dim, p.head_dim_v, "the jzyfa varlen kernel");
  if (!head_dims.empty()) return head_dims;
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
  return mask.windowed ? LaunchHeadDims<true>(p, mask, stream)
                       : LaunchHeadDims<false>(p, mask, stream);
}

}  // namespace jzyfa
