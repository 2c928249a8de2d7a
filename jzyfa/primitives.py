"""The attention primitives: one family for every configuration (dense or varlen, 16-bit or FP8), forward
and backward.

Operands are q, k, v (the backward adds dout, lse, delta) and extras: cu_seqlens_q, cu_seqlens_k for
packed (varlen) batches, or seqlens_q, seqlens_k for padded dense ones (`jzyfa.padded`: per shard they
run as a packed call), then descale_q, descale_k, descale_v for FP8 inputs, or q_scale, k_scale,
descale_v for INT8 ones (int8 q and k, e4m3 v: `jzyfa.int8_quant`). One frozen
`AttentionSpec` carries the static parameters. Two primitives per direction, as JAX's own cuDNN
attention does it:
- `attention_fwd_p`, what programs bind: one abstract eval, one vmap rule, an eager impl. It lowers
  through `jax.experimental.custom_partitioning` (the rule in `jzyfa.sharding`, built from the operand
  list), so a sharded jit splits it over the mesh; on one device that lowering is the per-shard call.
- `attention_fwd_shard_p`, the call on one device's blocks. CUDA lowers it to the FFI target
  `jzyfa_attention_fwd` (docs/architecture.md has the contract). Other platforms lower it to the best
  pure-JAX model of the kernel: the FP8 kernel's emulation for dense FP8 calls (`jzyfa.fp8_emulation`),
  the INT8 kernel's for INT8 ones (`jzyfa.int8_emulation`), the exact reference otherwise. A call that
  demanded the kernel (`kernel_required`) refuses to lower anywhere but CUDA. precision="int8" binds
  16-bit q, k, v (`int8_in_call`): the per-shard call quantizes them first (`int8_quantize_p`: the
  target `jzyfa_int8_quantize` on CUDA, `jzyfa.int8_quant`'s XLA ops elsewhere).
The backward's pair, `attention_bwd_p` and `attention_bwd_shard_p`, mirrors them: (q, k, v, dout, lse,
delta, *extras) -> (dq, dk, dv). CUDA lowers the per-shard call to the FFI target `jzyfa_attention_bwd`
where the plan has a backward kernel for the call (`AttentionSpec.backward_kernel`), and every other
case to the pure-JAX backward from the same residuals (`jzyfa.reference.attention_bwd_reference`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import dispatch  # No public hook yet; JAX's cuDNN attention registers the same way.
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import PartitionSpec as P

from jzyfa import fp8_layout, int8_quant, padded, plan, sharding
from jzyfa._validation import NO_WINDOW, Window, mask_window
from jzyfa.fp8_emulation import attention_fp8_emulated
from jzyfa.int8_emulation import attention_int8_emulated, attention_int8_varlen_emulated
from jzyfa.quantize import rotation_signs
from jzyfa.reference import attention_bwd_reference, attention_reference
from jzyfa.varlen import (
    fp8_varlen_attention_reference,
    varlen_attention_bwd_reference,
    varlen_attention_reference,
)

FFI_TARGET = "jzyfa_attention_fwd"
FFI_TARGET_BWD = "jzyfa_attention_bwd"
FFI_TARGET_VALUE_OPERAND = "jzyfa_fp8_value_operand"
FFI_TARGET_INT8_QUANTIZE = "jzyfa_int8_quantize"


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The attention primitives' static parameters.

    The mask is `causal` and `window` combined as in `attention_reference` (causal sets the window's
    right bound to 0); the kernel resolves windows that come down to causal or none to its plain
    instantiations. `varlen` holds (max_seqlen_q, max_seqlen_k) for packed batches. `v_transposed` and
    `key_block` are per-shard choices of the FP8 kernel (`jzyfa.plan`), set by `attention_shard`.
    `backward_kernel`: the plan has a backward kernel for this configuration, which the backward
    primitive's CUDA lowering then calls. `seqlens`: a dense call with per-sequence lengths (extras
    seqlens_q, seqlens_k), computed per shard as a packed call of 2 * batch sequences (`jzyfa.padded`).
    `softcap`: c > 0 caps each scaled score s to c * tanh(s / c) (16-bit calls); 0 for none.
    `int8`: int8 q and k with one float32 scale per 128 tokens and head, e4m3 v (precision="int8"'s
    operands, `jzyfa.int8_quant.Int8Inputs`); extras end with q_scale [B, Hq, ceil(Sq / 128)], k_scale
    [B, Hkv, ceil(Sk / 128)] and descale_v [B, Hkv] (varlen: num_seqs for B, the maxima for the
    lengths, `jzyfa.int8_quant.int8_quantize_packed`); out is bf16.
    `int8_in_call`: precision="int8" on 16-bit q, k, v (no scale extras): each shard quantizes its q, k, v
    (`rotate`: Hadamard-rotated q and k; packed and padded batches per sequence), runs the `int8` call and
    returns the unsmoothed keys' LSE.
    """

    softmax_scale: float
    causal: bool
    window: Window = NO_WINDOW
    kernel_required: bool = False
    varlen: tuple[int, int] | None = None
    fp8: bool = False
    lean_p: bool = True
    v_transposed: bool = False
    key_block: int = 0
    backward_kernel: bool = False
    seqlens: bool = False
    softcap: float = 0.0
    int8: bool = False
    int8_in_call: bool = False
    rotate: bool = False

    @property
    def eight_bit(self) -> bool:
        """FP8 or INT8: out is bf16, no backward, the query sequence of a shard gathered."""
        return self.fp8 or self.int8 or self.int8_in_call

    @property
    def num_extras(self) -> int:
        """cu_seqlens or seqlens, then FP8's descales or INT8's scales."""
        return 2 * bool(self.varlen) + 2 * self.seqlens + 3 * (self.fp8 or self.int8)

    def as_packed(self, seq_q: int, seq_k: int) -> AttentionSpec:
        """The packed call a padded dense one runs per shard (`jzyfa.padded`)."""
        return dataclasses.replace(self, seqlens=False, varlen=(seq_q, seq_k))


