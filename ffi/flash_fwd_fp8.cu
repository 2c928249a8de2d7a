// Launch planning for the FP8 forward kernel: validation, tensor maps (Q, K and V, or V^T, as
// bytes), the persistent grid, and the instantiations (lean P, exact P; each plain and
// sliding-window, and MLA's head dims, q/k 192 with v 128, causal or no mask; each with V as it is,
// transposed in the kernel, or V^T from fp8_value_operand.cu: FlashFwdFp8Params::v_transposed).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "flash_fwd.h"
#include "flash_fwd_fp8_kernel.cuh"
#include "launch_utils.h"

namespace jzyfa {
namespace {

// The plain kernel, the sliding-window one, or MLA's (Fp8MlaTile, no window), for the tile's V
// source (Tile::kStagedV).
template <typename Tile, bool kLeanP, bool kWindow>
constexpr auto Fp8ForwardKernel() {
  constexpr bool kStagedV = Tile::kStagedV;
  if constexpr (Tile::kHeadDimQK != Tile::kHeadDimV) {
    static_assert(!kWindow, "MLA's FP8 kernel takes no sliding window");
    return FlashFwdFp8MlaKernel<kLeanP, kStagedV>;
  } else if constexpr (kWindow) {
    return FlashFwdFp8WindowKernel<kLeanP, kStagedV>;
  } else if constexpr (Tile::kBlockN != 128) {
    static_assert(!kStagedV && Tile::kBlockN == Fp8VtWideTile::kBlockN);
    return FlashFwdFp8WideKernel<kLeanP>;
  } else {
    return FlashFwdFp8Kernel<kLeanP, kStagedV>;
  }
}

template <typename Tile, bool kLeanP, bool kWindow>
std::string Launch(const FlashFwdFp8Params& p, const MaskPlan& mask, cudaStream_t stream) {
  constexpr auto kernel = Fp8ForwardKernel<Tile, kLeanP, kWindow>();
  const DeviceInfo* info = nullptr;
  std::string error = PrepareLaunch<kernel>(Tile::kDynamicSmemBytes, &info);
  if (!error.empty()) return error;

  CUtensorMap tmap_q, tmap_k, tmap_v;
  // Q and K as bytes, boxes of 128 head-dim columns (128 bytes: the whole head dim, or one of MLA's
  // two slices) x the rows. V (head dim 128) likewise but unswizzled: the kernel's staging buffer,
  // transposed into V^T in shared memory (fp8_value_transpose.cuh).
  constexpr auto kBytes = CU_TENSOR_MAP_DATA_TYPE_UINT8;
  constexpr int kD = Tile::kHeadDimQK, kBox = Tile::kQkSliceCols;
  if (!EncodeRowMap(&tmap_q, p.q, kBytes, 1, p.batch, p.seqlen_q, p.heads_q, kD, kBox,
                    Tile::kRowsPerConsumer, &error) ||
      !EncodeRowMap(&tmap_k, p.k, kBytes, 1, p.batch, p.seqlen_k, p.heads_kv, kD, kBox,
                    Tile::kBlockN, &error)) {
    return error;
  }
  if constexpr (Tile::kStagedV) {
    if (!EncodeRowMap(&tmap_v, p.v, kBytes, 1, p.batch, p.seqlen_k, p.heads_kv, Tile::kHeadDimV,
                      Tile::kHeadDimV, Tile::kBlockN, &error, Tile::kVStagingSwizzle)) {
      return error;
    }
  } else {
    // V^T [batch, heads_kv, 128, keys]: boxes of 128 keys (contiguous; one 128-byte swizzle row) x
    // the 128 head-dim rows, one per 128 keys of a block (Fp8TileT::kVtSlices); or of 64 keys,
    // 64-byte swizzled (the 192-key tile).
    if (!EncodeValueOperandMap(&tmap_v, p.v, p.batch, p.heads_kv, Tile::kHeadDimV, p.seqlen_k_padded,
                               Tile::kVtSliceKeys, &error)) {
      return error;
    }
  }
  // O (bf16 [batch, seq_q, heads_q, 128]) in Q's boxes of 64 rows, 64 columns (one 128-byte swizzle
  // row) wide, for the TMA-store epilogue (Fp8TileT::kEpilogueTma; unused otherwise).
  CUtensorMap tmap_o;
  if (!EncodeRowMap16(&tmap_o, p.out, /*bf16=*/true, p.batch, p.seqlen_q, p.heads_q, Tile::kHeadDimV,
                      Tile::kRowsPerConsumer, &error)) {
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
  SetTileGroups(args, info->sm_count, mask.window_left, mask.window_right, Tile::kBlockM);

  int grid = 0;
  error = StartTileQueue(p.tile_counter, args.num_tiles, info->sm_count, stream, &grid);
  if (!error.empty()) return error;
  kernel<<<grid, Tile::kThreads, Tile::kDynamicSmemBytes, stream>>>(tmap_q, tmap_k, tmap_v, args,
                                                                     tmap_o);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return CudaError("launching the jzyfa FP8 forward kernel", err);
  return "";
}

template <typename T>
struct TileTag {
  using type = T;
};

// Keys per block of the dense V^T kernel, JZYFA_FP8_KEY_BLOCK: "auto" (or unset) picks by the keys a
// row sees, "128" or "192" force one (tests, A/B benchmarks). 0 for any other value.
constexpr const char* kKeyBlockEnv = "JZYFA_FP8_KEY_BLOCK";

int KeyBlockOverride() {
  const char* value = std::getenv(kKeyBlockEnv);
  if (value == nullptr || *value == '\0' || std::strcmp(value, "auto") == 0) return -1;
  if (std::strcmp(value, "128") == 0) return 128;
  if (std::strcmp(value, "192") == 0) return 192;
  return 0;
}

// 192-key blocks pay off once a row sees enough keys: each block's fixed work (quad shuffles, the r
// chain, waits, the turn hand-over) is spread over 1.5x the keys, while a causal tile's diagonal
// computes ~64 more masked keys and a row's last block covers up to 191 keys past its end. Measured on
// the H200, 192 against 128 with V^T in 64-key slices (docs/fp8.md 10.30): causal 6x2560 +0.3%, 5x3072
// +1.9%, 4x4K +3.3%, 3x6K +3.9%, 2x8K and longer +1 to +3%; no mask (32 q / 8 kv heads) 4x1024 -3.9%,
// 4x1536 +7.4%, 9x2304 +8.4%, 5x3072 +7.8%.
constexpr int64_t kWideMinKeysCausal = 3072;
constexpr int64_t kWideMinKeysNoMask = 1536;

// key_block_override: KeyBlockOverride(), read once per launch.
bool UseWideKeyBlocks(const FlashFwdFp8Params& p, const MaskPlan& mask, int key_block_override) {
  if (key_block_override > 0) return key_block_override == Fp8VtWideTile::kBlockN;
  return p.seqlen_k >= (mask.causal ? kWideMinKeysCausal : kWideMinKeysNoMask);
}

// The tile and kernel a call runs on, by its head dims, mask, P, V source and (dense V^T) the keys
// its rows see: visit(TileTag<Tile>, lean P, windowed), the flags as std::bool_constant. The launch
// and Fp8KeyBlock both ask here.
template <typename Visit>
auto VisitKernelTile(const FlashFwdFp8Params& p, const MaskPlan& mask, int key_block_override,
                     Visit visit) {
  using Yes = std::true_type;
  using No = std::false_type;
  const auto with_p = [&](auto tile, auto windowed) {
    return p.lean_p ? visit(tile, Yes{}, windowed) : visit(tile, No{}, windowed);
  };
  if (p.head_dim == Fp8MlaTile::kHeadDimQK) {  // no window, v's head dim 128 (ValidateFlashFwdFp8)
    return p.v_transposed ? with_p(TileTag<Fp8MlaVtTile>{}, No{}) : with_p(TileTag<Fp8MlaTile>{}, No{});
  }
  if (mask.windowed) {
    return p.v_transposed ? with_p(TileTag<Fp8VtTile>{}, Yes{}) : with_p(TileTag<Fp8Tile>{}, Yes{});
  }
  if (!p.v_transposed) return with_p(TileTag<Fp8Tile>{}, No{});
  return UseWideKeyBlocks(p, mask, key_block_override) ? with_p(TileTag<Fp8VtWideTile>{}, No{})
                                   : with_p(TileTag<Fp8VtTile>{}, No{});
}

}  // namespace

std::string ValidateFlashFwdFp8(const FlashFwdFp8Params& p) {
  if (p.batch < 1 || p.seqlen_q < 1 || p.seqlen_k < 1 || p.heads_q < 1 || p.heads_kv < 1) {
    return "q, k and v need batch, sequence and head counts of at least 1";
  }
  const bool mla = p.head_dim == Fp8MlaTile::kHeadDimQK && p.head_dim_v == Fp8MlaTile::kHeadDimV;
  if (!(p.head_dim == Fp8Tile::kHeadDim && p.head_dim_v == Fp8Tile::kHeadDim) && !mla) {
    return "head_dim must be 128 for q, k and v, or 192 for q and k with 128 for v (MLA), for the "
           "jzyfa FP8 kernel; got " +
           std::to_string(p.head_dim) + " for q and k, " + std::to_string(p.head_dim_v) + " for v";
  }
  if (p.heads_q % p.heads_kv != 0) {
    return "heads of q (" + std::to_string(p.heads_q) + ") must be a multiple of heads of k/v (" +
           std::to_string(p.heads_kv) + ")";
  }
  if (p.v_transposed && p.seqlen_k_padded != (p.seqlen_k + 31) / 32 * 32) {
    return "vt must hold seqlen_k rounded up to a multiple of 32 keys (" +
           std::to_string((p.seqlen_k + 31) / 32 * 32) + "), got " +
           std::to_string(p.seqlen_k_padded);
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
  if (mla && mask.windowed) {
    return "the jzyfa FP8 kernel takes MLA's head dims (192 for q and k, 128 for v) with a causal "
           "mask or none, not a sliding window";
  }
  return "";
}

std::string LaunchFlashFwdFp8(const FlashFwdFp8Params& p, cudaStream_t stream) {
  std::string error = ValidateFlashFwdFp8(p);
  if (!error.empty()) return error;
  MaskPlan mask;
  error = ResolveMask(p.causal, p.window_left, p.window_right, p.seqlen_q, p.seqlen_k, &mask);
  if (!error.empty()) return error;
  const int key_block_override = KeyBlockOverride();
  if (key_block_override == 0) {
    return std::string(kKeyBlockEnv) + " must be auto, 128 or 192 (or unset), got '" +
           std::getenv(kKeyBlockEnv) + "'";
  }
  return VisitKernelTile(p, mask, key_block_override, [&](auto tile, auto lean_p, auto windowed) {
    return Launch<typename decltype(tile)::type, decltype(lean_p)::value, decltype(windowed)::value>(
        p, mask, stream);
  });
}

int Fp8KeyBlock(const FlashFwdFp8Params& p) {
  MaskPlan mask;  // where ResolveMask refuses the bounds the launch refuses the call: any answer does
  ResolveMask(p.causal, p.window_left, p.window_right, p.seqlen_q, p.seqlen_k, &mask);
  // An invalid JZYFA_FP8_KEY_BLOCK (0) answers as auto; the launch refuses it.
  return VisitKernelTile(p, mask, KeyBlockOverride(),
                         [](auto tile, auto, auto) { return decltype(tile)::type::kBlockN; });
}

std::string ReadFlashFwdFp8Timeline(std::vector<uint64_t>* out) { return ReadTimeline(out); }

}  // namespace jzyfa
