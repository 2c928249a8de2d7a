// The nanobind module `jzyfa._jzyfa_ffi`. Its only job: hand JAX the FFI handler capsules.
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
    return targets;
  });
}
