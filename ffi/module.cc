// The nanobind module `jzyfa._jzyfa_ffi`: hands JAX the FFI handler capsules, and reads the
// handler-call counter (tests use it to tell a command-buffer replay from a handler run).
#include <nanobind/nanobind.h>

#include "ffi_handlers.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule HandlerCapsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_jzyfa_ffi, m) {
  m.doc() = "XLA FFI handlers of jzyfa's Hopper attention kernels";
  m.def("registrations", []() {
    nb::dict targets;
    targets["jzyfa_flash_attention_fwd"] = HandlerCapsule(jzyfa::FlashAttentionFwd);
    targets["jzyfa_flash_attention_varlen_fwd"] = HandlerCapsule(jzyfa::FlashAttentionVarlenFwd);
    targets["jzyfa_flash_attention_fp8_fwd"] = HandlerCapsule(jzyfa::FlashAttentionFp8Fwd);
    targets["jzyfa_fp8_value_operand"] = HandlerCapsule(jzyfa::Fp8ValueOperand);
    return targets;
  });
  m.def(
      "handler_calls", []() { return jzyfa::HandlerCalls(); },
      "How many times the jzyfa_flash_attention_fwd handler has executed in this process.");
}
