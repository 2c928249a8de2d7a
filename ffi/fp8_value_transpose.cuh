// V's operand of the FP8 kernel, built in shared memory: FP8 wgmma reads B K-major, so O += P V
// needs V^T (head-dim rows of keys), keys permuted inside each 32-key group (jzyfa/fp8_layout.py:
// column k of a group holds key physical_key(k)). The producer's TMA loads V's tile as it lies in
// memory, [128 keys][128 head-dim bytes], unswizzled, into a staging buffer; three producer warps
// transpose it into the stage's V^T tile, [128 head-dim rows][128 keys], 128-byte swizzled exactly
// as a TMA load of V^T would have left it (16-byte chunk c of row n at chunk c ^ (n % 8)), which is
// what the consumers' SmemDescSw128 descriptors read.
//
// The work is 8 pieces: piece c = keys 16c .. 16c + 15 = logical 16-byte chunk c of every V^T row.
// In a piece, lane l reads the 4-byte word `word` (head-dim bytes 4 word .. 4 word + 3) of each of
// the 16 key rows (16 LDS.32; one key row per instruction, 32 distinct words: conflict-free),
// transposes them in 4 x 4 byte blocks with PRMT (which bytes it picks applies the permutation:
// word i of the chunk holds keys 2i, 2i + 1, 2i + 8, 2i + 9 of the piece) and stores 16 bytes to
// each of the 4 V^T rows 4 word .. 4 word + 3 (4 STS.128). Store k of lane l writes row
// 4 word + (k + rot) % 4, rot = l % 4 (the transpose's first PRMTs take their selectors from
// registers, so the rotation costs nothing), and word is odd for l / 4 odd: the 8 lanes of a
// 128-bit store phase then write 8 different rows % 8, i.e. 8 different swizzled chunks (all 32
// banks). Without the rotation they would hit 2 chunks: 4-way conflicts.
// tests/test_fp8_value_transpose.py simulates these lanes in NumPy against fp8_value_operand.
#pragma once

#include <cstdint>
#include <type_traits>

#include "measure_variant.h"
#include "sm90_mma.cuh"

namespace jzyfa {

// The LDSM.T / STSM transpose below (Fp8MatrixTransposeLane), 33 instead of 65 instructions per piece
// and lane, measured +1-4% over the PRMT transpose on the H200 (docs/fp8.md 10.16); the PRMT one
// (Fp8TransposeLane) is a measuring build's (tools/measure/prmt_transpose.h).

struct Fp8ValueTranspose {
  // Whether the staging tile is 128-byte swizzled (the matrix transpose's loads need it; the TMA
  // map of V then asks for CU_TENSOR_MAP_SWIZZLE_128B).
  static constexpr bool kSwizzledStaging = !MeasureVariant<>::kFp8PrmtTranspose;
  static constexpr int kKeys = 128;      // key rows of the staging tile (one key block)
  static constexpr int kHeadDim = 128;   // bytes per key row = V^T rows
  static constexpr int kPieceKeys = 16;  // keys of one piece: one 16-byte chunk of each V^T row
  static constexpr int kPieces = kKeys / kPieceKeys;
  static constexpr int kWarps = 3;  // warps 1..3 of the producer warpgroup (warp 0 issues TMA)
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kTileBytes = kKeys * kHeadDim;
  static_assert(kHeadDim == 4 * 32, "one 4-byte word of each key row per lane");
};

// A transposing lane's constants (see above).
struct Fp8TransposeLane {
  uint32_t word;    // the word of each key row it reads: head-dim rows 4 word .. 4 word + 3
  uint32_t rot;     // its store k writes row 4 word + (k + rot) % 4
  uint32_t sel_lo;  // PRMT selectors interleaving bytes rot, rot + 1 (lo) and rot + 2, rot + 3
  uint32_t sel_hi;  // (hi) of two words, mod 4

  __device__ __forceinline__ explicit Fp8TransposeLane(uint32_t lane)
      : word((lane & 24u) | ((lane & 3u) << 1) | ((lane >> 2) & 1u)),
        rot(lane & 3u),
        sel_lo(Selector(lane & 3u)),
        sel_hi(Selector((lane + 2u) & 3u)) {}

