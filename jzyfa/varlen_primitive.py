"""The `jzyfa_flash_attention_varlen_fwd` primitive: the 16-bit kernel over packed variable-length batches.

Operands q [total_q, Hq, D], k [total_k, Hkv, D] and v [total_k, Hkv, Dv] (bf16/f16; D = Dv in 64, 128,
256, or MLA's D 192 with Dv 128), cu_seqlens_q and cu_seqlens_k int32 [num_seqs + 1] (on the device, never
read by the host); results out [total_q, Hq, Dv] in q's dtype and lse float32 [Hq, total_q]. CUDA lowers to the XLA FFI handler of that name (contract
in docs/architecture.md); every other platform lowers to the pure-JAX reference (`jzyfa.varlen`), unless
the caller demanded the kernel (`kernel_required=True`), in which case lowering for a non-CUDA platform
is an error.

No sharding rule: under a sharded jit XLA treats the custom call like any custom call without one and
gathers its operands onto every device (each device then computes the whole batch). No vmap rule.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jzyfa import _validation
from jzyfa.primitive import TILE_COUNTER, _vary_alike, element_problem, refuse_required_kernel
from jzyfa.varlen import varlen_attention_reference

FFI_TARGET_VARLEN = "jzyfa_flash_attention_varlen_fwd"

flash_attention_varlen_p = Primitive(FFI_TARGET_VARLEN)
flash_attention_varlen_p.multiple_results = True


def flash_attention_varlen_fwd(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    kernel_required: bool,
    window: _validation.Window = _validation.NO_WINDOW,
) -> tuple[jax.Array, jax.Array]:
    """Binds the primitive: (out [total_q, Hq, D] in q's dtype, lse float32 [Hq, total_q]).

    The mask is `causal` and `window` combined (`jzyfa._validation.mask_window`), per sequence.
    """
    q, k, v, cu_seqlens_q, cu_seqlens_k = _vary_alike(
        q, k, v, jnp.asarray(cu_seqlens_q, jnp.int32), jnp.asarray(cu_seqlens_k, jnp.int32)
    )
    out, lse = flash_attention_varlen_p.bind(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        **varlen_bind_params(max_seqlen_q, max_seqlen_k, softmax_scale, causal, window, kernel_required),
    )
    return out, lse


def varlen_bind_params(max_seqlen_q, max_seqlen_k, softmax_scale, causal, window, kernel_required) -> dict:
    """The varlen primitives' parameters (16-bit and FP8) as plain hashable Python values."""
    return {
        "max_seqlen_q": int(max_seqlen_q),
        "max_seqlen_k": int(max_seqlen_k),
        "softmax_scale": float(softmax_scale),
        "causal": bool(causal),
        "window": (int(window[0]), int(window[1])),
        "kernel_required": bool(kernel_required),
    }


def _abstract_eval(q, k, v, cu_seqlens_q, cu_seqlens_k, **params):
    del k, cu_seqlens_q, cu_seqlens_k, params
    total_q, heads_q, _ = q.shape
    out = q.update(shape=(total_q, heads_q, v.shape[2]), weak_type=False)
    lse = q.update(shape=(heads_q, total_q), dtype=jnp.float32, weak_type=False)
    return out, lse


flash_attention_varlen_p.def_abstract_eval(_abstract_eval)


# Eager calls compile the primitive alone, once per shape and parameters.
@functools.partial(
    jax.jit,
    static_argnames=("max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal", "window", "kernel_required"),
)
def _impl(q, k, v, cu_seqlens_q, cu_seqlens_k, **params):
    return flash_attention_varlen_p.bind(q, k, v, cu_seqlens_q, cu_seqlens_k, **params)


flash_attention_varlen_p.def_impl(_impl)


def _reference_fallback(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale,
    causal,
    window,
    kernel_required,
):
    refuse_required_kernel(kernel_required)
    return varlen_attention_reference(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        window=_validation.mask_window(causal, window),
        softmax_scale=softmax_scale,
    )


_ffi_lowering = jax.ffi.ffi_lowering(FFI_TARGET_VARLEN)


def varlen_ffi_attributes(max_seqlen_q, max_seqlen_k, softmax_scale, causal, window) -> dict:
    """The varlen custom calls' attributes (16-bit and FP8). Their types are part of the FFI contract:
    softmax_scale f32, causal bool, maxima and window bounds i64."""
    return {
        "softmax_scale": np.float32(softmax_scale),
        "causal": bool(causal),
        "max_seqlen_q": np.int64(max_seqlen_q),
        "max_seqlen_k": np.int64(max_seqlen_k),
        "window_left": np.int64(window[0]),
        "window_right": np.int64(window[1]),
    }


def _cuda_lowering(
    ctx,
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale,
    causal,
    window,
    kernel_required,
):
    del kernel_required  # Only decides what non-CUDA platforms do.
    ctx = ctx.replace(avals_out=[*ctx.avals_out, TILE_COUNTER])  # the tile queue, dropped below
    attributes = varlen_ffi_attributes(max_seqlen_q, max_seqlen_k, softmax_scale, causal, window)
    out, lse, _ = _ffi_lowering(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, **attributes)
    return [out, lse]


mlir.register_lowering(flash_attention_varlen_p, mlir.lower_fun(_reference_fallback, multiple_results=True))
mlir.register_lowering(flash_attention_varlen_p, _cuda_lowering, platform="cuda")


# Shape limits the launch code enforces (ffi/flash_fwd_varlen.cu); its head dims are the dense kernel's
# (jzyfa.primitive.element_problem).
KERNEL_MAX_TOKENS = 1 << 30
KERNEL_MAX_TILES = 1 << 30


def varlen_kernel_config_problem(
    q, k, v, num_seqs: int, max_seqlen_q: int, softmax_scale: float, window: _validation.Window
) -> str | None:
    """None when the varlen kernel serves a validated call, else why not. `window` is the effective mask."""
    if problem := element_problem(q, v, softmax_scale):
        return problem
    return varlen_shape_problem(q, k, num_seqs, max_seqlen_q)


def varlen_shape_problem(q, k, num_seqs: int, max_seqlen_q: int) -> str | None:
    """The token and tile limits of both varlen launches (16-bit and FP8): None, or why not."""
    if q.shape[0] == 0 or k.shape[0] == 0:
        return f"the kernel needs total_q and total_k >= 1, got {q.shape[0]} and {k.shape[0]}"
    if max(q.shape[0], k.shape[0]) > KERNEL_MAX_TOKENS:
        return f"the kernel takes at most {KERNEL_MAX_TOKENS} tokens, got {max(q.shape[0], k.shape[0])}"
    tiles = (num_seqs + 1) * -(-max_seqlen_q // 128) * q.shape[1]
    if tiles > KERNEL_MAX_TILES:
        return f"the kernel takes (num_seqs + 1) * ceil(max_seqlen_q / 128) * heads_q <= 2^30, got {tiles}"
    return None
