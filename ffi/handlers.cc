// XLA FFI handlers: decode buffers and attributes into one parameter type, validate it once
// (ValidateFwd), launch on XLA's stream. Everything the handler checks depends on shapes only, so it
// never reads device memory and stays compatible with XLA's command buffers (CUDA graphs).
#include "handlers.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "flash_bwd.h"
#include "flash_fwd.h"
#include "fp8_value_operand.h"
#include "int8_quantize.h"
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

// Every handler's end: the validation (InvalidArgument), the device check, the launch (Internal),
// each error prefixed with `name`.
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

constexpr const char* kFwdName = "jzyfa_attention_fwd: ";

ffi::Error Invalid(const std::string& message) {
  return ffi::Error::InvalidArgument(kFwdName + message);
}

// A varlen call's sequence offsets, extra operands `first` and `first + 1`: cu_seqlens_q and
// cu_seqlens_k, int32 [num_seqs + 1] each. Sets the pointers and num_seqs, or says what is wrong
// (`name` prefixes the message: the target's).
struct SeqOffsets {
  const int32_t* q = nullptr;
  const int32_t* k = nullptr;
  int64_t num_seqs = 0;
};

ffi::Error DecodeSeqOffsets(ffi::RemainingArgs& extra, size_t first, const std::string& name,
                            SeqOffsets* offsets) {
  auto cu_q = extra.get<ffi::AnyBuffer>(first), cu_k = extra.get<ffi::AnyBuffer>(first + 1);
  if (cu_q.has_error()) return cu_q.error();
  if (cu_k.has_error()) return cu_k.error();
  const auto cqd = cu_q->dimensions(), ckd = cu_k->dimensions();
  if (cu_q->element_type() != ffi::DataType::S32 || cu_k->element_type() != ffi::DataType::S32 ||
      cqd.size() != 1 || ckd.size() != 1 || cqd[0] != ckd[0] || cqd[0] < 2) {
    return ffi::Error::InvalidArgument(name + "cu_seqlens_q " + ShapeString(cqd) + " and cu_seqlens_k " +
                                       ShapeString(ckd) +
                                       " must both be int32 [num_seqs + 1], num_seqs >= 1");
  }
  offsets->q = static_cast<const int32_t*>(cu_q->untyped_data());
  offsets->k = static_cast<const int32_t*>(cu_k->untyped_data());
  offsets->num_seqs = cqd[0] - 1;
  return ffi::Error::Success();
}

