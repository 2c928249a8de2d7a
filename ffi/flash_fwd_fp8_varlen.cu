// Launch planning for the FP8 kernel over packed variable-length batches: validation, tensor maps
// over the packed q, k and v (or the varlen V^T), the persistent grid, and the instantiations
// (plain and sliding-window, lean P; each with V as it is, transposed in the kernel, or V^T from
// jzyfa/fp8_layout.py's fp8_varlen_value_operand: FlashFwdFp8VarlenParams::v_transposed). The
// kernel is flash_fwd_fp8_kernel.cuh's, with Fp8VarlenArgs; the tile plan and the tail of tokens
// outside every sequence are the 16-bit varlen kernel's.
#include <cmath>
#include <string>
#include <type_traits>

#include "flash_fwd.h"
#include "flash_fwd_fp8_kernel.cuh"
#include "launch_utils.h"

namespace jzyfa {
namespace {

// The plain kernel, or the sliding-window one, for the tile's V source; lean P (the FP8 kernel's
// default) only.
template <typename Tile, bool kWindow>
constexpr auto Fp8VarlenKernel() {
  if constexpr (kWindow) {
    return FlashFwdFp8VarlenWindowKernel<true, Tile::kStagedV>;
  } else {
    return FlashFwdFp8VarlenKernel<true, Tile::kStagedV>;
  }
}

template <typename Tile, bool kWindow>
std::string Launch(const FlashFwdFp8VarlenParams& p, const MaskPlan& mask, cudaStream_t stream) {
  constexpr auto kernel = Fp8VarlenKernel<Tile, kWindow>();
  const DeviceInfo* info = nullptr;
  std::string error = PrepareLaunch<kernel>(Tile::kDynamicSmemBytes, &info);
  if (!error.empty()) return error;

  CUtensorMap tmap_q, tmap_k, tmap_v;
  // Packed q, k and v as bytes, batches of one; boxes of the whole head dim (128 bytes) x the rows;
  // v unswizzled (the kernel's staging buffer, transposed in shared memory). A tile's K and V boxes
  // start at its sequence's first key; keys past the sequence's end are the next one's (finite)
  // tokens or TMA's zeros, and masked.
  constexpr auto kBytes = CU_TENSOR_MAP_DATA_TYPE_UINT8;
  constexpr int kD = Tile::kHeadDim;
  if (!EncodeRowMap(&tmap_q, p.q, kBytes, 1, 1, p.total_q, p.heads_q, kD, kD,
                    Tile::kRowsPerConsumer, &error) ||
      !EncodeRowMap(&tmap_k, p.k, kBytes, 1, 1, p.total_k, p.heads_kv, kD, kD, Tile::kBlockN,
                    &error)) {
    return error;
  }
  if constexpr (Tile::kStagedV) {
    if (!EncodeRowMap(&tmap_v, p.v, kBytes, 1, 1, p.total_k, p.heads_kv, kD, kD, Tile::kBlockN,
                      &error, Tile::kVStagingSwizzle)) {
      return error;
    }
  } else {
    // V^T [1, heads_kv, 128, vt_keys]: boxes of 128 keys (contiguous) x the 128 head-dim rows; a
    // tile's boxes start at its sequence's column (Fp8VarlenValueColumn).
    if (!EncodeValueOperandMap(&tmap_v, p.v, 1, p.heads_kv, Tile::kHeadDim, p.vt_keys, Tile::kBlockN,
                               &error)) {
      return error;
    }
  }
  std::conditional_t<kWindow, WindowedArgs<Fp8VarlenArgs>, Fp8VarlenArgs> args;
  args.out = p.out;
  args.lse = p.lse;
  args.tile_counter = p.tile_counter;
  SetVarlenGeometry(args, p, mask.causal, Tile::kBlockM);  // with the tail "sequence"
  // Rounded to float32 once, here, as jzyfa.fp8_emulation.scale_log2 does (and the dense launch).
  args.scale_log2 = static_cast<float>(static_cast<double>(p.softmax_scale) * 1.4426950408889634);
  SetDescaleArgs(args, p);
  SetWindowArgs(args, mask.window_left, mask.window_right);

  int grid = 0;
  error = StartTileQueue(p.tile_counter, args.num_tiles, info->sm_count, stream, &grid);
  if (!error.empty()) return error;
  kernel<<<grid, Tile::kThreads, Tile::kDynamicSmemBytes, stream>>>(tmap_q, tmap_k, tmap_v, args);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return CudaError("launching the jzyfa FP8 varlen forward kernel", err);
  return "";
}

}  // namespace

std::string ValidateFlashFwdFp8Varlen(const FlashFwdFp8VarlenParams& p) {
  if (p.head_dim != Fp8Tile::kHeadDim) {
    return "head_dim must be 128 for the jzyfa FP8 kernel, got " + std::to_string(p.head_dim);
  }
  std::string error = ValidateFlashFwdVarlen(p);  // lengths, heads, limits, scale, mask
  if (!error.empty()) return error;
  if (p.descale_count != 1 && p.descale_count != p.num_seqs * p.heads_kv) {
    return "descales must hold 1 or num_seqs * heads_kv (" +
           std::to_string(p.num_seqs * p.heads_kv) + ") values, got " +
           std::to_string(p.descale_count);
  }
  if (p.v_transposed) {
    const int64_t want_keys = Fp8VarlenValueKeys(p.total_k, p.num_seqs);
    if (p.vt_keys != want_keys) {
      return "vt must hold roundup32(total_k) + 32 * (num_seqs + 1) = " +
             std::to_string(want_keys) + " key columns, got " + std::to_string(p.vt_keys);
    }
    // V^T columns (a box starts up to 128 keys past a sequence's end) stay int32.
    if (p.vt_keys > (int64_t{1} << 31) - 1024) {
      return "total_k + 32 * (num_seqs + 1) must be below 2^31 - 1024, got " +
             std::to_string(p.vt_keys);
    }
  }
  if (p.v == nullptr || p.descale_q == nullptr || p.descale_k == nullptr ||
      p.descale_v == nullptr) {
    return std::string(p.v_transposed ? "vt" : "v") + " or a descale is missing";
  }
  return "";
}

std::string LaunchFlashFwdFp8Varlen(const FlashFwdFp8VarlenParams& p, cudaStream_t stream) {
  std::string error = ValidateFlashFwdFp8Varlen(p);
  if (!error.empty()) return error;
  // Bounds over the longest sequences, as in flash_fwd_varlen.cu.
  MaskPlan mask;
  error = ResolveMask(p.causal, p.window_left, p.window_right, p.max_seqlen_q, p.max_seqlen_k,
                      &mask);
  if (!error.empty()) return error;
  if (p.v_transposed) {
    return mask.windowed ? Launch<Fp8VarlenVtTile, true>(p, mask, stream)
                         : Launch<Fp8VarlenVtTile, false>(p, mask, stream);
  }
  return mask.windowed ? Launch<Fp8VarlenTile, true>(p, mask, stream)
                       : Launch<Fp8VarlenTile, false>(p, mask, stream);
}

}  // namespace jzyfa
