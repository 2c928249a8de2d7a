"""The FP8 kernel as a JAX primitive: abstract eval, CUDA lowering to the FFI target, and a CPU
lowering that runs the kernel's algorithm in pure JAX (jzyfa.fp8_emulation).

Two primitives, as for 16-bit inputs (jzyfa/primitive.py): `flash_attention_fp8_p` takes e4m3 q, k,
v in `flash_attention`'s layout and descales of shape [batch, heads_kv]; it has the abstract eval, the
vmap rule (the mapped axis folds into the batch) and a `custom_partitioning` lowering
(jzyfa/sharding.py: batch and heads shard with no collective, descales with K/V; a sequence-sharded
q is gathered). Per shard `flash_attention_fp8_shard_p` is bound: the FFI custom call on CUDA, the
emulation elsewhere. Descales reach the kernel as device buffers, never as host values, so nothing is
read back and calls stay inside CUDA graphs.

V's operand layout (jzyfa/fp8_layout.py: V^T, keys permuted inside each 32-key group) reaches the kernel
one of two ways, chosen per shard from its static shapes at trace time (`fp8_value_layout`):
  - "staged": the kernel takes V as it is and its producer warps transpose each tile in shared memory
    (v_transposed=False);
  - "transposed": `fp8_value_operand_p` writes V^T to device memory first (on CUDA the FFI kernel
    `jzyfa_fp8_value_operand`, elsewhere `fp8_layout.fp8_value_operand`) and the kernel TMA-loads its
    tiles (v_transposed=True).
The rule: staged when seq_q * (heads_q // heads_kv) <= FP8_STAGED_V_MAX_ROWS, else transposed; and
transposed for those few rows too when they see enough keys that the kernel with V^T runs 192-key
blocks (a prefill chunk against a long cache; docs/fp8.md 10.30), which the staged kernel does not
have. FP8_STAGED_V_VERIFIED = False, a kill switch, makes every call transposed. The
environment variable JZYFA_FP8_V_LAYOUT = "staged" or "transposed" overrides it (benchmarks, tests); it
is read when a call is traced (a function already traced for the same shapes keeps its layout until
`jax.clear_caches()`), and any other non-empty value raises ValueError. Varlen calls
(jzyfa/fp8_varlen_primitive.py) take the same rule on max_seqlen_q * (heads_q // heads_kv) against
FP8_VARLEN_STAGED_V_MAX_ROWS (`fp8_varlen_value_layout`).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch  # As in jzyfa/primitive.py: custom_partitioning needs the devices.
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jzyfa import _extension, _validation, sharding
from jzyfa._validation import NO_WINDOW
from jzyfa.fp8_emulation import attention_fp8_emulated
from jzyfa.fp8_layout import fp8_value_operand, padded_keys, value_from_operand
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
FFI_TARGET_VALUE_OPERAND = "jzyfa_fp8_value_operand"
FP8_KERNEL_HEAD_DIM = 128

# Where V's operand layout is built (module docstring). Measured on the H200 in one run (whole call,
# TFLOP/s, staged vs transposed, LDSM transpose and TMA-store epilogue, 2026-12-01; docs/fp8.md 10.16):
# 16x1024 544 vs 494, 4x4096 817 vs 819, 2x8192 874 vs 907, 1x16384 877 vs 931, 1x32768 862 vs 908.
# The layout kernel costs one pass over V's bytes (~22 us per 32 MB at ~3 TB/s), a cost per V byte; the
# staged kernel is ~4-6% slower per key block (its transposing warps take issue slots from the
# issue-bound softmax), a cost per block of work, i.e. per query row that shares the V. So the rows
# that share one KV head's V, seq_q * (heads_q // heads_kv) per shard, decide: few rows (short or
# prefill-chunk calls) pay less in the staged kernel than a pass over V; many rows amortize the pass.
# 4096 rows is the measured break-even; 2048 keeps the calls between staged's clear win (1024 rows)
# and it.
FP8_STAGED_V_MAX_ROWS = 2048
# ... unless those rows see enough keys that the kernel with V^T runs 192-key blocks, which the staged
# kernel does not have (docs/fp8.md 10.30, 10.31; the extension's rule decides, `fp8_value_layout`).
# Measured on the H200 with the layout pass timed, V^T against staged: causal 512-row chunks x 4 query
# heads per KV head against 3K, 4K, 6K, 8K and 16K keys +4.1%, +0.9%, +5.6%, +7.8%, +7.7%; no mask
# 1536 and 2048 keys +5.6% / +4.0%.

# The same for packed varlen calls, on the longest sequence's rows, max_seqlen_q * (heads_q //
# heads_kv). Their V^T costs more than a dense one (an XLA gather of token rows into the sequences'
# columns, then the layout kernel: 82 us for 16320 tokens of 16 heads, 16% of the call), so staging
# pays for more rows: measured (same run) on the bench's 8-sequence batch (8192, 4096, ..., 64 tokens)
# 701 TFLOP/s staged against 633 transposed. Above 8192 rows unmeasured; by the two costs above a
# single 16K sequence is near break-even.
FP8_VARLEN_STAGED_V_MAX_ROWS = 8192

# Kill switch for the rule above: False sends every dense call to the transposed layout. The staged
# kernels pass the GPU suites under both layouts, and give O and LSE bitwise equal to the transposed
# kernels' on the same inputs (tests/test_fp8_kernel_gpu.py). The one failure seen (docs/fp8.md 10.13)
# was the test's: an e4m3 rounding tie in a 5-key row that both layouts round alike (tests/fp8_lse_slack.py).
FP8_STAGED_V_VERIFIED = True
FP8_V_LAYOUT_ENV = "JZYFA_FP8_V_LAYOUT"
FP8_V_LAYOUTS = ("staged", "transposed")

# Keys per block of the dense kernel with V^T from memory (head dim 128, no window): the kernel picks
# 192 for rows that see many keys, 128 otherwise (ffi/flash_fwd_fp8.cu, UseWideKeyBlocks; docs/fp8.md
# 10.28). JZYFA_FP8_KEY_BLOCK forces one for tests and A/B benchmarks; the launch reads it, so changing
# it needs no retrace, except for calls with few query rows per KV head, whose V layout follows the key
# block at trace time (`fp8_value_layout`). Checked here at trace time so that a bad value fails before
# any launch.
FP8_KEY_BLOCK_ENV = "JZYFA_FP8_KEY_BLOCK"
FP8_KEY_BLOCKS = ("auto", "128", "192")

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
    q8,
    k8,
    v8,
    descale_q,
    descale_k,
    descale_v,
    *,
    softmax_scale,
    causal,
    window,
    lean_p,
    kernel_required,
    v_transposed,
):
    batch, seq_q, heads_q, _ = q8.shape
    # out has v's head dim (MLA: 128 where q and k have 192): V^T's rows when v8 is V^T.
    head_dim_v = v8.shape[2] if v_transposed else v8.shape[3]
    out = jax.core.ShapedArray((batch, seq_q, heads_q, head_dim_v), jnp.bfloat16)
    lse = jax.core.ShapedArray((batch, heads_q, seq_q), jnp.float32)
    return out, lse


flash_attention_fp8_shard_p.def_abstract_eval(_shard_abstract_eval)


@functools.partial(
    jax.jit, static_argnames=("softmax_scale", "causal", "window", "lean_p", "kernel_required")
)
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
    q8,
    k8,
    v8,
    descale_q,
    descale_k,
    descale_v,
    *,
    softmax_scale,
    causal,
    window,
    lean_p,
    kernel_required,
    v_transposed,
):
    """Off CUDA: the kernel's algorithm in pure JAX (integer reference exponents, as the kernel)."""
    refuse_required_kernel(kernel_required)
    batch, heads_kv = k8.shape[0], k8.shape[2]
    if v_transposed:
        v8 = value_from_operand(v8, k8.shape[1])
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