// The shapes of q, k, v, out and lse, dense ([B, S, H, D]) or packed varlen ([T, H, D]): the
// buffers' dims into `p` (head dims, heads, lengths), or why they do not fit together.
ffi::Error DecodeShapes(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                        ffi::Span<const int64_t> od, ffi::Span<const int64_t> ld, FwdParams& p) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const bool vt = p.v_transposed;
  const char* const v_name = vt ? "vt" : "v";
  const size_t rank = p.varlen ? 3 : 4;
  const std::string layout = p.varlen ? "packed [total_tokens, heads, head_dim]"
                                      : "[batch, seq, heads, head_dim]";
  const std::string vt_layout = p.varlen ? "[heads_kv, head_dim_v, roundup32(total_k) + 32 * (num_seqs + 1)]"
                                         : "[batch, heads_kv, head_dim_v, seq_k rounded up to 32]";
  if (qd.size() != rank || kd.size() != rank || vd.size() != rank) {
    return Invalid(vt ? "q and k must be " + layout + ", vt " + vt_layout + " (v_transposed)"
                      : "q, k and v must be " + layout);
  }
  // Token/batch and heads dims of k (dense: batch, seq, heads; varlen: tokens, heads).
  const size_t h = rank - 2, d = rank - 1;  // heads' and head_dim's axes
  if (kd[d] != qd[d] || (!p.varlen && kd[0] != qd[0])) {
    return Invalid("q " + ShapeString(qd) + " and k " + ShapeString(kd) + " disagree on " +
                   (p.varlen ? "head_dim" : "batch or head_dim"));
  }
  // v [..., seq_k or tokens, heads_kv, head_dim_v], or V^T [(batch,) heads_kv, head_dim_v, keys]: v's
  // head dim may differ from k's (MLA: 128 where q and k have 192).
  bool agree = true;
  if (vt) {
    agree = p.varlen ? vd[0] == kd[1] : (vd[0] == kd[0] && vd[1] == kd[2]);
  } else {
    for (size_t i = 0; i < d; ++i) agree = agree && vd[i] == kd[i];
  }
  if (!agree) {
    return Invalid("q " + ShapeString(qd) + ", k " + ShapeString(kd) + " and " + v_name + " " +
                   ShapeString(vd) + " disagree" + (vt ? " (vt: " + vt_layout + ")" : ""));
  }
  p.head_dim = qd[d];
  p.head_dim_v = vt ? vd[rank - 2] : vd[d];
  p.heads_q = qd[h];
  p.heads_kv = kd[h];
  if (vt) p.vt_keys = vd[rank - 1];
  if (p.varlen) {
    p.total_q = qd[0];
    p.total_k = kd[0];
  } else {
    p.batch = qd[0];
    p.seqlen_q = qd[1];
    p.seqlen_k = kd[1];
  }
  if (od.size() != qd.size() || !std::equal(od.begin(), od.end() - 1, qd.begin()) ||
      od.back() != p.head_dim_v) {
    return Invalid("out " + ShapeString(od) + " must have the shape of q " + ShapeString(qd) +
                   " with head_dim " + std::to_string(p.head_dim_v));
  }
  const bool lse_ok = p.varlen ? (ld.size() == 2 && ld[0] == qd[1] && ld[1] == qd[0])
                               : (ld.size() == 3 && ld[0] == qd[0] && ld[1] == qd[2] && ld[2] == qd[1]);
  if (!lse_ok) {
    return Invalid("lse " + ShapeString(ld) + " must be " +
                   (p.varlen ? "[heads_q, total_q]" : "[batch, heads_q, seq_q]"));
  }
  return ffi::Error::Success();
}