  // Result bytes: x.b, y.b, x.(b + 1), y.(b + 1), b + 1 mod 4 (__byte_perm numbers y's bytes 4..7).
  __device__ __forceinline__ static uint32_t Selector(uint32_t b) {
    const uint32_t b1 = (b + 1u) & 3u;
    return b | ((b + 4u) << 4) | (b1 << 8) | ((b1 + 4u) << 12);
  }
};

// rows[k] = byte (k + rot) % 4 of w0, w1, w2, w3 (w0's in the lowest byte): a 4 x 4 byte
// transpose, its rows rotated by rot (rot = 0: 0x5140, 0x7362, the transpose of
// ffi/fp8_value_operand.cu before this kernel took it over).
__device__ __forceinline__ void Transpose4x4Rotated(uint32_t w0, uint32_t w1, uint32_t w2,
                                                    uint32_t w3, const Fp8TransposeLane& lane,
                                                    uint32_t (&rows)[4]) {
  const uint32_t lo01 = __byte_perm(w0, w1, lane.sel_lo);  // w0.r w1.r w0.r+1 w1.r+1
  const uint32_t hi01 = __byte_perm(w0, w1, lane.sel_hi);  // w0.r+2 w1.r+2 w0.r+3 w1.r+3
  const uint32_t lo23 = __byte_perm(w2, w3, lane.sel_lo);
  const uint32_t hi23 = __byte_perm(w2, w3, lane.sel_hi);
  rows[0] = __byte_perm(lo01, lo23, 0x5410);  // w0.r w1.r w2.r w3.r
  rows[1] = __byte_perm(lo01, lo23, 0x7632);
  rows[2] = __byte_perm(hi01, hi23, 0x5410);
  rows[3] = __byte_perm(hi01, hi23, 0x7632);
}

__device__ __forceinline__ uint32_t LoadShared32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ void StoreShared128(uint32_t addr, uint32_t a, uint32_t b, uint32_t c,
                                               uint32_t d) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c),
               "r"(d)
               : "memory");
}

// Piece `piece` (keys 16 piece .. + 15) of the staging tile at `staging` (shared address, [key][128
// bytes], unswizzled) into chunk `piece` of every row of the V^T tile at `vt` (1024-byte aligned,
// 128-byte swizzled).
__device__ __forceinline__ void TransposeValuePiece(uint32_t staging, uint32_t vt, uint32_t piece,
                                                    const Fp8TransposeLane& lane) {
  using T = Fp8ValueTranspose;
  const uint32_t src = staging + piece * (T::kPieceKeys * T::kHeadDim) + 4u * lane.word;
  uint32_t w[T::kPieceKeys];  // w[j]: head-dim bytes 4 word .. 4 word + 3 of the piece's key j
#pragma unroll
  for (int j = 0; j < T::kPieceKeys; ++j) w[j] = LoadShared32(src + j * T::kHeadDim);
  uint32_t words[4][4];  // [word i of the chunk][store k]
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    Transpose4x4Rotated(w[2 * i], w[2 * i + 1], w[2 * i + 8], w[2 * i + 9], lane, words[i]);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t row = 4u * lane.word + ((k + lane.rot) & 3u);
    StoreShared128(vt + row * 128u + ((piece ^ (row & 7u)) << 4), words[0][k], words[1][k],
                   words[2][k], words[3][k]);
  }
}

