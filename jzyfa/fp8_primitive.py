"""The FP8 kernel as a JAX primitive: abstract eval, CUDA lowering to the FFI target, and a CPU
lowering that runs the kernel's algorithm in pure JAX (jzyfa.fp8_emulation).

Two primitives, as for 16-bit inputs (jzyfa/primitive.py): `flash_attention_fp8_p` takes e4m3 q, k,
v in `flash_attention`'s layout and descales of shape [batch, heads_kv]; it has the abstract eval, the
vmap rule (the mapped axis folds into the batch) and a `custom_partitioning` lowering
(jzyfa/sharding.py: batch and heads shard with no collective, descales with K/V; a sequence-sharded
q is gathered). Per shard `flash_attention_fp8_shard_p` is bound: the FFI custom call on CUDA (which
takes V as it is and builds V's operand layout, jzyfa/fp8_layout.py, in shared memory), the emulation
elsewhere. Descales reach the kernel as device buffers, never as host values, so nothing is read back
and calls stay inside CUDA graphs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch  # As in jzyfa/primitive.py: custom_partitioning needs the devices.
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jzyfa import sharding
from jzyfa._validation import NO_WINDOW
from jzyfa.fp8_emulation import attention_fp8_emulated
from jzyfa.primitive import (
    KERNEL_MAX_BATCH,
    KERNEL_MAX_SEQ_Q,
    MLA_HEAD_DIMS,
    TILE_COUNTER,
    is_mla,
    refuse_required_kernel,
)
from jzyfa.primitive import _abstract_eval as _attention_abstract_eval

FFI_TARGET_FP8 = "jzyfa_flash_attention_fp8_fwd"
FP8_KERNEL_HEAD_DIM = 128

flash_attention_fp8_p = Primitive(FFI_TARGET_FP8)
flash_attention_fp8_p.multiple_results = True
flash_attention_fp8_shard_p = Primitive(FFI_TARGET_FP8 + "_shard")
flash_attention_fp8_shard_p.multiple_results = True


def _abstract_eval(
    q8, k8, v8, descale_q, descale_k, descale_v, *, softmax_scale, causal, window, lean_p, kernel_required
):
    """(out bf16 with q's shape and sharding, lse), as the 16-bit primitive's."""
    out, lse = _attention_abstract_eval(
        q8, k8, v8, softmax_scale=softmax_scale, causal=causal, kernel_required=kernel_required
    )
    return out.update(dtype=jnp.bfloat16), lse


flash_attention_fp8_p.def_abstract_eval(_abstract_eval)


def _shard_abstract_eval(
    q8, k8, v8, descale_q, descale_k, descale_v, *, softmax_scale, causal, window, lean_p, kernel_required
):
    batch, seq_q, heads_q, _ = q8.shape
    # out has v's head dim (MLA: 128 where q and k have 192).
    out = jax.core.ShapedArray((batch, seq_q, heads_q, v8.shape[3]), jnp.bfloat16)
    lse = jax.core.ShapedArray((batch, heads_q, seq_q), jnp.float32)
    return out, lse


flash_attention_fp8_shard_p.def_abstract_eval(_shard_abstract_eval)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "causal", "window", "lean_p", "kernel_required"))
def _impl(*args, softmax_scale, causal, window, lean_p, kernel_required):
    return flash_attention_fp8_p.bind(
        *args,
        softmax_scale=softmax_scale,
        causal=causal,
        window=window,
        lean_p=lean_p,
        kernel_required=kernel_required,
    )


flash_attention_fp8_p.def_impl(_impl)


def _emulation_fallback(
    q8, k8, v8, descale_q, descale_k, descale_v, *, softmax_scale, causal, window, lean_p, kernel_required
):
    """Off CUDA: the kernel's algorithm in pure JAX (integer reference exponents, as the kernel)."""
    refuse_required_kernel(kernel_required)
    batch, heads_kv = k8.shape[0], k8.shape[2]
    return attention_fp8_emulated(
        q8,
        k8,
        v8,
        *(d.reshape(batch, heads_kv) for d in (descale_q, descale_k, descale_v)),
        causal=causal,
        window=window,
        softmax_scale=softmax_scale,
        lean_p=lean_p,
        integer_reference=True,
    )


_ffi_lowering = jax.ffi.ffi_lowering(FFI_TARGET_FP8)


def _cuda_lowering(ctx, *args, softmax_scale, causal, window, lean_p, kernel_required):
    del kernel_required
    ctx = ctx.replace(avals_out=[*ctx.avals_out, TILE_COUNTER])
    # Attribute types are part of the FFI contract: window bounds i64, as for the 16-bit kernel.
    out, lse, _ = _ffi_lowering(
        ctx,
        *args,
        softmax_scale=np.float32(softmax_scale),
        causal=bool(causal),
        window_left=np.int64(window[0]),
        window_right=np.int64(window[1]),
        lean_p=bool(lean_p),
    )
    return [out, lse]


mlir.register_lowering(
    flash_attention_fp8_shard_p, mlir.lower_fun(_emulation_fallback, multiple_results=True)
)
mlir.register_lowering(flash_attention_fp8_shard_p, _cuda_lowering, platform="cuda")


def fp8_attention_shard(
    q8, k8, v8, descale_q, descale_k, descale_v, *, softmax_scale, causal, window, lean_p, kernel_required
):
    """The call on one device's blocks, descales as [B * Hkv] vectors."""
    out, lse = flash_attention_fp8_shard_p.bind(
        q8,
        k8,
        v8,
        *(d.reshape(-1) for d in (descale_q, descale_k, descale_v)),
        softmax_scale=softmax_scale,
        causal=causal,
        window=window,
        lean_p=lean_p,
        kernel_required=kernel_required,
    )
    return out, lse


_partitioned_shard_call = sharding.partitioned_fp8(fp8_attention_shard)


def _partitioned(q8, k8, v8, dq, dk, dv, *, softmax_scale, causal, window, lean_p, kernel_required):
    return _partitioned_shard_call(
        q8, k8, v8, dq, dk, dv, softmax_scale, causal, window, lean_p, kernel_required
    )


mlir.register_lowering(flash_attention_fp8_p, mlir.lower_fun(_partitioned, multiple_results=True))
dispatch.prim_requires_devices_during_lowering.add(flash_attention_fp8_p)


def _batch_rule(args, dims, **params):
    """vmap: folds the mapped axis into the batch axis of every operand (one launch)."""
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)

    def fold(x, d):
        x = jnp.broadcast_to(x, (size,) + x.shape) if d is None else jnp.moveaxis(x, d, 0)
        return x.reshape((size * x.shape[1],) + x.shape[2:])

    out, lse = flash_attention_fp8_p.bind(*(fold(x, d) for x, d in zip(args, dims)), **params)
    unfold = lambda y: y.reshape((size, -1) + y.shape[1:])
    return (unfold(out), unfold(lse)), (0, 0)


