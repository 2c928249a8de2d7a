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

namespace jzyfa {

struct Fp8ValueTranspose {
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

}  // namespace jzyfa