def make_spec(
    *,
    softmax_scale: float,
    causal: bool,
    window: Window = NO_WINDOW,
    kernel_required: bool = False,
    varlen: tuple[int, int] | None = None,
    fp8: bool = False,
    lean_p: bool = True,
    backward_kernel: bool = False,
    seqlens: bool = False,
    softcap: float | None = None,
    int8: bool = False,
    int8_in_call: bool = False,
    rotate: bool = False,
) -> AttentionSpec:
    """An AttentionSpec of plain hashable Python values."""
    return AttentionSpec(
        softmax_scale=float(softmax_scale),
        causal=bool(causal),
        window=(int(window[0]), int(window[1])),
        kernel_required=bool(kernel_required),
        varlen=None if varlen is None else (int(varlen[0]), int(varlen[1])),
        fp8=bool(fp8),
        lean_p=bool(lean_p),
        backward_kernel=bool(backward_kernel),
        seqlens=bool(seqlens),
        softcap=0.0 if softcap is None else float(softcap),
        int8=bool(int8),
        int8_in_call=bool(int8_in_call),
        rotate=bool(rotate),
    )


attention_fwd_p = Primitive("jzyfa_attention_fwd")
attention_fwd_p.multiple_results = True
attention_fwd_shard_p = Primitive("jzyfa_attention_fwd_shard")
attention_fwd_shard_p.multiple_results = True


def attention_fwd(q, k, v, *extras, spec: AttentionSpec) -> tuple[jax.Array, jax.Array]:
    """Binds the primitive: (out in q's dtype, bf16 for FP8; lse float32). Dense: out [B, Sq, Hq, Dv],
    lse [B, Hq, Sq]; varlen: out [Tq, Hq, Dv], lse [Hq, Tq]. FP8 descales are broadcast to one value
    per (batch or sequence, KV head)."""
    if len(extras) != spec.num_extras:
        raise TypeError(f"attention_fwd takes {spec.num_extras} extra operands for {spec}, got {len(extras)}")
    extras = list(extras)
    if spec.varlen or spec.seqlens:
        extras[:2] = [jnp.asarray(lengths, jnp.int32) for lengths in extras[:2]]
    if spec.fp8:
        per_head = (extras[0].shape[0] - 1, k.shape[1]) if spec.varlen else (k.shape[0], k.shape[2])
        extras[-3:] = [_per_head_descale(d, per_head) for d in extras[-3:]]
    if spec.int8:
        extras[-3:] = [jnp.asarray(d, jnp.float32) for d in extras[-3:]]
    out, lse = attention_fwd_p.bind(*_vary_alike(q, k, v, *extras), spec=spec)
    return out, lse


