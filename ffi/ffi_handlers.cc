// XLA FFI handlers: decode buffers and attributes, validate them, launch on XLA's stream.
// Everything the handler checks here depends on shapes only, so it never reads device
// memory and stays compatible with XLA's command buffers (CUDA graphs).
#include "ffi_handlers.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "flash_fwd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jzyfa {
namespace {

// Handler executions in this process; read by HandlerCalls(). Relaxed: a counter, ordering nothing.
std::atomic<uint64_t> handler_calls{0};

std::string ShapeString(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

ffi::Error FlashAttentionFwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                 ffi::AnyBuffer v, ffi::Result<ffi::AnyBuffer> out,
                                 ffi::Result<ffi::Buffer<ffi::F32>> lse,
                                 ffi::Result<ffi::Buffer<ffi::S32>> tile_counter,
                                 float softmax_scale, bool causal) {
  handler_calls.fetch_add(1, std::memory_order_relaxed);
  const ffi::DataType dtype = q.element_type();
  if (dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16) {
    return ffi::Error::InvalidArgument("jzyfa_flash_attention_fwd: q must be bf16 or f16");
  }
  if (k.element_type() != dtype || v.element_type() != dtype || out->element_type() != dtype) {
    return ffi::Error::InvalidArgument(
        "jzyfa_flash_attention_fwd: k, v and out must have the dtype of q");
  }
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(),
             od = out->dimensions(), ld = lse->dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return ffi::Error::InvalidArgument(
        "jzyfa_flash_attention_fwd: q, k and v must be [batch, seq, heads, head_dim]");
  }
  for (int i = 0; i < 4; ++i) {
    if (kd[i] != vd[i]) {
      return ffi::Error::InvalidArgument("jzyfa_flash_attention_fwd: k " + ShapeString(kd) +
                                         " and v " + ShapeString(vd) + " differ");
    }
    if (od.size() != 4 || od[i] != qd[i]) {
      return ffi::Error::InvalidArgument("jzyfa_flash_attention_fwd: out " + ShapeString(od) +
                                         " must have the shape of q " + ShapeString(qd));
    }
  }
  if (kd[0] != qd[0] || kd[3] != qd[3]) {
    return ffi::Error::InvalidArgument("jzyfa_flash_attention_fwd: q " + ShapeString(qd) +
                                       " and k " + ShapeString(kd) +
                                       " disagree on batch or head_dim");
  }
  if (ld.size() != 3 || ld[0] != qd[0] || ld[1] != qd[2] || ld[2] != qd[1]) {
    return ffi::Error::InvalidArgument("jzyfa_flash_attention_fwd: lse " + ShapeString(ld) +
                                       " must be [batch, heads_q, seq_q]");
  }

  if (tile_counter->element_count() != 1) {
    return ffi::Error::InvalidArgument(
        "jzyfa_flash_attention_fwd: the tile counter scratch result must hold one int32");
  }

  FlashFwdParams p;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.out = out->untyped_data();
  p.lse = lse->typed_data();
  p.tile_counter = tile_counter->typed_data();
  p.batch = qd[0];
  p.seqlen_q = qd[1];
  p.heads_q = qd[2];
  p.head_dim = qd[3];
  p.seqlen_k = kd[1];
  p.heads_kv = kd[2];
  p.softmax_scale = softmax_scale;
  p.causal = causal;
  p.element_type = dtype == ffi::DataType::BF16 ? ElementType::kBF16 : ElementType::kF16;

  std::string error = ValidateFlashFwd(p);
  if (!error.empty()) return ffi::Error::InvalidArgument("jzyfa_flash_attention_fwd: " + error);
  error = CheckDeviceSupport();
  if (!error.empty()) return ffi::Error::InvalidArgument("jzyfa_flash_attention_fwd: " + error);
  error = LaunchFlashFwd(p, stream);
  if (!error.empty()) return ffi::Error::Internal("jzyfa_flash_attention_fwd: " + error);
  return ffi::Error::Success();
}

}  // namespace

uint64_t HandlerCalls() { return handler_calls.load(std::memory_order_relaxed); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashAttentionFwd, FlashAttentionFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
                                  .Ret<ffi::Buffer<ffi::S32>>()  // tile counter (scratch)
                                  .Attr<float>("softmax_scale")
                                  .Attr<bool>("causal"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jzyfa
