// The FP8 kernel's online softmax (docs/fp8.md sections 1-3, 10.7): per-row integer reference
// exponents, lean P's e4m3 codes from the FMA pipe (or exact P through ex2 and a conversion), and the
// packing of the codes into P V's A fragments. jzyfa/fp8_emulation.py specifies it bit for bit where it
// can; flash_fwd_fp8_kernel.cuh runs it on each key block.
#pragma once

#include <cstdint>

#include "kernel_timeline.cuh"
#include "sm90_mma.cuh"

namespace jzyfa {

// The FP8 softmax's constants (jzyfa/fp8_emulation.py, docs/fp8.md).
struct Fp8Softmax {
  // A fresh r puts a block's max P~ in (2^6, 2^7], and r rises only past P~ = 2^8.75 (< 448):
  // 1.75 to 2.75 doublings of headroom, so r changes, and O is rescaled, in fewer blocks (12% of a
  // warp's blocks on Gaussian inputs at 4K, 42% on activation-like ones, against 38% and 65% with
  // (2^7, 2^8] and 0.75): jzyfa/fp8_emulation.py, docs/fp8.md section 1.
  static constexpr float kPExponent = 7.f;
  static constexpr float kLazyThreshold = 1.75f;
  static constexpr float kHysteresis = 4.f;        // r falls only below P~ = 2^3
  static constexpr float kMaxBlockExponent = 32.f;  // r stays within 2^32 of the running max's
  static constexpr float kCodeSlope = 8.f;         // e4m3 codes per doubling
  static constexpr float kCodeOfOne = 56.f;        // 0x38
  // Lean P in two FFMAs, both on the FMA pipe (the ALU pipe, at half the issue rate, held the clamp
  // and the byte packing before): y = saturate((8 s' + 56 - 8 r) / 128) clamps codes below 0 to 0,
  // then y * 128 + magic rounds to the code (an integer in [2^23, 2^24)). The packing adds the
  // four words with integer multiply-adds, so their magics must cancel: the third code of each
  // register takes 2^23 + 0xB500, the others 2^23 (0x4B000000 + 0x4B00B500 * 2^16 = 0 mod 2^32).
  static constexpr float kCodeScale = 1.f / 128.f;
  static constexpr float kPackMagic = 8388608.f;       // 2^23, bits 0x4B000000
  static constexpr float kPackMagicThird = 8434944.f;  // 2^23 + 0xB500, bits 0x4B00B500
};

// r after a block whose largest score (log2 units) is block_max; integers only, so exact.
__device__ __forceinline__ float NextReference(float r, float running_max, float block_max) {
  using C = Fp8Softmax;
  const float floor_r = ceilf(running_max) - C::kPExponent - C::kMaxBlockExponent;
  const float fresh = fmaxf(ceilf(block_max) - C::kPExponent, floor_r);
  bool change = block_max > r + C::kPExponent + C::kLazyThreshold;  // r = -inf: any visible key
  change |= block_max < r + C::kPExponent - C::kHysteresis && fresh < r;
  change &= block_max > -INFINITY;
  return change ? fresh : r;
}

// 2^d for an integer-valued d (0 below the float32 normal range): the exact rescale factor.
__device__ __forceinline__ float Exp2Integer(float d) {
  return d < -126.f ? 0.f : __int_as_float((static_cast<int>(d) + 127) << 23);
}

// Four lean-P codes in one A register, `a` lowest: a + 2^8 b + 2^16 c + 2^24 d over the words'
// bits (mod 2^32), three integer multiply-adds on the FMA pipe. The magics cancel (Fp8Softmax):
// a, b, d carry 0x4B000000, c carries 0x4B00B500, and every code is below 2^8, so nothing carries.
__device__ __forceinline__ uint32_t PackCodes(float a, float b, float c, float d) {
  const uint32_t low = __float_as_uint(b) * 256u + __float_as_uint(a);
  const uint32_t high = __float_as_uint(d) * 256u + __float_as_uint(c);
  return high * 65536u + low;
}

// The maximum of m[0 .. n) into m[0], a tree: m[c] = max(m[c], m[c + ceil(n / 2)]) per level (an odd
// count keeps its middle value for the next level).
template <int kN, int kSize>
__device__ __forceinline__ void FoldMax(float (&m)[kSize]) {
  if constexpr (kN > 1) {
#pragma unroll
    for (int c = 0; c < kN / 2; ++c) m[c] = fmaxf(m[c], m[c + (kN + 1) / 2]);
    FoldMax<(kN + 1) / 2>(m);
  }
}

// The online softmax of one consumer warpgroup over one key block (accumulator layout as in
// OnlineSoftmax of flash_fwd_kernel.cuh: a thread owns rows h = 0, 1, pairs of columns).
template <bool kLeanP, int kBlockN = 128>
struct Fp8OnlineSoftmax {
  float r[2] = {-INFINITY, -INFINITY};            // reference exponents (integers)
  float running_max[2] = {-INFINITY, -INFINITY};  // log2 units

