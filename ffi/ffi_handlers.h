// The XLA FFI handler symbols jzyfa exports (see docs/architecture.md for the contract).
#pragma once

#include "xla/ffi/api/api.h"

namespace jzyfa {

// Custom-call target "jzyfa_flash_attention_fwd": q, k, v -> out, lse.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashAttentionFwd);

}  // namespace jzyfa
