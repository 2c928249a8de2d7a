// The FP8 (e4m3) forward launches, dense and varlen, and the INT8 one (int8 Q and K, e4m3 V): the
// tile, its tensor maps (Q, K and V, or V^T, as bytes) and the descales or scales (LaunchFwdKernel
// does the rest). One group (head dims, layout) per instantiation file; P (lean or
// exact), V's layout (as it is, transposed in the kernel, or V^T from fp8_value_operand.cu), the mask
// (plain or windowed) and the key block (FwdParams::key_block, ValidateFwd's) are switched here.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <string>
#include <type_traits>

#include "dispatch.h"
#include "flash_fwd.h"
#include "flash_fwd_fp8_kernel.cuh"
#include "fwd_kernel.cuh"
#include "launch_utils.h"

namespace jzyfa {

// Q and K as bytes (e4m3 or int8), boxes of 128 head-dim columns (128 bytes: the whole head dim, or one
// of MLA's two slices; head dim 64: 64 bytes, 64-byte swizzled) x the rows. V (head dim 128) likewise but unswizzled, or 128-byte swizzled for
// the matrix transpose: the kernel's staging buffer, transposed into V^T in shared memory
// (fp8_value_transpose.cuh). Or V^T [batch, heads_kv, 128, keys] (varlen: [1, heads_kv, 128,
// vt_keys], a tile's boxes starting at its sequence's column, Fp8VarlenValueColumn): boxes of 128
// keys (contiguous; one 128-byte swizzle row) x the 128 head-dim rows, one per 128 keys of a block
// (Fp8TileT::kVtSlices); or of 64 keys, 64-byte swizzled (the 192-key tile). Varlen: a tile's K and
// V boxes start at its sequence's first key; keys past the sequence's end are the next one's
// (finite) tokens or TMA's zeros, and masked.
template <typename Tile>
bool EncodeByteOperands(const FwdParams& p, int64_t batch, int64_t seq_q, int64_t seq_k, CUtensorMap* q,
                        CUtensorMap* k, CUtensorMap* v, std::string* error) {
  constexpr auto kBytes = CU_TENSOR_MAP_DATA_TYPE_UINT8;
  constexpr int kD = Tile::kHeadDimQK, kBox = Tile::kQkSliceCols;
  constexpr CUtensorMapSwizzle kSwizzle = Tile::kQkSwizzle;
  if (!EncodeRowMap(q, p.q, kBytes, 1, batch, seq_q, p.heads_q, kD, kBox, Tile::kRowsPerConsumer, error,
                    kSwizzle) ||
      !EncodeRowMap(k, p.k, kBytes, 1, batch, seq_k, p.heads_kv, kD, kBox, Tile::kBlockN, error, kSwizzle)) {
    return false;
  }
  if constexpr (Tile::kStagedV) {
    return EncodeRowMap(v, p.v, kBytes, 1, batch, seq_k, p.heads_kv, Tile::kHeadDimV, Tile::kHeadDimV,
                        Tile::kBlockN, error, Tile::kVStagingSwizzle);
  } else {
    return EncodeValueOperandMap(v, p.v, batch, p.heads_kv, Tile::kHeadDimV, p.vt_keys, Tile::kVtSliceKeys,
                                 error);
  }
}

// softmax_scale * log2(e), rounded to float32 once, here, as jzyfa.fp8_emulation.scale_log2 does.
inline float ScaleLog2Of(const FwdParams& p) {
  return static_cast<float>(static_cast<double>(p.softmax_scale) * 1.4426950408889634);
}

template <typename Tile, bool kLeanP, bool kWindow>
std::string LaunchFp8Tile(const FwdParams& p, const MaskPlan& mask, cudaStream_t stream) {
  using Base = std::conditional_t<Tile::kLayout == Layout::kVarlen, Fp8VarlenArgs, Fp8Args>;
  using Args = std::conditional_t<kWindow, WindowedArgs<Base>, Base>;
  return LaunchFwdKernel<Fp8Mainloop<kLeanP, Tile>, Tile, Args>(
      p, mask, ScaleLog2Of(p), stream, [&](auto... maps) { return EncodeByteOperands<Tile>(p, maps...); },
      [&](Args& args) { SetDescaleArgs(args, p); });
}

// The INT8 launch (Int8Args, varlen Int8VarlenArgs): lean P, the FP8 tile's key blocks (head dims 128
// and MLA's 192/128: 128 keys, one K scale each; 256: 64 keys, two blocks a K scale); V staged and
// transposed in the kernel (v's head dim 128 only), or V^T from fp8_value_operand.cu (p.v_transposed);
// the scales' blocks (128 tokens) from the lengths (varlen: the longest sequences').
template <int kHeadDim, Layout kLayout, bool kWindow, bool kStagedV>
std::string LaunchInt8Tile(const FwdParams& p, const MaskPlan& mask, cudaStream_t stream) {
  using Tile = Fp8TileT<kHeadDim, kStagedV, kLayout>;
  using Base = std::conditional_t<kLayout == Layout::kVarlen, Int8VarlenArgs, Int8Args>;
  using Args = std::conditional_t<kWindow, WindowedArgs<Base>, Base>;
  const int64_t seqlen_q = kLayout == Layout::kVarlen ? p.max_seqlen_q : p.seqlen_q;
  const int64_t seqlen_k = kLayout == Layout::kVarlen ? p.max_seqlen_k : p.seqlen_k;
  return LaunchFwdKernel<Fp8Mainloop<true, Tile>, Tile, Args>(
      p, mask, ScaleLog2Of(p), stream, [&](auto... maps) { return EncodeByteOperands<Tile>(p, maps...); },
      [&](Args& args) {
        SetDescaleArgs(args, p);
        args.q_blocks = static_cast<int>((seqlen_q + kInt8ScaleBlock - 1) / kInt8ScaleBlock);
        args.k_blocks = static_cast<int>((seqlen_k + kInt8ScaleBlock - 1) / kInt8ScaleBlock);
      });
}

// A template, so that only the INT8 instantiation files compile their kernels.
template <int kHeadDim, Layout kLayout>
std::string LaunchInt8(const FwdParams& p, const MaskPlan& mask, cudaStream_t stream) {
  constexpr int kHeadDimV = Fp8TileT<kHeadDim, false>::kHeadDimV;
  static_assert(kLayout == Layout::kDense || kHeadDim == 128, "the INT8 varlen tile: head dim 128");
  return BoolSwitch(mask.windowed, [&](auto windowed) -> std::string {
    constexpr bool kWindow = decltype(windowed)::value;
    if constexpr (kWindow && kHeadDim != kHeadDimV) {
      return "no INT8 sliding-window kernel at MLA's head dims";  // ValidateFwd admits none
    } else if constexpr (kHeadDimV != 128) {  // V^T only (ValidateFwd)
      return LaunchInt8Tile<kHeadDim, kLayout, kWindow, false>(p, mask, stream);
    } else {
      return BoolSwitch(p.v_transposed, [&](auto transposed) {
        return LaunchInt8Tile<kHeadDim, kLayout, kWindow, !decltype(transposed)::value>(p, mask, stream);
      });
    }
  });
}

// The tile a call runs on: head dims, V source, layout, keys per block (p.key_block, which
// ValidateFwd resolved to the head dim's default, Fp8DefaultBlockN, or, for the dense unwindowed V^T
// kernel, 192).
template <int kHeadDimQK, Layout kLayout>
std::string LaunchFp8(const FwdParams& p, const MaskPlan& mask, cudaStream_t stream) {
  const auto with_tile = [&](auto tile) {
    using Tile = typename decltype(tile)::type;
    return BoolSwitch(mask.windowed, [&](auto windowed) -> std::string {
      constexpr bool kWindow = decltype(windowed)::value;
      if constexpr (kLayout == Layout::kVarlen) {
        return LaunchFp8Tile<Tile, true, kWindow>(p, mask, stream);  // lean P only
      } else if constexpr (kWindow && (kHeadDimQK != Tile::kHeadDimV ||
                                       Tile::kBlockN != Fp8DefaultBlockN(Tile::kHeadDimV))) {
        return "no FP8 sliding-window kernel for this tile";  // ValidateFwd admits none
      } else {
        return BoolSwitch(p.lean_p, [&](auto lean_p) {
          return LaunchFp8Tile<Tile, decltype(lean_p)::value, kWindow>(p, mask, stream);
        });
      }
    });
  };
  constexpr Layout L = kLayout;
  if (p.v_transposed) {
    if constexpr (kLayout == Layout::kDense && kHeadDimQK == 128) {
      if (p.key_block == kFp8WideBlockN) return with_tile(TypeTag<Fp8VtWideTile>{});
    }
    return with_tile(TypeTag<Fp8TileT<kHeadDimQK, false, L>>{});
  }
  if constexpr (kHeadDimQK == 64 || kHeadDimQK == 256) {
    return "v_transposed must be true for the FP8 kernel at head dims 64 and 256 (V^T from memory only)";
  } else {
    return with_tile(TypeTag<Fp8TileT<kHeadDimQK, true, L>>{});
  }
}

}  // namespace jzyfa