  // The codes' affine map for the current r, kept by UpdateReference for WriteCodes: lean, the
  // code (scaled by 2^-7) is s * c1 + c0[h]; exact, P~ = 2^(s * c1 + c0[h]). While r = -inf the
  // map is that of r = 0 (a row with no visible key yet has only -inf scores: P~ = 0).
  float c1, c0[2];

  __device__ __forceinline__ Fp8OnlineSoftmax() : c0{MapOffset(0.f), MapOffset(0.f)} {}

  // Before the first Step: row_scale = descale_q descale_k scale log2(e).
  __device__ __forceinline__ void SetRowScale(float row_scale) {
    c1 = kLeanP ? (Fp8Softmax::kCodeSlope * Fp8Softmax::kCodeScale) * row_scale : row_scale;
  }

  // c0 for a finite r: lean, the code of 2^0 minus 8 r, scaled by 2^-7 (exact); exact, -r.
  __device__ __forceinline__ static float MapOffset(float r) {
    using C = Fp8Softmax;
    return kLeanP ? (C::kCodeOfOne - C::kCodeSlope * r) * C::kCodeScale : -r;
  }

  // Scores of keys a row does not see (past seqlen_k, or after the row's causal diagonal) -> -inf.
  __device__ __forceinline__ static void Mask(float (&s)[kBlockN / 2], int key_start,
                                              int first_row, int lane, int seqlen_k, bool causal,
                                              int diagonal) {
    const int quad_col = 2 * (lane % 4);
#pragma unroll
    for (int c = 0; c < kBlockN / 8; ++c)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key_start + 8 * c + quad_col + (e & 1);
        const int row = first_row + 8 * (e >> 1);
        if (!(key < seqlen_k && (!causal || key <= row + diagonal))) s[4 * c + e] = -INFINITY;
      }
  }

