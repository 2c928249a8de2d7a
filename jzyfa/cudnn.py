"""cuDNN's fused attention, through `jax.nn.dot_product_attention(implementation="cudnn")`, for CUDA GPUs
where jzyfa's kernel does not run (any GPU but Hopper, or Hopper without the extension).

`problem` says, from a call's configuration and the target devices, whether cuDNN computes exactly what
`jzyfa.flash_attention` defines; `attention` makes the call. Both read the same mapping:

- dtypes bf16 and f16; head dims multiples of 8, at most 128 before Hopper (compute capability 9.0)
  and 256 from it; one head dim for q, k and v (cuDNN has MLA's 192/128 from Hopper and cuDNN 9.10,
  but jax.nn.dot_product_attention requires value's shape to equal key's). Compute
  capability 8.0 (Ampere) or later; 10.3 needs cuDNN 9.11 (the conditions JAX's cuDNN path checks).
- Masks: none, for any seq_q and seq_k. cuDNN's causal mask (jax.nn's) is aligned top-left, jzyfa's
  bottom-right: they agree only when seq_q == seq_k, so causal calls and windows route only then. A
  window must be a left bound with the causal diagonal, (left, 0), which cuDNN's sliding window is
  (cuDNN 9.2 on); windows with a right bound, or a left bound only, stay on the pure-JAX path.
- Per-sequence lengths (`seqlens_q`/`seqlens_k`): jzyfa aligns the mask per sequence (query t at
  t + len_k - len_q), cuDNN top-left; they agree without a mask, or with a causal mask when one array
  holds both lengths (len_q == len_k for every sequence) and seq_q == seq_k. Lengths are clipped to
  the padded sizes and raised to at least 1 for cuDNN, and the rows jzyfa defines as empty (padded
  queries, sequences with no keys) are set to 0 after. Not with windows.
- No lse (jax.nn returns none whose gradient is defined), hence no sinks; no softcap; no FP8 inputs;
  no packed (varlen) layout.

Gradients are jax.nn's (cuDNN's backward).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jzyfa._validation import NO_WINDOW, Window
from jzyfa.plan import Target, surely

MIN_COMPUTE_CAPABILITY = (8, 0)
HOPPER = (9, 0)
HEAD_DIM_MAX_BEFORE_HOPPER = 128
HEAD_DIM_MAX = 256
SLIDING_WINDOW_MIN_CUDNN = 90200
CC_10_3_MIN_CUDNN = 91100
DTYPES = ("bfloat16", "float16")
LENGTHS = ("none", "shared", "separate")  # no lengths; one array for both; two (or one missing)


@dataclasses.dataclass(frozen=True)
class Call:
    """What cuDNN would have to serve of a validated `flash_attention` call."""

    dtype: str  # numpy name: "bfloat16", "float16", ...
    head_dims: tuple[int, int]  # (q and k, v)
    seq_q: int
    seq_k: int
    window: Window  # the effective mask, canonical for these lengths (`_validation.canonical_window`)
    lengths: str = "none"  # one of LENGTHS
    layout: str = "dense"
    return_lse: bool = False
    softcap: bool = False


def _capability(target: Target) -> tuple[int, ...] | None:
    if target.compute_capability is None:
        return None
    return tuple(int(part) for part in target.compute_capability.split("."))


def device_problem(target: Target) -> str | None:
    """None where cuDNN's fused attention runs on the target's devices, else why not."""
    if target.backend != "gpu":
        return f"cuDNN's fused attention runs on CUDA GPUs, the default JAX backend is {target.backend!r}"
    capability = _capability(target)
    if capability is None:
        return "cuDNN's fused attention runs on CUDA GPUs, these devices report no compute capability"
    if capability < MIN_COMPUTE_CAPABILITY:
        return (
            f"cuDNN's fused attention needs compute capability 8.0 or later, got {target.compute_capability}"
        )
    if target.cudnn_version is None:
        return "JAX finds no cuDNN (jax.nn.dot_product_attention(implementation='cudnn') would fail)"
    if capability == (10, 3) and target.cudnn_version < CC_10_3_MIN_CUDNN:
        return f"compute capability 10.3 needs cuDNN 9.11 or later, got {target.cudnn_version}"
    return None


def replaces_kernel(target: Target) -> bool:
    """Whether cuDNN's fused attention takes the place of jzyfa's kernel on these devices: it runs
    there and the kernel does not."""
    return target.kernel_problem is not None and device_problem(target) is None


def call_problem(call: Call, target: Target) -> str | None:
    """None where cuDNN computes exactly what jzyfa defines for `call` on these devices, else why not
    (the module docstring's mapping). The target must pass `device_problem`."""
    if call.layout != "dense":
        return "cuDNN's path takes the dense layout only"
    if call.dtype not in DTYPES:
        return f"cuDNN's fused attention takes bf16 or f16 inputs, got {call.dtype}"
    if call.return_lse:
        return "jax.nn.dot_product_attention returns no lse (return_lse=True, sinks)"
    if call.softcap:
        return "cuDNN's path has no softcap"
    hopper_or_later = _capability(target) >= HOPPER
    head_max = HEAD_DIM_MAX if hopper_or_later else HEAD_DIM_MAX_BEFORE_HOPPER
    for dim in call.head_dims:
        if dim % 8 or dim > head_max:
            return (
                f"cuDNN's fused attention takes head dims that are multiples of 8 up to {head_max} on compute "
                f"capability {target.compute_capability}, got {call.head_dims[0]}/{call.head_dims[1]}"
            )
    if call.head_dims[0] != call.head_dims[1]:
        return (
            "jax.nn.dot_product_attention takes one head dim for q, k and v (its value must have key's "
            f"shape), got {call.head_dims[0]}/{call.head_dims[1]}"
        )
    if surely(lambda: call.seq_q == 0 or call.seq_k == 0):
        return f"cuDNN's path needs seq_q and seq_k >= 1, got {call.seq_q} and {call.seq_k}"
    if call.window == NO_WINDOW:
        return None
    left, right = call.window
    if right != 0:
        return f"cuDNN's sliding window is a left bound with the causal diagonal, got window {call.window}"
    if not surely(lambda: call.seq_q == call.seq_k):
        return (
            "cuDNN's causal mask is aligned top-left, jzyfa's bottom-right: they agree only when "
            f"seq_q == seq_k, got {call.seq_q} and {call.seq_k}"
        )
    if call.lengths == "separate":
        return (
            "with per-sequence lengths a causal mask agrees with cuDNN's only when one array holds "
            "both seqlens_q and seqlens_k"
        )
    if left >= 0 and call.lengths != "none":
        return "cuDNN's path takes sliding windows without per-sequence lengths only"
    if left >= 0 and target.cudnn_version < SLIDING_WINDOW_MIN_CUDNN:
        return f"cuDNN's sliding window needs cuDNN 9.2 or later, got {target.cudnn_version}"
    return None


def problem(call: Call, target: Target) -> str | None:
    """None where the cuDNN path serves `call` on `target`, else why not."""
    return device_problem(target) or call_problem(call, target)


def attention(q, k, v, lengths: tuple, *, window: Window, softmax_scale: float) -> jax.Array:
    """out [B, Sq, Hq, Dv] of a call `problem` accepts, by jax.nn's cuDNN implementation. `lengths`:
    () or (seqlens_q, seqlens_k) as int32 [B] (`_validation.check_seqlens`); `window` as in `Call`."""
    left, right = window
    options = {}
    if right == 0:
        options["is_causal"] = True
        if left >= 0:
            options["local_window_size"] = (left, 0)
    if lengths:
        len_q, len_k = (jnp.clip(n, 0, size) for n, size in zip(lengths, (q.shape[1], k.shape[1])))
        options["query_seq_lengths"] = jnp.maximum(len_q, 1)
        options["key_value_seq_lengths"] = jnp.maximum(len_k, 1)
    out = jax.nn.dot_product_attention(q, k, v, scale=softmax_scale, implementation="cudnn", **options)
    if lengths:
        rows = (jnp.arange(q.shape[1])[None, :] < len_q[:, None]) & (len_k > 0)[:, None]  # [B, Sq]
        out = jnp.where(rows[:, :, None, None], out, jnp.zeros((), out.dtype))
    return out
