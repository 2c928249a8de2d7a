// XLA FFI handlers: decode buffers and attributes, validate them, launch on XLA's stream.
// Everything the handler checks here depends on shapes only, so it never reads device
// memory and stays compatible with XLA's command buffers (CUDA graphs).
#include "ffi_handlers.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "flash_fwd.h"
#include "fp8_value_operand.h"
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

// Every handler's end: the launch's own validation (InvalidArgument), the device check, the launch
// (Internal), each error prefixed with `name`.
template <typename Params>
ffi::Error ValidateAndLaunch(const std::string& name, const Params& p,
                             std::string (*validate)(const Params&),
                             std::string (*launch)(const Params&, cudaStream_t),
                             cudaStream_t stream) {
  std::string error = validate(p);
  if (!error.empty()) return ffi::Error::InvalidArgument(name + error);
  error = CheckDeviceSupport();
  if (!error.empty()) return ffi::Error::InvalidArgument(name + error);
  error = launch(p, stream);
  if (!error.empty()) return ffi::Error::Internal(name + error);
  return ffi::Error::Success();
}

// The descale fields of the FP8 launches' parameters (dense and varlen).
template <typename Params>
void SetDescales(Params& p, const ffi::Buffer<ffi::F32>& dq, const ffi::Buffer<ffi::F32>& dk,
                 const ffi::Buffer<ffi::F32>& dv) {
  p.descale_q = dq.typed_data();
  p.descale_k = dk.typed_data();
  p.descale_v = dv.typed_data();
  p.descale_count = static_cast<int64_t>(dq.element_count());
}

// out must have q's shape with v's head dim (out_head_dim; MLA: 128 where q has 192), lse be
// [batch, heads_q, seq_q], the tile counter one int32.
ffi::Error CheckResults(const std::string& name, ffi::Span<const int64_t> qd,
                        ffi::Span<const int64_t> od, ffi::Span<const int64_t> ld,
                        int64_t out_head_dim, int64_t tile_counter_size) {
  if (od.size() != qd.size() || !std::equal(od.begin(), od.end() - 1, qd.begin()) ||
      od.back() != out_head_dim) {
    return ffi::Error::InvalidArgument(name + "out " + ShapeString(od) + " must have the shape of q " +
                                       ShapeString(qd) + " with head_dim " +
                                       std::to_string(out_head_dim));
  }
  if (ld.size() != 3 || ld[0] != qd[0] || ld[1] != qd[2] || ld[2] != qd[1]) {
    return ffi::Error::InvalidArgument(name + "lse " + ShapeString(ld) +
                                       " must be [batch, heads_q, seq_q]");
  }
  if (tile_counter_size != 1) {
    return ffi::Error::InvalidArgument(name + "the tile counter scratch result must hold one int32");
  }
  return ffi::Error::Success();
}

// The fields both kernels' parameters share, from the decoded buffers: q [B, Sq, Hq, D] and
// k [B, Sk, Hkv, D], out, lse, the tile counter and the attributes.
template <typename Params, typename Out>
void SetCommonParams(Params& p, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, Out& out,
                     ffi::Result<ffi::Buffer<ffi::F32>>& lse,
                     ffi::Result<ffi::Buffer<ffi::S32>>& tile_counter, float softmax_scale,
                     bool causal) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  p.q = q.untyped_data();
  p.k = k.untyped_data();
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
}