def _per_head_descale(d, per_head: tuple[int, int]) -> jax.Array:
    d = jnp.asarray(d, jnp.float32)
    return jnp.broadcast_to(d.reshape(-1, 1) if d.size == 1 else d, per_head)


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


# ---- abstract eval (both primitives)


def _head_dim_v(v, spec: AttentionSpec) -> int:
    """v's head dim: V^T's rows when v is the FP8 kernel's V^T (dense [B, Hkv, Dv, keys], varlen
    [Hkv, Dv, keys])."""
    if spec.v_transposed:
        return v.shape[1] if spec.varlen else v.shape[2]
    return v.shape[-1]


def _padded_spec(x, rank: int) -> tuple:
    spec = getattr(getattr(x, "sharding", None), "spec", None)
    spec = tuple(spec) if spec is not None else ()
    return spec + (None,) * (rank - len(spec))


def _abstract_eval(q, k, v, *extras, spec: AttentionSpec):
    del k, extras
    dtype = jnp.bfloat16 if spec.eight_bit else q.dtype
    dv = _head_dim_v(v, spec)
    q_spec, v_spec = _padded_spec(q, q.ndim), _padded_spec(v, v.ndim)
    dv_spec = None if spec.v_transposed else v_spec[-1]
    # Results keep q's mesh sharding and the shard_map axes it varies over (update() carries both); out's
    # head dim is v's (MLA: it may differ from q's); lse takes q's heads and tokens.
    if spec.varlen:
        total_q, heads_q, _ = q.shape
        out_shape, lse_shape = (total_q, heads_q, dv), (heads_q, total_q)
        out_part, lse_part = P(*q_spec[:2], dv_spec), P(q_spec[1], q_spec[0])
    else:
        batch, seq_q, heads_q, _ = q.shape
        out_shape, lse_shape = (batch, seq_q, heads_q, dv), (batch, heads_q, seq_q)
        out_part, lse_part = P(*q_spec[:3], dv_spec), P(q_spec[0], q_spec[2], q_spec[1])
    if not hasattr(q, "sharding"):
        return jax.core.ShapedArray(out_shape, dtype), jax.core.ShapedArray(lse_shape, jnp.float32)
    out = q.update(shape=out_shape, dtype=dtype, weak_type=False, sharding=q.sharding.update(spec=out_part))
    lse = q.update(
        shape=lse_shape, dtype=jnp.float32, weak_type=False, sharding=q.sharding.update(spec=lse_part)
    )
    return out, lse


attention_fwd_p.def_abstract_eval(_abstract_eval)
attention_fwd_shard_p.def_abstract_eval(_abstract_eval)


def _eager(primitive: Primitive):
    """The primitive's impl: eager calls compile it alone, once per shape and spec."""

    @functools.partial(jax.jit, static_argnames=("spec",))
    def impl(*operands, spec):
        return primitive.bind(*operands, spec=spec)

    return impl


attention_fwd_p.def_impl(_eager(attention_fwd_p))


FP8_NOT_DIFFERENTIABLE = (
    "jzyfa attention on float8_e4m3fn inputs is not differentiable (there is no FP8 backward, and a "
    "gradient through e4m3 rounding would be wrong or zero); differentiate a bf16/f16 call instead, or "
    "stop the gradient at the quantized inputs with jax.lax.stop_gradient"
)
INT8_NOT_DIFFERENTIABLE = (
    "jzyfa attention with precision='int8' is not differentiable (there is no INT8 backward, and a "
    "gradient through int8 rounding would be wrong or zero); differentiate a call with precision=None "
    "instead, or stop the gradient at q, k and v with jax.lax.stop_gradient"
)


def _not_differentiable(primals, tangents, *, spec: AttentionSpec):
    """16-bit calls are differentiated by jzyfa.api's custom_vjp and never reach this rule; FP8 calls have
    no backward, and say so rather than fail inside JAX or return a silent zero."""
    del primals, tangents
    if spec.fp8:
        raise TypeError(FP8_NOT_DIFFERENTIABLE)
    if spec.int8 or spec.int8_in_call:
        raise TypeError(INT8_NOT_DIFFERENTIABLE)
    raise TypeError("the jzyfa_attention_fwd primitive is differentiated through jzyfa.flash_attention only")