def _cuda_lowering(ctx, *args, softmax_scale, causal, window, lean_p, kernel_required, v_transposed):
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
        v_transposed=bool(v_transposed),
    )
    return [out, lse]


mlir.register_lowering(
    flash_attention_fp8_shard_p, mlir.lower_fun(_emulation_fallback, multiple_results=True)
)
mlir.register_lowering(flash_attention_fp8_shard_p, _cuda_lowering, platform="cuda")


# V into the kernel's layout (the "transposed" source): one pass over V's bytes. XLA's fusion of
# `fp8_value_operand` (pad, gather inside each 32-key group, transpose) runs far below memory bandwidth,
# so on CUDA a kernel of ours builds the operand (ffi/fp8_value_operand.cu, bitwise the same); everywhere
# else, and for shapes that kernel does not take, the pure-JAX function is the lowering.
fp8_value_operand_p = Primitive(FFI_TARGET_VALUE_OPERAND)


def _value_operand_abstract_eval(v):
    if v.ndim != 4:
        raise ValueError(f"v must be [batch, seq_k, heads_kv, head_dim], got shape {v.shape}")
    batch, seq_k, heads_kv, head_dim = v.shape
    return jax.core.ShapedArray((batch, heads_kv, head_dim, padded_keys(seq_k)), v.dtype)


