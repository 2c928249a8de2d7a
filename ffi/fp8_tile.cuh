// The FP8 kernel's tile: its shapes (rows per consumer, keys per block, head dims), the compile-time
// choices that go with them (V staged or V^T from memory, the TMA-store epilogue, Q buffers, how often
// O is promoted and how much of its copy stays in registers), and the shared-memory layout they give.
// flash_fwd_fp8_kernel.cuh runs on it; launch_fwd_fp8.cuh sizes its launches and tensor maps by it. The
// sizes themselves are tile_size.h's (Fp8TileSize); this struct derives the layout.
#pragma once

#include <cuda.h>

#include "flash_fwd_common.cuh"
#include "fp8_value_transpose.cuh"
#include "measure_variant.h"
#include "tile_size.h"

namespace jzyfa {

// The tile for head dim kHeadDimQK: 64, 128 or 256 for q, k, v and out alike, or MLA's 192 for q and
// k with 128 for v and out. kHeadDim is v's and out's (V^T's rows, O's columns); Q and K rows of more than 128
// bytes are loaded as 128-byte-swizzle slices of 128 columns each, laid out back to back (slice s at
// s * rows * 128 bytes), TMA filling the columns past kHeadDimQK with zeros that no wgmma reads; rows
// of 64 bytes (head dim 64) are one 64-byte-swizzle slice. kStagedV: V's operand built in shared
// memory from V as it is (staging buffers, transposing warps), or TMA-loaded from a V^T in global
// memory (no staging buffers). kEpilogueTma: O stored through a bf16 tile per consumer in shared
// memory and TMA (TmaEpilogue), or from registers (the varlen kernels: a box would reach into the
// next sequence).
// kLayout_: dense, or varlen (O from registers). kBlockN_: keys per block, 128 (64 at head dim 256:
// Fp8DefaultBlockN) or (V^T from global memory only) 192 (kFp8WideBlockN, docs/fp8.md 10.26). The
// sizes are tile_size.h's (Fp8TileSize).
template <int kHeadDimQK_, bool kStagedV_ = true, Layout kLayout_ = Layout::kDense,
          int kBlockN_ = Fp8DefaultBlockN(kHeadDimQK_ == kMlaHeadDimQK ? kMlaHeadDimV : kHeadDimQK_)>
struct Fp8TileT {
  static constexpr TileSize kSize = Fp8TileSize(kHeadDimQK_, kStagedV_, kLayout_, kBlockN_);
  static constexpr Layout kLayout = kLayout_;
  static constexpr int kHeadDimQK = kHeadDimQK_;
  static constexpr bool kStagedV = kStagedV_;
  static constexpr int kHeadDimV = kHeadDimQK == kMlaHeadDimQK ? kMlaHeadDimV : kHeadDimQK;
  static constexpr int kHeadDim = kHeadDimV;
  static_assert(kHeadDimV == 64 || kHeadDimV == 128 || kHeadDimV == 256, "v's head dim: 64, 128 or 256");
  // Bytes (e4m3 columns) of one swizzle slice of Q and K: 128, or the whole 64-byte row (IssueQK
  // reads the same rule off the head dim).
  static constexpr int kQkSliceCols = kHeadDimQK < 128 ? 64 : 128;
  static constexpr CUtensorMapSwizzle kQkSwizzle =
      kQkSliceCols == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
  static constexpr int kQkSlices = (kHeadDimQK + kQkSliceCols - 1) / kQkSliceCols;
  static constexpr int kConsumers = kFwdConsumers;
  static constexpr int kRowsPerConsumer = kFwdRowsPerConsumer;
  static constexpr int kBlockM = kConsumers * kRowsPerConsumer;
  static constexpr int kBlockN = kSize.block_n;
  static_assert(kBlockN % 32 == 0 && kBlockN <= 256, "P V takes keys in k-steps of 32");
  static_assert(kBlockN == 128 || !kStagedV_, "the in-kernel V transpose handles 128-key blocks");
  static_assert(kHeadDimV == 128 || !kStagedV_, "the in-kernel V transpose handles 128-byte V rows");
  static constexpr int kStages = kSize.stages;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kProducerRegs = kSize.producer_regs;
  static constexpr int kConsumerRegs = kSize.consumer_regs;
  static constexpr int kPvN = kHeadDim + 8;  // O's columns plus the row-sum columns
  // A wgmma's N is at most 256: at head dim 256 the row sums take a P V wgmma of their own (N = 8)
  // from one block of ones that every stage shares; otherwise the ones follow each V^T slice and one
  // wgmma of N = kPvN accumulates both.
  static constexpr bool kSeparateSums = kPvN > 256;
  // Key blocks summed in the wgmma accumulator before it is added to O's float32 copy (tile_size.h).
  static constexpr int kPromoteBlocks = kSize.promote_blocks;
  // One byte per element: a 128-byte swizzle row holds 128 head-dim columns (or 128 keys of V^T).
  static constexpr int kQSliceBytes = kRowsPerConsumer * kQkSliceCols;
  static constexpr int kKSliceBytes = kBlockN * kQkSliceCols;
  static constexpr int kQConsumerBytes = kQSliceBytes * kQkSlices;
  static constexpr int kQBytes = kQConsumerBytes * kConsumers;
  static constexpr int kKBytes = kKSliceBytes * kQkSlices;
  // V^T in slices of 128 keys (one 128-byte swizzle row: a box with 128-byte swizzle is at most 128
  // bytes wide), each [128 rows][128 keys] followed by its 8 rows of ones. A 192-key block takes three
  // 64-key slices, 64-byte swizzled: no keys of the next block over-fetched, and the bytes saved bring
  // the TMA-store epilogue back (docs/fp8.md 10.29: +1 to +3% from 8K keys, measured).
  static constexpr int kVtSliceKeys = kBlockN % 128 == 0 ? 128 : 64;
  static_assert(kVtSliceKeys == 128 || kVtSliceKeys == 64, "one swizzle row (128 or 64 bytes) per slice");
  static constexpr int kVtStepsPerSlice = kVtSliceKeys / 32;  // P V k-steps
  static constexpr int kVtSlices = (kBlockN + kVtSliceKeys - 1) / kVtSliceKeys;
  static constexpr int kVtBytes = kHeadDim * kVtSliceKeys;  // per slice (one TMA box)
  static constexpr int kOnesBytes = 8 * kVtSliceKeys;  // rows 128..135 of the P V B operand, per slice
  static constexpr int kVtSliceBytes = kVtBytes + (kSeparateSums ? 0 : kOnesBytes);  // whole 8-row groups
  // Stages start 1024-byte aligned (Q K^T's 128-byte swizzle); 64-key slices leave 512 bytes over.
  static constexpr int kStageBytes = (kKBytes + kVtSlices * kVtSliceBytes + 1023) / 1024 * 1024;
  // V's tile as TMA loads it ([128 keys][128 bytes], unswizzled), per stage, after the O copies:
  // the producer's transposing warps build the stage's V^T from it (fp8_value_transpose.cuh).
  static constexpr int kVStagingBytes = kBlockN * kHeadDim;
  // How TMA lays the staging tile out: as it is, or 128-byte swizzled for the matrix transpose.
  static constexpr CUtensorMapSwizzle kVStagingSwizzle =
      Fp8ValueTranspose::kSwizzledStaging ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE;
  // O's float32 copy, per consumer: each thread's kPvN / 2 accumulator values as float4s,
  // float4 q of thread t at (q * 128 + t) * 16 (conflict-free 128-bit accesses).
  // The copy's first kRegCopyChunks float4s per thread stay in registers, the rest in shared
  // memory: 41% less shared-memory traffic per promotion. 7 is the most that ptxas fits in the
  // consumers' 232 registers without spilling (8 spills); MLA's longer Q K^T leaves room for 6 (7
  // spills).
  // (tile_size.h: 7 at head dim 128, MLA 6, none with 192-key blocks; a measuring variant may keep
  // fewer where the table keeps 7, as the timeline's does for its pointer and counter.)
  static constexpr int kRegCopyChunks =
      kSize.reg_copy_chunks == 7 && MeasureVariant<>::kFp8RegCopyChunks > 0
          ? MeasureVariant<>::kFp8RegCopyChunks
          : kSize.reg_copy_chunks;
  // The chunks in registers are the first kRegCopyChunks, or with separate sums the last (the sums').
  static constexpr int kOChunks = kPvN / 8;
  static constexpr int kRegCopyFirst = kSeparateSums ? kOChunks - kRegCopyChunks : 0;
  static constexpr int kOCopyBytes = kRowsPerConsumer * (kPvN - 8 * kRegCopyChunks) * 4;
  // The TMA-store epilogue's O tiles, after everything else: per consumer 64 rows of bf16 O in two
  // 64-column slices (128-byte swizzle rows).
  static constexpr int kOSliceBytes = kRowsPerConsumer * 128;
  static constexpr int kOConsumerBytes = kOSliceBytes * (kHeadDimV / 64);
  static constexpr int kOTilesBytes = kConsumers * kOConsumerBytes;
  static constexpr int kSmemAlign = 1024;
  static constexpr int kSmemLimit = 227 * 1024;
  // Shared memory: Q (kQBuffers tiles), the K/V ring, O's float32 copies, the sums' ones (separate
  // sums), V's staging buffers (staged V), the O tiles (the TMA-store epilogue).
  // Separate sums: their block of ones (8 rows of one V^T slice's keys) after the O copies, in a
  // 1024-byte slot (what follows stays aligned).
  static constexpr int kSumOnesBytes = kSeparateSums ? (kOnesBytes + 1023) / 1024 * 1024 : 0;
  static constexpr int kBetweenQAndOTilesBytes = kStages * kStageBytes + kConsumers * kOCopyBytes +
                                                 kSumOnesBytes + (kStagedV ? kStages * kVStagingBytes : 0);
  // Where the O tiles fit with one Q tile: not MLA's staged tile (207 KB before them).
  static constexpr bool kEpilogueTma =
      kSize.epilogue_tma && kQBytes + kBetweenQAndOTilesBytes + kOTilesBytes + kSmemAlign <= kSmemLimit;
  // One Q tile: a second (the producer loading the next tile's Q a key block earlier) measured
  // 0.6-2.4% slower (docs/fp8.md 10.24).
  static constexpr int kQBuffers = 1;
  static constexpr int kRingOffset = kQBuffers * kQBytes;
  static constexpr int kOCopyOffset = kRingOffset + kStages * kStageBytes;
  static constexpr int kSumOnesOffset = kOCopyOffset + kConsumers * kOCopyBytes;
  static constexpr int kVStagingOffset = kSumOnesOffset + kSumOnesBytes;
  static constexpr int kOTileOffset = kVStagingOffset + (kStagedV ? kStages * kVStagingBytes : 0);
  static constexpr int kSmemBytes = kOTileOffset + (kEpilogueTma ? kOTilesBytes : 0);
  static constexpr int kDynamicSmemBytes = kSmemBytes + kSmemAlign;
  static_assert(kStageBytes % kSmemAlign == 0, "stages must stay 1024-byte aligned");
  static_assert(kQSliceBytes % kSmemAlign == 0 && kKSliceBytes % kSmemAlign == 0,
                "Q and K slices must stay 1024-byte aligned");
  static_assert(kHeadDimQK % 32 == 0 && kHeadDimQK <= kQkSlices * kQkSliceCols);
  static_assert(kDynamicSmemBytes <= kSmemLimit, "the tile must fit Hopper's shared memory");
  static_assert(kOTileOffset % kSmemAlign == 0, "O tiles must stay 1024-byte aligned (swizzle)");
  static_assert(!kStagedV || (kVStagingOffset % kSmemAlign == 0 &&
                              kVStagingBytes == Fp8ValueTranspose::kTileBytes &&
                              kVtBytes == Fp8ValueTranspose::kTileBytes));
  static_assert(kPvN % 8 == 0 && kPromoteBlocks >= 1);
  static_assert(!kSeparateSums || (!kStagedV && kRegCopyChunks == 1 && kSumOnesOffset % kSmemAlign == 0),
                "separate sums: V^T from memory, the sums' copy in registers, the ones 1024-byte aligned");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= CtaRegisterPool(kThreads));
};

using Fp8Tile = Fp8TileT<128>;
using Fp8MlaTile = Fp8TileT<kMlaHeadDimQK>;  // MLA: q/k head dim 192, v/out 128
// The same tiles reading V^T from global memory (kStagedV false).
using Fp8VtTile = Fp8TileT<128, false>;
using Fp8MlaVtTile = Fp8TileT<kMlaHeadDimQK, false>;
// The dense (unwindowed, head dim 128) kernel's tile with V^T from global memory and 192 keys per
// block, for calls whose rows see many keys (docs/fp8.md 10.26, 10.28; Fp8KeyBlock picks it).
using Fp8VtWideTile = Fp8TileT<128, false, Layout::kDense, kFp8WideBlockN>;
// The varlen kernels' tiles: O stored from registers.
using Fp8VarlenTile = Fp8TileT<128, true, Layout::kVarlen>;
using Fp8VarlenVtTile = Fp8TileT<128, false, Layout::kVarlen>;

}  // namespace jzyfa