ad.primitive_jvps[attention_fwd_p] = _not_differentiable


# ---- the per-shard call and its lowerings


def attention_shard(q, k, v, *extras, spec: AttentionSpec) -> tuple[jax.Array, jax.Array]:
    """The call on one device's blocks. FP8 and INT8: V as it is or as V^T from the layout kernel, by
    `jzyfa.plan`'s rule on the shard's shapes; descales flattened to [B * Hkv] (or [num_seqs * Hkv]).
    Padded dense calls run as packed ones."""
    if spec.seqlens:
        packed = spec.as_packed(q.shape[1], k.shape[1])
        return padded.attention(functools.partial(attention_shard, spec=packed), q, k, v, *extras)
    if spec.int8_in_call:
        quantized = dataclasses.replace(spec, int8_in_call=False, rotate=False, int8=True)
        if spec.varlen:  # packed: XLA ops, each sequence its own key mean and scale blocks
            cu_q, cu_k = extras
            x = int8_quant.int8_quantize_packed(q, k, v, cu_q, cu_k, *spec.varlen, rotate=spec.rotate)
            out, lse = attention_shard(x.q8, x.k8, x.v8, cu_q, cu_k, *x[3:6], spec=quantized)
            shift = int8_quant.lse_shift_packed(q, x.key_mean, cu_q, spec.softmax_scale)
        else:
            signs = rotation_signs(q.shape[-1])
            q8, q_scale, k8, k_scale, v8, descale_v, key_mean = int8_quantize_p.bind(
                q, k, v, signs, rotate=spec.rotate
            )
            out, lse = attention_shard(q8, k8, v8, q_scale, k_scale, descale_v, spec=quantized)
            shift = int8_quant.lse_shift(q, key_mean, spec.softmax_scale)
        return out, jnp.where(jnp.isfinite(lse), lse + shift, lse)
    extras = list(extras)
    if spec.fp8:
        if spec.varlen:
            v_transposed = (
                plan.fp8_varlen_value_layout(spec.varlen[0], q.shape[1], k.shape[1], head_dim=q.shape[-1])
                == "transposed"
            )
            if v_transposed:
                v = fp8_layout.fp8_varlen_value_operand(v, extras[1], value_operand=fp8_value_operand_p.bind)
        else:
            window = mask_window(spec.causal, spec.window)
            v_transposed = (
                plan.fp8_value_layout(
                    q.shape[1],
                    q.shape[2],
                    k.shape[2],
                    seq_k=k.shape[1],
                    head_dim=q.shape[3],
                    causal=spec.causal,
                    window=window,
                )
                == "transposed"
            )
            if v_transposed:
                v = fp8_value_operand_p.bind(v)
        windowed = mask_window(spec.causal, spec.window) not in (NO_WINDOW, (-1, 0))
        key_block = plan.fp8_key_block_attribute(
            v_transposed=v_transposed,
            head_dims=(q.shape[-1], k.shape[-1]),
            windowed=windowed,
            layout="varlen" if spec.varlen else "dense",
        )
        extras[-3:] = [d.reshape(-1) for d in extras[-3:]]
        spec = dataclasses.replace(spec, v_transposed=v_transposed, key_block=key_block)
    # INT8: V as it is or V^T (the layout kernel's), by the FP8 rule on the shard's rows.
    if spec.int8 and spec.varlen:
        if plan.fp8_varlen_value_layout(spec.varlen[0], q.shape[1], k.shape[1], head_dim=q.shape[-1]) == "transposed":
            v = fp8_layout.fp8_varlen_value_operand(v, extras[1], value_operand=fp8_value_operand_p.bind)
            spec = dataclasses.replace(spec, v_transposed=True)
    elif spec.int8 and plan.int8_value_layout(q.shape[1], q.shape[2], k.shape[2], head_dim=q.shape[3]) == "transposed":
        v = fp8_value_operand_p.bind(v)
        spec = dataclasses.replace(spec, v_transposed=True)
    out, lse = attention_fwd_shard_p.bind(q, k, v, *extras, spec=spec)
    return out, lse