fp8_value_operand_p.def_abstract_eval(_value_operand_abstract_eval)
fp8_value_operand_p.def_impl(jax.jit(fp8_value_operand_p.bind))


def _value_operand_batch_rule(args, dims):
    """vmap: the mapped axis folds into the batch axis."""
    (v,), (d,) = args, dims
    v = jnp.moveaxis(v, d, 0)
    vt = fp8_value_operand_p.bind(v.reshape((-1,) + v.shape[2:]))
    return vt.reshape(v.shape[:2] + vt.shape[1:]), 0


batching.primitive_batchers[fp8_value_operand_p] = _value_operand_batch_rule

_value_operand_fallback = mlir.lower_fun(fp8_value_operand, multiple_results=False)
_value_operand_ffi = jax.ffi.ffi_lowering(FFI_TARGET_VALUE_OPERAND)


def _value_operand_cuda_lowering(ctx, v):
    (aval,) = ctx.avals_in
    if aval.dtype != jnp.float8_e4m3fn or aval.shape[3] != FP8_KERNEL_HEAD_DIM:
        return _value_operand_fallback(ctx, v)
    return _value_operand_ffi(ctx, v)


mlir.register_lowering(fp8_value_operand_p, _value_operand_fallback)
mlir.register_lowering(fp8_value_operand_p, _value_operand_cuda_lowering, platform="cuda")


def _v_layout_override() -> str:
    """JZYFA_FP8_V_LAYOUT's value ("staged" | "transposed"), or "" when unset; read at trace time."""
    override = os.environ.get(FP8_V_LAYOUT_ENV, "")
    if override and override not in FP8_V_LAYOUTS:
        raise ValueError(
            f"{FP8_V_LAYOUT_ENV} must be one of {', '.join(FP8_V_LAYOUTS)} (or unset for the default), "
            f"got {override!r}"
        )
    return override


def check_key_block_override() -> None:
    """Raises ValueError unless JZYFA_FP8_KEY_BLOCK is unset, empty or one of FP8_KEY_BLOCKS."""
    override = os.environ.get(FP8_KEY_BLOCK_ENV, "")
    if override and override not in FP8_KEY_BLOCKS:
        raise ValueError(
            f"{FP8_KEY_BLOCK_ENV} must be one of {', '.join(FP8_KEY_BLOCKS)} (or unset for auto), got {override!r}"
        )


def _key_block(v_transposed: bool, seq_q: int, seq_k: int, head_dim: int, causal: bool, window) -> int:
    """The extension's answer (ffi/flash_fwd_fp8.cu's rule and JZYFA_FP8_KEY_BLOCK); 128 without it."""
    return _extension.fp8_key_block(
        v_transposed=v_transposed, head_dim=head_dim, causal=causal, window=window, seq_q=seq_q, seq_k=seq_k
    )