// The one forward handler: q, k, v, then (varlen) cu_seqlens_q, cu_seqlens_k, then (float8_e4m3fn
// q) descale_q, descale_k, descale_v, or (int8 q and k, float8_e4m3fn v) q_scale, k_scale, descale_v
// -> out, lse, tile counter.
ffi::Error AttentionFwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::RemainingArgs extra,
                            ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                            ffi::Result<ffi::Buffer<ffi::S32>> tile_counter, float softmax_scale,
                            bool causal, int64_t window_left, int64_t window_right, bool varlen,
                            int64_t max_seqlen_q, int64_t max_seqlen_k, bool lean_p,
                            bool v_transposed, int64_t key_block, float softcap) {
  handler_calls.fetch_add(1, std::memory_order_relaxed);
  FwdParams p;
  // Dtypes: q's decides the family; k, v and out follow it.
  const ffi::DataType dtype = q.element_type();
  const bool int8 = dtype == ffi::DataType::S8;
  const bool fp8 = dtype == ffi::DataType::F8E4M3FN;
  if (!fp8 && !int8 && dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16) {
    return Invalid("q must be bf16, f16, float8_e4m3fn or int8");
  }
  const char* const v_name = (fp8 || int8) && v_transposed ? "vt" : "v";
  if (int8) {
    if (k.element_type() != ffi::DataType::S8 || v.element_type() != ffi::DataType::F8E4M3FN) {
      return Invalid("int8 q takes int8 k and float8_e4m3fn v (precision=\"int8\"'s operands)");
    }
  } else if (k.element_type() != dtype || v.element_type() != dtype) {
    return Invalid(std::string("k and ") + v_name + " must have the dtype of q");
  }
  const ffi::DataType out_dtype = fp8 || int8 ? ffi::DataType::BF16 : dtype;
  if (out->element_type() != out_dtype) {
    return Invalid(fp8 || int8 ? "out must be bf16 for float8_e4m3fn and int8 inputs"
                               : "out must have the dtype of q");
  }
  p.element_type = int8  ? ElementType::kS8
                   : fp8 ? ElementType::kE4M3
                         : dtype == ffi::DataType::BF16 ? ElementType::kBF16 : ElementType::kF16;
  p.varlen = varlen;
  p.v_transposed = v_transposed;
  p.lean_p = lean_p;
  p.key_block = key_block;
  p.softmax_scale = softmax_scale;
  p.softcap = softcap;
  p.causal = causal;
  p.window_left = window_left;
  p.window_right = window_right;
  p.max_seqlen_q = max_seqlen_q;
  p.max_seqlen_k = max_seqlen_k;
  if (!fp8 && !int8 && v_transposed) return Invalid("v_transposed must be false for 16-bit inputs");

  // The operands after q, k and v.
  const size_t want = (varlen ? 2 : 0) + (fp8 || int8 ? 3 : 0);
  if (extra.size() != want) {
    return Invalid("expected " + std::to_string(3 + want) + " operands (q, k, v" +
                   (varlen ? ", cu_seqlens_q, cu_seqlens_k" : "") +
                   (fp8 ? ", descale_q, descale_k, descale_v" : "") +
                   (int8 ? ", q_scale, k_scale, descale_v" : "") + "), got " + std::to_string(3 + extra.size()));
  }
  ffi::Error shapes = DecodeShapes(q, k, v, out->dimensions(), lse->dimensions(), p);
  if (shapes.failure()) return shapes;
  size_t next = 0;
  if (varlen) {
    SeqOffsets offsets;
    ffi::Error error = DecodeSeqOffsets(extra, next, kFwdName, &offsets);
    if (error.failure()) return error;
    next += 2;
    p.cu_seqlens_q = offsets.q;
    p.cu_seqlens_k = offsets.k;
    p.num_seqs = offsets.num_seqs;
  }  // dense calls pass max_seqlen_q = max_seqlen_k = 0; the handler reads them for varlen only
  if (fp8) {
    const float* descales[3];
    int64_t counts[3];
    for (int i = 0; i < 3; ++i) {
      auto d = extra.get<ffi::AnyBuffer>(next++);
      if (d.has_error()) return d.error();
      if (d->element_type() != ffi::DataType::F32) {
        return Invalid("descale_q, descale_k and descale_v must be float32");
      }
      descales[i] = static_cast<const float*>(d->untyped_data());
      counts[i] = static_cast<int64_t>(d->element_count());
    }
    const int64_t groups = varlen ? p.num_seqs : p.batch;
    if (counts[1] != counts[0] || counts[2] != counts[0] ||
        (counts[0] != 1 && counts[0] != groups * p.heads_kv)) {
      return Invalid(std::string("descale_q, descale_k and descale_v must each hold 1 or ") +
                     (varlen ? "num_seqs" : "batch") + " * heads_kv (" +
                     std::to_string(groups * p.heads_kv) + ") float32 values");
    }
    p.descale_q = descales[0];
    p.descale_k = descales[1];
    p.descale_v = descales[2];
    p.descale_count = counts[0];
  }
  if (int8) {
    // q_scale [batch, heads_q, ceil(seq_q / 128)], k_scale [batch, heads_kv, ceil(seq_k / 128)],
    // descale_v [batch, heads_kv]: float32 (jzyfa.int8_quant's blocks of 128 tokens). Varlen: per
    // sequence, num_seqs for batch and the maxima for the lengths (jzyfa.int8_quant.int8_quantize_packed).
    const int64_t groups = varlen ? p.num_seqs : p.batch;
    const int64_t seq_q = varlen ? p.max_seqlen_q : p.seqlen_q, seq_k = varlen ? p.max_seqlen_k : p.seqlen_k;
    if (seq_q < 1 || seq_k < 1) return Invalid("max_seqlen_q and max_seqlen_k must be at least 1");
    const int64_t want_dims[3][3] = {{groups, p.heads_q, (seq_q + 127) / 128},
                                     {groups, p.heads_kv, (seq_k + 127) / 128},
                                     {groups, p.heads_kv, 0}};
    const char* const names[3] = {"q_scale", "k_scale", "descale_v"};
    const float* scales[3];
    for (int i = 0; i < 3; ++i) {
      auto d = extra.get<ffi::AnyBuffer>(next++);
      if (d.has_error()) return d.error();
      const auto dims = d->dimensions();
      const size_t rank = i < 2 ? 3 : 2;
      const ffi::Span<const int64_t> want_span(want_dims[i], rank);
      if (d->element_type() != ffi::DataType::F32 || dims.size() != rank ||
          !std::equal(dims.begin(), dims.end(), want_span.begin())) {
        return Invalid(std::string(names[i]) + " must be float32 " + ShapeString(want_span) + ", got " +
                       ShapeString(dims) + " (blocks of 128 tokens: jzyfa.int8_quant)");
      }
      scales[i] = static_cast<const float*>(d->untyped_data());
    }
    p.descale_q = scales[0];
    p.descale_k = scales[1];
    p.descale_v = scales[2];
    p.descale_count = groups * p.heads_kv;  // descale_v's: one per (batch or sequence, KV head)
  }
  if (tile_counter->element_count() != 1) {
    return Invalid("the tile counter scratch result must hold one int32");
  }
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.out = out->untyped_data();
  p.lse = lse->typed_data();
  p.tile_counter = tile_counter->typed_data();

  MaskPlan mask;
  std::string error = ValidateFwd(&p, &mask);
  if (!error.empty()) return Invalid(error);
  error = CheckDeviceSupport();
  if (!error.empty()) return Invalid(error);
  error = LaunchFwd(p, mask, stream);
  if (!error.empty()) return ffi::Error::Internal(kFwdName + error);
  return ffi::Error::Success();
}