def refuse_required_kernel(kernel_required: bool) -> None:
    """The non-CUDA lowerings' one refusal: implementation="kernel" cannot be served there."""
    if kernel_required:
        raise ValueError(
            "implementation='kernel' needs a Hopper GPU with the jzyfa extension, but this program is "
            "being lowered for a non-CUDA platform; use implementation=None or 'xla' for the pure-JAX path"
        )


def _pure_jax_fallback(q, k, v, *extras, spec: AttentionSpec):
    """Off CUDA: the FP8 kernel's emulation for dense FP8 calls, the exact reference otherwise. Packed
    calls trust their maxima, as the kernel must: `jzyfa.api` poisons a call whose sequences exceed
    them."""
    refuse_required_kernel(spec.kernel_required)
    window = mask_window(spec.causal, spec.window)
    if spec.varlen and spec.int8:
        cu_q, cu_k = extras[:2]
        if spec.v_transposed:
            v = fp8_layout.varlen_value_from_operand(v, cu_k, k.shape[0])
        return attention_int8_varlen_emulated(
            q, k, v, *extras, *spec.varlen, window=window, softmax_scale=spec.softmax_scale, lean_p=spec.lean_p,
        )  # fmt: skip
    if spec.varlen:
        cu_q, cu_k = extras[:2]
        max_q, max_k = spec.varlen
        if not spec.fp8:
            return varlen_attention_reference(
                q, k, v, cu_q, cu_k, max_q, max_k, window=window, softmax_scale=spec.softmax_scale,
                softcap=spec.softcap or None, trust_maxima=True,
            )  # fmt: skip
        if spec.v_transposed:
            v = fp8_layout.varlen_value_from_operand(v, cu_k, k.shape[0])
        descales = tuple(d.reshape(cu_q.shape[0] - 1, k.shape[1]) for d in extras[2:])
        return fp8_varlen_attention_reference(
            q, k, v, cu_q, cu_k, descales, max_q, max_k, window=window, softmax_scale=spec.softmax_scale,
            trust_maxima=True,
        )  # fmt: skip
    if spec.int8:
        if spec.v_transposed:
            v = fp8_layout.value_from_operand(v, k.shape[1])
        return attention_int8_emulated(
            q, k, v, *extras, causal=spec.causal, window=spec.window, softmax_scale=spec.softmax_scale,
            out_dtype=jnp.bfloat16, lean_p=spec.lean_p,
        )  # fmt: skip
    if not spec.fp8:
        return attention_reference(
            q, k, v, causal=spec.causal, softmax_scale=spec.softmax_scale, window=spec.window,
            softcap=spec.softcap or None,
        )  # fmt: skip
    if spec.v_transposed:
        v = fp8_layout.value_from_operand(v, k.shape[1])
    descales = (d.reshape(k.shape[0], k.shape[2]) for d in extras)
    return attention_fp8_emulated(
        q,
        k,
        v,
        *descales,
        causal=spec.causal,
        window=spec.window,
        softmax_scale=spec.softmax_scale,
        lean_p=spec.lean_p,
        integer_reference=True,
    )


_ffi_lowering = jax.ffi.ffi_lowering(FFI_TARGET)

# The custom call's third result: one int32 the launch zeroes and the persistent kernel's CTAs claim
# tiles from. A result (not a global) so that XLA owns it: concurrent calls never share one and command
# buffers track it like any buffer. The primitive drops it.
TILE_COUNTER = jax.core.ShapedArray((1,), np.int32)


def ffi_attributes(spec: AttentionSpec) -> dict:
    """The custom call's attributes; their types are part of the FFI contract (docs/architecture.md)."""
    max_q, max_k = spec.varlen or (0, 0)
    return {
        "softmax_scale": np.float32(spec.softmax_scale),
        "causal": bool(spec.causal),
        "window_left": np.int64(spec.window[0]),
        "window_right": np.int64(spec.window[1]),
        "varlen": spec.varlen is not None,
        "max_seqlen_q": np.int64(max_q),
        "max_seqlen_k": np.int64(max_k),
        "lean_p": bool(spec.lean_p),
        "v_transposed": bool(spec.v_transposed),
        "key_block": np.int64(spec.key_block),
        "softcap": np.float32(spec.softcap),  # 0: none
    }


def _cuda_lowering(ctx, *operands, spec: AttentionSpec):
    ctx = ctx.replace(avals_out=[*ctx.avals_out, TILE_COUNTER])
    out, lse, _ = _ffi_lowering(ctx, *operands, **ffi_attributes(spec))
    return [out, lse]


