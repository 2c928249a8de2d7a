// The nanobind module `jzyfa._jzyfa_ffi`: hands JAX the FFI handler capsules (one table of targets),
// the forward instantiations the library was built with (tile_size.h's kFwdKernels), the launch
// rules the Python side mirrors (FP8 key blocks, the tile order's groups), and the handler-call
// counter (tests use it to tell a command-buffer replay from a handler run).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "flash_fwd.h"
#include "handlers.h"
#include "launch_utils.h"
#include "tile_size.h"

namespace nb = nanobind;

namespace {

struct Target {
  const char* name;
  void* handler;
};

// Every custom-call target the extension registers.
const Target kTargets[] = {
    {"jzyfa_attention_fwd", reinterpret_cast<void*>(jzyfa::AttentionFwd)},
    {"jzyfa_attention_bwd", reinterpret_cast<void*>(jzyfa::AttentionBwd)},
    {"jzyfa_fp8_value_operand", reinterpret_cast<void*>(jzyfa::Fp8ValueOperand)},
    {"jzyfa_int8_quantize", reinterpret_cast<void*>(jzyfa::Int8Quantize)},
};

const char* FamilyName(jzyfa::Family family) {
  return family == jzyfa::Family::kFp8 ? "fp8" : family == jzyfa::Family::kInt8 ? "int8" : "16bit";
}

const char* MaskName(jzyfa::MaskKind mask) {
  switch (mask) {
    case jzyfa::MaskKind::kCausal:
      return "causal";
    case jzyfa::MaskKind::kWindow:
      return "window";
    default:
      return "none";
  }
}

}  // namespace

NB_MODULE(_jzyfa_ffi, m) {
  m.doc() = "XLA FFI handlers of jzyfa's Hopper attention kernels";
  m.def(
      "registrations",
      []() {
        nb::dict targets;
        for (const Target& target : kTargets) targets[target.name] = nb::capsule(target.handler);
        return targets;
      },
      "{custom-call target name: XLA FFI handler capsule} for platform CUDA.");
  m.def(
      "handler_calls", []() { return jzyfa::HandlerCalls(); },
      "How many times the jzyfa_attention_fwd handler has executed in this process.");
  m.def(
      "kernels",
      []() {
        std::vector<std::tuple<std::string, int, int, std::string, std::string, std::string>> rows;
        auto add = [&rows](const char* family, int dim_qk, int dim_v, unsigned masks,
                           jzyfa::Layout layout, const char* direction) {
          for (jzyfa::MaskKind mask : jzyfa::kMaskKinds) {
            if ((masks & jzyfa::MaskBit(mask)) == 0) continue;
            rows.emplace_back(family, dim_qk, dim_v, MaskName(mask),
                              layout == jzyfa::Layout::kVarlen ? "varlen" : "dense", direction);
          }
        };
        for (const jzyfa::FwdKernelGroup& g : jzyfa::kFwdKernels) {
          add(FamilyName(g.family), g.head_dim_qk, g.head_dim_v, g.masks, g.layout, "fwd");
        }
        for (const jzyfa::BwdKernelGroup& g : jzyfa::kBwdKernels) {
          add("16bit", g.head_dim_qk, g.head_dim_v, g.masks, g.layout, "bwd");
        }
        return rows;
      },
      "The instantiations the library was built with: (family, head_dim_qk, head_dim_v, mask, "
      "layout, direction) tuples, family '16bit' or 'fp8', mask 'none', 'causal' or 'window', "
      "layout 'dense' or 'varlen', direction 'fwd' or 'bwd' (ffi/tile_size.h, kFwdKernels and "
      "kBwdKernels).");
  m.def(
      "fp8_key_block",
      [](bool v_transposed, int64_t head_dim, bool causal, int64_t window_left,
         int64_t window_right, int64_t seqlen_q, int64_t seqlen_k) {
        return jzyfa::Fp8KeyBlock(v_transposed, head_dim, causal, window_left, window_right,
                                  seqlen_q, seqlen_k);
      },
      nb::arg("v_transposed"), nb::arg("head_dim"), nb::arg("causal"), nb::arg("window_left"),
      nb::arg("window_right"), nb::arg("seqlen_q"), nb::arg("seqlen_k"),
      "Keys per block of the FP8 kernel for such a call with key_block 0 (window bounds -1 for none, "
      "head_dim of q and k): the block_n its emulation must use.");
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
        if (kernel != "fp8" && kernel != "16bit") {
          throw nb::value_error("kernel must be 'fp8' or '16bit'");
        }
        std::vector<uint64_t> stamps;
        const std::string error = jzyfa::ReadFwdTimeline(&stamps);
        if (!error.empty()) throw std::runtime_error("kernel_timeline: " + error);
        return nb::bytes(reinterpret_cast<const char*>(stamps.data()), stamps.size() * sizeof(uint64_t));
      },
      "SM-clock timestamps of the kernels' consumer loops (ffi/kernel_timeline.cuh), uint64 bytes "
      "[cta][consumer][iteration][event], then [cta][consumer][tile][tile event], summed over the "
      "kernels that ran since the last read (run one kind between reads; `kernel` names it); zeroed "
      "after reading. Needs a timeline build (CMake -DJZYFA_MEASURE=timeline).");
}