constexpr const char* kBwdName = "jzyfa_attention_bwd: ";

// The backward handler: q, k, v, dout, lse, delta (+ varlen's cu_seqlens_q, cu_seqlens_k) -> dq, dk,
// dv, tile counters int32 [2]. Shapes only: no device memory is read.
ffi::Error AttentionBwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> lse,
                            ffi::Buffer<ffi::F32> delta, ffi::RemainingArgs extra,
                            ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                            ffi::Result<ffi::AnyBuffer> dv,
                            ffi::Result<ffi::Buffer<ffi::S32>> tile_counters, float softmax_scale,
                            bool causal, int64_t window_left, int64_t window_right, bool varlen,
                            int64_t max_seqlen_q, int64_t max_seqlen_k, float softcap) {
  auto invalid = [](const std::string& m) { return ffi::Error::InvalidArgument(kBwdName + m); };
  const ffi::DataType dtype = q.element_type();
  if (dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16) {
    return invalid("q must be bf16 or f16");
  }
  for (ffi::DataType t : {k.element_type(), v.element_type(), dout.element_type(),
                          dq->element_type(), dk->element_type(), dv->element_type()}) {
    if (t != dtype) return invalid("k, v, dout, dq, dk and dv must have the dtype of q");
  }
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const size_t rank = varlen ? 3 : 4;
  if (qd.size() != rank || kd.size() != rank || vd.size() != rank) {
    return invalid(varlen ? "q, k and v must be packed [total_tokens, heads, head_dim]"
                          : "q, k and v must be [batch, seq, heads, head_dim]");
  }
  if (kd[rank - 1] != qd[rank - 1] || (!varlen && kd[0] != qd[0]) ||
      !std::equal(vd.begin(), vd.end() - 1, kd.begin())) {
    return invalid("q " + ShapeString(qd) + ", k " + ShapeString(kd) + " and v " + ShapeString(vd) +
                   " disagree (v must have k's shape but for its head_dim, k q's head_dim" +
                   (varlen ? ")" : " and batch)"));
  }
  auto same = [](ffi::Span<const int64_t> a, ffi::Span<const int64_t> b) {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
  };
  // dout has the output's shape: q's with v's head_dim.
  std::vector<int64_t> out_dims(qd.begin(), qd.end());
  out_dims.back() = vd[rank - 1];
  if (!same(dout.dimensions(), ffi::Span<const int64_t>(out_dims.data(), out_dims.size())) ||
      !same(dq->dimensions(), qd) || !same(dk->dimensions(), kd) || !same(dv->dimensions(), vd)) {
    return invalid("dout must have the output's shape (q's with v's head_dim), dq q's, dk k's and dv v's");
  }
  // lse and delta: [batch, heads_q, seq_q], varlen [heads_q, total_q].
  const int64_t dense_rows[3] = {qd[0], qd[rank - 2], qd[1]};
  const int64_t varlen_rows[2] = {qd[1], qd[0]};
  const ffi::Span<const int64_t> rows = varlen ? ffi::Span<const int64_t>(varlen_rows, 2)
                                               : ffi::Span<const int64_t>(dense_rows, 3);
  if (!same(lse.dimensions(), rows) || !same(delta.dimensions(), rows)) {
    return invalid("lse " + ShapeString(lse.dimensions()) + " and delta " +
                   ShapeString(delta.dimensions()) + " must be " +
                   (varlen ? "[heads_q, total_q] = " : "[batch, heads_q, seq_q] = ") +
                   ShapeString(rows));
  }
  if (tile_counters->element_count() != 2) {
    return invalid("the tile counters scratch result must hold two int32");
  }
  BwdParams p;
  p.varlen = varlen;
  if (extra.size() != (varlen ? 2u : 0u)) {
    return invalid(varlen ? "varlen calls take cu_seqlens_q and cu_seqlens_k after delta"
                          : "dense calls take no operands after delta");
  }
  if (varlen) {
    SeqOffsets offsets;
    ffi::Error error = DecodeSeqOffsets(extra, 0, kBwdName, &offsets);
    if (error.failure()) return error;
    p.cu_seqlens_q = offsets.q;
    p.cu_seqlens_k = offsets.k;
    p.batch = offsets.num_seqs;
    p.seqlen_q = max_seqlen_q;
    p.seqlen_k = max_seqlen_k;
    p.total_q = qd[0];
    p.total_k = kd[0];
  } else {
    p.batch = qd[0];
    p.seqlen_q = qd[1];
    p.seqlen_k = kd[1];
  }
  p.element_type = dtype == ffi::DataType::BF16 ? ElementType::kBF16 : ElementType::kF16;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.dout = dout.untyped_data();
  p.lse = lse.typed_data();
  p.delta = delta.typed_data();
  p.dq = dq->untyped_data();
  p.dk = dk->untyped_data();
  p.dv = dv->untyped_data();
  p.tile_counters = tile_counters->typed_data();
  p.heads_q = qd[rank - 2];
  p.heads_kv = kd[rank - 2];
  p.head_dim = qd[rank - 1];
  p.head_dim_v = vd[rank - 1];
  p.softmax_scale = softmax_scale;
  p.softcap = softcap;
  p.causal = causal;
  p.window_left = window_left;
  p.window_right = window_right;
  MaskPlan mask;
  std::string error = ValidateBwd(p, &mask);
  if (!error.empty()) return invalid(error);
  error = CheckDeviceSupport();
  if (!error.empty()) return invalid(error);
  error = LaunchBwd(p, mask, stream);
  if (!error.empty()) return ffi::Error::Internal(kBwdName + error);
  return ffi::Error::Success();
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
  if (vd[3] != 64 && vd[3] != 128 && vd[3] != 256) {
    return ffi::Error::InvalidArgument(name + "v's head_dim must be 64, 128 or 256, got " +
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

// precision="int8"'s quantization (int8_quantize.h): q, k, v (bf16 or f16, [B, S, H, 128]) and the
// rotation's signs float32 [128] -> q8, q_scale, k8, k_scale, v8, descale_v, key_mean, workspace.
ffi::Error Int8QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::Buffer<ffi::F32> signs, ffi::Result<ffi::Buffer<ffi::S8>> q8,
                            ffi::Result<ffi::Buffer<ffi::F32>> q_scale, ffi::Result<ffi::Buffer<ffi::S8>> k8,
                            ffi::Result<ffi::Buffer<ffi::F32>> k_scale, ffi::Result<ffi::AnyBuffer> v8,
                            ffi::Result<ffi::Buffer<ffi::F32>> descale_v,
                            ffi::Result<ffi::Buffer<ffi::F32>> key_mean,
                            ffi::Result<ffi::Buffer<ffi::F32>> workspace, bool rotate) {
  const std::string name = "jzyfa_int8_quantize: ";
  auto invalid = [&](const std::string& m) { return ffi::Error::InvalidArgument(name + m); };
  const ffi::DataType dtype = q.element_type();
  if ((dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16) || k.element_type() != dtype ||
      v.element_type() != dtype) {
    return invalid("q, k and v must be bf16 or f16, all three alike");
  }
  if (v8->element_type() != ffi::DataType::F8E4M3FN) return invalid("v8 must be float8_e4m3fn");
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || kd[0] != qd[0] || kd[3] != qd[3] ||
      !std::equal(vd.begin(), vd.end(), kd.begin())) {
    return invalid("q " + ShapeString(qd) + ", k " + ShapeString(kd) + " and v " + ShapeString(vd) +
                   " must be [batch, seq, heads, head_dim], v of k's shape, k of q's batch and head_dim");
  }
  const int64_t batch = qd[0], heads_kv = kd[2], blocks = kInt8QuantizeBlock;
  const int64_t q_blocks = (qd[1] + blocks - 1) / blocks, k_blocks = (kd[1] + blocks - 1) / blocks;
  const int64_t chunks = (kd[1] + kInt8KeyMeanChunk - 1) / kInt8KeyMeanChunk;
  auto same = [](ffi::Span<const int64_t> a, std::initializer_list<int64_t> b) {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
  };
  if (!same(signs.dimensions(), {qd[3]}) || !same(q8->dimensions(), {qd[0], qd[1], qd[2], qd[3]}) ||
      !same(k8->dimensions(), {kd[0], kd[1], kd[2], kd[3]}) ||
      !same(v8->dimensions(), {vd[0], vd[1], vd[2], vd[3]}) ||
      !same(q_scale->dimensions(), {batch, qd[2], q_blocks}) ||
      !same(k_scale->dimensions(), {batch, heads_kv, k_blocks}) ||
      !same(descale_v->dimensions(), {batch, heads_kv}) ||
      !same(key_mean->dimensions(), {batch, heads_kv, kd[3]}) ||
      !same(workspace->dimensions(), {batch, heads_kv, chunks, kd[3] + 1})) {
    return invalid("signs must be [head_dim]; results q8, k8, v8 of q's, k's, v's shapes, q_scale [batch, "
                   "heads_q, ceil(seq_q / 128)], k_scale [batch, heads_kv, ceil(seq_k / 128)], descale_v "
                   "[batch, heads_kv], key_mean [batch, heads_kv, head_dim], workspace [batch, heads_kv, "
                   "ceil(seq_k / 512), head_dim + 1]");
  }
  Int8QuantizeParams p;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.signs = signs.typed_data();
  p.q8 = q8->typed_data();
  p.k8 = k8->typed_data();
  p.v8 = v8->untyped_data();
  p.q_scale = q_scale->typed_data();
  p.k_scale = k_scale->typed_data();
  p.descale_v = descale_v->typed_data();
  p.key_mean = key_mean->typed_data();
  p.workspace = workspace->typed_data();
  p.bf16 = dtype == ffi::DataType::BF16;
  p.rotate = rotate;
  p.batch = batch;
  p.seqlen_q = qd[1];
  p.seqlen_k = kd[1];
  p.heads_q = qd[2];
  p.heads_kv = heads_kv;
  p.head_dim = qd[3];
  return ValidateAndLaunch(name, p, ValidateInt8Quantize, LaunchInt8Quantize, stream);
}

}  // namespace