mlir.register_lowering(attention_fwd_shard_p, mlir.lower_fun(_pure_jax_fallback, multiple_results=True))
mlir.register_lowering(attention_fwd_shard_p, _cuda_lowering, platform="cuda")

_partitioned_call = sharding.partitioned(attention_shard)


def _partitioned(*operands, spec: AttentionSpec):
    return _partitioned_call(*operands, spec)


mlir.register_lowering(attention_fwd_p, mlir.lower_fun(_partitioned, multiple_results=True))
# Lowering a custom_partitioning call needs the device assignment, which jit provides only for programs
# that hold a primitive in this set.
dispatch.prim_requires_devices_during_lowering.add(attention_fwd_p)


# ---- vmap (both directions)


def _batch_rule(primitive, args, dims, *, spec: AttentionSpec):
    """vmap. Dense: the mapped axis folds into the batch axis of every operand (one launch). Varlen:
    packed batches do not fold (their offsets would need rebasing and gaps), so one call per element."""
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    leading = [
        jnp.broadcast_to(x, (size,) + x.shape) if d is None else jnp.moveaxis(x, d, 0)
        for x, d in zip(args, dims)
    ]
    if spec.varlen:
        results = lax.map(lambda ops: primitive.bind(*ops, spec=spec), leading)
        return tuple(results), (0,) * len(results)
    folded = [x.reshape((size * x.shape[1],) + x.shape[2:]) for x in leading]
    results = primitive.bind(*folded, spec=spec)
    unfold = lambda y: y.reshape((size, -1) + y.shape[1:])
    return tuple(unfold(y) for y in results), (0,) * len(results)


batching.primitive_batchers[attention_fwd_p] = functools.partial(_batch_rule, attention_fwd_p)


# ---- the backward: (q, k, v, dout, lse, delta, *extras) -> (dq, dk, dv)

attention_bwd_p = Primitive("jzyfa_attention_bwd")
attention_bwd_p.multiple_results = True
attention_bwd_shard_p = Primitive("jzyfa_attention_bwd_shard")
attention_bwd_shard_p.multiple_results = True


