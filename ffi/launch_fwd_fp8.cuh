// The FP8 (e4m3) forward launches, dense and varlen: tensor maps (Q, K and V, or V^T, as bytes), the
// arguments, the persistent grid. One group (head dims, layout) per instantiation file; P (lean or
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

template <typename Tile, bool kLeanP, bool kWindow>
std::string LaunchFp8Dense(const FwdParams& p, const MaskPlan& mask, cudaStream_t stream) {
  using Args = std::conditional_t<kWindow, WindowedArgs<Fp8Args>, Fp8Args>;
  constexpr auto kernel = FwdKernel<Fp8Mainloop<kLeanP, Tile>, Args>;
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
    if (!EncodeValueOperandMap(&tmap_v, p.v, p.batch, p.heads_kv, Tile::kHeadDimV, p.vt_keys,
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
  Args args;
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

// Packed variable-length batches, lean P only.
template <typename Tile, bool kWindow>
std::string LaunchFp8Varlen(const FwdParams& p, const MaskPlan& mask, cudaStream_t stream) {
  using Args = std::conditional_t<kWindow, WindowedArgs<Fp8VarlenArgs>, Fp8VarlenArgs>;
  constexpr auto kernel = FwdVarlenKernel<Fp8Mainloop<true, Tile>, Args>;
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
  Args args;
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

// The tile a call runs on: head dims, V source, layout, keys per block (p.key_block, which
// ValidateFwd resolved to 128 or, for the dense unwindowed V^T kernel, 192).
template <int kHeadDimQK, Layout kLayout>
std::string LaunchFp8(const FwdParams& p, const MaskPlan& mask, cudaStream_t stream) {
  const auto with_tile = [&](auto tile) {
    using Tile = typename decltype(tile)::type;
    return BoolSwitch(mask.windowed, [&](auto windowed) -> std::string {
      constexpr bool kWindow = decltype(windowed)::value;
      if constexpr (kLayout == Layout::kVarlen) {
        return LaunchFp8Varlen<Tile, kWindow>(p, mask, stream);
      } else if constexpr (kWindow && (kHeadDimQK != Tile::kHeadDimV || Tile::kBlockN != 128)) {
        return "no FP8 sliding-window kernel for this tile";  // ValidateFwd admits none
      } else {
        return BoolSwitch(p.lean_p, [&](auto lean_p) {
          return LaunchFp8Dense<Tile, decltype(lean_p)::value, kWindow>(p, mask, stream);
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
  return with_tile(TypeTag<Fp8TileT<kHeadDimQK, true, L>>{});
}

}  // namespace jzyfa