uint64_t HandlerCalls() { return handler_calls.load(std::memory_order_relaxed); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionFwd, AttentionFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v, or vt (FP8 and INT8 v_transposed)
                                  // [cu_seqlens_q, cu_seqlens_k] (varlen), [descale_q, descale_k,
                                  // descale_v] (float8_e4m3fn q)
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
                                  .Ret<ffi::Buffer<ffi::S32>>()  // tile counter (scratch)
                                  .Attr<float>("softmax_scale")
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("window_left")  // -1: unbounded
                                  .Attr<int64_t>("window_right")
                                  .Attr<bool>("varlen")
                                  .Attr<int64_t>("max_seqlen_q")  // 0 for dense calls
                                  .Attr<int64_t>("max_seqlen_k")
                                  .Attr<bool>("lean_p")        // FP8 only
                                  .Attr<bool>("v_transposed")  // FP8 and INT8 only
                                  .Attr<int64_t>("key_block")  // 0: the launch's rule
                                  .Attr<float>("softcap"),     // 0: none; 16-bit only
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionBwd, AttentionBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // k
                                  .Arg<ffi::AnyBuffer>()         // v
                                  .Arg<ffi::AnyBuffer>()         // dout
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lse
                                  .Arg<ffi::Buffer<ffi::F32>>()  // delta
                                  .RemainingArgs()               // varlen: cu_seqlens_q, cu_seqlens_k
                                  .Ret<ffi::AnyBuffer>()         // dq
                                  .Ret<ffi::AnyBuffer>()         // dk
                                  .Ret<ffi::AnyBuffer>()         // dv
                                  .Ret<ffi::Buffer<ffi::S32>>()  // tile counters [2] (scratch)
                                  .Attr<float>("softmax_scale")
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("window_left")
                                  .Attr<int64_t>("window_right")
                                  .Attr<bool>("varlen")
                                  .Attr<int64_t>("max_seqlen_q")
                                  .Attr<int64_t>("max_seqlen_k")
                                  .Attr<float>("softcap"),  // 0: none
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8ValueOperand, Fp8ValueOperandImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // v, e4m3 [B, Sk, Hkv, 128]
                                  .Ret<ffi::AnyBuffer>(),  // vt, e4m3 [B, Hkv, 128, Sk']
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(Int8Quantize, Int8QuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // k
                                  .Arg<ffi::AnyBuffer>()         // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // signs
                                  .Ret<ffi::Buffer<ffi::S8>>()   // q8
                                  .Ret<ffi::Buffer<ffi::F32>>()  // q_scale
                                  .Ret<ffi::Buffer<ffi::S8>>()   // k8
                                  .Ret<ffi::Buffer<ffi::F32>>()  // k_scale
                                  .Ret<ffi::AnyBuffer>()         // v8
                                  .Ret<ffi::Buffer<ffi::F32>>()  // descale_v
                                  .Ret<ffi::Buffer<ffi::F32>>()  // key_mean
                                  .Ret<ffi::Buffer<ffi::F32>>()  // workspace (scratch)
                                  .Attr<bool>("rotate"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jzyfa
