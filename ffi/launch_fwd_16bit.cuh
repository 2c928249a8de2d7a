// The 16-bit (bf16, f16) forward launches, dense and varlen: the tile and its Q/K/V tensor maps
// (LaunchFwdKernel does the rest). One group (head dims, layout) per instantiation file; the element
// type, the mask (plain or windowed) and the keys per block are switched here.
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

// q and k have head dim kHeadDimQK, v and out kHeadDimV; kBlockN keys per block; dense or varlen.
template <typename Element, int kHeadDimQK, int kHeadDimV, bool kWindow, int kBlockN, Layout kLayout>
std::string Launch16Tile(const FwdParams& p, const MaskPlan& mask, cudaStream_t stream) {
  using Tile = FwdTile<kHeadDimQK, kHeadDimV, kBlockN, kLayout>;
  using Base = std::conditional_t<kLayout == Layout::kVarlen, VarlenFwdArgs, FwdArgs>;
  using Args = std::conditional_t<kWindow, WindowedArgs<Base>, Base>;
  const bool bf16 = p.element_type == ElementType::kBF16;
  const auto encode_qkv = [&](int64_t batch, int64_t seq_q, int64_t seq_k, CUtensorMap* q,
                              CUtensorMap* k, CUtensorMap* v, std::string* error) {
    return EncodeRowMap16(q, p.q, bf16, batch, seq_q, p.heads_q, kHeadDimQK,
                          Tile::kRowsPerConsumer, error) &&
           EncodeRowMap16(k, p.k, bf16, batch, seq_k, p.heads_kv, kHeadDimQK, Tile::kBlockN,
                          error) &&
           EncodeRowMap16(v, p.v, bf16, batch, seq_k, p.heads_kv, kHeadDimV, Tile::kBlockN, error);
  };
  // Softcap c: the softmax runs on t = tanh(s / c) with c log2(e) as its scale (softcap.cuh).
  if (p.softcap > 0.f && !Fwd16HasSoftcap(kHeadDimQK, kHeadDimV, kBlockN)) {
    return "softcap must be 0 for this build's " + std::to_string(kBlockN) + "-key tile at head dims (" +
           std::to_string(kHeadDimQK) + ", " + std::to_string(kHeadDimV) + "): it has no softcap pass";
  }
  const SoftcapScales scales = SoftcapScalesOf(p.softmax_scale, p.softcap);
  return LaunchFwdKernel<Fwd16Mainloop<Element, kHeadDimQK, kHeadDimV, kBlockN>, Tile, Args>(
      p, mask, scales.scale_log2, stream, encode_qkv,
      [&](Args& args) { args.softcap_tanh_scale = scales.tanh_scale; });
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
      constexpr int kDefaultN = Fwd16DefaultBlockN(kHeadDimV);
      if constexpr (kLayout == Layout::kVarlen || kWindow) {
        return Launch16Tile<Element, kHeadDimQK, kHeadDimV, kWindow, kDefaultN, kLayout>(p, mask,
                                                                                       stream);
      } else {
        constexpr int kCausalN = Dense16BlockN<kHeadDimQK, kHeadDimV>(true);
        constexpr int kNoMaskN = Dense16BlockN<kHeadDimQK, kHeadDimV>(false);
        if (mask.causal || kCausalN == kNoMaskN) {
          return Launch16Tile<Element, kHeadDimQK, kHeadDimV, false, kCausalN, kLayout>(p, mask,
                                                                                      stream);
        }
        return Launch16Tile<Element, kHeadDimQK, kHeadDimV, false, kNoMaskN, kLayout>(p, mask, stream);
      }
    });
  };
  return p.element_type == ElementType::kBF16 ? with_element(TypeTag<__nv_bfloat16>{})
                                              : with_element(TypeTag<__half>{});
}

}  // namespace jzyfa
