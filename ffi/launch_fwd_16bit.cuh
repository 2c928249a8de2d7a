// The 16-bit (bf16, f16) forward launches, dense and varlen: TMA tensor maps, the arguments, the
// persistent grid. One group (head dims, layout) per instantiation file; the element type and the
// mask (plain or windowed) are switched here.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <string>
#include <type_traits>

#include "dispatch.h"
#include "flash_fwd.h"
#include "flash_fwd_kernel.cuh"
#include "fwd_kernel.cuh"
#include "launch_utils.h"
#include "measure_variant.h"

namespace jzyfa {

// Dense batches: q and k have head dim kHeadDimQK, v and out kHeadDimV; kBlockN keys per block.
template <typename Element, int kHeadDimQK, int kHeadDimV, bool kWindow, int kBlockN>
std::string Launch16Dense(const FwdParams& p, const MaskPlan& mask, cudaStream_t stream) {
  using Tile = FwdTile<kHeadDimQK, kHeadDimV, kBlockN>;
  using Args = std::conditional_t<kWindow, WindowedArgs<FwdArgs>, FwdArgs>;
  constexpr auto kernel = FwdKernel<Fwd16Mainloop<Element, kHeadDimQK, kHeadDimV, kBlockN>, Args>;
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
  // O is stored in Q's boxes (64 rows), v's head dim wide, by the tiles with the TMA-store
  // epilogue (FwdTile::kEpilogueTma); the others take the map as an unused last argument.
  CUtensorMap tmap_o;
  if (!EncodeRowMap16(&tmap_o, p.out, bf16, p.batch, p.seqlen_q, p.heads_q, kHeadDimV,
                      Tile::kRowsPerConsumer, &error)) {
    return error;
  }
  Args args;
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
  kernel<<<grid, Tile::kThreads, Tile::kDynamicSmemBytes, stream>>>(tmap_q, tmap_k, tmap_v, args,
                                                                     tmap_o);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return CudaError("launching the jzyfa forward kernel", err);
  return "";
}

// Packed variable-length batches: the maps cover [1, total, heads, D]; O from registers.
template <typename Element, int kHeadDimQK, int kHeadDimV, bool kWindow>
std::string Launch16Varlen(const FwdParams& p, const MaskPlan& mask, cudaStream_t stream) {
  using Tile = FwdTile<kHeadDimQK, kHeadDimV, Fwd16DefaultBlockN(kHeadDimV), Layout::kVarlen>;
  using Args = std::conditional_t<kWindow, WindowedArgs<VarlenFwdArgs>, VarlenFwdArgs>;
  constexpr auto kernel = FwdVarlenKernel<Fwd16Mainloop<Element, kHeadDimQK, kHeadDimV>, Args>;
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
  Args args;
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

// Keys per block of the dense plain (unwindowed) kernels: the table's, or a measuring variant's at
// head dim 256 and at head dim 128 without a mask.
template <int kHeadDimQK, int kHeadDimV>
constexpr int Dense16BlockN(bool causal) {
  using V = MeasureVariant<>;
  if constexpr (kHeadDimQK == 256 && kHeadDimV == 256 && V::kHd256BlockN > 0) {
    return V::kHd256BlockN;
  } else if constexpr (kHeadDimQK == 128 && kHeadDimV == 128 && V::kNoMaskBlockN > 0) {
    return causal ? Fwd16DefaultBlockN(kHeadDimV) : V::kNoMaskBlockN;
  }
  return Fwd16DefaultBlockN(kHeadDimV);
}

template <int kHeadDimQK, int kHeadDimV, Layout kLayout>
std::string Launch16(const FwdParams& p, const MaskPlan& mask, cudaStream_t stream) {
  const auto with_element = [&](auto element) {
    using Element = typename decltype(element)::type;
    return BoolSwitch(mask.windowed, [&](auto windowed) {
      constexpr bool kWindow = decltype(windowed)::value;
      if constexpr (kLayout == Layout::kVarlen) {
        return Launch16Varlen<Element, kHeadDimQK, kHeadDimV, kWindow>(p, mask, stream);
      } else if constexpr (kWindow) {
        return Launch16Dense<Element, kHeadDimQK, kHeadDimV, true,
                             Fwd16DefaultBlockN(kHeadDimV)>(p, mask, stream);
      } else {
        constexpr int kCausalN = Dense16BlockN<kHeadDimQK, kHeadDimV>(true);
        constexpr int kNoMaskN = Dense16BlockN<kHeadDimQK, kHeadDimV>(false);
        if (mask.causal || kCausalN == kNoMaskN) {
          return Launch16Dense<Element, kHeadDimQK, kHeadDimV, false, kCausalN>(p, mask, stream);
        }
        return Launch16Dense<Element, kHeadDimQK, kHeadDimV, false, kNoMaskN>(p, mask, stream);
      }
    });
  };
  return p.element_type == ElementType::kBF16 ? with_element(TypeTag<__nv_bfloat16>{})
                                              : with_element(TypeTag<__half>{});
}

}  // namespace jzyfa