ffi::Error FlashAttentionFwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                 ffi::AnyBuffer v, ffi::Result<ffi::AnyBuffer> out,
                                 ffi::Result<ffi::Buffer<ffi::F32>> lse,
                                 ffi::Result<ffi::Buffer<ffi::S32>> tile_counter,
                                 float softmax_scale, bool causal, int64_t window_left,
                                 int64_t window_right) {
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
  for (int i = 0; i < 3; ++i) {  // v's head dim may differ from k's (MLA; ValidateFlashFwd)
    if (kd[i] != vd[i]) {
      return ffi::Error::InvalidArgument("jzyfa_flash_attention_fwd: k " + ShapeString(kd) +
                                         " and v " + ShapeString(vd) +
                                         " differ in batch, seq or heads");
    }
  }
  if (kd[0] != qd[0] || kd[3] != qd[3]) {
    return ffi::Error::InvalidArgument("jzyfa_flash_attention_fwd: q " + ShapeString(qd) +
                                       " and k " + ShapeString(kd) +
                                       " disagree on batch or head_dim");
  }
  ffi::Error results = CheckResults("jzyfa_flash_attention_fwd: ", qd, od, ld, vd[3],
                                    tile_counter->element_count());
  if (results.failure()) return results;

  FlashFwdParams p;
  SetCommonParams(p, q, k, out, lse, tile_counter, softmax_scale, causal);
  p.v = v.untyped_data();
  p.head_dim_v = vd[3];
  p.window_left = window_left;
  p.window_right = window_right;
  p.element_type = dtype == ffi::DataType::BF16 ? ElementType::kBF16 : ElementType::kF16;

  return ValidateAndLaunch("jzyfa_flash_attention_fwd: ", p, ValidateFlashFwd, LaunchFlashFwd, stream);
}

// The varlen handlers' (16-bit and FP8) shared checks of shapes beyond q, k and v: cu_seqlens int32
// [num_seqs + 1] (num_seqs >= 1) alike, out with q's shape, lse [heads_q, total_q], one counter.
ffi::Error CheckVarlenOperands(const std::string& name, ffi::Span<const int64_t> qd,
                               int64_t head_dim_v, const ffi::Buffer<ffi::S32>& cu_seqlens_q,
                               const ffi::Buffer<ffi::S32>& cu_seqlens_k,
                               ffi::Span<const int64_t> od, ffi::Span<const int64_t> ld,
                               int64_t tile_counter_size) {
  const auto cqd = cu_seqlens_q.dimensions(), ckd = cu_seqlens_k.dimensions();
  if (cqd.size() != 1 || ckd.size() != 1 || cqd[0] != ckd[0] || cqd[0] < 2) {
    return ffi::Error::InvalidArgument(name + "cu_seqlens_q " + ShapeString(cqd) +
                                       " and cu_seqlens_k " + ShapeString(ckd) +
                                       " must both be int32 [num_seqs + 1], num_seqs >= 1");
  }
  if (od.size() != qd.size() || !std::equal(od.begin(), od.end() - 1, qd.begin()) ||
      od.back() != head_dim_v) {
    return ffi::Error::InvalidArgument(name + "out " + ShapeString(od) +
                                       " must have the shape of q " + ShapeString(qd) +
                                       " with head_dim " + std::to_string(head_dim_v));
  }
  if (ld.size() != 2 || ld[0] != qd[1] || ld[1] != qd[0]) {
    return ffi::Error::InvalidArgument(name + "lse " + ShapeString(ld) +
                                       " must be [heads_q, total_q]");
  }
  if (tile_counter_size != 1) {
    return ffi::Error::InvalidArgument(name + "the tile counter scratch result must hold one int32");
  }
  return ffi::Error::Success();
}

// The fields of FlashFwdVarlenParams both varlen handlers set alike (all but v and element_type).
template <typename Out>
void SetVarlenParams(FlashFwdVarlenParams& p, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                     const ffi::Buffer<ffi::S32>& cu_seqlens_q,
                     const ffi::Buffer<ffi::S32>& cu_seqlens_k, Out& out,
                     ffi::Result<ffi::Buffer<ffi::F32>>& lse,
                     ffi::Result<ffi::Buffer<ffi::S32>>& tile_counter, float softmax_scale,
                     bool causal, int64_t max_seqlen_q, int64_t max_seqlen_k, int64_t window_left,
                     int64_t window_right) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.cu_seqlens_q = cu_seqlens_q.typed_data();
  p.cu_seqlens_k = cu_seqlens_k.typed_data();
  p.out = out->untyped_data();
  p.lse = lse->typed_data();
  p.tile_counter = tile_counter->typed_data();
  p.num_seqs = cu_seqlens_q.dimensions()[0] - 1;
  p.total_q = qd[0];
  p.total_k = kd[0];
  p.max_seqlen_q = max_seqlen_q;
  p.max_seqlen_k = max_seqlen_k;
  p.heads_q = qd[1];
  p.heads_kv = kd[1];
  p.head_dim = qd[2];
  p.softmax_scale = softmax_scale;
  p.causal = causal;
  p.window_left = window_left;
  p.window_right = window_right;
}

ffi::Error FlashAttentionVarlenFwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                       ffi::AnyBuffer v, ffi::Buffer<ffi::S32> cu_seqlens_q,
                                       ffi::Buffer<ffi::S32> cu_seqlens_k,
                                       ffi::Result<ffi::AnyBuffer> out,
                                       ffi::Result<ffi::Buffer<ffi::F32>> lse,
                                       ffi::Result<ffi::Buffer<ffi::S32>> tile_counter,
                                       float softmax_scale, bool causal, int64_t max_seqlen_q,
                                       int64_t max_seqlen_k, int64_t window_left,
                                       int64_t window_right) {
  const std::string name = "jzyfa_flash_attention_varlen_fwd: ";
  const ffi::DataType dtype = q.element_type();
  if (dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16) {
    return ffi::Error::InvalidArgument(name + "q must be bf16 or f16");
  }
  if (k.element_type() != dtype || v.element_type() != dtype || out->element_type() != dtype) {
    return ffi::Error::InvalidArgument(name + "k, v and out must have the dtype of q");
  }
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(),
             od = out->dimensions(), ld = lse->dimensions();
  if (qd.size() != 3 || kd.size() != 3 || vd.size() != 3) {
    return ffi::Error::InvalidArgument(
        name + "q, k and v must be packed [total_tokens, heads, head_dim]");
  }
  // v may have a head dim of its own (MLA: 128 where q and k have 192).
  if (vd[0] != kd[0] || vd[1] != kd[1]) {
    return ffi::Error::InvalidArgument(name + "k " + ShapeString(kd) + " and v " +
                                       ShapeString(vd) + " disagree on tokens or heads");
  }
  if (kd[2] != qd[2]) {
    return ffi::Error::InvalidArgument(name + "q " + ShapeString(qd) + " and k " +
                                       ShapeString(kd) + " disagree on head_dim");
  }
  ffi::Error checked = CheckVarlenOperands(name, qd, vd[2], cu_seqlens_q, cu_seqlens_k, od, ld,
                                          tile_counter->element_count());
  if (checked.failure()) return checked;

  FlashFwdVarlenParams p;
  SetVarlenParams(p, q, k, cu_seqlens_q, cu_seqlens_k, out, lse, tile_counter, softmax_scale, causal,
                  max_seqlen_q, max_seqlen_k, window_left, window_right);
  p.v = v.untyped_data();
  p.head_dim_v = vd[2];
  p.element_type = dtype == ffi::DataType::BF16 ? ElementType::kBF16 : ElementType::kF16;

  return ValidateAndLaunch(name, p, ValidateFlashFwdVarlen, LaunchFlashFwdVarlen, stream);
}

// Descales: float32, one value or one per (batch or sequence, KV head); the same count for all
// three. `batch` names what the first factor counts.
ffi::Error CheckDescales(const std::string& name, ffi::Buffer<ffi::F32> dq,
                         ffi::Buffer<ffi::F32> dk, ffi::Buffer<ffi::F32> dv, const char* batch_name,
                         int64_t batch, int64_t heads_kv) {
  const int64_t count = static_cast<int64_t>(dq.element_count());
  if (static_cast<int64_t>(dk.element_count()) != count ||
      static_cast<int64_t>(dv.element_count()) != count ||
      (count != 1 && count != batch * heads_kv)) {
    return ffi::Error::InvalidArgument(
        name + "descale_q, descale_k and descale_v must each hold 1 or " + batch_name +
        " * heads_kv (" + std::to_string(batch * heads_kv) + ") float32 values");
  }
  return ffi::Error::Success();
}

// Whether q, k and v are all e4m3.
bool AllE4m3(std::initializer_list<const ffi::AnyBuffer*> buffers) {
  return std::all_of(buffers.begin(), buffers.end(), [](const ffi::AnyBuffer* x) {
    return x->element_type() == ffi::DataType::F8E4M3FN;
  });
}