// ---------------------------------------------------------------------------------------------
// The same piece with matrix instructions (the default; ~31 instead of ~48
// instructions per piece and lane). The staging tile is 128-byte swizzled here (TMA: chunk c of key
// row n at chunk c ^ (n % 8)). A piece is done in 4 quarters q of the head dim (bytes 32 q .. 32 q +
// 31), each one LDSM.x4.T, 4 PRMT and one STSM.x4:
//   - ldmatrix .trans reads four 8 x 8 matrices of 16-bit elements: M0 = keys 0..7 of the piece x
//     chunk 2q, M1 = keys 8..15 x chunk 2q, M2, M3 the same for chunk 2q + 1. Lane 8 i + l gives the
//     address of row l of matrix i. Transposed, lane t receives from matrix i the 16-bit elements
//     (row 2 (t % 4), column t / 4) and (row 2 (t % 4) + 1, column t / 4): the bytes of head-dim
//     d, d + 1 (d = 16 chunk + 2 (t / 4)) of keys k0 = 2 (t % 4) and k0 + 1 (plus 8 in M1, M3).
//     A matrix's 8 rows are 8 consecutive keys, so 8 different swizzled chunks: conflict-free.
//   - PRMT 0x6420 of M0's and M1's words gives keys k0, k0 + 1, k0 + 8, k0 + 9 of row d, 0x7531 of
//     row d + 1: word t % 4 of the piece's chunk in V^T's permuted key order (physical_key) comes
//     out of the 16-bit transpose as it is.
//   - stmatrix (not transposed) writes four 8 x 8 matrices; lane t gives word t % 4 of row t / 4 of
//     each, lane 8 j + r the address of row r of matrix j. Lanes t < 16 put row d in matrix 0 and
//     d + 1 in matrix 1, lanes t >= 16 the other way round (their selectors swap), so a matrix's rows
//     are 32 q + {0, 2, 4, 6, 9, 11, 13, 15} (+ 1, + 16, + 17): 8 different rows % 8, 8 different
//     swizzled chunks: conflict-free.
// tests/test_fp8_value_transpose_ldsm.py simulates these lanes in NumPy against fp8_value_operand.
struct Fp8MatrixTransposeLane {
  uint32_t load_offset;     // its LDSM row's offset in a piece of the staging tile, quarter 0
  uint32_t store_offset;    // its STSM row's offset in V^T (quarter 0), without the chunk
  uint32_t store_row_mod8;  // that row % 8: the chunk's swizzle
  uint32_t sel_even;        // PRMT selector of the word stored to matrices 0 and 2
  uint32_t sel_odd;         // and to matrices 1 and 3

  // Lane 8 i + l addresses row l of matrix i: key 8 (i % 2) + l (key % 8 = l) of the piece, logical
  // chunk 2 q + i / 2, at swizzled chunk (2 q + i / 2) ^ l = 2 (q ^ (l / 2)) + ((i / 2) ^ l) % 2.
  // Quarter q's bits (5, 6) sit above the rest and below the piece's, so quarter q's address is
  // quarter 0's XOR (q << 5): one register per lane for all four.
  __device__ __forceinline__ explicit Fp8MatrixTransposeLane(uint32_t lane) {
    const uint32_t matrix = lane / 8, row = lane % 8;
    load_offset =
        (8u * (matrix & 1u) + row) * 128u + ((((matrix / 2u) ^ row) & 1u) << 4) + ((row / 2u) << 5);
    const uint32_t vt_row = 16u * (matrix / 2u) + 2u * row + ((matrix & 1u) ^ (row >= 4u ? 1u : 0u));
    store_offset = vt_row * 128u;
    store_row_mod8 = vt_row % 8u;
    sel_even = lane < 16u ? 0x6420u : 0x7531u;
    sel_odd = lane < 16u ? 0x7531u : 0x6420u;
  }
};

__device__ __forceinline__ void LoadMatrixX4Trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// TransposeValuePiece with matrix instructions, from a 128-byte swizzled staging tile.
__device__ __forceinline__ void TransposeValuePiece(uint32_t staging, uint32_t vt, uint32_t piece,
                                                    const Fp8MatrixTransposeLane& lane) {
  using T = Fp8ValueTranspose;
  const uint32_t src = staging + piece * (T::kPieceKeys * T::kHeadDim);
  const uint32_t dst = vt + lane.store_offset + ((piece ^ lane.store_row_mod8) << 4);
  uint32_t m[4][4];  // [quarter][matrix]
#pragma unroll
  for (int q = 0; q < 4; ++q) LoadMatrixX4Trans((src + lane.load_offset) ^ (q << 5), m[q]);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    StoreMatrixX4(dst + q * 32u * 128u, __byte_perm(m[q][0], m[q][1], lane.sel_even),
                  __byte_perm(m[q][0], m[q][1], lane.sel_odd),
                  __byte_perm(m[q][2], m[q][3], lane.sel_even),
                  __byte_perm(m[q][2], m[q][3], lane.sel_odd));
  }
}

// The transposing lanes' type: its TransposeValuePiece overload is the one the kernel calls.
using Fp8ValueTransposeLane = std::conditional_t<MeasureVariant<>::kFp8PrmtTranspose, Fp8TransposeLane,
                                                  Fp8MatrixTransposeLane>;

}  // namespace jzyfa
