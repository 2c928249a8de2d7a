// The nanobind module `jzyfa._jzyfa_ffi`: hands JAX the FFI handler capsules, and reads the
// handler-call counter (tests use it to tell a command-buffer replay from a handler run).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "ffi_handlers.h"
#include "flash_fwd.h"
#include "launch_utils.h"

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
    targets["jzyfa_flash_attention_fp8_varlen_fwd"] =
        HandlerCapsule(jzyfa::FlashAttentionFp8VarlenFwd);
    targets["jzyfa_fp8_value_operand"] = HandlerCapsule(jzyfa::Fp8ValueOperand);
    return targets;
  });
  m.def(
      "handler_calls", []() { return jzyfa::HandlerCalls(); },
      "How many times the jzyfa_flash_attention_fwd handler has executed in this process.");
  m.def(
      "fp8_key_block",
      [](bool v_transposed, int64_t head_dim, bool causal, int64_t window_left,
         int64_t window_right, int64_t seqlen_q, int64_t seqlen_k) {
        jzyfa::FlashFwdFp8Params params;
        params.v_transposed = v_transposed;
        params.head_dim = head_dim;
        params.causal = causal;
        params.window_left = window_left;
        params.window_right = window_right;
        params.seqlen_q = seqlen_q;
        params.seqlen_k = seqlen_k;
        return jzyfa::Fp8KeyBlock(params);
      },
      nb::arg("v_transposed"), nb::arg("head_dim"), nb::arg("causal"), nb::arg("window_left"),
      nb::arg("window_right"), nb::arg("seqlen_q"), nb::arg("seqlen_k"),
      "Keys per block of the FP8 kernel for such a call (window bounds -1 for none, head_dim of q "
      "and k): the block_n its emulation must use.");
  m.def(
      "tile_group_pairs",
      [](int64_t pairs, int64_t seqlen_q, int64_t seqlen_k, bool causal, int window_left,
         int window_right, int block_m, int sm_count) {
        return jzyfa::TileGroupPairs(pairs, seqlen_q, seqlen_k, causal, window_left, window_right,
                                     block_m, sm_count);
      },
      nb::arg("pairs"), nb::arg("seqlen_q"), nb::arg("seqlen_k"), nb::arg("causal"),
      nb::arg("window_left"), nb::arg("window_right"), nb::arg("block_m"), nb::arg("sm_count"),
      "(batch, head) pairs per group of the dense kernels' tile order (ffi/launch_utils.h) for such "
      "a call on a GPU of sm_count SMs.");
  m.def(
      "kernel_timeline",
      [](const std::string& kernel) {
        std::vector<uint64_t> stamps;
        std::string error;
        if (kernel == "fp8") {
          error = jzyfa::ReadFlashFwdFp8Timeline(&stamps);
        } else if (kernel == "16bit") {
          error = jzyfa::ReadFlashFwdTimeline(&stamps);
        } else {
          throw nb::value_error("kernel must be 'fp8' or '16bit'");
        }
        if (!error.empty()) throw std::runtime_error("kernel_timeline: " + error);
        return nb::bytes(reinterpret_cast<const char*>(stamps.data()), stamps.size() * sizeof(uint64_t));
      },
      "SM-clock timestamps of the kernel's consumer loops (ffi/kernel_timeline.cuh), uint64 bytes "
      "[cta][consumer][iteration][event], then [cta][consumer][tile][tile event]; zeroed after "
      "reading. Needs a -DJZYFA_TIMELINE=1 build.");
}