ffi::Error FlashAttentionFp8FwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                    ffi::AnyBuffer v, ffi::Buffer<ffi::F32> descale_q,
                                    ffi::Buffer<ffi::F32> descale_k,
                                    ffi::Buffer<ffi::F32> descale_v,
                                    ffi::Result<ffi::Buffer<ffi::BF16>> out,
                                    ffi::Result<ffi::Buffer<ffi::F32>> lse,
                                    ffi::Result<ffi::Buffer<ffi::S32>> tile_counter,
                                    float softmax_scale, bool causal, int64_t window_left,
                                    int64_t window_right, bool lean_p, bool v_transposed) {
  const std::string name = "jzyfa_flash_attention_fp8_fwd: ";
  const char* const v_name = v_transposed ? "vt" : "v";
  if (!AllE4m3({&q, &k, &v})) {
    return ffi::Error::InvalidArgument(name + "q, k and " + v_name + " must be float8_e4m3fn");
  }
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(),
             od = out->dimensions(), ld = lse->dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return ffi::Error::InvalidArgument(
        name + (v_transposed ? "q and k must be [batch, seq, heads, head_dim], vt [batch, heads_kv, "
                               "128, seq_k rounded up to 32] (v_transposed)"
                             : "q, k and v must be [batch, seq, heads, head_dim]"));
  }
  // v's head dim may differ from q's and k's (MLA: 128 where they have 192): out's head dim.
  if (kd[3] != qd[3]) {
    return ffi::Error::InvalidArgument(name + "q " + ShapeString(qd) + " and k " + ShapeString(kd) +
                                       " disagree on head_dim");
  }
  // v [batch, seq_k, heads_kv, head_dim_v], or vt [batch, heads_kv, head_dim_v, seq_k padded]
  // (its key count: ValidateFlashFwdFp8).
  const bool agree = v_transposed ? (vd[0] == kd[0] && vd[1] == kd[2])
                                  : (vd[0] == kd[0] && vd[1] == kd[1] && vd[2] == kd[2]);
  if (kd[0] != qd[0] || !agree) {
    return ffi::Error::InvalidArgument(name + "q " + ShapeString(qd) + ", k " + ShapeString(kd) +
                                       " and " + v_name + " " + ShapeString(vd) + " disagree" +
                                       (v_transposed ? " (vt: [batch, heads_kv, 128, seq_k rounded "
                                                       "up to 32])"
                                                     : ""));
  }
  const int64_t head_dim_v = v_transposed ? vd[2] : vd[3];
  ffi::Error results = CheckResults(name, qd, od, ld, head_dim_v, tile_counter->element_count());
  if (results.failure()) return results;
  ffi::Error descales = CheckDescales(name, descale_q, descale_k, descale_v, "batch", kd[0], kd[2]);
  if (descales.failure()) return descales;

  FlashFwdFp8Params p;
  SetCommonParams(p, q, k, out, lse, tile_counter, softmax_scale, causal);
  p.v = v.untyped_data();
  p.head_dim_v = head_dim_v;
  p.v_transposed = v_transposed;
  if (v_transposed) p.seqlen_k_padded = vd[3];
  SetDescales(p, descale_q, descale_k, descale_v);
  p.window_left = window_left;
  p.window_right = window_right;
  p.lean_p = lean_p;

  return ValidateAndLaunch(name, p, ValidateFlashFwdFp8, LaunchFlashFwdFp8, stream);
}

