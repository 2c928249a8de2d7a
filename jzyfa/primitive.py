"""The `jzyfa_flash_attention_fwd` primitive: abstract eval, lowerings, batching, eager impl.

Two primitives, as JAX's own cuDNN attention does it:
- `flash_attention_fwd_p`, what programs bind: abstract eval, vmap rule, eager impl. It lowers through
  `jax.experimental.custom_partitioning` (rules in `jzyfa.sharding`), so a sharded jit splits it over
  the mesh; on one device, or inside `shard_map`, that lowering is just the per-shard call.
- `flash_attention_shard_p`, the call on one device's blocks. CUDA lowers it to the XLA FFI handler
  `jzyfa_flash_attention_fwd` (contract in docs/architecture.md). Every other platform lowers it to
  the pure-JAX reference, so one program runs on CPU too, unless the caller demanded the kernel
  (`kernel_required=True`), in which case lowering for a non-CUDA platform is an error.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import dispatch  # No public hook yet; JAX's cuDNN attention registers the same way.
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.sharding import PartitionSpec as P

from jzyfa import sharding
from jzyfa._validation import NO_WINDOW, Window
from jzyfa.reference import attention_reference

FFI_TARGET = "jzyfa_flash_attention_fwd"
KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Head dims of q, k and v alike, dense and varlen (jzyfa.varlen_primitive), any mask; 256's kill switch is
# jzyfa.api.HD256_KERNEL_VERIFIED, and its sliding windows' and varlen batches' the wide gates
# (jzyfa.api.WIDE_WINDOW_KERNEL_VERIFIED, WIDE_VARLEN_KERNEL_VERIFIED).
KERNEL_HEAD_DIMS = (64, 128, 256)
# MLA's head dims (q/k, v): instantiations of their own, dense and varlen, any mask. Dense with causal or
# no mask verified on an H200 on 2026-11-30 (kill switch: jzyfa.api.MLA_KERNEL_VERIFIED); sliding windows
# and varlen batches behind the wide gates.
MLA_HEAD_DIMS = (192, 128)

flash_attention_fwd_p = Primitive(FFI_TARGET)
flash_attention_fwd_p.multiple_results = True
flash_attention_shard_p = Primitive(FFI_TARGET + "_shard")
flash_attention_shard_p.multiple_results = True


# Shape limits the kernels' launch code enforces (ffi/flash_fwd.cu, ffi/flash_fwd_fp8.cu).
KERNEL_MAX_BATCH = 65535
KERNEL_MAX_SEQ_Q = 65535 * 128


def refuse_required_kernel(kernel_required: bool) -> None:
    """The non-CUDA lowerings' one refusal: implementation="kernel" cannot be served there."""
    if kernel_required:
        raise ValueError(
            "implementation='kernel' needs a Hopper GPU with the jzyfa extension, but this program is "
            "being lowered for a non-CUDA platform; use implementation=None or 'xla' for the pure-JAX path"
        )


def is_mla(q: jax.Array, v: jax.Array) -> bool:
    """Whether q/k and v have MLA's head dims (192, 128)."""
    return (q.shape[-1], v.shape[-1]) == MLA_HEAD_DIMS


def element_problem(q: jax.Array, v: jax.Array, softmax_scale: float) -> str | None:
    """What the 16-bit kernels (dense and varlen) need of the dtype, head dims and scale, else None."""
    if jnp.dtype(q.dtype) not in KERNEL_DTYPES:
        return f"the kernel takes bf16 or f16 inputs, got {q.dtype}"
    # MLA's head dims: the one pair of unequal head dims with instantiations of its own.
    if not is_mla(q, v) and q.shape[-1] not in KERNEL_HEAD_DIMS:
        return (
            f"the kernel supports head_dim in {KERNEL_HEAD_DIMS}, got {q.shape[-1]} (and MLA's {MLA_HEAD_DIMS} "
            "for q/k and v)"
        )
    if not is_mla(q, v) and v.shape[-1] != q.shape[-1]:
        return (
            f"the kernel needs v's head_dim equal to q's and k's ({q.shape[-1]}), got {v.shape[-1]}; of "
            f"unequal head dims it has MLA's {MLA_HEAD_DIMS} (q/k, v) only (other shapes run on the pure-JAX "
            "path)"
        )
    if softmax_scale <= 0:
        return f"the kernel needs softmax_scale > 0, got {softmax_scale}"
    return None


