// The measuring hooks of the kernels: what a measurement build may change, and the product's values.
// Plain C++ (no CUDA), no macros. The product build uses ProductVariant as it is; a measurement build
// force-includes one header of tools/measure/ (CMake: -DJZYFA_MEASURE=<name>, or the environment
// variable JZYFA_MEASURE at configure time), which specializes MeasureVariant<0> before any kernel
// code is seen. Nothing in ffi/ includes those headers, so the product never builds a measuring
// variant.
#pragma once

namespace jzyfa {

struct NoTimeline;

struct ProductVariant {
  // 1 takes the softmax out of the 16-bit kernels (P = the scaled scores; results wrong): what the
  // tensor work, loads and schedule alone reach (tools/measure/softmax_ablation.h).
  static constexpr bool kSoftmaxAblation = false;
  // The dense kernels' tile order in groups of (batch, head) pairs (TileGroupPairs); false: each
  // batch element a group, the previous order (tools/measure/no_tile_groups.h).
  static constexpr bool kTileGroups = true;
  // Keys per block of the dense 16-bit kernels at head dim 256 (causal or no mask) and at head dim 128
  // without a mask; 0: the tile table's (tile_size.h). Measurement builds: 80 and 176
  // (tools/measure/hd256_80_keys.h, nomask_176_keys.h).
  static constexpr int kHd256BlockN = 0;
  static constexpr int kNoMaskBlockN = 0;
  // The consumer-loop timeline (kernel_timeline.cuh's interface; tools/measure/timeline.h records).
  static constexpr bool kTimeline = false;
  using Timeline = NoTimeline;
  // The FP8 staged kernels' V transpose by PRMT instead of LDSM.T / STSM (measured 1-3.5% slower;
  // tools/measure/prmt_transpose.h).
  static constexpr bool kFp8PrmtTranspose = false;
  // float4s of the FP8 hd128 kernels' O copy kept in registers; 0: the tile table's (7). The timeline
  // takes 5 (its pointer and counter need the registers).
  static constexpr int kFp8RegCopyChunks = 0;
};

// The build's variant: ProductVariant unless a tools/measure/ header specializes it.
template <int kUnused = 0>
struct MeasureVariant : ProductVariant {};

}  // namespace jzyfa