ffi::Error FlashAttentionFp8VarlenFwdImpl(
    cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
    ffi::Buffer<ffi::S32> cu_seqlens_q, ffi::Buffer<ffi::S32> cu_seqlens_k,
    ffi::Buffer<ffi::F32> descale_q, ffi::Buffer<ffi::F32> descale_k,
    ffi::Buffer<ffi::F32> descale_v, ffi::Result<ffi::Buffer<ffi::BF16>> out,
    ffi::Result<ffi::Buffer<ffi::F32>> lse, ffi::Result<ffi::Buffer<ffi::S32>> tile_counter,
    float softmax_scale, bool causal, int64_t max_seqlen_q, int64_t max_seqlen_k,
    int64_t window_left, int64_t window_right, bool v_transposed) {
  const std::string name = "jzyfa_flash_attention_fp8_varlen_fwd: ";
  const char* const v_name = v_transposed ? "vt" : "v";
  if (!AllE4m3({&q, &k, &v})) {
    return ffi::Error::InvalidArgument(name + "q, k and " + v_name + " must be float8_e4m3fn");
  }
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(),
             od = out->dimensions(), ld = lse->dimensions();
  if (qd.size() != 3 || kd.size() != 3 || vd.size() != 3) {
    return ffi::Error::InvalidArgument(
        name + (v_transposed ? "q and k must be packed [total_tokens, heads, head_dim], vt [heads_kv, "
                               "128, roundup32(total_k) + 32 * (num_seqs + 1)] (v_transposed)"
                             : "q, k and v must be packed [total_tokens, heads, head_dim]"));
  }
  // v [total_k, heads_kv, 128], or vt [heads_kv, 128, vt_keys] (its key count: below).
  const bool agree = v_transposed ? (vd[0] == kd[1] && vd[1] == kd[2])
                                  : (vd[0] == kd[0] && vd[1] == kd[1] && vd[2] == kd[2]);
  if (kd[2] != qd[2] || !agree) {
    return ffi::Error::InvalidArgument(name + "q " + ShapeString(qd) + ", k " + ShapeString(kd) +
                                       " and " + v_name + " " + ShapeString(vd) + " disagree" +
                                       (v_transposed ? " (vt: [heads_kv, 128, roundup32(total_k) + "
                                                       "32 * (num_seqs + 1)])"
                                                     : ""));
  }
  const int64_t head_dim_v = v_transposed ? vd[1] : vd[2];
  ffi::Error checked = CheckVarlenOperands(name, qd, head_dim_v, cu_seqlens_q, cu_seqlens_k, od,
                                          ld, tile_counter->element_count());
  if (checked.failure()) return checked;
  const int64_t num_seqs = cu_seqlens_q.dimensions()[0] - 1;
  if (v_transposed) {
    const int64_t want_keys = Fp8VarlenValueKeys(kd[0], num_seqs);
    if (vd[2] != want_keys) {
      return ffi::Error::InvalidArgument(
          name + "vt must be [heads_kv, 128, roundup32(total_k) + 32 * (num_seqs + 1)] = [" +
          std::to_string(kd[1]) + ", " + std::to_string(kd[2]) + ", " + std::to_string(want_keys) +
          "], got " + ShapeString(vd));
    }
  }
  ffi::Error descales =
      CheckDescales(name, descale_q, descale_k, descale_v, "num_seqs", num_seqs, kd[1]);
  if (descales.failure()) return descales;

  FlashFwdFp8VarlenParams p;
  SetVarlenParams(p, q, k, cu_seqlens_q, cu_seqlens_k, out, lse, tile_counter, softmax_scale, causal,
                  max_seqlen_q, max_seqlen_k, window_left, window_right);
  p.v = v.untyped_data();
  p.head_dim_v = head_dim_v;
  p.v_transposed = v_transposed;
  if (v_transposed) p.vt_keys = vd[2];
  SetDescales(p, descale_q, descale_k, descale_v);

  return ValidateAndLaunch(name, p, ValidateFlashFwdFp8Varlen, LaunchFlashFwdFp8Varlen, stream);
}