def kernel_config_problem(q: jax.Array, k: jax.Array, v: jax.Array, softmax_scale: float) -> str | None:
    """None when the kernel serves a validated call with these q, k, v (mask and MLA gate aside: see
    jzyfa.api.kernel_problem), else why not."""
    if problem := element_problem(q, v, softmax_scale):
        return problem
    if q.shape[0] > KERNEL_MAX_BATCH:
        return f"the kernel takes batch <= {KERNEL_MAX_BATCH}, got {q.shape[0]}"
    if q.shape[1] > KERNEL_MAX_SEQ_Q:
        return f"the kernel takes seq_q <= {KERNEL_MAX_SEQ_Q}, got {q.shape[1]}"
    if q.shape[1] == 0 or k.shape[1] == 0:
        return f"the kernel needs seq_q and seq_k >= 1, got {q.shape[1]} and {k.shape[1]}"
    return None


def flash_attention_fwd(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    softmax_scale: float,
    causal: bool,
    kernel_required: bool,
    window: Window = NO_WINDOW,
) -> tuple[jax.Array, jax.Array]:
    """Binds the primitive: (out [B, Sq, Hq, Dv] in q's dtype, lse float32 [B, Hq, Sq]).

    The mask is `causal` and `window` combined as in `attention_reference` (causal sets the window's
    right bound to 0); the kernel runs windows other than none and causal on its windowed instantiation.
    """
    q, k, v = _vary_alike(q, k, v)
    out, lse = flash_attention_fwd_p.bind(
        q,
        k,
        v,
        softmax_scale=float(softmax_scale),
        causal=bool(causal),
        window=(int(window[0]), int(window[1])),
        kernel_required=bool(kernel_required),
    )
    return out, lse


def _varying_axes(x: jax.Array) -> frozenset:
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.11; `vma` before
    return manual.varying if manual is not None else getattr(aval, "vma", frozenset())


def _vary_alike(*xs: jax.Array) -> list[jax.Array]:
    """Inside shard_map, marks every operand as varying over the mesh axes any of them varies over.

    lax operations do this implicitly; a primitive of our own must, so its results' types are right.
    """
    varying = [_varying_axes(x) for x in xs]
    union = frozenset().union(*varying)
    return [
        x if axes == union else lax.pcast(x, tuple(sorted(union - axes)), to="varying")
        for x, axes in zip(xs, varying)
    ]


def _abstract_eval(q, k, v, *, softmax_scale, causal, kernel_required, window=NO_WINDOW):
    batch, seq_q, heads_q, _ = q.shape
    # Results keep q's mesh sharding and the shard_map axes it varies over (update() carries both);
    # out's head dim is v's (MLA: it may differ from q's) and takes v's sharding of it; lse's
    # [B, H, Sq] takes q's batch, head and sequence shardings.
    spec = tuple(q.sharding.spec) + (None,) * (4 - len(q.sharding.spec))
    v_spec = tuple(v.sharding.spec) + (None,) * (4 - len(v.sharding.spec))
    out_sharding = q.sharding.update(spec=P(*spec[:3], v_spec[3]))
    out = q.update(shape=(batch, seq_q, heads_q, v.shape[3]), weak_type=False, sharding=out_sharding)
    lse_sharding = q.sharding.update(spec=P(spec[0], spec[2], spec[1]))
    lse = q.update(shape=(batch, heads_q, seq_q), dtype=jnp.float32, weak_type=False, sharding=lse_sharding)
    return out, lse


