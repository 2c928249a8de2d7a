// The forward calls' one validation (ValidateFwd), the mask and key-block rules, and the device check.
// Host code: the handler (handlers.cc) and module.cc call it; no kernel is compiled here.
#include <cmath>
#include <cstdint>
#include <string>

#include "flash_fwd.h"
#include "launch_utils.h"
#include "tile_size.h"

namespace jzyfa {
namespace {

constexpr int64_t kLimit30 = int64_t{1} << 30;

std::string Str(int64_t x) { return std::to_string(x); }

// 192-key blocks pay off once a row sees enough keys: each block's fixed work (quad shuffles, the r
// chain, waits, the turn hand-over) is spread over 1.5x the keys, while a causal tile's diagonal
// computes ~64 more masked keys and a row's last block covers up to 191 keys past its end. Measured on
// the H200, 192 against 128 with V^T in 64-key slices (docs/fp8.md 10.30): causal 6x2560 +0.3%, 5x3072
// +1.9%, 4x4K +3.3%, 3x6K +3.9%, 2x8K and longer +1 to +3%; no mask (32 q / 8 kv heads) 4x1024 -3.9%,
// 4x1536 +7.4%, 9x2304 +8.4%, 5x3072 +7.8%.
constexpr int64_t kWideMinKeysCausal = 3072;
constexpr int64_t kWideMinKeysNoMask = 1536;

// Whether the FP8 call runs on the dense V^T kernel that has 192-key blocks (unwindowed, head dim
// 128, V^T from memory).
bool HasWideFp8Kernel(bool varlen, bool v_transposed, int64_t head_dim, const MaskPlan& mask) {
  return !varlen && v_transposed && head_dim == 128 && !mask.windowed;
}

const char* FamilyName(Family family) {
  return family == Family::kFp8 ? "FP8" : family == Family::kInt8 ? "INT8" : "16-bit";
}

std::string HeadDimsMessage(const FwdParams& p) {
  const std::string got =
      "; got " + Str(p.head_dim) + " for q and k, " + Str(p.head_dim_v) + " for v";
  if (p.family() == Family::kInt8) {
    if (p.varlen) return "head_dim must be 128 for q, k and v for the jzyfa INT8 varlen kernel" + got;
    return "head_dim must be 128 or 256 for q, k and v, or 192 for q and k with 128 for v (MLA), for the "
           "jzyfa INT8 kernel (dense batches)" + got;
  }
  if (p.family() == Family::kFp8) {
    return std::string("head_dim must be 64, 128 or 256 for q, k and v") +
           (p.varlen ? "" : ", or 192 for q and k with 128 for v (MLA),") +
           " for the jzyfa FP8 " + (p.varlen ? "varlen " : "") + "kernel" + got;
  }
  return std::string("head_dim must be 64, 128 or 256 for the jzyfa ") +
         (p.varlen ? "varlen " : "") +
         "kernel (q, k and v alike), or 192 for q and k with 128 for v (MLA)" + got;
}

}  // namespace

std::string ResolveMask(bool causal, int64_t left, int64_t right, int64_t seqlen_q,
                        int64_t seqlen_k, MaskPlan* plan) {
  if (left < -1 || right < -1) {
    return "window_left and window_right must be >= 0, or -1 for unbounded; got (" + Str(left) +
           ", " + Str(right) + ")";
  }
  *plan = MaskPlan();
  if (left == -1 && right == -1) {  // no window: the mask is `causal`'s
    plan->causal = causal;
    return "";
  }
  if (causal) right = 0;
  if (left >= seqlen_k - 1) left = -1;
  if (right >= seqlen_q - 1) right = -1;
  if (left < 0 && right <= 0) {
    plan->causal = right == 0;
  } else {
    // The windowed kernels' positions, keys and bounds stay below 2^30 in magnitude (int32 masks).
    if (seqlen_q + seqlen_k > kLimit30) {
      return "sliding windows need seqlen_q + seqlen_k <= 2^30, got " + Str(seqlen_q + seqlen_k);
    }
    plan->windowed = true;
    plan->window_left = static_cast<int>(left);  // < seqlen_k <= 2^30
    plan->window_right = static_cast<int>(right);
  }
  return "";
}

int Fp8KeyBlock(bool v_transposed, int64_t head_dim, bool causal, int64_t window_left,
                int64_t window_right, int64_t seqlen_q, int64_t seqlen_k) {
  MaskPlan mask;  // where ResolveMask refuses the bounds the launch refuses the call: any answer does
  ResolveMask(causal, window_left, window_right, seqlen_q, seqlen_k, &mask);
  // The default block follows v's head dim: MLA's 192-wide q and k pair with a 128-wide v.
  const int head_dim_v = head_dim == kMlaHeadDimQK ? kMlaHeadDimV : static_cast<int>(head_dim);
  const int default_block = Fp8DefaultBlockN(head_dim_v);
  if (!HasWideFp8Kernel(false, v_transposed, head_dim, mask)) return default_block;
  return seqlen_k >= (mask.causal ? kWideMinKeysCausal : kWideMinKeysNoMask) ? kFp8WideBlockN
                                                                              : default_block;
}

std::string ValidateFwd(FwdParams* params, MaskPlan* mask) {
  FwdParams& p = *params;
  const bool fp8 = p.family() == Family::kFp8;
  const bool int8 = p.family() == Family::kInt8;
  // Sizes.
  if (p.varlen) {
    if (p.num_seqs < 1) {
      return "cu_seqlens_q and cu_seqlens_k need at least 2 entries (num_seqs + 1), got " +
             Str(p.num_seqs + 1);
    }
    if (p.total_q < 1 || p.total_k < 1) {
      return "q and k need at least one token (total_q = " + Str(p.total_q) +
             ", total_k = " + Str(p.total_k) + ")";
    }
    if (p.heads_q < 1 || p.heads_kv < 1) return "q, k and v need at least one head";
    if (p.max_seqlen_q < 1 || p.max_seqlen_k < 1) {
      return "max_seqlen_q and max_seqlen_k must be at least 1";
    }
  } else if (p.batch < 1 || p.seqlen_q < 1 || p.seqlen_k < 1 || p.heads_q < 1 || p.heads_kv < 1) {
    return "q, k and v need batch, sequence and head counts of at least 1";
  }
  // Head dims: some kernel of the family and layout has them (the mask is checked below).
  if (!HasFwdKernel(p.family(), static_cast<int>(p.head_dim), static_cast<int>(p.head_dim_v),
                    MaskKind::kNone, p.layout(), /*any_mask=*/true) ||
      p.head_dim > 256 || p.head_dim_v > 256) {
    return HeadDimsMessage(p);
  }
  if (p.heads_q % p.heads_kv != 0) {
    return "heads of q (" + Str(p.heads_q) + ") must be a multiple of heads of k/v (" +
           Str(p.heads_kv) + ")";
  }
  // Limits: token indices, TMA coordinates and tile indices are int32, with room for a grid's worth
  // of claims past the last tile.
  const int64_t seqlen_q = p.varlen ? p.max_seqlen_q : p.seqlen_q;
  const int64_t seqlen_k = p.varlen ? p.max_seqlen_k : p.seqlen_k;
  if (p.varlen) {
    if (p.total_q > kLimit30 || p.total_k > kLimit30 || p.max_seqlen_q > kLimit30 ||
        p.max_seqlen_k > kLimit30 || p.heads_q > kLimit30) {
      return "total_q, total_k, max_seqlen_q, max_seqlen_k and heads must be at most 2^30";
    }
    const int64_t tiles = (p.num_seqs + 1) * ((p.max_seqlen_q + 127) / 128) * p.heads_q;
    if (tiles > kLimit30) {
      return "(num_seqs + 1) x ceil(max_seqlen_q / 128) x heads_q must be at most 2^30, got " +
             Str(tiles);
    }
    if (p.cu_seqlens_q == nullptr || p.cu_seqlens_k == nullptr) return "cu_seqlens are missing";
  } else {
    if (p.batch > 65535) return "batch must be at most 65535, got " + Str(p.batch);
    if (p.seqlen_q > 65535 * 128) return "seqlen_q must be at most " + Str(65535 * 128);
    if (p.seqlen_k > kLimit30 || p.heads_q > kLimit30) {
      return "seqlen_k and heads must be at most 2^30";
    }
    const int64_t tiles = p.batch * ((p.seqlen_q + 127) / 128) * p.heads_q;
    if (tiles > kLimit30) {
      return "batch x ceil(seqlen_q / 128) x heads_q must be at most 2^30, got " + Str(tiles);
    }
  }
  if (p.tile_counter == nullptr) return "the tile counter scratch buffer is missing";
  if (!(p.softmax_scale > 0.f) || !std::isfinite(p.softmax_scale)) {
    return "softmax_scale must be a positive finite number";
  }
  if (!(p.softcap >= 0.f) || !std::isfinite(p.softcap)) {
    return "softcap must be 0 (none) or a positive finite number";
  }
  if (fp8 && p.softcap != 0.f) {
    return "softcap must be 0 for float8_e4m3fn inputs: the FP8 kernel has no softcap";
  }
  if (int8 && p.softcap != 0.f) return "softcap must be 0 for int8 inputs: the INT8 kernel has no softcap";
  // INT8 operands (their shapes: the handler's).
  if (int8) {
    if (p.descale_q == nullptr || p.descale_k == nullptr || p.descale_v == nullptr) {
      return "q_scale, k_scale and descale_v are required for int8 inputs";
    }
    if (!p.lean_p) return "lean_p must be true for int8 inputs (the INT8 kernel computes lean P only)";
    if (p.head_dim_v != 128 && !p.v_transposed) {
      return "v_transposed must be true for the INT8 kernel at head dim " + Str(p.head_dim_v) +
             ": it reads V^T from memory (jzyfa.fp8_layout), its in-kernel transpose takes 128-byte "
             "V rows only";
    }
    if (p.v_transposed && !p.varlen && p.vt_keys != (p.seqlen_k + 31) / 32 * 32) {
      return "vt must hold seqlen_k rounded up to a multiple of 32 keys (" + Str((p.seqlen_k + 31) / 32 * 32) +
             "), got " + Str(p.vt_keys);
    }
  }
  if (p.softcap != 0.f && p.head_dim != p.head_dim_v) {
    return "softcap must be 0 at head dims (" + Str(p.head_dim) + ", " + Str(p.head_dim_v) +
           "): the MLA kernel has no softcap";
  }
  // FP8 operands.
  if (fp8) {
    const int64_t groups = p.varlen ? p.num_seqs : p.batch;
    if (p.descale_count != 1 && p.descale_count != groups * p.heads_kv) {
      return std::string("descale_q, descale_k and descale_v must each hold 1 or ") +
             (p.varlen ? "num_seqs" : "batch") + " * heads_kv (" + Str(groups * p.heads_kv) +
             ") float32 values, got " + Str(p.descale_count);
    }
    if (p.descale_q == nullptr || p.descale_k == nullptr || p.descale_v == nullptr) {
      return "descale_q, descale_k and descale_v are required for float8_e4m3fn inputs";
    }
    if (p.varlen && !p.lean_p) {
      return "lean_p must be true for the FP8 varlen kernel (exact P has no varlen instantiation)";
    }
    if (p.head_dim_v != 128 && !p.v_transposed) {
      return "v_transposed must be true for the FP8 kernel at head dim " + Str(p.head_dim_v) +
             ": it reads V^T from memory (jzyfa.fp8_layout), its in-kernel transpose takes 128-byte "
             "V rows only";
    }
    if (p.v_transposed && !p.varlen && p.vt_keys != (p.seqlen_k + 31) / 32 * 32) {
      return "vt must hold seqlen_k rounded up to a multiple of 32 keys (" +
             Str((p.seqlen_k + 31) / 32 * 32) + "), got " + Str(p.vt_keys);
    }
  } else if (p.v_transposed && !int8) {  // INT8: checked above
    return "v_transposed must be false for 16-bit inputs";
  }
  // A varlen V^T (FP8 and INT8): each sequence's keys from its own 32-key group (Fp8VarlenValueKeys).
  if (p.v_transposed && p.varlen) {
    const int64_t want_keys = Fp8VarlenValueKeys(p.total_k, p.num_seqs);
    if (p.vt_keys != want_keys) {
      return "vt must hold roundup32(total_k) + 32 * (num_seqs + 1) = " + Str(want_keys) +
             " key columns, got " + Str(p.vt_keys);
    }
    // V^T columns (a box starts up to 128 keys past a sequence's end) stay int32.
    if (p.vt_keys > (int64_t{1} << 31) - 1024) {
      return "total_k + 32 * (num_seqs + 1) must be below 2^31 - 1024, got " + Str(p.vt_keys);
    }
  }
  // The mask: over the longest sequences for varlen calls (a bound that excludes no key of those
  // excludes none of a shorter one either).
  std::string error =
      ResolveMask(p.causal, p.window_left, p.window_right, seqlen_q, seqlen_k, mask);
  if (!error.empty()) return error;
  if (p.varlen && mask->windowed && p.total_q + p.total_k > kLimit30) {
    return "sliding windows need total_q + total_k <= 2^30, got " + Str(p.total_q + p.total_k);
  }
  if (!HasFwdKernel(p.family(), static_cast<int>(p.head_dim), static_cast<int>(p.head_dim_v),
                    mask->kind(), p.layout())) {
    return std::string("the jzyfa ") + FamilyName(p.family()) + " kernel takes head dims (" +
           Str(p.head_dim) + ", " + Str(p.head_dim_v) + ") " + (p.varlen ? "over varlen batches " : "") +
           "with a causal mask or none, not a sliding window (window_left, window_right)";
  }
  // Keys per block.
  if (fp8) {
    const bool wide = HasWideFp8Kernel(p.varlen, p.v_transposed, p.head_dim, *mask);
    const int64_t block = Fp8DefaultBlockN(static_cast<int>(p.head_dim_v));
    if (p.key_block == 0) {
      p.key_block = wide ? Fp8KeyBlock(p.v_transposed, p.head_dim, p.causal, p.window_left,
                                       p.window_right, p.seqlen_q, p.seqlen_k)
                         : block;
    } else if (!(p.key_block == block || (wide && p.key_block == kFp8WideBlockN))) {
      return "key_block must be 0 (the launch's rule), " + Str(block) +
             std::string(wide ? " or 192" : "") + " for this FP8 call, got " + Str(p.key_block) +
             (wide ? "" : " (192-key blocks: dense, unwindowed head dim 128 with v_transposed)");
    }
  } else if (int8) {
    // The FP8 tile's default block: 128 keys (one K scale), 64 at head dim 256 (half a K scale block).
    const int64_t block = Fp8DefaultBlockN(static_cast<int>(p.head_dim_v));
    if (p.key_block != 0 && p.key_block != block) {
      return "key_block must be 0 (the launch's rule) or " + Str(block) + " for int8 inputs at head dim " +
             Str(p.head_dim_v) + ", got " + Str(p.key_block);
    }
    p.key_block = block;
  } else {
    const int64_t block = Fwd16DefaultBlockN(static_cast<int>(p.head_dim_v));
    if (p.key_block != 0 && p.key_block != block) {
      return "key_block must be 0 (the launch's rule) or " + Str(block) +
             " for the 16-bit kernel at head dims (" + Str(p.head_dim) + ", " + Str(p.head_dim_v) +
             "), got " + Str(p.key_block);
    }
  }
  return "";
}

std::string CheckDeviceSupport() {
  int device = 0;
  std::string error = CurrentDevice(&device);
  return error.empty() ? GetDeviceInfo(device).error : error;
}

}  // namespace jzyfa
