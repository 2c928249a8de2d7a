// The XLA FFI handler symbols jzyfa exports (see docs/architecture.md for the contract).
#pragma once

#include <cstdint>

#include "xla/ffi/api/api.h"

namespace jzyfa {

// Custom-call target "jzyfa_flash_attention_fwd": q, k, v -> out, lse, tile counter (an int32[1]
// scratch result the launch zeroes and the persistent kernel claims tiles from).
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashAttentionFwd);

// Custom-call target "jzyfa_flash_attention_varlen_fwd": q [total_q, Hq, D], k, v [total_k, Hkv, D]
// (bf16/f16), cu_seqlens_q, cu_seqlens_k (int32 [num_seqs + 1]) -> out, lse [Hq, total_q], tile
// counter; attributes softmax_scale, causal, max_seqlen_q, max_seqlen_k (int64).
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashAttentionVarlenFwd);

// Custom-call target "jzyfa_flash_attention_fp8_fwd": q, k, v (e4m3), descale_q, descale_k,
// descale_v (f32) -> out (bf16, q's shape with v's head dim: MLA's 128 where q has 192), lse, tile
// counter; attributes softmax_scale, causal, window_left, window_right, lean_p, v_transposed (v is
// then V^T [batch, heads_kv, 128, seq_k rounded up to 32], jzyfa_fp8_value_operand's output).
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashAttentionFp8Fwd);

// Custom-call target "jzyfa_flash_attention_fp8_varlen_fwd": q, k, v (e4m3, packed),
// cu_seqlens_q, cu_seqlens_k (s32), descale_q, descale_k, descale_v (f32) -> out (bf16),
// lse [heads_q, total_q], tile counter; attributes as jzyfa_flash_attention_varlen_fwd's.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashAttentionFp8VarlenFwd);

// Custom-call target "jzyfa_fp8_value_operand": v e4m3 [batch, seq_k, heads_kv, 128] -> vt e4m3
// [batch, heads_kv, 128, seq_k rounded up to 32], the FP8 kernel's V operand (jzyfa/fp8_layout.py).
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8ValueOperand);

// How many times the FlashAttentionFwd handler has executed in this process (every device,
// every call site, failed calls included). Under XLA command buffers the handler runs only
// when a graph is recorded or updated, not when it is replayed: tests count its runs to see
// which happened.
uint64_t HandlerCalls();

}  // namespace jzyfa
