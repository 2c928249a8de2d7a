// Launch planning for the forward kernel: validation, TMA tensor maps, the persistent grid,
// and the explicit instantiations (bf16/f16 x head dims 64, 128, 256 and MLA's (192, 128), plain
// and windowed).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "flash_fwd.h"
#include "flash_fwd_kernel.cuh"
#include "launch_utils.h"

namespace jzyfa {
namespace {

// The plain kernel, the sliding-window one, or MLA's (two head dims), plain or windowed; with other
// than the tile's default key block, FlashFwdWideKernel (no mask).
template <typename Element, int kHeadDimQK, int kHeadDimV, bool kWindow, int kBlockN>
constexpr auto ForwardKernel() {
  if constexpr (kBlockN != FwdTile<kHeadDimQK, kHeadDimV>::kBlockN) {
    static_assert(!kWindow && kHeadDimQK == kHeadDimV, "wide key blocks: the plain kernel only");
    return FlashFwdWideKernel<Element, kHeadDimQK, kBlockN>;
  } else if constexpr (kWindow && kHeadDimQK != kHeadDimV) {
    return FlashFwdMlaVariantKernel<Element, kHeadDimQK, kHeadDimV, WindowedArgs<FwdArgs>>;
  } else if constexpr (kWindow) {
    return FlashFwdWindowKernel<Element, kHeadDimQK>;
  } else if constexpr (kHeadDimQK != kHeadDimV) {
    return FlashFwdMlaKernel<Element, kHeadDimQK, kHeadDimV>;
  } else {
    return FlashFwdKernel<Element, kHeadDimQK>;
  }
}

// q and k have head dim kHeadDimQK, v and out kHeadDimV; kBlockN keys per block.
template <typename Element, int kHeadDimQK, int kHeadDimV, bool kWindow,
          int kBlockN = FwdTile<kHeadDimQK, kHeadDimV>::kBlockN>
std::string Launch(const FlashFwdParams& p, const MaskPlan& mask, cudaStream_t stream) {
  using Tile = FwdTile<kHeadDimQK, kHeadDimV, kBlockN>;
  if constexpr (!Tile::kFitsSharedMemory) {
    // Not instantiated: MLA in builds with -DJZYFA_KV_STAGES=3 (FwdTile).
    (void)p, (void)mask, (void)stream;
    return TileTooLarge<Tile>(kHeadDimQK, kHeadDimV, Tile::kEpilogueTma);
  } else {
    constexpr auto kernel = ForwardKernel<Element, kHeadDimQK, kHeadDimV, kWindow, kBlockN>();
    const DeviceInfo* info = nullptr;
    std::string error = PrepareLaunch<kernel>(Tile::kDynamicSmemBytes, &info);
    if (!error.empty()) return error;

    const bool bf16 = p.element_type == ElementType::kBF16;
    CUtensorMap tmap_q, tmap_k, tmap_v;
    if (!EncodeRowMap16(&tmap_q, p.q, bf16, p.batch, p.seqlen_q, p.heads_q, kHeadDimQK,
                        Tile::kRowsPerConsumer, &error) ||
        !EncodeRowMap16(&tmap_k, p.k, bf16, p.batch, p.seqlen_k, p.heads_kv, kHeadDimQK,
                        Tile::kBlockN, &error) ||
        !EncodeRowMap16(&tmap_v, p.v, bf16, p.batch, p.seqlen_k, p.heads_kv, kHeadDimV,
                        Tile::kBlockN, &error)) {
      return error;
    }
#if JZYFA_EPILOGUE_TMA
    // O is stored in Q's boxes (64 rows), v's head dim wide, by the tiles with the TMA-store
    // epilogue (FwdTile::kEpilogueTma); the others take the map as an unused last argument.
    CUtensorMap tmap_o;
    if (!EncodeRowMap16(&tmap_o, p.out, bf16, p.batch, p.seqlen_q, p.heads_q, kHeadDimV,
                        Tile::kRowsPerConsumer, &error)) {
      return error;
    }
#endif
    std::conditional_t<kWindow, WindowedArgs<FwdArgs>, FwdArgs> args;
    args.out = p.out;
    args.lse = p.lse;
    args.tile_counter = p.tile_counter;
    SetTileGeometry(args, p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, mask.causal,
                    Tile::kBlockM);
    args.scale_log2 = p.softmax_scale * 1.4426950408889634f;
    SetWindowArgs(args, mask.window_left, mask.window_right);
    SetTileGroups(args, info->sm_count, mask.window_left, mask.window_right, Tile::kBlockM);

    // Persistent: CTA i starts on tile i and claims the rest from the counter.
    int grid = 0;
    error = StartTileQueue(p.tile_counter, args.num_tiles, info->sm_count, stream, &grid);
    if (!error.empty()) return error;
    kernel<<<grid, Tile::kThreads, Tile::kDynamicSmemBytes, stream>>>(tmap_q, tmap_k, tmap_v, args
#if JZYFA_EPILOGUE_TMA
                                                                       , tmap_o
#endif
    );
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return CudaError("launching the jzyfa forward kernel", err);
    return "";
  }
}

}  // namespace

std::string CheckHeadDims(int64_t head_dim, int64_t head_dim_v, const std::string& kernel) {
  const bool mla = head_dim == kMlaHeadDimQK && head_dim_v == kMlaHeadDimV;
  const bool equal =
      (head_dim == 64 || head_dim == 128 || head_dim == 256) && head_dim_v == head_dim;
  if (mla || equal) return "";
  return "head_dim must be 64, 128 or 256 for " + kernel +
         " (q, k and v alike), or 192 for q and k with 128 for v (MLA); got " +
         std::to_string(head_dim) + " for q and k, " + std::to_string(head_dim_v) + " for v";
}

std::string ValidateFlashFwd(const FlashFwdParams& p) {
  if (p.batch < 1 || p.seqlen_q < 1 || p.seqlen_k < 1 || p.heads_q < 1 || p.heads_kv < 1) {
    return "q, k and v need batch, sequence and head counts of at least 1";
  }
  std::string error = CheckHeadDims(p.head_dim, p.head_dim_v, "the jzyfa kernel");
  if (!error.empty()) return error;
  if (p.heads_q % p.heads_kv != 0) {
    return "heads of q (" + std::to_string(p.heads_q) + ") must be a multiple of heads of k/v (" +
           std::to_string(p.heads_kv) + ")";
  }
  // Tile indices are int32, with room for a grid's worth of claims past the last tile.
  if (p.batch > 65535) return "batch must be at most 65535, got " + std::to_string(p.batch);
  if (p.seqlen_q > 65535 * 128) {
    return "seqlen_q must be at most " + std::to_string(65535 * 128);
  }
  const int64_t tiles = p.batch * ((p.seqlen_q + 127) / 128) * p.heads_q;
  if (tiles > (int64_t{1} << 30)) {
    return "batch x ceil(seqlen_q / 128) x heads_q must be at most 2^30, got " +
           std::to_string(tiles);
  }
  if (p.tile_counter == nullptr) return "the tile counter scratch buffer is missing";
  if (p.seqlen_k > (int64_t{1} << 30) || p.heads_q > (int64_t{1} << 30)) {
    return "seqlen_k and heads must be at most 2^30";
  }
  if (!(p.softmax_scale > 0.f) || !std::isfinite(p.softmax_scale)) {
    return "softmax_scale must be a positive finite number";
  }
  MaskPlan mask;
  return ResolveMask(p.causal, p.window_left, p.window_right, p.seqlen_q, p.seqlen_k, &mask);
}

std::string ResolveMask(bool causal, int64_t left, int64_t right, int64_t seqlen_q,
                        int64_t seqlen_k, MaskPlan* plan) {
  if (left < -1 || right < -1) {
    return "window_left and window_right must be >= 0, or -1 for unbounded; got (" +
           std::to_string(left) + ", " + std::to_string(right) + ")";
  }
  *plan = MaskPlan();
  if (left == -1 && right == -1) {  // no window: the mask is `causal`'s
    plan->causal = causal;
    return "";
  }
  if (causal) right = 0;
  if (left >= seqlen_k - 1) left = -1;
  if (right >= seqlen_q - 1) right = -1;
  if (left < 0 && right <= 0) {
    plan->causal = right == 0;
  } else {
    // The windowed kernels' positions, keys and bounds stay below 2^30 in magnitude (int32 masks).
    if (seqlen_q + seqlen_k > (int64_t{1} << 30)) {
      return "sliding windows need seqlen_q + seqlen_k <= 2^30, got " +
             std::to_string(seqlen_q + seqlen_k);
    }
    plan->windowed = true;
    plan->window_left = static_cast<int>(left);  // < seqlen_k <= 2^30
    plan->window_right = static_cast<int>(right);
  }
  return "";
}

std::string CheckDeviceSupport() {
  int device = 0;
  std::string error = CurrentDevice(&device);
  return error.empty() ? GetDeviceInfo(device).error : error;
}

std::string LaunchFlashFwd(const FlashFwdParams& p, cudaStream_t stream) {
  std::string error = ValidateFlashFwd(p);
  if (!error.empty()) return error;
  MaskPlan mask;
  error = ResolveMask(p.causal, p.window_left, p.window_right, p.seqlen_q, p.seqlen_k, &mask);
  if (!error.empty()) return error;
  const bool bf16 = p.element_type == ElementType::kBF16;
  if (mask.windowed) {
    if (p.head_dim == kMlaHeadDimQK) {  // head_dim_v is kMlaHeadDimV (ValidateFlashFwd)
      return bf16 ? Launch<__nv_bfloat16, kMlaHeadDimQK, kMlaHeadDimV, true>(p, mask, stream)
                  : Launch<__half, kMlaHeadDimQK, kMlaHeadDimV, true>(p, mask, stream);
    }
    if (p.head_dim == 64) {
      return bf16 ? Launch<__nv_bfloat16, 64, 64, true>(p, mask, stream)
                  : Launch<__half, 64, 64, true>(p, mask, stream);
    }
    if (p.head_dim == 256) {
      return bf16 ? Launch<__nv_bfloat16, 256, 256, true>(p, mask, stream)
                  : Launch<__half, 256, 256, true>(p, mask, stream);
    }
    return bf16 ? Launch<__nv_bfloat16, 128, 128, true>(p, mask, stream)
                : Launch<__half, 128, 128, true>(p, mask, stream);
  }
  if (p.head_dim == kMlaHeadDimQK) {
    return bf16 ? Launch<__nv_bfloat16, kMlaHeadDimQK, kMlaHeadDimV, false>(p, mask, stream)
                : Launch<__half, kMlaHeadDimQK, kMlaHeadDimV, false>(p, mask, stream);
  }
  if (p.head_dim == 64) {
    return bf16 ? Launch<__nv_bfloat16, 64, 64, false>(p, mask, stream)
                : Launch<__half, 64, 64, false>(p, mask, stream);
  }
  if (p.head_dim == 256) {  // JZYFA_HD256_BLOCK_N keys per block
    return bf16 ? Launch<__nv_bfloat16, 256, 256, false, JZYFA_HD256_BLOCK_N>(p, mask, stream)
                : Launch<__half, 256, 256, false, JZYFA_HD256_BLOCK_N>(p, mask, stream);
  }
  if (!mask.causal) {  // no mask: JZYFA_NOMASK_BLOCK_N keys per block
    return bf16 ? Launch<__nv_bfloat16, 128, 128, false, JZYFA_NOMASK_BLOCK_N>(p, mask, stream)
                : Launch<__half, 128, 128, false, JZYFA_NOMASK_BLOCK_N>(p, mask, stream);
  }
  return bf16 ? Launch<__nv_bfloat16, 128, 128, false>(p, mask, stream)
              : Launch<__half, 128, 128, false>(p, mask, stream);
}

std::string ReadFlashFwdTimeline(std::vector<uint64_t>* out) { return ReadTimeline(out); }

}  // namespace jzyfa
