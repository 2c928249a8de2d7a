"""The FP8 kernel as a JAX primitive: abstract eval, CUDA lowering to the FFI target, and a CPU
lowering that runs the kernel's algorithm in pure JAX (jzyfa.fp8_emulation).

`flash_attention_fp8_kernel` takes e4m3 q, k, v as `flash_attention` does, brings V into the
kernel's layout (jzyfa/fp8_layout.py: transposed, keys padded to 32 and permuted) and binds the
primitive. Descales reach the kernel as device buffers (float32, one value or one per (batch, KV
head)), never as host values, so nothing is read back and calls stay inside CUDA graphs.
`jax.vmap` folds the mapped axis into the batch. No sharding rule yet: under `jit` with sharded
inputs XLA gathers them to run the call whole; shard over batch or heads with `shard_map` instead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jzyfa.fp8_emulation import attention_fp8_emulated
from jzyfa.fp8_layout import fp8_value_operand, value_from_operand
from jzyfa.primitive import TILE_COUNTER

FFI_TARGET_FP8 = "jzyfa_flash_attention_fp8_fwd"
FP8_KERNEL_HEAD_DIM = 128

flash_attention_fp8_p = Primitive(FFI_TARGET_FP8)
flash_attention_fp8_p.multiple_results = True


def _abstract_eval(
    q8, k8, vt8, descale_q, descale_k, descale_v, *, softmax_scale, causal, lean_p, kernel_required
):
    batch, seq_q, heads_q, head_dim = q8.shape
    out = jax.core.ShapedArray((batch, seq_q, heads_q, head_dim), jnp.bfloat16)
    lse = jax.core.ShapedArray((batch, heads_q, seq_q), jnp.float32)
    return out, lse


flash_attention_fp8_p.def_abstract_eval(_abstract_eval)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "causal", "lean_p", "kernel_required"))
def _impl(*args, softmax_scale, causal, lean_p, kernel_required):
    return flash_attention_fp8_p.bind(
        *args, softmax_scale=softmax_scale, causal=causal, lean_p=lean_p, kernel_required=kernel_required
    )


flash_attention_fp8_p.def_impl(_impl)


def _emulation_fallback(
    q8, k8, vt8, descale_q, descale_k, descale_v, *, softmax_scale, causal, lean_p, kernel_required
):
    """Off CUDA: the kernel's algorithm in pure JAX (integer reference exponents, as the kernel)."""
    if kernel_required:
        raise ValueError(
            "implementation='kernel' needs a Hopper GPU with the jzyfa extension, but this program is "
            "being lowered for a non-CUDA platform; use implementation=None or 'xla' for the pure-JAX path"
        )
    batch, heads_kv = k8.shape[0], k8.shape[2]
    v8 = value_from_operand(vt8, k8.shape[1])

    def shaped(descale):
        return descale.reshape(()) if descale.size == 1 else descale.reshape(batch, heads_kv)

    return attention_fp8_emulated(
        q8,
        k8,
        v8,
        shaped(descale_q),
        shaped(descale_k),
        shaped(descale_v),
        causal=causal,
        softmax_scale=softmax_scale,
        lean_p=lean_p,
        integer_reference=True,
    )


_ffi_lowering = jax.ffi.ffi_lowering(FFI_TARGET_FP8)


def _cuda_lowering(ctx, *args, softmax_scale, causal, lean_p, kernel_required):
    del kernel_required
    ctx = ctx.replace(avals_out=[*ctx.avals_out, TILE_COUNTER])
    out, lse, _ = _ffi_lowering(
        ctx, *args, softmax_scale=np.float32(softmax_scale), causal=bool(causal), lean_p=bool(lean_p)
    )
    return [out, lse]


mlir.register_lowering(flash_attention_fp8_p, mlir.lower_fun(_emulation_fallback, multiple_results=True))
mlir.register_lowering(flash_attention_fp8_p, _cuda_lowering, platform="cuda")


def fp8_kernel_config_problem(q8, k8, v8) -> str | None:
    """None when the FP8 kernel serves these (validated) shapes, else why not."""
    if q8.shape[-1] != FP8_KERNEL_HEAD_DIM or v8.shape[-1] != FP8_KERNEL_HEAD_DIM:
        return f"the FP8 kernel needs head dim {FP8_KERNEL_HEAD_DIM} for q, k and v, got {q8.shape[-1]}/{v8.shape[-1]}"
    if q8.shape[0] > 65535 or q8.shape[1] > 65535 * 128:
        return "the FP8 kernel takes batch <= 65535 and seq_q <= 65535 * 128"
    return None


def _device_descales(descales, batch: int, heads_kv: int) -> list[jax.Array]:
    """(), (1,) or [B, Hkv] descales as the kernel's float32 vectors: all [1], or all [B * Hkv] when
    any is per (batch, KV head)."""
    descales = [jnp.asarray(d, jnp.float32) for d in descales]
    if all(d.size == 1 for d in descales):
        return [d.reshape(1) for d in descales]
    return [
        jnp.broadcast_to(d.reshape(-1, 1) if d.size == 1 else d, (batch, heads_kv)).reshape(-1)
        for d in descales
    ]


def flash_attention_fp8_kernel(
    q8, k8, v8, descales, *, softmax_scale: float, causal: bool, lean_p: bool, kernel_required: bool
):
    """(out bf16, lse) of e4m3 attention through the FP8 kernel (its emulation off CUDA)."""
    vt8 = fp8_value_operand(v8)
    return flash_attention_fp8_p.bind(
        q8,
        k8,
        vt8,
        *_device_descales(descales, k8.shape[0], k8.shape[2]),
        softmax_scale=float(softmax_scale),
        causal=bool(causal),
        lean_p=bool(lean_p),
        kernel_required=bool(kernel_required),
    )


def _batch_rule(args, dims, **params):
    """vmap: folds the mapped axis into the batch axis (one launch). Descales follow: per-(batch, KV
    head) vectors fold with the batch; a scalar descale that differs along the mapped axis becomes a
    per-(batch, KV head) vector."""
    q8, k8, vt8, *descales = args
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)

    def moved(x, d):
        return jnp.broadcast_to(x, (size,) + x.shape) if d is None else jnp.moveaxis(x, d, 0)

    def fold(x, d):
        x = moved(x, d)
        return x.reshape((size * x.shape[1],) + x.shape[2:])

    q8, k8, vt8 = (fold(x, d) for x, d in zip((q8, k8, vt8), dims[:3]))
    descale_dims = dims[3:]
    if all(d is None for d in descale_dims) and all(x.size == 1 for x in descales):
        folded = descales  # one value for everything
    else:
        per_element = (k8.shape[0] // size) * k8.shape[2]  # B * Hkv of one mapped element

        def per_head(x, d):  # [size, 1 or B * Hkv] -> [size * B * Hkv]
            x = moved(x, d)
            return jnp.broadcast_to(x, (size, per_element)).reshape(-1)

        folded = [per_head(x, d) for x, d in zip(descales, descale_dims)]
    out, lse = flash_attention_fp8_p.bind(q8, k8, vt8, *folded, **params)
    unfold = lambda y: y.reshape((size, -1) + y.shape[1:])
    return (unfold(out), unfold(lse)), (0, 0)


batching.primitive_batchers[flash_attention_fp8_p] = _batch_rule
