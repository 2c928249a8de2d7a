// The forward kernels as data: which instantiations the library has (kFwdKernels: the rows the
// Python plan mirrors, module.cc's kernels()) and the tile sizes each runs with (Fwd16TileSize,
// Fp8TileSize: keys per block, ring stages, register split, epilogue, V source, ...). FwdTile and
// Fp8TileT (flash_fwd_kernel.cuh, fp8_tile.cuh) read their sizes from here and derive only the
// shared-memory layout; the launches (launch_fwd_16bit.cuh, launch_fwd_fp8.cuh) and the host's
// key-block rule (flash_fwd.cc) read the same values. Plain C++: the host compiler includes it.
// A new variant is one row of kFwdKernels, its sizes here, and one file of ffi/instantiations/.
#pragma once

#include <cstddef>

namespace jzyfa {

enum class Family { k16Bit, kFp8, kInt8 };
enum class MaskKind { kNone, kCausal, kWindow };
enum class Layout { kDense, kVarlen };

// MLA's head dims, the one unequal pair: q and k 192, v and out 128.
constexpr int kMlaHeadDimQK = 192;
constexpr int kMlaHeadDimV = 128;

// A set of masks (the resolved ones, ResolveMask: "window" only for windows that are neither causal nor
// none) as bits.
constexpr unsigned MaskBit(MaskKind mask) { return 1u << static_cast<int>(mask); }
constexpr unsigned kAllMasks = 0b111;
constexpr unsigned kCausalOrNone = 0b011;
constexpr MaskKind kMaskKinds[] = {MaskKind::kNone, MaskKind::kCausal, MaskKind::kWindow};

// One group of forward instantiations: (family, q/k head dim, v head dim, layout) with the masks it
// serves. One file of ffi/instantiations/ compiles each group (dispatch.h); kernels() lists a row
// per (group, mask).
struct FwdKernelGroup {
  Family family;
  int head_dim_qk;
  int head_dim_v;
  Layout layout;
  unsigned masks;
};

inline constexpr FwdKernelGroup kFwdKernels[] = {
    // 16-bit (bf16 and f16): every head dim, every mask, dense and varlen.
    {Family::k16Bit, 64, 64, Layout::kDense, kAllMasks},
    {Family::k16Bit, 64, 64, Layout::kVarlen, kAllMasks},
    {Family::k16Bit, 128, 128, Layout::kDense, kAllMasks},
    {Family::k16Bit, 128, 128, Layout::kVarlen, kAllMasks},
    {Family::k16Bit, 256, 256, Layout::kDense, kAllMasks},
    {Family::k16Bit, 256, 256, Layout::kVarlen, kAllMasks},
    {Family::k16Bit, kMlaHeadDimQK, kMlaHeadDimV, Layout::kDense, kAllMasks},
    {Family::k16Bit, kMlaHeadDimQK, kMlaHeadDimV, Layout::kVarlen, kAllMasks},
    // FP8 (e4m3): head dims 64, 128 and 256 every mask, dense and varlen; MLA's dense, causal or no
    // mask.
    {Family::kFp8, 64, 64, Layout::kDense, kAllMasks},
    {Family::kFp8, 64, 64, Layout::kVarlen, kAllMasks},
    {Family::kFp8, 128, 128, Layout::kDense, kAllMasks},
    {Family::kFp8, 128, 128, Layout::kVarlen, kAllMasks},
    {Family::kFp8, 256, 256, Layout::kDense, kAllMasks},
    {Family::kFp8, 256, 256, Layout::kVarlen, kAllMasks},
    {Family::kFp8, kMlaHeadDimQK, kMlaHeadDimV, Layout::kDense, kCausalOrNone},
    // INT8 Q K^T with e4m3 V (precision="int8"): head dims 128 and 256, dense, every mask; head dim 128
    // varlen, every mask; MLA's, dense, causal or no mask (the FP8 tiles').
    {Family::kInt8, 128, 128, Layout::kDense, kAllMasks},
    {Family::kInt8, 128, 128, Layout::kVarlen, kAllMasks},
    {Family::kInt8, 256, 256, Layout::kDense, kAllMasks},
    {Family::kInt8, kMlaHeadDimQK, kMlaHeadDimV, Layout::kDense, kCausalOrNone},
};
inline constexpr size_t kNumFwdKernelGroups = sizeof(kFwdKernels) / sizeof(kFwdKernels[0]);

// Whether kFwdKernels has (family, head dims, layout) with `mask` (with any mask when `any_mask`).
constexpr bool HasFwdKernel(Family family, int head_dim_qk, int head_dim_v, MaskKind mask,
                            Layout layout, bool any_mask = false) {
  for (const FwdKernelGroup& group : kFwdKernels) {
    if (group.family == family && group.head_dim_qk == head_dim_qk &&
        group.head_dim_v == head_dim_v && group.layout == layout &&
        (any_mask || (group.masks & MaskBit(mask)) != 0)) {
      return true;
    }
  }
  return false;
}

// One tile's sizes. Both families: 2 consumer warpgroups of 64 query rows (block M 128) and one
// producer warpgroup.
struct TileSize {
  int block_n;        // keys per block: the N of S = Q K^T
  int stages;         // K/V ring depth
  int producer_regs;  // setmaxnreg of the producer and the consumers
  int consumer_regs;
  bool epilogue_tma;  // O through shared memory and a TMA store where the O tiles fit; false:
                      // from registers (varlen: a store box would reach into the next sequence)
  bool staged_v;      // FP8: V staged and transposed in the kernel; false: V^T from memory
  int promote_blocks;   // FP8: key blocks summed in the wgmma accumulator per promotion to O
  int reg_copy_chunks;  // FP8: float4s of O's float32 copy kept in registers (the rest in smem)
};

constexpr int kFwdRowsPerConsumer = 64;
constexpr int kFwdConsumers = 2;
constexpr int kFwdBlockM = kFwdRowsPerConsumer * kFwdConsumers;

// The 16-bit tiles (FwdTile). Keys per block: 128, 64 where v's head dim is 256 (the O accumulator
// alone takes 128 registers per consumer thread; 64-key blocks keep S at 32 and P at 16). Two stages:
// three measured the same at hd128 (docs/benchmarks.md: 528/581 against 2 stages' at 4K/16K). The
// TMA-store epilogue (measured +2-10% at hd128) for dense calls where the O tiles fit. block_n other
// than the default: the measuring variants' wide tiles (hd256 with 80 keys: consumers at 240,
// producer 24, as 232 spills 44 bytes).
constexpr int Fwd16DefaultBlockN(int head_dim_v) { return head_dim_v > 128 ? 64 : 128; }
// The 16-bit tiles with a softcap pass (ffi/softcap.cuh): not MLA's head dims nor key blocks past 128
// (the measuring variants'), whose registers it would spill.
constexpr bool Fwd16HasSoftcap(int head_dim_qk, int head_dim_v, int block_n) {
  return head_dim_qk == head_dim_v && block_n <= 128;
}
constexpr TileSize Fwd16TileSize(int head_dim_v, Layout layout, int block_n) {
  const bool wide_hd256 = head_dim_v > 128 && block_n > 64;
  return TileSize{block_n,
                  2,
                  wide_hd256 ? 24 : 40,
                  wide_hd256 ? 240 : 232,
                  layout == Layout::kDense,
                  false,
                  0,
                  0};
}

// The FP8 tiles (Fp8TileT). 128 keys per block, or 192 (V^T from memory, dense, unwindowed head dim
// 128: Fp8KeyBlock's rule); 64 at head dim 256, where O's accumulator alone takes 132 registers per
// consumer thread (S then 32, P 2 x 8). O is promoted every 8 blocks of 128 keys (every 4: 8.6% of
// the kernel time at 32K keys, every 8: 4.6%; every 16 measured 1.4-3.2% faster but left the row sum
// 1.9% low: docs/benchmarks.md), 5 for 192 keys, 16 for 64 (1024 keys between promotions as at 128).
// O's float32 copy keeps 7 float4s per thread in registers (8 spill), MLA 6 (its longer Q K^T), none
// with 192-key blocks (1 spilled 28 bytes); head dim 64 all 9 (its O is half as wide); head dim 256
// only the row sums' (its O copy, 64 KB per consumer, in shared memory). Head dims 64 and 256 read
// V^T from memory (the in-kernel transpose is 128 x 128).
constexpr int kFp8WideBlockN = 192;
constexpr int Fp8DefaultBlockN(int head_dim_v) { return head_dim_v > 128 ? 64 : 128; }
constexpr TileSize Fp8TileSize(int head_dim_qk, bool staged_v, Layout layout, int block_n) {
  return TileSize{block_n,
                  2,
                  40,
                  232,
                  layout == Layout::kDense,
                  staged_v,
                  8 * 128 / block_n > 0 ? 8 * 128 / block_n : 1,
                  block_n > 128    ? 0
                  : head_dim_qk == 64  ? 9
                  : head_dim_qk == 128 ? 7
                  : head_dim_qk == 256 ? 1
                                       : 6};
}

// The backward kernels (ffi/flash_bwd_dkdv.cuh, ffi/flash_bwd_dq.cuh): one group per (head dims,
// layout) of 16-bit inputs and the masks it serves; module.cc's kernels() lists them as "bwd" rows.
// One instantiation per head dim pair (ffi/instantiations/bwd_16bit_hd*.cu) serves both layouts:
// varlen is a runtime argument (cu_seqlens), read once per tile.
struct BwdKernelGroup {
  int head_dim_qk;
  int head_dim_v;
  Layout layout;
  unsigned masks;
};

inline constexpr BwdKernelGroup kBwdKernels[] = {
    {64, 64, Layout::kDense, kAllMasks},
    {64, 64, Layout::kVarlen, kAllMasks},
    {128, 128, Layout::kDense, kAllMasks},
    {128, 128, Layout::kVarlen, kAllMasks},
    {256, 256, Layout::kDense, kAllMasks},
    {256, 256, Layout::kVarlen, kAllMasks},
    {kMlaHeadDimQK, kMlaHeadDimV, Layout::kDense, kAllMasks},
    {kMlaHeadDimQK, kMlaHeadDimV, Layout::kVarlen, kAllMasks},
};

constexpr bool HasBwdKernel(int head_dim_qk, int head_dim_v, MaskKind mask, Layout layout) {
  for (const BwdKernelGroup& group : kBwdKernels) {
    if (group.head_dim_qk == head_dim_qk && group.head_dim_v == head_dim_v && group.layout == layout &&
        (group.masks & MaskBit(mask)) != 0) {
      return true;
    }
  }
  return false;
}

// The backward tiles. Both kernels: 2 consumer warpgroups of 64 rows (the wgmma M) and a producer
// warpgroup loading with TMA through a 2-stage ring (flash_bwd_common.cuh's BwdTiles).
//   dK/dV kernel: 128 keys per tile (64 per warpgroup: dK and dV accumulate in registers, head_dim
//     / 2 floats each), query blocks of dkdv_block_m rows streamed through the ring.
//   dQ kernel: 128 query rows per tile (64 per warpgroup: dQ in registers), key blocks of
//     dq_block_n keys streamed through the ring.
// Where a warpgroup's gradients would not fit its registers, the kernel splits the gradients'
// columns instead (BwdSplitColumns): a tile is 64 rows, both warpgroups compute its S and dP (the
// same 64 x 64 block each) and each accumulates some of the gradients' 64-column slices, so a thread
// holds at most what it holds at head dim 128. The price is S and dP computed twice: at head dim 256,
// 6 GEMM units per dK/dV block where 4 are needed, 5 for 3 in the dQ kernel.
struct BwdTileSize {
  int dkdv_block_n;  // keys per dK/dV tile
  int dkdv_block_m;  // query rows per streamed block: the N of S^T = K Q^T
  int dq_block_m;    // query rows per dQ tile
  int dq_block_n;    // keys per streamed block: the N of S = Q K^T
  int stages;        // ring depth of the streamed blocks
};

constexpr int kBwdWarpgroups = 2;
constexpr int kBwdRowsPerWarpgroup = 64;

enum class BwdKernelKind { kDkdv, kDq };

// Split columns where the whole tile does not fit: the dK/dV kernel where a warpgroup's float32 dK
// and dV, (qk + v) / 2 per thread, pass head dim 128's 128 (MLA 192/128: 160); the dQ kernel where
// its 128 rows of Q and dO and two stages of 64 keys of K and V pass 192 KB of shared memory (head
// dim 256: 256 KB; MLA 160 KB, and its dQ takes 96 floats per thread). So head dim 256 splits both
// kernels, MLA only the dK/dV kernel.
constexpr bool BwdSplitColumns(BwdKernelKind kernel, int head_dim_qk, int head_dim_v) {
  return kernel == BwdKernelKind::kDkdv ? (head_dim_qk + head_dim_v) / 2 > 128
                                        : (head_dim_qk + head_dim_v) * 2 * (128 + 2 * 64) > 192 * 1024;
}

// Split columns: of a gradient's `slices` 64-column slices, consumer 0 takes the first half (rounded
// up), consumer 1 the rest. MLA's dK/dV: consumer 0 dK columns 0-127 and dV 0-63 (96 floats),
// consumer 1 dK 128-191 and dV 64-127 (64).
constexpr int BwdConsumerSlices(int slices, int consumer) {
  return consumer == 0 ? (slices + 1) / 2 : slices / 2;
}
constexpr int BwdConsumerFirstSlice(int slices, int consumer) { return consumer == 0 ? 0 : (slices + 1) / 2; }

constexpr BwdTileSize BwdTile16Size(int head_dim_qk, int head_dim_v) {
  auto tile_rows = [&](BwdKernelKind kernel) {
    return BwdSplitColumns(kernel, head_dim_qk, head_dim_v) ? kBwdRowsPerWarpgroup
                                                           : kBwdWarpgroups * kBwdRowsPerWarpgroup;
  };
  return BwdTileSize{tile_rows(BwdKernelKind::kDkdv), 64, tile_rows(BwdKernelKind::kDq), 64, 2};
}

}  // namespace jzyfa