  // Finds each row's block maximum, updates r and the codes' map; alpha is the factor O must be
  // rescaled by. A dependency chain (max tree, two quad shuffles, the reference update).
  __device__ __forceinline__ void UpdateReference(const float (&s)[kBlockN / 2],
                                                  float (&alpha)[2], float row_scale) {
    constexpr int kChunks = kBlockN / 8;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // A tree, not a chain: 5 dependent FMNMX instead of 32.
      float m[kChunks];
#pragma unroll
      for (int c = 0; c < kChunks; ++c) m[c] = fmaxf(s[4 * c + 2 * h], s[4 * c + 2 * h + 1]);
      // Fold the upper chunks onto the lower ones (16 -> 8 -> 4 -> 2 -> 1, 24 -> 12 -> 6 -> 3 -> 2 -> 1).
      FoldMax<kChunks>(m);
      const float block_max = QuadMax(m[0]) * row_scale;  // max commutes with the positive scale
      running_max[h] = fmaxf(running_max[h], block_max);
      const float new_r = NextReference(r[h], running_max[h], block_max);
      alpha[h] = r[h] == -INFINITY ? 0.f : Exp2Integer(r[h] - new_r);  // O is still 0 at -inf
      r[h] = new_r;
      // A row with no visible key yet has r = -inf and only -inf scores: any finite c0 works.
      c0[h] = MapOffset(new_r == -INFINITY ? 0.f : new_r);
    }
  }

  // P~'s e4m3 A fragments (p[j]: keys 32j..32j+31, packed so that V^T's permuted keys line up),
  // from S and the current map. S is overwritten.
  __device__ __forceinline__ void WriteCodes(float (&s)[kBlockN / 2],
                                             uint32_t (&p)[kBlockN / 32][4]) const {
    Encode(s);
    Pack(s, p);
  }
  // WriteCodes' first half: each score in S replaced by its code (as a float).
  __device__ __forceinline__ void Encode(float (&s)[kBlockN / 2]) const {
#pragma unroll
    for (int i = 0; i < kBlockN / 2; ++i) s[i] = Code(s[i], i);
  }
  // Its second half: the A fragments from the codes in S.
  __device__ __forceinline__ static void Pack(const float (&s)[kBlockN / 2],
                                              uint32_t (&p)[kBlockN / 32][4]) {
#pragma unroll
    for (int j = 0; j < kBlockN / 32; ++j) PackStep(s, p, j);
  }

  // P~ of accumulator value i (score x): lean, the code RNE(fl32(8 s' + 56 - 8 r)) in the float's
  // low byte, codes below 0 saturated to 0 (tau keeps them <= 126, so none reaches NaN's 0x7F);
  // exact, 2^(s scale - r) rounded to e4m3. Lean rounds twice (to float32, then to an integer): it
  // differs from one rounding only within 2^-17 of a half-integer code.
  __device__ __forceinline__ float Code(float score, int i) const {
    using C = Fp8Softmax;
    const float x = fmaf(score, c1, c0[(i >> 1) & 1]);
    if (kLeanP) {
      const float magic = (i % 8 == 4 || i % 8 == 6) ? C::kPackMagicThird : C::kPackMagic;
      return fmaf(__saturatef(x), 128.f, magic);
    }
    return ptx::ex2_approx(x);
  }

  // A fragment of k-step j, from accumulator chunks c = 4j .. 4j + 3 (jzyfa/fp8_layout.py):
  // registers 0/1 hold rows g / g + 8 of chunks c, c + 1; registers 2/3 those of c + 2, c + 3.
  __device__ __forceinline__ static void PackStep(const float (&s)[kBlockN / 2],
                                                  uint32_t (&p)[kBlockN / 32][4], int j) {
    const float* t = s + 16 * j;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float* u = t + 8 * half;
      if (kLeanP) {
        p[j][2 * half + 0] = PackCodes(u[0], u[1], u[4], u[5]);
        p[j][2 * half + 1] = PackCodes(u[2], u[3], u[6], u[7]);
      } else {
        p[j][2 * half + 0] = ptx::pack4_e4m3(u[0], u[1], u[4], u[5]);
        p[j][2 * half + 1] = ptx::pack4_e4m3(u[2], u[3], u[6], u[7]);
      }
    }
  }

  // One block: S masked as needed, r updated (alpha: O's rescale factor), P~'s A fragments.
  // (Writing the codes with the old r before the block's maxima are known, and again where r moved,
  // measured no faster: docs/benchmarks.md, "speculative codes".)
  // kPack false: the codes stay in S (as floats) and p is not written; Pack builds it later.
  template <bool kPack = true, typename Timeline>
  __device__ __forceinline__ void Step(float (&s)[kBlockN / 2], uint32_t (&p)[kBlockN / 32][4],
                                       float (&alpha)[2], float row_scale, bool needs_mask,
                                       int key_start, int first_row, int lane, int seqlen_k,
                                       bool causal, int diagonal, Timeline& timeline) {
    if (needs_mask) Mask(s, key_start, first_row, lane, seqlen_k, causal, diagonal);
    UpdateReference(s, alpha, row_scale);
    timeline.Mark(kReferenceKnown);  // block 0's stamp is overwritten by iteration 1's
    if constexpr (kPack) {
      WriteCodes(s, p);
    } else {
      Encode(s);
    }
  }
};

}  // namespace jzyfa
