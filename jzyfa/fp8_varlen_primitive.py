"""The `jzyfa_flash_attention_fp8_varlen_fwd` primitive: the FP8 kernel over packed variable-length batches.

`flash_attention_fp8_varlen_p` takes e4m3 q [total_q, Hq, 128], k and v [total_k, Hkv, 128], cu_seqlens_q
and cu_seqlens_k int32 [num_seqs + 1] (on the device, never read by the host) and float32 descales
[num_seqs, Hkv]; its results are out bf16 [total_q, Hq, 128] and lse float32 [Hq, total_q]. On CUDA it
lowers to the FFI custom call of that name (`_kernel_call_p`), with V's operand layout built one of two
ways (`fp8_primitive.fp8_varlen_value_layout` of max_seqlen_q and the heads, read when the call is
lowered): "staged", V's packed rows as they are (v_transposed=False; the kernel transposes each tile in
shared memory), for up to FP8_VARLEN_STAGED_V_MAX_ROWS rows per KV head in the longest sequence;
beyond, "transposed", V brought into the varlen V^T layout first (`fp8_layout.fp8_varlen_value_operand`:
a gather of token rows, then the dense layout's kernel) and passed with v_transposed=True.
JZYFA_FP8_V_LAYOUT overrides the rule. Every
other platform lowers to the pure-JAX path
(`jzyfa.varlen.fp8_varlen_attention_reference`: dequantize, exact attention), unless the caller demanded
the kernel (`kernel_required=True`), in which case lowering for a non-CUDA platform is an error.

P is always lean (the FP8 kernel's default; `flash_attention`'s lean_p=False has no varlen instantiation).
No sharding, vmap or autodiff rule (FP8 inputs are not differentiated).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jzyfa import _validation
from jzyfa.fp8_layout import fp8_varlen_value_operand, varlen_padded_keys
from jzyfa.fp8_primitive import fp8_value_operand_p, fp8_varlen_value_layout
from jzyfa.primitive import TILE_COUNTER, _vary_alike, refuse_required_kernel
from jzyfa.varlen import fp8_varlen_attention_reference
from jzyfa.varlen_primitive import varlen_bind_params, varlen_ffi_attributes, varlen_shape_problem

FFI_TARGET_FP8_VARLEN = "jzyfa_flash_attention_fp8_varlen_fwd"
# The launch keeps V^T's columns in int32 (ffi/flash_fwd_fp8_varlen.cu; the "transposed" layout).
KERNEL_MAX_VALUE_KEYS = (1 << 31) - 1024

flash_attention_fp8_varlen_p = Primitive(FFI_TARGET_FP8_VARLEN)
flash_attention_fp8_varlen_p.multiple_results = True
# The custom call itself, descales flattened, V or V^T (v_transposed); bound only by the CUDA lowering
# below.
_kernel_call_p = Primitive(FFI_TARGET_FP8_VARLEN + "_call")
_kernel_call_p.multiple_results = True


def flash_attention_fp8_varlen_fwd(
    q8,
    k8,
    v8,
    cu_seqlens_q,
    cu_seqlens_k,
    descales,
    *,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    kernel_required: bool,
    window: _validation.Window = _validation.NO_WINDOW,
) -> tuple[jax.Array, jax.Array]:
    """Binds the primitive: (out bf16 [total_q, Hq, 128], lse float32 [Hq, total_q]). Descales of shape (),
    (1,) or [num_seqs, Hkv] are broadcast to [num_seqs, Hkv]; the mask is `causal` and `window` combined."""
    per_head = (cu_seqlens_q.shape[0] - 1, k8.shape[1])
    descales = [
        jnp.broadcast_to(jnp.asarray(d, jnp.float32).reshape(-1, 1) if jnp.size(d) == 1 else d, per_head)
        for d in descales
    ]
    operands = _vary_alike(
        q8, k8, v8, jnp.asarray(cu_seqlens_q, jnp.int32), jnp.asarray(cu_seqlens_k, jnp.int32), *descales
    )
    out, lse = flash_attention_fp8_varlen_p.bind(
        *operands,
        **varlen_bind_params(max_seqlen_q, max_seqlen_k, softmax_scale, causal, window, kernel_required),
    )
    return out, lse


def _abstract_eval(q8, *operands, **params):
    del operands, params
    total_q, heads_q, head_dim = q8.shape
    out = q8.update(shape=(total_q, heads_q, head_dim), dtype=jnp.bfloat16, weak_type=False)
    lse = q8.update(shape=(heads_q, total_q), dtype=jnp.float32, weak_type=False)
    return out, lse


flash_attention_fp8_varlen_p.def_abstract_eval(_abstract_eval)
_kernel_call_p.def_abstract_eval(_abstract_eval)


# Eager calls compile the primitive alone, once per shape and parameters.
@functools.partial(
    jax.jit,
    static_argnames=("max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal", "window", "kernel_required"),
)
def _impl(*operands, **params):
    return flash_attention_fp8_varlen_p.bind(*operands, **params)


flash_attention_fp8_varlen_p.def_impl(_impl)


def _reference_fallback(
    q8,
    k8,
    v8,
    cu_q,
    cu_k,
    dq,
    dk,
    dv,
    *,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale,
    causal,
    window,
    kernel_required,
):
    refuse_required_kernel(kernel_required)
    return fp8_varlen_attention_reference(
        q8,
        k8,
        v8,
        cu_q,
        cu_k,
        (dq, dk, dv),
        max_seqlen_q,
        max_seqlen_k,
        window=_validation.mask_window(causal, window),
        softmax_scale=softmax_scale,
    )


def _kernel_call(q8, k8, v8, cu_q, cu_k, dq, dk, dv, *, kernel_required, **params):
    """On CUDA: V into the varlen V^T layout (its 32-key permutation by the dense layout's kernel) unless
    the layout is "staged", then the custom call (descales as [num_seqs * Hkv])."""
    del kernel_required  # Only decides what non-CUDA platforms do.
    v_transposed = fp8_varlen_value_layout(params["max_seqlen_q"], q8.shape[1], k8.shape[1]) == "transposed"
    if v_transposed:
        v8 = fp8_varlen_value_operand(v8, cu_k, value_operand=fp8_value_operand_p.bind)
    return _kernel_call_p.bind(
        q8, k8, v8, cu_q, cu_k, *(d.reshape(-1) for d in (dq, dk, dv)), v_transposed=v_transposed, **params
    )


_ffi_lowering = jax.ffi.ffi_lowering(FFI_TARGET_FP8_VARLEN)


def _ffi_call_lowering(
    ctx, *operands, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window, v_transposed
):
    ctx = ctx.replace(avals_out=[*ctx.avals_out, TILE_COUNTER])  # the tile queue, dropped below
    attributes = varlen_ffi_attributes(max_seqlen_q, max_seqlen_k, softmax_scale, causal, window)
    out, lse, _ = _ffi_lowering(ctx, *operands, **attributes, v_transposed=bool(v_transposed))
    return [out, lse]


mlir.register_lowering(
    flash_attention_fp8_varlen_p, mlir.lower_fun(_reference_fallback, multiple_results=True)
)
mlir.register_lowering(
    flash_attention_fp8_varlen_p, mlir.lower_fun(_kernel_call, multiple_results=True), platform="cuda"
)
mlir.register_lowering(_kernel_call_p, _ffi_call_lowering, platform="cuda")


def fp8_varlen_kernel_config_problem(q8, k8, num_seqs: int, max_seqlen_q: int) -> str | None:
    """None when the FP8 varlen kernel serves a validated call (head dim 128 is checked before), else why
    not."""
    if problem := varlen_shape_problem(q8, k8, num_seqs, max_seqlen_q):
        return problem
    transposed = fp8_varlen_value_layout(max_seqlen_q, q8.shape[1], k8.shape[1]) == "transposed"
    if transposed and varlen_padded_keys(k8.shape[0], num_seqs) > KERNEL_MAX_VALUE_KEYS:
        return (
            f"the FP8 varlen kernel takes total_k + 32 * (num_seqs + 1) < 2^31 - 1024 (V^T's columns), got "
            f"{k8.shape[0]} keys"
        )
    return None
