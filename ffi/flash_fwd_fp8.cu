// Launch planning for the FP8 forward kernel: validation, tensor maps (Q, K and V as bytes),
// the persistent grid, and the instantiations (lean P, exact P; each plain and sliding-window).
#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "flash_fwd.h"
#include "flash_fwd_fp8_kernel.cuh"
#include "launch_utils.h"

namespace jzyfa {
namespace {

// The plain kernel, or the sliding-window one.
template <bool kLeanP, bool kWindow>
constexpr auto Fp8ForwardKernel() {
  if constexpr (kWindow) {
    return FlashFwdFp8WindowKernel<kLeanP>;
  } else {
    return FlashFwdFp8Kernel<kLeanP>;
  }
}

template <bool kLeanP, bool kWindow>
std::string Launch(const FlashFwdFp8Params& p, const MaskPlan& mask, cudaStream_t stream) {
  using Tile = Fp8Tile;
  constexpr auto kernel = Fp8ForwardKernel<kLeanP, kWindow>();
  const DeviceInfo* info = nullptr;
  std::string error = PrepareLaunch<kernel>(Tile::kDynamicSmemBytes, &info);
  if (!error.empty()) return error;

  CUtensorMap tmap_q, tmap_k, tmap_v;
  // Q, K and V as bytes, boxes of the whole head dim (128 bytes) x the rows; V unswizzled (the
  // kernel's staging buffer, transposed into V^T in shared memory: fp8_value_transpose.cuh).
  constexpr auto kBytes = CU_TENSOR_MAP_DATA_TYPE_UINT8;
  constexpr int kD = Tile::kHeadDim;
  if (!EncodeRowMap(&tmap_q, p.q, kBytes, 1, p.batch, p.seqlen_q, p.heads_q, kD, kD,
                    Tile::kRowsPerConsumer, &error) ||
      !EncodeRowMap(&tmap_k, p.k, kBytes, 1, p.batch, p.seqlen_k, p.heads_kv, kD, kD,
                    Tile::kBlockN, &error) ||
      !EncodeRowMap(&tmap_v, p.v, kBytes, 1, p.batch, p.seqlen_k, p.heads_kv, kD, kD,
                    Tile::kBlockN, &error, CU_TENSOR_MAP_SWIZZLE_NONE)) {
    return error;
  }
  std::conditional_t<kWindow, WindowedArgs<Fp8Args>, Fp8Args> args;
  args.out = static_cast<__nv_bfloat16*>(p.out);
  args.lse = p.lse;
  args.tile_counter = p.tile_counter;
  SetDescaleArgs(args, p);
  SetTileGeometry(args, p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, mask.causal,
                  Tile::kBlockM);
  // Rounded to float32 once, here, as jzyfa.fp8_emulation.scale_log2 does.
  args.scale_log2 = static_cast<float>(static_cast<double>(p.softmax_scale) * 1.4426950408889634);
  SetWindowArgs(args, mask.window_left, mask.window_right);

  int grid = 0;
  error = StartTileQueue(p.tile_counter, args.num_tiles, info->sm_count, stream, &grid);
  if (!error.empty()) return error;
  kernel<<<grid, Tile::kThreads, Tile::kDynamicSmemBytes, stream>>>(tmap_q, tmap_k, tmap_v, args);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return CudaError("launching the jzyfa FP8 forward kernel", err);
  return "";
}

}  // namespace

std::string ValidateFlashFwdFp8(const FlashFwdFp8Params& p) {
  if (p.batch < 1 || p.seqlen_q < 1 || p.seqlen_k < 1 || p.heads_q < 1 || p.heads_kv < 1) {
    return "q, k and v need batch, sequence and head counts of at least 1";
  }
  if (p.head_dim != Fp8Tile::kHeadDim) {
    return "head_dim must be 128 for the jzyfa FP8 kernel, got " + std::to_string(p.head_dim);
  }
  if (p.heads_q % p.heads_kv != 0) {
    return "heads of q (" + std::to_string(p.heads_q) + ") must be a multiple of heads of k/v (" +
           std::to_string(p.heads_kv) + ")";
  }
  if (p.descale_count != 1 && p.descale_count != p.batch * p.heads_kv) {
    return "descales must hold 1 or batch * heads_kv (" + std::to_string(p.batch * p.heads_kv) +
           ") values, got " + std::to_string(p.descale_count);
  }
  if (p.batch > 65535 || p.seqlen_q > 65535 * 128 || p.seqlen_k > (int64_t{1} << 30) ||
      p.heads_q > (int64_t{1} << 30)) {
    return "batch must be at most 65535, seqlen_q at most 65535 * 128, seqlen_k and heads at "
           "most 2^30";
  }
  const int64_t tiles = p.batch * ((p.seqlen_q + 127) / 128) * p.heads_q;
  if (tiles > (int64_t{1} << 30)) {
    return "batch x ceil(seqlen_q / 128) x heads_q must be at most 2^30, got " +
           std::to_string(tiles);
  }
  if (p.tile_counter == nullptr) return "the tile counter scratch buffer is missing";
  if (!(p.softmax_scale > 0.f) || !std::isfinite(p.softmax_scale)) {
    return "softmax_scale must be a positive finite number";
  }
  MaskPlan mask;
  const std::string error =
      ResolveMask(p.causal, p.window_left, p.window_right, p.seqlen_q, p.seqlen_k, &mask);
  if (!error.empty()) return error;
  return "";
}

std::string LaunchFlashFwdFp8(const FlashFwdFp8Params& p, cudaStream_t stream) {
  std::string error = ValidateFlashFwdFp8(p);
  if (!error.empty()) return error;
  MaskPlan mask;
  error = ResolveMask(p.causal, p.window_left, p.window_right, p.seqlen_q, p.seqlen_k, &mask);
  if (!error.empty()) return error;
  if (mask.windowed) {
    return p.lean_p ? Launch<true, true>(p, mask, stream) : Launch<false, true>(p, mask, stream);
  }
  return p.lean_p ? Launch<true, false>(p, mask, stream) : Launch<false, false>(p, mask, stream);
}

std::string ReadFlashFwdFp8Timeline(std::vector<uint64_t>* out) { return ReadTimeline(out); }

}  // namespace jzyfa
