// The XLA FFI handler symbols jzyfa exports (docs/architecture.md describes the contract).
#pragma once

#include <cstdint>

#include "xla/ffi/api/api.h"

namespace jzyfa {

// Custom-call target "jzyfa_attention_fwd", every forward call: operands q, k, v, then cu_seqlens_q
// and cu_seqlens_k (int32 [num_seqs + 1]) iff attribute varlen, then descale_q, descale_k,
// descale_v (float32, each 1 value or (batch or num_seqs) * heads_kv) iff q is float8_e4m3fn.
// Dense: q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv] or, FP8 v_transposed, V^T [B, Hkv,
// 128, Sk rounded up to 32]; varlen: q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv] or, FP8
// v_transposed, V^T [Hkv, 128, Fp8VarlenValueKeys]. Results: out (q's dtype, bf16 for FP8; q's shape
// with Dv), lse float32 ([B, Hq, Sq] dense, [Hq, Tq] varlen), tile counter (int32[1] scratch the
// launch zeroes and the persistent kernel claims tiles from). Attributes, all always present:
// softmax_scale f32, causal, window_left / window_right i64 (-1 unbounded), varlen, max_seqlen_q /
// max_seqlen_k i64 (0 for dense), lean_p (FP8), v_transposed (FP8), key_block i64 (0: the launch's
// rule; 128 or 192 force it where that instantiation exists).
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionFwd);

// Custom-call target "jzyfa_attention_bwd" (docs/architecture.md, "The backward"): q, k, v, dout
// (16-bit, dense [B, S, H, D]), lse and delta float32 [B, Hq, Sq] -> dq, dk, dv, int32 [2] tile
// counters. Attributes softmax_scale, causal, window_left, window_right, varlen, max_seqlen_q,
// max_seqlen_k; varlen, windows and head dims other than 64 and 128 are refused.
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionBwd);

// Custom-call target "jzyfa_fp8_value_operand": v e4m3 [batch, seq_k, heads_kv, 128] -> vt e4m3
// [batch, heads_kv, 128, seq_k rounded up to 32], the FP8 kernel's V operand (jzyfa/fp8_layout.py).
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8ValueOperand);

XLA_FFI_DECLARE_HANDLER_SYMBOL(Int8Quantize);

// How many times the jzyfa_attention_fwd handler has executed in this process (every device,
// every call site, failed calls included). Under XLA command buffers the handler runs only
// when a graph is recorded or updated, not when it is replayed: tests count its runs to see
// which happened.
uint64_t HandlerCalls();

}  // namespace jzyfa