ffi::Error Fp8ValueOperandImpl(cudaStream_t stream, ffi::AnyBuffer v,
                               ffi::Result<ffi::AnyBuffer> vt) {
  const std::string name = "jzyfa_fp8_value_operand: ";
  for (ffi::DataType dtype : {v.element_type(), vt->element_type()}) {
    if (dtype != ffi::DataType::F8E4M3FN) {
      return ffi::Error::InvalidArgument(name + "v and vt must be float8_e4m3fn");
    }
  }
  const auto vd = v.dimensions(), td = vt->dimensions();
  if (vd.size() != 4) {
    return ffi::Error::InvalidArgument(name + "v " + ShapeString(vd) +
                                       " must be [batch, seq_k, heads_kv, head_dim]");
  }
  if (vd[3] != 128) {
    return ffi::Error::InvalidArgument(name + "v's head_dim must be 128, got " +
                                       std::to_string(vd[3]));
  }
  const int64_t padded = (vd[1] + 31) / 32 * 32;
  if (td.size() != 4 || td[0] != vd[0] || td[1] != vd[2] || td[2] != vd[3] || td[3] != padded) {
    const int64_t want[4] = {vd[0], vd[2], vd[3], padded};
    return ffi::Error::InvalidArgument(
        name + "vt " + ShapeString(td) + " must be [batch, heads_kv, head_dim, seq_k rounded up to "
        "32] = " + ShapeString(ffi::Span<const int64_t>(want, 4)) + " for v " + ShapeString(vd));
  }

  Fp8ValueOperandParams p;
  p.v = v.untyped_data();
  p.vt = vt->untyped_data();
  p.batch = vd[0];
  p.seqlen_k = vd[1];
  p.heads_kv = vd[2];
  p.head_dim = vd[3];
  p.seqlen_k_padded = td[3];

  return ValidateAndLaunch(name, p, ValidateFp8ValueOperand, LaunchFp8ValueOperand, stream);
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
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("window_left")  // -1: unbounded
                                  .Attr<int64_t>("window_right"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashAttentionVarlenFwd, FlashAttentionVarlenFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // q [total_q, Hq, D]
                                  .Arg<ffi::AnyBuffer>()  // k [total_k, Hkv, D]
                                  .Arg<ffi::AnyBuffer>()  // v [total_k, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_seqlens_q [num_seqs + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_seqlens_k [num_seqs + 1]
                                  .Ret<ffi::AnyBuffer>()  // out [total_q, Hq, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse [Hq, total_q]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // tile counter (scratch)
                                  .Attr<float>("softmax_scale")
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("max_seqlen_q")
                                  .Attr<int64_t>("max_seqlen_k")
                                  .Attr<int64_t>("window_left")  // -1: unbounded
                                  .Attr<int64_t>("window_right"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashAttentionFp8Fwd, FlashAttentionFp8FwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // q, e4m3
                                  .Arg<ffi::AnyBuffer>()  // k, e4m3
                                  .Arg<ffi::AnyBuffer>()  // v, e4m3 [B, Sk, Hkv, Dv], or vt
                                  .Arg<ffi::Buffer<ffi::F32>>()  // descale_q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // descale_k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // descale_v
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
                                  .Ret<ffi::Buffer<ffi::S32>>()  // tile counter (scratch)
                                  .Attr<float>("softmax_scale")
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("window_left")  // -1: unbounded
                                  .Attr<int64_t>("window_right")
                                  .Attr<bool>("lean_p")
                                  // v is vt [B, Hkv, 128, roundup32(Sk)] (jzyfa_fp8_value_operand)
                                  .Attr<bool>("v_transposed"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashAttentionFp8VarlenFwd, FlashAttentionFp8VarlenFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // q, e4m3 [total_q, Hq, 128]
                                  .Arg<ffi::AnyBuffer>()  // k, e4m3 [total_k, Hkv, 128]
                                  .Arg<ffi::AnyBuffer>()  // v, e4m3 [total_k, Hkv, 128], or vt
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_seqlens_q [num_seqs + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_seqlens_k [num_seqs + 1]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // descale_q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // descale_k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // descale_v
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // out [total_q, Hq, 128]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse [Hq, total_q]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // tile counter (scratch)
                                  .Attr<float>("softmax_scale")
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("max_seqlen_q")
                                  .Attr<int64_t>("max_seqlen_k")
                                  .Attr<int64_t>("window_left")  // -1: unbounded
                                  .Attr<int64_t>("window_right")
                                  // v is vt [Hkv, 128, Fp8VarlenValueKeys] (fp8_varlen_value_operand)
                                  .Attr<bool>("v_transposed"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8ValueOperand, Fp8ValueOperandImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // v, e4m3 [B, Sk, Hkv, 128]
                                  .Ret<ffi::AnyBuffer>(),  // vt, e4m3 [B, Hkv, 128, Sk']
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jzyfa
