"""`flash_attention` and `flash_attention_varlen`: validate -> plan -> bind the primitive or run the
pure-JAX path; one custom_vjp for dense and varlen calls."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import checkify

from jzyfa import _validation, cudnn, padded, plan, primitives
from jzyfa.int8_emulation import int8_attention
from jzyfa.merge import add_attention_sinks
from jzyfa.plan import Path
from jzyfa.quantize import dequantize, fp8_quantize, hadamard_rotate
from jzyfa.reference import attention_delta, attention_reference
from jzyfa.varlen import (
    fp8_varlen_attention_reference,
    lengths_fit,
    longest_sequences,
    maxima_cover,
    poison_unless,
    through_slots,
    varlen_attention_reference,
)

_MASK_KINDS = {_validation.NO_WINDOW: "none", _validation.CAUSAL_WINDOW: "causal"}
_MASK_WINDOWS = {kind: window for window, kind in _MASK_KINDS.items()}


def kernel_mask(causal: bool, window, seq_q: int, seq_k: int) -> tuple[str, bool, _validation.Window]:
    """(mask kind, the kernel's causal flag, its window) for this mask over these lengths: a window
    that comes down to causal or none for these lengths is that (the plain kernels, NO_WINDOW); any
    other is "window", with bounds that exclude no key as -1."""
    canonical = _validation.canonical_window(_validation.mask_window(causal, window), seq_q, seq_k)
    kind = _MASK_KINDS.get(canonical, "window")
    if kind == "window":
        return kind, False, canonical
    return kind, kind == "causal", _validation.NO_WINDOW


def _family_problem(dtype) -> tuple[str, str | None]:
    """(family, None), or (family, why no kernel takes this dtype)."""
    if _validation.is_fp8(dtype):
        return "fp8", None
    if jnp.dtype(dtype) in _validation.SIXTEEN_BIT_DTYPES:
        return "16bit", None
    return "16bit", f"the kernels take bf16, f16 or float8_e4m3fn inputs, got {jnp.dtype(dtype).name}"


def _problem(
    q, v, mask: str, layout: str, sizes: plan.CallSizes, softmax_scale: float, softcap: float | None
) -> str | None:
    family, problem = _family_problem(q.dtype)
    if problem:
        return problem
    if softcap is not None and family == "fp8":
        return "the FP8 kernel has no softcap (the tanh cap of the scores); the pure-JAX path serves it"
    if softcap is not None and q.shape[-1] != v.shape[-1]:
        return "the MLA kernel (q and v head dims differ) has no softcap; the pure-JAX path serves it"
    config = plan.Config(family, (q.shape[-1], v.shape[-1]), mask, layout)
    return plan.call_problem(config, sizes, softmax_scale)


# Names of the residuals the backward reads beside q, k and v: `jax.checkpoint` policies keep or drop
# them by name (e.g. `jax.checkpoint_policies.save_only_these_names(*RESIDUAL_NAMES)`).
RESIDUAL_NAMES = ("jzyfa_attention_out", "jzyfa_attention_lse")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _differentiable(spec: primitives.AttentionSpec, q, k, v, extras):
    return primitives.attention_fwd(q, k, v, *extras, spec=spec)


def _differentiable_fwd(spec, q, k, v, extras):
    # Named as they leave, so that a policy that keeps them keeps the outputs the caller uses too.
    out, lse = (
        checkpoint_name(x, name) for x, name in zip(_differentiable(spec, q, k, v, extras), RESIDUAL_NAMES)
    )
    return (out, lse), (q, k, v, extras, out, lse)


def _differentiable_bwd(spec, residuals, cotangents):
    """The backward primitive on the forward's residuals: no forward is recomputed."""
    q, k, v, extras, out, lse = residuals
    dout, dlse = cotangents
    delta = attention_delta(out, dout, dlse, varlen=spec.varlen is not None)
    dq, dk, dv = primitives.attention_bwd(q, k, v, dout.astype(out.dtype), lse, delta, *extras, spec=spec)
    if spec.varlen and not maxima_cover(q, k, *spec.varlen):
        dq, dk, dv = poison_unless(lengths_fit(*extras, *spec.varlen), dq, dk, dv)
    # Integer offsets take float0 cotangents.
    zeros = tuple(np.zeros(x.shape, jax.dtypes.float0) for x in extras)
    return dq, dk, dv, zeros


_differentiable.defvjp(_differentiable_fwd, _differentiable_bwd)


def _gradient_refused(message: str):
    """The identity, whose derivative raises TypeError(message): a pure-JAX path that refuses to be
    differentiated as its kernel path does (rounding would give zero or wrong gradients)."""

    @jax.custom_jvp
    def identity(x):
        return x

    @identity.defjvp
    def refuse(primals, tangents):
        del primals, tangents
        raise TypeError(message)

    return identity


_fp8_gradient_refused = _gradient_refused(primitives.FP8_NOT_DIFFERENTIABLE)
_int8_gradient_refused = _gradient_refused(primitives.INT8_NOT_DIFFERENTIABLE)


def _dense_reference(q, k, v, lengths, descales, *, causal, window, softmax_scale, softcap):
    """The pure-JAX path of a dense call: exact attention (of the dequantized values for FP8 inputs,
    bf16 out), through the packed reference for padded batches."""
    if descales is not None:
        if lengths:
            packed = functools.partial(fp8_varlen_packed, window=_validation.mask_window(causal, window),
                                       softmax_scale=softmax_scale, softcap=softcap, max_lengths=(q.shape[1], k.shape[1]))  # fmt: skip
            return padded.attention(packed, q, k, v, *lengths, *descales)
        q, k, v = (dequantize(x, d) for x, d in zip((q, k, v), descales))
        out, lse = attention_reference(
            q, k, v, causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap
        )
        return out.astype(jnp.bfloat16), lse
    if lengths:

        def packed(q, k, v, cu_q, cu_k):
            return varlen_attention_reference(
                q, k, v, cu_q, cu_k, *max_lengths, window=_validation.mask_window(causal, window),
                softmax_scale=softmax_scale, softcap=softcap, trust_maxima=True,
            )  # fmt: skip

        max_lengths = (q.shape[1], k.shape[1])
        return padded.attention(packed, q, k, v, *lengths)
    return attention_reference(
        q, k, v, causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap
    )


def fp8_varlen_packed(q, k, v, cu_q, cu_k, *descales, window, softmax_scale, softcap, max_lengths):
    """The FP8 packed reference with its descales as positional operands (`jzyfa.padded.attention`)."""
    return fp8_varlen_attention_reference(
        q,
        k,
        v,
        cu_q,
        cu_k,
        descales,
        *max_lengths,
        window=window,
        softmax_scale=softmax_scale,
        softcap=softcap,
        trust_maxima=True,
    )


def _backward_kernel(q, v, mask: str, layout: str) -> bool:
    """Whether the plan has a backward kernel for this 16-bit call's configuration."""
    config = plan.Config("16bit", (q.shape[-1], v.shape[-1]), mask, layout, "bwd")
    return plan.kernel_for(config) is not None


def _quantize_in_call(q, k, v, *, rotate: bool):
    """precision="fp8": e4m3 q, k, v with [batch, heads_kv] power-of-two descales (q's shared by each
    KV head's query group), q and k Hadamard-rotated first when asked."""
    if rotate:
        q, k = hadamard_rotate(q, k)
    heads_kv = k.shape[2]
    (q8, dq), (k8, dk), (v8, dv) = (fp8_quantize(x, "head", kv_heads=heads_kv) for x in (q, k, v))
    return q8, k8, v8, {"descale_q": dq, "descale_k": dk, "descale_v": dv}


def _int8_options(q, k, v, *, layout: str, seq_q: int, seq_k: int, causal, window, softmax_scale, implementation,
                  lean_p, rotate, softcap, num_seqs: int = 0) -> tuple[dict, Path]:  # fmt: skip
    """precision="int8"'s arguments checked as any call's, before any work: (`int8_attention`'s options,
    the path). The INT8 kernel serves the plan's "int8" rows with lean P on a Hopper GPU; the emulation
    serves the rest and every other backend, and implementation="kernel" raises what the kernel cannot
    serve. layout "varlen": packed q, k, v of num_seqs sequences, or padded dense ones (num_seqs 0: the
    batch's rows and their padding, `jzyfa.padded`). seq_q, seq_k: the lengths the mask is read at
    (varlen: the maxima)."""
    _validation.check_causal(causal)
    window = _validation.check_window(window)
    _validation.check_implementation(implementation)
    lean_p = _check_lean_p(lean_p)
    softmax_scale = _validation.resolve_softmax_scale(softmax_scale, q.shape[-1])
    if _validation.check_softcap(softcap) is not None:
        raise ValueError("softcap is not available with precision='int8'; use precision=None for a softcap")
    if not softmax_scale > 0:
        raise ValueError(f"precision='int8' needs softmax_scale > 0, got {softmax_scale}")
    mask, _, _ = kernel_mask(causal, window, seq_q, seq_k)
    config = plan.Config("int8", (q.shape[-1], v.shape[-1]), mask, layout)
    problem = plan.config_problem(config)
    if problem is None and not lean_p:
        problem = "the INT8 kernel computes lean P only (lean_p=True); lean_p=False runs the emulation"
    if problem is None:
        if layout == "dense":
            sizes = plan.CallSizes(layout, q.shape[0], seq_q, seq_k, q.shape[2], k.shape[2])
        elif num_seqs:  # packed [tokens, heads, dim]
            sizes = plan.CallSizes(layout, num_seqs, seq_q, seq_k, q.shape[1], k.shape[1], q.shape[0], k.shape[0])
        else:  # padded [batch, seq, heads, dim]: 2 * batch packed sequences
            batch = q.shape[0]
            sizes = plan.CallSizes(layout, 2 * batch, seq_q, seq_k, q.shape[2], k.shape[2], batch * seq_q, batch * seq_k)
        problem = plan.call_problem(config, sizes, softmax_scale)
    path = plan.choose_path(problem, implementation, cpu_primitive=False)
    window = _validation.mask_window(causal, window)
    return {"window": window, "softmax_scale": softmax_scale, "lean_p": lean_p, "rotate": rotate}, path


def _int8_attention(q, k, v, seqlens_q=None, seqlens_k=None, **options):
    """`int8_attention` of [B, S, H, D] q, k, v, refusing to be differentiated."""
    q, k, v = map(_int8_gradient_refused, (q, k, v))
    return int8_attention(q, k, v, seqlens_q=seqlens_q, seqlens_k=seqlens_k, **options)


@functools.partial(
    jax.jit, static_argnames=("window", "softmax_scale", "rotate", "lean_p", "kernel_required", "varlen")
)
def _int8_kernel_attention(q, k, v, *lengths, window, softmax_scale, rotate, lean_p, kernel_required, varlen=None):
    """precision="int8" on the INT8 kernel: the primitive quantizes each shard's q, k, v
    (`jzyfa.primitives.int8_quantize_p`; packed and padded batches per sequence,
    `jzyfa.int8_quant.int8_quantize_packed`), runs the kernel and gives the unsmoothed keys' LSE; out in
    q's dtype. Dense [B, S, H, D] q, k, v with no lengths or (seqlens_q, seqlens_k); or packed ones with
    (cu_seqlens_q, cu_seqlens_k) and varlen = (max_seqlen_q, max_seqlen_k). Not differentiable."""
    q, k, v = map(_int8_gradient_refused, (q, k, v))
    seq_q, seq_k = varlen or (q.shape[1], k.shape[1])
    _, kernel_causal, kernel_window = kernel_mask(False, window, seq_q, seq_k)
    spec = primitives.make_spec(
        softmax_scale=softmax_scale, causal=kernel_causal, window=kernel_window, kernel_required=kernel_required,
        int8_in_call=True, rotate=rotate, lean_p=lean_p, varlen=varlen, seqlens=bool(lengths) and varlen is None,
    )  # fmt: skip
    out, lse = primitives.attention_fwd(q, k, v, *lengths, spec=spec)
    return out.astype(q.dtype), lse


def _check_lean_p(lean_p) -> bool:
    if not isinstance(lean_p, (bool, np.bool_)):
        raise TypeError(f"lean_p must be a bool, got {type(lean_p).__name__}")
    return bool(lean_p)


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
    descale_q: jax.Array | None = None,
    descale_k: jax.Array | None = None,
    descale_v: jax.Array | None = None,
    lean_p: bool = True,
    precision: str | None = None,
    rotate: bool = False,
    sinks: jax.Array | None = None,
    softcap: float | None = None,
    seqlens_q: jax.Array | None = None,
    seqlens_k: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Scaled dot-product attention, softmax(scale * q k^T) v, per batch and head.

    Args:
      q: [batch, seq_q, heads_q, head_dim]; bf16, f16, float32 or float8_e4m3fn.
      k: [batch, seq_k, heads_kv, head_dim], q's dtype; heads_q a multiple of heads_kv (GQA/MQA:
        query head h uses key/value head h // (heads_q // heads_kv)).
      v: [batch, seq_k, heads_kv, head_dim_v], q's dtype; head_dim_v may differ from head_dim (MLA:
        192 for q/k, 128 for v), and the output has it.
      causal: mask aligned bottom-right, query i sees key j iff j <= i + seq_k - seq_q; the same as
        window=(-1, 0).
      window: None or a static (left, right) pair: query i, at position p = i + seq_k - seq_q, sees
        key j iff p - left <= j <= p + right, -1 leaving a side unbounded. With causal=True the
        right bound is 0 whatever is given (flash-attention's convention). Rows that see no key give
        out = 0 and lse = -inf.
      softmax_scale: static float; default 1 / sqrt(head_dim) (q's and k's head dim).
      return_lse: also return the log-sum-exp, float32 [batch, heads_q, seq_q], natural log.
      implementation: None uses a kernel where one serves the call (a Hopper GPU and a configuration in
        `jzyfa.plan.KERNELS`: the README's support matrix); on other CUDA GPUs cuDNN's fused attention
        (`jax.nn.dot_product_attention(implementation="cudnn")`) where it computes exactly this call
        (`jzyfa.cudnn`); the pure-JAX path elsewhere. "kernel" raises a ValueError naming what the
        kernels cannot serve; "xla" always uses the pure-JAX path.
      descale_q, descale_k, descale_v: float32 descales, required for FP8 inputs and refused for
        others: shape () or (1,), or [batch, heads_kv] (one per batch and KV head; for q, one per
        group of query heads sharing a KV head). The values used are x_fp8 * descale.
      lean_p: FP8 kernel only: each probability's e4m3 code from one FFMA (True, the default) or
        exp2 rounded to e4m3 (False). See docs/fp8.md.
      precision: None computes in the inputs' precision. "fp8" quantizes bf16/f16/float32 q, k, v to
        e4m3 inside the call (`fp8_quantize`, one power-of-two descale per batch and KV head, on the
        device) and runs the FP8 path; out keeps the inputs' dtype. Not differentiable. "int8"
        subtracts each (batch, KV head)'s mean key (softmax is unchanged; the LSE returned is the
        unsmoothed keys'), quantizes q and k to INT8 with one scale per 128 tokens and head and v to
        e4m3 (`jzyfa.int8_quant`), and runs the INT8 kernel (dense calls at head dim 128 and MLA's
        192/128 on a Hopper GPU: the README's support matrix) or elsewhere its bit-faithful
        emulation (`jzyfa.int8_emulation`). Not differentiable.
        See docs/int8.md.
      rotate: with precision="fp8" or "int8", rotate q and k by one Hadamard matrix with random signs
        (`hadamard_rotate`, seed 0) before quantizing: q k^T is unchanged, outliers are spread.
      sinks: None, or one sink logit per query head, [heads_q] (gpt-oss): every row's softmax also
        spans that logit with a zero value. Applied exactly to the kernel's (out, lse)
        (`jzyfa.merge.add_attention_sinks`); differentiable, the sinks included.
      softcap: None, or a static c > 0 capping each scaled score s to c * tanh(s / c) (Gemma 2).
        The kernels have none: such calls take the pure-JAX path ("kernel" raises).
      seqlens_q, seqlens_k: None, or int [batch] device arrays (never read by the host): right-padded
        batches, sequence b holding its first seqlens_q[b] queries and seqlens_k[b] keys (values
        clipped to [0, seq]; a missing one means all). Keys past a length are never seen, the mask is
        bottom-right aligned per sequence (query t at t + seqlens_k[b] - seqlens_q[b]), and padded
        query rows give out = 0 and lse = -inf. Served by the packed (varlen) kernels
        (`jzyfa.padded`).

    Returns:
      out [batch, seq_q, heads_q, head_dim_v] in q's dtype (bf16 for FP8 inputs), or (out, lse).
    """
    _validation.check_qkv(q, k, v)
    _validation.check_sinks(sinks, q.shape[2])
    if sinks is not None:
        options = {name: value for name, value in locals().items() if name not in ("q", "k", "v", "sinks")}
        out, lse = flash_attention(q, k, v, **{**options, "return_lse": True})
        out, lse = add_attention_sinks(out, lse, sinks)
        return (out, lse) if return_lse else out
    given = (descale_q, descale_k, descale_v)
    _validation.check_precision(precision, rotate, q.dtype, any(d is not None for d in given))
    if precision == "fp8":
        q8, k8, v8, descales = _quantize_in_call(q, k, v, rotate=rotate)
        options = {
            "causal": causal,
            "window": window,
            "softmax_scale": softmax_scale,
            "return_lse": return_lse,
            "softcap": softcap,
            "seqlens_q": seqlens_q,
            "seqlens_k": seqlens_k,
        }
        result = flash_attention(
            q8, k8, v8, **options, implementation=implementation, lean_p=lean_p, **descales
        )
        out, lse = result if return_lse else (result, None)
        return (out.astype(q.dtype), lse) if return_lse else out.astype(q.dtype)
    if precision == "int8":
        lengths = _validation.check_seqlens(seqlens_q, seqlens_k, q.shape[:2], k.shape[1])
        options, path = _int8_options(q, k, v, layout="varlen" if lengths else "dense", seq_q=q.shape[1],
                                      seq_k=k.shape[1], causal=causal, window=window, softmax_scale=softmax_scale,
                                      implementation=implementation, lean_p=lean_p, rotate=rotate, softcap=softcap)  # fmt: skip
        if path is Path.REFERENCE:
            out, lse = _int8_attention(q, k, v, *lengths, **options)
        else:
            out, lse = _int8_kernel_attention(
                q, k, v, *lengths, **options, kernel_required=path is Path.KERNEL_REQUIRED
            )
        return (out, lse) if return_lse else out
    _validation.check_causal(causal)
    window = _validation.check_window(window)
    _validation.check_implementation(implementation)
    lean_p = _check_lean_p(lean_p)
    softmax_scale = _validation.resolve_softmax_scale(softmax_scale, q.shape[-1])
    softcap = _validation.check_softcap(softcap)
    descales = _validation.check_descales(q, k, (descale_q, descale_k, descale_v))
    fp8 = descales is not None

    shared_lengths = seqlens_q is not None and seqlens_q is seqlens_k
    lengths = _validation.check_seqlens(seqlens_q, seqlens_k, q.shape[:2], k.shape[1])

    mask, kernel_causal, kernel_window = kernel_mask(causal, window, q.shape[1], k.shape[1])
    (batch, seq_q, heads_q, _), (_, seq_k, heads_kv, _) = q.shape, k.shape
    if lengths:  # the packed kernels serve padded batches: 2 * batch sequences (jzyfa.padded)
        layout = "varlen"
        sizes = plan.CallSizes(
            layout, 2 * batch, seq_q, seq_k, heads_q, heads_kv, batch * seq_q, batch * seq_k
        )
    else:
        layout = "dense"
        sizes = plan.CallSizes(layout, batch, seq_q, seq_k, heads_q, heads_kv)
    problem = _problem(q, v, mask, layout, sizes, softmax_scale, softcap)
    cudnn_call = cudnn.Call(
        jnp.dtype(q.dtype).name,
        (q.shape[-1], v.shape[-1]),
        seq_q,
        seq_k,
        _MASK_WINDOWS.get(mask, kernel_window),
        lengths="none" if not lengths else "shared" if shared_lengths else "separate",
        return_lse=return_lse,
        softcap=softcap is not None,
    )
    # On a CPU backend 16-bit calls still bind the primitive (its lowering there is the reference), so
    # the same program lowers for CUDA; FP8 calls take the exact pure-JAX path there.
    path = plan.choose_path(problem, implementation, cpu_primitive=not fp8, cudnn_call=cudnn_call)
    if path is Path.CUDNN:
        out, lse = (
            cudnn.attention(q, k, v, lengths, window=cudnn_call.window, softmax_scale=softmax_scale),
            None,
        )
    elif path is Path.REFERENCE:
        if fp8:
            q, k, v, *descales = map(_fp8_gradient_refused, (q, k, v, *descales))
        reference = functools.partial(_dense_reference, causal=causal, window=window, softmax_scale=softmax_scale,
                                      softcap=softcap)  # fmt: skip
        out, lse = reference(q, k, v, lengths, descales)
    else:
        spec = primitives.make_spec(
            softmax_scale=softmax_scale,
            causal=kernel_causal,
            window=kernel_window,
            kernel_required=path is Path.KERNEL_REQUIRED,
            fp8=fp8,
            lean_p=lean_p,
            backward_kernel=not fp8 and _backward_kernel(q, v, mask, layout),
            seqlens=bool(lengths),
            softcap=softcap,
        )
        if fp8:  # FP8 inputs are not differentiated
            out, lse = primitives.attention_fwd(q, k, v, *lengths, *descales, spec=spec)
        else:
            out, lse = _differentiable(spec, q, k, v, lengths)
    return (out, lse) if return_lse else out


def flash_attention_varlen(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
    descale_q: jax.Array | None = None,
    descale_k: jax.Array | None = None,
    descale_v: jax.Array | None = None,
    precision: str | None = None,
    rotate: bool = False,
    sinks: jax.Array | None = None,
    softcap: float | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention over a packed batch of sequences of different lengths (flash-attention's varlen).

    Args:
      q: [total_q, heads_q, head_dim], the batch's query tokens back to back; bf16, f16, float32 or
        float8_e4m3fn (with descales).
      k: [total_k, heads_kv, head_dim]; v: [total_k, heads_kv, head_dim_v]; q's dtype, GQA/MQA and
        MLA head dims as in `flash_attention`.
      cu_seqlens_q, cu_seqlens_k: int32 [num_seqs + 1] cumulative offsets: sequence s holds query
        tokens cu_seqlens_q[s]:cu_seqlens_q[s + 1] and key tokens cu_seqlens_k[s]:cu_seqlens_k[s + 1].
        Device arrays, never read by the host (they may be traced); sequences may be empty.
      max_seqlen_q, max_seqlen_k: static ints >= 1, at least the longest query / key sequence.
        Concrete offsets are checked at trace time (ValueError). Traced ones are checked on the
        device: the pure-JAX path stays exact (a slower whole-buffer computation when a sequence is
        longer), the kernel path returns NaN in out, lse and the gradients, and under
        `jax.experimental.checkify` (errors=checkify.user_checks) the call reports the error.
      causal, window, softmax_scale: as in `flash_attention`, per sequence: query t of a sequence
        with lengths (len_q, len_k) sits at position t + len_k - len_q (bottom-right alignment).
      return_lse: also return the log-sum-exp, float32 [heads_q, total_q] (flash-attention's varlen
        layout: heads first, then packed tokens).
      implementation: as in `flash_attention` (the plan's "varlen" rows).
      descale_q, descale_k, descale_v: float32 descales, required for FP8 inputs and refused for
        others: shape () or (1,), or [num_seqs, heads_kv] (one per sequence and KV head; for q, one
        per group of query heads sharing a KV head). The values used are x_fp8 * descale. FP8 varlen
        calls use lean P.
      precision, rotate: as in `flash_attention`; "fp8" quantizes with one descale per KV head over
        the whole packed batch; "int8" smooths each sequence's keys and starts its scale blocks at
        each sequence's first token.
      sinks, softcap: as in `flash_attention`.

    Returns:
      out [total_q, heads_q, head_dim_v] in q's dtype (bf16 for FP8 inputs), or (out, lse). Queries
      that see no key (a sequence with no keys, an empty window) and tokens past cu_seqlens_q[-1] give
      out = 0 and lse = -inf.
    """
    _validation.check_packed_qkv(q, k, v)
    _validation.check_sinks(sinks, q.shape[1])
    if sinks is not None:
        options = {name: value for name, value in locals().items() if name not in ("q", "k", "v", "sinks")}
        out, lse = flash_attention_varlen(q, k, v, **{**options, "return_lse": True})
        out, lse = add_attention_sinks(out, lse, sinks, packed=True)
        return (out, lse) if return_lse else out
    given = (descale_q, descale_k, descale_v)
    _validation.check_precision(precision, rotate, q.dtype, any(d is not None for d in given))
    if precision == "fp8":
        q8, k8, v8, descales = _quantize_in_call(q[None], k[None], v[None], rotate=rotate)
        num_seqs = jnp.shape(cu_seqlens_q)[0] - 1
        descales = {name: jnp.broadcast_to(d, (num_seqs, k.shape[1])) for name, d in descales.items()}
        result = flash_attention_varlen(
            q8[0], k8[0], v8[0], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            causal=causal, window=window, softmax_scale=softmax_scale, return_lse=return_lse,
            implementation=implementation, softcap=softcap, **descales,
        )  # fmt: skip
        out, lse = result if return_lse else (result, None)
        return (out.astype(q.dtype), lse) if return_lse else out.astype(q.dtype)
    _validation.check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
    max_seqlen_q = _validation.check_max_seqlen("max_seqlen_q", max_seqlen_q, cu_seqlens_q)
    max_seqlen_k = _validation.check_max_seqlen("max_seqlen_k", max_seqlen_k, cu_seqlens_k)
    if precision == "int8":
        options, path = _int8_options(q, k, v, layout="varlen", seq_q=max_seqlen_q, seq_k=max_seqlen_k,
                                      causal=causal, window=window, softmax_scale=softmax_scale,
                                      implementation=implementation, lean_p=True, rotate=rotate, softcap=softcap,
                                      num_seqs=cu_seqlens_q.shape[0] - 1)  # fmt: skip
        cu = [jnp.asarray(c, jnp.int32) for c in (cu_seqlens_q, cu_seqlens_k)]
        if path is Path.REFERENCE:  # each sequence in a right-padded slot of max_seqlen tokens
            attend = functools.partial(_int8_attention, **options)
            out, lse = through_slots(attend, q, k, v, *cu, max_seqlen_q, max_seqlen_k)
        else:
            out, lse = _int8_kernel_attention(
                q, k, v, *cu, **options, kernel_required=path is Path.KERNEL_REQUIRED,
                varlen=(max_seqlen_q, max_seqlen_k),
            )  # fmt: skip
        # Slots hold max_seqlen tokens: traced offsets with a longer sequence give NaN, as the kernels do.
        fits = _fits_on_device(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        if fits is not None:
            out, lse = poison_unless(fits, out, lse)
        return (out, lse) if return_lse else out
    _validation.check_causal(causal)
    window = _validation.check_window(window)
    _validation.check_implementation(implementation)
    softmax_scale = _validation.resolve_softmax_scale(softmax_scale, q.shape[-1])
    softcap = _validation.check_softcap(softcap)
    num_seqs = cu_seqlens_q.shape[0] - 1
    descales = _validation.check_descales(
        q,
        k,
        (descale_q, descale_k, descale_v),
        per_head_shape=(num_seqs, k.shape[1]),
        per_head_axes="num_seqs",
    )
    fp8 = descales is not None
    effective_window = _validation.mask_window(causal, window)
    # The kernel's mask: bounds that exclude no key of sequences up to the maxima as -1, so that windows
    # that come down to causal or none run the plain kernels.
    mask, kernel_causal, kernel_window = kernel_mask(causal, window, max_seqlen_q, max_seqlen_k)
    sizes = plan.CallSizes(
        "varlen", num_seqs, max_seqlen_q, max_seqlen_k, q.shape[1], k.shape[1], q.shape[0], k.shape[0]
    )
    problem = _problem(q, v, mask, "varlen", sizes, softmax_scale, softcap)
    path = plan.choose_path(problem, implementation, cpu_primitive=False)
    cu_q, cu_k = jnp.asarray(cu_seqlens_q, jnp.int32), jnp.asarray(cu_seqlens_k, jnp.int32)
    fits = _fits_on_device(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if path is Path.REFERENCE:
        if fp8:
            q, k, v, *descales = map(_fp8_gradient_refused, (q, k, v, *descales))
            out, lse = fp8_varlen_attention_reference(
                q, k, v, cu_q, cu_k, descales, max_seqlen_q, max_seqlen_k,
                window=effective_window, softmax_scale=softmax_scale, softcap=softcap,
            )  # fmt: skip
        else:
            out, lse = varlen_attention_reference(
                q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k,
                window=effective_window, softmax_scale=softmax_scale, softcap=softcap,
            )  # fmt: skip
    else:
        spec = primitives.make_spec(
            softmax_scale=softmax_scale,
            causal=kernel_causal,
            window=kernel_window,
            kernel_required=path is Path.KERNEL_REQUIRED,
            varlen=(max_seqlen_q, max_seqlen_k),
            fp8=fp8,
            backward_kernel=not fp8 and _backward_kernel(q, v, mask, "varlen"),
            softcap=softcap,
        )
        if fp8:
            out, lse = primitives.attention_fwd(q, k, v, cu_q, cu_k, *descales, spec=spec)
        else:
            out, lse = _differentiable(spec, q, k, v, (cu_q, cu_k))
        if fits is not None:  # the kernels need the maxima: a call they cannot compute is NaN
            out, lse = poison_unless(fits, out, lse)
    return (out, lse) if return_lse else out


def _fits_on_device(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int):
    """None where the maxima are known to cover every sequence (offsets read at trace time were checked
    against them; maxima as long as the packed buffers cover anything), else a device bool: every
    sequence fits its maxima."""
    checked = all(map(_validation.is_concrete, (cu_seqlens_q, cu_seqlens_k)))
    if checked or maxima_cover(q, k, max_seqlen_q, max_seqlen_k):
        return None
    cu_q, cu_k = jnp.asarray(cu_seqlens_q, jnp.int32), jnp.asarray(cu_seqlens_k, jnp.int32)
    return _device_check(cu_q, cu_k, max_seqlen_q, max_seqlen_k)


def _device_check(cu_q, cu_k, max_seqlen_q: int, max_seqlen_k: int) -> jax.Array:
    """Whether every traced sequence fits the maxima (bool, on the device), checked under
    `jax.experimental.checkify` (an error naming the argument) and a no-op check outside it."""
    longest_q, longest_k = longest_sequences(cu_q, cu_k)
    fits = (longest_q <= max_seqlen_q) & (longest_k <= max_seqlen_k)
    checkify.debug_check(
        fits,
        f"flash_attention_varlen: max_seqlen_q={max_seqlen_q}, max_seqlen_k={max_seqlen_k}, but the "
        "longest sequences in cu_seqlens_q / cu_seqlens_k hold {} / {} tokens; pass max_seqlen_q and "
        "max_seqlen_k at least that long",
        longest_q,
        longest_k,
    )
    return fits