def attention_bwd(
    q, k, v, dout, lse, delta, *extras, spec: AttentionSpec
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Binds the backward primitive: gradients of a 16-bit call's (out, lse) from its residuals. dout is
    out's cotangent; delta float32, lse's shape: rowsum(dout * out) minus lse's cotangent
    (`jzyfa.reference.attention_delta`). Results have the shapes and dtypes of q, k, v."""
    if spec.eight_bit:
        raise TypeError("attention_bwd: FP8 and INT8 calls have no backward")
    if len(extras) != spec.num_extras:
        raise TypeError(f"attention_bwd takes {spec.num_extras} extra operands for {spec}, got {len(extras)}")
    extras = [jnp.asarray(cu, jnp.int32) for cu in extras]
    dq, dk, dv = attention_bwd_p.bind(*_vary_alike(q, k, v, dout, lse, delta, *extras), spec=spec)
    return dq, dk, dv


def _bwd_abstract_eval(q, k, v, *_, spec: AttentionSpec):
    """dq, dk, dv: q's, k's and v's types (shardings and varying axes included)."""
    del spec
    return tuple(x.update(weak_type=False) for x in (q, k, v))


attention_bwd_p.def_abstract_eval(_bwd_abstract_eval)
attention_bwd_shard_p.def_abstract_eval(_bwd_abstract_eval)


attention_bwd_p.def_impl(_eager(attention_bwd_p))


def attention_bwd_shard(q, k, v, dout, lse, delta, *extras, spec: AttentionSpec):
    """The backward on one device's blocks (padded dense calls as packed ones)."""
    if spec.seqlens:
        packed = spec.as_packed(q.shape[1], k.shape[1])
        return padded.backward(
            functools.partial(attention_bwd_shard, spec=packed), q, k, v, dout, lse, delta, *extras
        )
    dq, dk, dv = attention_bwd_shard_p.bind(q, k, v, dout, lse, delta, *extras, spec=spec)
    return dq, dk, dv


def _pure_jax_backward(q, k, v, dout, lse, delta, *extras, spec: AttentionSpec):
    """The backward from the residuals in pure JAX: the CPU lowering, and CUDA's where no backward kernel
    serves the call."""
    refuse_required_kernel(spec.kernel_required and spec.backward_kernel)
    window = mask_window(spec.causal, spec.window)
    if spec.varlen:
        return varlen_attention_bwd_reference(
            q, k, v, dout, lse, delta, *extras, *spec.varlen, window=window, softmax_scale=spec.softmax_scale,
            softcap=spec.softcap or None, trust_maxima=True,
        )  # fmt: skip
    return attention_bwd_reference(
        q, k, v, dout, lse, delta, softmax_scale=spec.softmax_scale, window=window, softcap=spec.softcap or None
    )


_pure_jax_backward_lowering = mlir.lower_fun(_pure_jax_backward, multiple_results=True)
_ffi_lowering_bwd = jax.ffi.ffi_lowering(FFI_TARGET_BWD)
# The backward custom call's fourth result: the two persistent kernels' tile counters (dK/dV, then dQ),
# zeroed by the launch; the primitive drops it.
BWD_TILE_COUNTERS = jax.core.ShapedArray((2,), np.int32)


def ffi_attributes_bwd(spec: AttentionSpec) -> dict:
    """The backward custom call's attributes: the forward's mask, scale, softcap and varlen ones."""
    keys = (
        "softmax_scale",
        "softcap",
        "causal",
        "window_left",
        "window_right",
        "varlen",
        "max_seqlen_q",
        "max_seqlen_k",
    )
    attributes = ffi_attributes(spec)
    return {key: attributes[key] for key in keys}


def _cuda_lowering_bwd(ctx, *operands, spec: AttentionSpec):
    if not spec.backward_kernel:
        return _pure_jax_backward_lowering(ctx, *operands, spec=spec)
    ctx = ctx.replace(avals_out=[*ctx.avals_out, BWD_TILE_COUNTERS])
    dq, dk, dv, _ = _ffi_lowering_bwd(ctx, *operands, **ffi_attributes_bwd(spec))
    return [dq, dk, dv]


mlir.register_lowering(attention_bwd_shard_p, _pure_jax_backward_lowering)
mlir.register_lowering(attention_bwd_shard_p, _cuda_lowering_bwd, platform="cuda")

_partitioned_bwd_call = sharding.partitioned(attention_bwd_shard, direction="bwd")


def _partitioned_bwd(*operands, spec: AttentionSpec):
    return _partitioned_bwd_call(*operands, spec)


mlir.register_lowering(attention_bwd_p, mlir.lower_fun(_partitioned_bwd, multiple_results=True))
dispatch.prim_requires_devices_during_lowering.add(attention_bwd_p)
batching.primitive_batchers[attention_bwd_p] = functools.partial(_batch_rule, attention_bwd_p)


# ---- V into the FP8 kernel's operand layout
#
# One pass over V's bytes. XLA's fusion of `fp8_value_operand` (pad, gather inside each 32-key group,
# transpose) runs far below memory bandwidth, so on CUDA a kernel of ours builds the operand
# (ffi/fp8_value_operand.cu, bitwise the same); everywhere else, and for shapes that kernel does not take,
# the pure-JAX function is the lowering.
fp8_value_operand_p = Primitive(FFI_TARGET_VALUE_OPERAND)
FP8_VALUE_OPERAND_HEAD_DIMS = (64, 128, 256)


def _value_operand_abstract_eval(v):
    if v.ndim != 4:
        raise ValueError(f"v must be [batch, seq_k, heads_kv, head_dim], got shape {v.shape}")
    batch, seq_k, heads_kv, head_dim = v.shape
    return jax.core.ShapedArray((batch, heads_kv, head_dim, fp8_layout.padded_keys(seq_k)), v.dtype)


fp8_value_operand_p.def_abstract_eval(_value_operand_abstract_eval)
fp8_value_operand_p.def_impl(jax.jit(fp8_value_operand_p.bind))


def _value_operand_batch_rule(args, dims):
    """vmap: the mapped axis folds into the batch axis."""
    (v,), (d,) = args, dims
    v = jnp.moveaxis(v, d, 0)
    vt = fp8_value_operand_p.bind(v.reshape((-1,) + v.shape[2:]))
    return vt.reshape(v.shape[:2] + vt.shape[1:]), 0


batching.primitive_batchers[fp8_value_operand_p] = _value_operand_batch_rule

_value_operand_fallback = mlir.lower_fun(fp8_layout.fp8_value_operand, multiple_results=False)
_value_operand_ffi = jax.ffi.ffi_lowering(FFI_TARGET_VALUE_OPERAND)


def _value_operand_cuda_lowering(ctx, v):
    (aval,) = ctx.avals_in
    if aval.dtype != jnp.float8_e4m3fn or aval.shape[3] not in FP8_VALUE_OPERAND_HEAD_DIMS:
        return _value_operand_fallback(ctx, v)
    return _value_operand_ffi(ctx, v)


mlir.register_lowering(fp8_value_operand_p, _value_operand_fallback)
mlir.register_lowering(fp8_value_operand_p, _value_operand_cuda_lowering, platform="cuda")


# ---- precision="int8"'s quantization of one shard's q, k, v
#
# (q, k, v, signs) -> (q8, q_scale, k8, k_scale, v8, descale_v, key_mean), `jzyfa.int8_quant.Int8Inputs`'s
# arrays: smoothed k, q and k rotated when asked (by signs then the Walsh-Hadamard matrix), INT8 per 128
# tokens and head, v in e4m3. CUDA lowers it to `jzyfa_int8_quantize` (ffi/int8_quantize.cu: two
# launches, q and v read once, k twice) for dense head-dim-128 operands; everything else lowers to
# `jzyfa.int8_quant.int8_quantize_qkv`'s XLA ops (which the device kernel matches up to float32
# rounding: the mean's and the rotation's summation orders).
int8_quantize_p = Primitive(FFI_TARGET_INT8_QUANTIZE)
int8_quantize_p.multiple_results = True


def _int8_quantize_abstract_eval(q, k, v, signs, *, rotate):
    del signs, rotate
    blocks = lambda seq: -(-seq // int8_quant.INT8_BLOCK)
    (batch, seq_q, heads_q, dim), (_, seq_k, heads_kv, _) = q.shape, k.shape
    shaped = jax.core.ShapedArray
    return (
        shaped(q.shape, jnp.int8),
        shaped((batch, heads_q, blocks(seq_q)), jnp.float32),
        shaped(k.shape, jnp.int8),
        shaped((batch, heads_kv, blocks(seq_k)), jnp.float32),
        shaped(v.shape, jnp.float8_e4m3fn),
        shaped((batch, heads_kv), jnp.float32),
        shaped((batch, heads_kv, dim), jnp.float32),
    )


int8_quantize_p.def_abstract_eval(_int8_quantize_abstract_eval)
int8_quantize_p.def_impl(jax.jit(int8_quantize_p.bind, static_argnames="rotate"))


def _int8_quantize_xla(q, k, v, signs, *, rotate):
    del signs  # int8_quantize_qkv rotates by the same signs (seed 0)
    x = int8_quant.int8_quantize_qkv(q, k, v, rotate=rotate)
    return x.q8, x.q_scale, x.k8, x.k_scale, x.v8, x.descale_v, x.key_mean


_int8_quantize_fallback = mlir.lower_fun(_int8_quantize_xla, multiple_results=True)
_int8_quantize_ffi = jax.ffi.ffi_lowering(FFI_TARGET_INT8_QUANTIZE)


def _int8_quantize_cuda_lowering(ctx, q, k, v, signs, *, rotate):
    q_aval, k_aval, v_aval = ctx.avals_in[:3]
    if (
        q_aval.shape[-1] != 128
        or v_aval.shape != k_aval.shape
        or jnp.dtype(q_aval.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    ):
        return _int8_quantize_fallback(ctx, q, k, v, signs, rotate=rotate)
    batch, seq_k, heads_kv, dim = k_aval.shape
    chunks = -(-seq_k // int8_quant.KEY_MEAN_CHUNK)
    workspace = jax.core.ShapedArray((batch, heads_kv, chunks, dim + 1), jnp.float32)
    ctx = ctx.replace(avals_out=[*ctx.avals_out, workspace])
    *results, _ = _int8_quantize_ffi(ctx, q, k, v, signs, rotate=bool(rotate))
    return results


mlir.register_lowering(int8_quantize_p, _int8_quantize_fallback)
mlir.register_lowering(int8_quantize_p, _int8_quantize_cuda_lowering, platform="cuda")