batching.primitive_batchers[flash_attention_fp8_p] = _batch_rule


def fp8_kernel_config_problem(q8, k8, v8, sliding: bool = False) -> str | None:
    """None when the FP8 kernel serves these (validated) shapes, else why not. `sliding`: the mask is a
    sliding window other than causal or none, which MLA's head dims do not take on the FP8 kernel."""
    mla = is_mla(q8, v8)
    if not mla and (q8.shape[-1] != FP8_KERNEL_HEAD_DIM or v8.shape[-1] != FP8_KERNEL_HEAD_DIM):
        return (
            f"the FP8 kernel needs head dim {FP8_KERNEL_HEAD_DIM} for q, k and v, or MLA's {MLA_HEAD_DIMS} "
            f"(q/k, v), got {q8.shape[-1]}/{v8.shape[-1]}"
        )
    if mla and sliding:
        return (
            f"the FP8 kernel takes MLA's head dims {MLA_HEAD_DIMS} (q/k, v) with a causal mask or none, "
            "not a sliding window; implementation=None runs such calls on the pure-JAX path"
        )
    if q8.shape[0] > KERNEL_MAX_BATCH or q8.shape[1] > KERNEL_MAX_SEQ_Q:
        return f"the FP8 kernel takes batch <= {KERNEL_MAX_BATCH} and seq_q <= {KERNEL_MAX_SEQ_Q}"
    return None


def flash_attention_fp8_kernel(
    q8,
    k8,
    v8,
    descales,
    *,
    softmax_scale: float,
    causal: bool,
    lean_p: bool,
    kernel_required: bool,
    window=NO_WINDOW,
):
    """(out bf16, lse) of e4m3 attention through the FP8 kernel (its emulation off CUDA). Descales of
    shape (), (1,) or [B, Hkv] are broadcast to [B, Hkv]. The mask is `causal` and `window` combined
    as in `attention_fp8_emulated` (causal sets the right bound to 0); the kernel runs windows other
    than none and causal on its windowed instantiation (dense batches)."""
    per_head = (k8.shape[0], k8.shape[2])
    descales = [
        jnp.broadcast_to(jnp.asarray(d, jnp.float32).reshape(-1, 1) if jnp.size(d) == 1 else d, per_head)
        for d in descales
    ]
    return flash_attention_fp8_p.bind(
        q8,
        k8,
        v8,
        *descales,
        softmax_scale=float(softmax_scale),
        causal=bool(causal),
        window=(int(window[0]), int(window[1])),
        lean_p=bool(lean_p),
        kernel_required=bool(kernel_required),
    )