def fp8_value_layout(
    seq_q: int, heads_q: int, heads_kv: int, *, seq_k: int, head_dim: int, causal: bool, window
) -> str:
    """ "staged" or "transposed": where one shard's call builds V's operand layout (module docstring):
    the rule on rows per KV head once FP8_STAGED_V_VERIFIED, "transposed" until then; with few rows still
    "transposed" when the kernel given V^T would run 192-key blocks (the extension's rule, so
    JZYFA_FP8_KEY_BLOCK=128 or 192 steers this too): measured, the layout pass costs less than the wider
    blocks gain (docs/fp8.md 10.30, 10.31). JZYFA_FP8_V_LAYOUT ("staged" | "transposed") overrides all;
    read at trace time. `head_dim` is q's; `window` as the FP8 primitive holds it (causal folded in,
    `_validation.mask_window`)."""
    layout = _layout_by_rows(seq_q * (heads_q // heads_kv), FP8_STAGED_V_MAX_ROWS)
    if layout == "staged" and not _v_layout_override():
        if _key_block(True, seq_q, seq_k, head_dim, causal, window) > 128:
            return "transposed"
    return layout


def fp8_kernel_key_block(q_shape, k_shape, *, causal: bool, window=None) -> int:
    """Keys per block of the dense FP8 kernel that a call with q, k of these shapes ([batch, seq, heads,
    head_dim]) runs now: the V layout as the call picks it, JZYFA_FP8_KEY_BLOCK as the launch reads it
    (docs/fp8.md 10.28). Its emulation must use the same `block_n` to follow the kernel's block scaling.
    128 without the extension."""
    window = _validation.mask_window(bool(causal), _validation.check_window(window))
    v_transposed = _call_value_layout(q_shape, k_shape, causal, window) == "transposed"
    (_, seq_q, _, head_dim), seq_k = q_shape, k_shape[1]
    return _key_block(v_transposed, seq_q, seq_k, head_dim, causal, window)


def _call_value_layout(q_shape, k_shape, causal: bool, window) -> str:
    """`fp8_value_layout` of a call with q, k of these shapes ([batch, seq, heads, head_dim])."""
    (_, seq_q, heads_q, head_dim), (_, seq_k, heads_kv, _) = q_shape, k_shape
    keys = dict(seq_k=seq_k, head_dim=head_dim, causal=causal, window=window)
    return fp8_value_layout(seq_q, heads_q, heads_kv, **keys)


def fp8_varlen_value_layout(max_seqlen_q: int, heads_q: int, heads_kv: int) -> str:
    """The same for a packed varlen call (jzyfa/fp8_varlen_primitive.py): "staged" (V as it is, transposed
    in the kernel's shared memory) when max_seqlen_q * (heads_q // heads_kv) <= FP8_VARLEN_STAGED_V_MAX_ROWS,
    else "transposed" (the varlen V^T, `fp8_layout.fp8_varlen_value_operand`, then the kernel); the kill
    switch and JZYFA_FP8_V_LAYOUT as for dense calls. Read at trace time."""
    return _layout_by_rows(max_seqlen_q * (heads_q // heads_kv), FP8_VARLEN_STAGED_V_MAX_ROWS)


def _layout_by_rows(rows: int, max_staged_rows: int) -> str:
    """The override, else the kill switch, else staged up to max_staged_rows query rows per KV head."""
    if override := _v_layout_override():
        return override
    if not FP8_STAGED_V_VERIFIED:
        return "transposed"
    return "staged" if rows <= max_staged_rows else "transposed"


def fp8_attention_shard(
    q8, k8, v8, descale_q, descale_k, descale_v, *, softmax_scale, causal, window, lean_p, kernel_required
):
    """The call on one device's blocks, descales as [B * Hkv] vectors; V as it is, or V^T from the
    layout kernel, by `fp8_value_layout` of the shard's shapes."""
    check_key_block_override()
    v_transposed = _call_value_layout(q8.shape, k8.shape, causal, window) == "transposed"
    out, lse = flash_attention_fp8_shard_p.bind(
        q8,
        k8,
        fp8_value_operand_p.bind(v8) if v_transposed else v8,
        *(d.reshape(-1) for d in (descale_q, descale_k, descale_v)),
        softmax_scale=softmax_scale,
        causal=causal,
        window=window,
        lean_p=lean_p,
        kernel_required=kernel_required,
        v_transposed=v_transposed,
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