flash_attention_fwd_p.def_abstract_eval(_abstract_eval)
flash_attention_shard_p.def_abstract_eval(_abstract_eval)


# Eager calls compile the primitive alone, once per shape and parameters.
@functools.partial(jax.jit, static_argnames=("softmax_scale", "causal", "window", "kernel_required"))
def _impl(q, k, v, *, softmax_scale, causal, window, kernel_required):
    return flash_attention_fwd_p.bind(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window=window, kernel_required=kernel_required
    )


flash_attention_fwd_p.def_impl(_impl)


def _reference_fallback(q, k, v, *, softmax_scale, causal, window, kernel_required):
    refuse_required_kernel(kernel_required)
    return attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window)


_ffi_lowering = jax.ffi.ffi_lowering(FFI_TARGET)


# The custom call's third result: one int32 the launch zeroes and the persistent kernel's CTAs
# claim tiles from. A result (not a global) so that XLA owns it: concurrent calls never share
# one and command buffers track it like any buffer. The primitive drops it.
TILE_COUNTER = jax.core.ShapedArray((1,), np.int32)


def _cuda_lowering(ctx, q, k, v, *, softmax_scale, causal, window, kernel_required):
    del kernel_required  # Only decides what non-CUDA platforms do.
    ctx = ctx.replace(avals_out=[*ctx.avals_out, TILE_COUNTER])
    # Attribute types are part of the FFI contract: softmax_scale f32, causal bool, window bounds i64.
    out, lse, _ = _ffi_lowering(
        ctx,
        q,
        k,
        v,
        softmax_scale=np.float32(softmax_scale),
        causal=bool(causal),
        window_left=np.int64(window[0]),
        window_right=np.int64(window[1]),
    )
    return [out, lse]


mlir.register_lowering(flash_attention_shard_p, mlir.lower_fun(_reference_fallback, multiple_results=True))
mlir.register_lowering(flash_attention_shard_p, _cuda_lowering, platform="cuda")


def flash_attention_shard(q, k, v, *, softmax_scale, causal, kernel_required, window=NO_WINDOW):
    """The call on one device's blocks: (out, lse)."""
    out, lse = flash_attention_shard_p.bind(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window=window, kernel_required=kernel_required
    )
    return out, lse


_partitioned_shard_call = sharding.partitioned(flash_attention_shard)


def _partitioned(q, k, v, *, softmax_scale, causal, window, kernel_required):
    return _partitioned_shard_call(q, k, v, softmax_scale, causal, kernel_required, window)


mlir.register_lowering(flash_attention_fwd_p, mlir.lower_fun(_partitioned, multiple_results=True))
# Lowering a custom_partitioning call needs the device assignment, which jit provides only for
# programs that hold a primitive in this set.
dispatch.prim_requires_devices_during_lowering.add(flash_attention_fwd_p)


def _batch_rule(args, dims, *, softmax_scale, causal, window, kernel_required):
    """vmap: folds the mapped axis into the batch axis, one kernel launch for all of it."""
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)

    def fold(x, d):
        # An unmapped operand (e.g. K/V shared across the vmapped axis) is broadcast to match.
        x = jnp.broadcast_to(x, (size,) + x.shape) if d is None else jnp.moveaxis(x, d, 0)
        return x.reshape((size * x.shape[1],) + x.shape[2:])

    out, lse = flash_attention_fwd(
        *(fold(x, d) for x, d in zip(args, dims)),
        softmax_scale=softmax_scale,
        causal=causal,
        window=window,
        kernel_required=kernel_required,
    )
    unfold = lambda y: y.reshape((size, -1) + y.shape[1:])
    return (unfold(out), unfold(lse)), (0, 0)


batching.primitive_batchers[flash_attention_fwd_p] = _batch_rule
