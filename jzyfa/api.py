"""`flash_attention`: argument checks, the choice between kernel and pure-JAX path, and autodiff."""

from __future__ import annotations

import enum
import functools

import jax
import jax.numpy as jnp

from jzyfa import _platform, _validation
from jzyfa.primitive import flash_attention_fwd, kernel_config_problem
from jzyfa.quantize import dequantize
from jzyfa.reference import attention_reference


class Path(enum.Enum):
    REFERENCE = "reference"  # pure JAX, no primitive
    PRIMITIVE = "primitive"  # the kernel on Hopper; its reference lowering elsewhere
    KERNEL_REQUIRED = "kernel_required"  # the primitive, and lowering anywhere but CUDA is an error


def choose_path(q: jax.Array, softmax_scale: float, implementation: str | None) -> Path:
    """Which path serves a validated non-FP8 call; raises if the kernel is demanded but cannot serve."""
    if implementation == "xla":
        return Path.REFERENCE
    config_problem = kernel_config_problem(q, softmax_scale)
    backend = _platform.default_backend()
    if implementation == "kernel":
        if config_problem:
            raise ValueError(f"implementation='kernel' cannot serve this call: {config_problem}")
        if backend == "gpu" and (reason := _platform.hopper_unavailable_reason()):
            raise ValueError(f"implementation='kernel' cannot run here: {reason}")
        return Path.KERNEL_REQUIRED
    if config_problem:
        return Path.REFERENCE
    if backend == "cpu" or _platform.kernel_available():
        return Path.PRIMITIVE
    return Path.REFERENCE


# The backward recomputes through the reference until a backward kernel exists.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _differentiable_kernel(q, k, v, softmax_scale: float, causal: bool, kernel_required: bool):
    return flash_attention_fwd(
        q, k, v, softmax_scale=softmax_scale, causal=causal, kernel_required=kernel_required
    )


def _differentiable_kernel_fwd(q, k, v, softmax_scale, causal, kernel_required):
    return _differentiable_kernel(q, k, v, softmax_scale, causal, kernel_required), (q, k, v)


def _differentiable_kernel_bwd(softmax_scale, causal, kernel_required, residuals, cotangents):
    reference = functools.partial(attention_reference, causal=causal, softmax_scale=softmax_scale)
    _, vjp = jax.vjp(reference, *residuals)
    return vjp(cotangents)


_differentiable_kernel.defvjp(_differentiable_kernel_fwd, _differentiable_kernel_bwd)


def _fp8_reference(q, k, v, descales, *, causal: bool, softmax_scale: float):
    """FP8 through the pure-JAX path: dequantize to float32, exact attention, bf16 output."""
    dequantized = [dequantize(x, d) for x, d in zip((q, k, v), descales)]
    out, lse = attention_reference(*dequantized, causal=causal, softmax_scale=softmax_scale)
    return out.astype(jnp.bfloat16), lse


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
    descale_q: jax.Array | None = None,
    descale_k: jax.Array | None = None,
    descale_v: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Scaled dot-product attention, softmax(scale * q k^T) v, per batch and head.

    Args:
      q: [batch, seq_q, heads_q, head_dim]; bf16, f16, float32 or float8_e4m3fn.
      k, v: [batch, seq_k, heads_kv, head_dim], q's dtype; heads_q a multiple of heads_kv
        (GQA/MQA: query head h uses key/value head h // (heads_q // heads_kv)).
      causal: mask aligned bottom-right, query i sees key j iff j <= i + seq_k - seq_q. Rows that
        see no key give out = 0 and lse = -inf.
      softmax_scale: static float; default 1 / sqrt(head_dim).
      return_lse: also return the log-sum-exp, float32 [batch, heads_q, seq_q], natural log.
      implementation: None uses the kernel where it can (Hopper GPU, bf16/f16, head_dim 64 or 128)
        and the pure-JAX path elsewhere; "kernel" raises if the kernel cannot serve; "xla" always
        uses the pure-JAX path.
      descale_q, descale_k, descale_v: float32 descales, required for FP8 inputs and refused for
        others: shape () or (1,), or [batch, heads_kv] (one per batch and KV head; for q, one per
        group of query heads sharing a KV head). The values used are x_fp8 * descale.

    Returns:
      out [batch, seq_q, heads_q, head_dim] in q's dtype (bf16 for FP8 inputs), or (out, lse).
    """
    _validation.check_qkv(q, k, v)
    _validation.check_causal(causal)
    _validation.check_implementation(implementation)
    softmax_scale = _validation.resolve_softmax_scale(softmax_scale, q.shape[-1])
    descales = _validation.check_descales(q, k, (descale_q, descale_k, descale_v))

    if descales is not None:
        if implementation == "kernel":
            raise ValueError(
                "implementation='kernel' cannot serve FP8 inputs: the FP8 kernel does not exist yet; "
                "use implementation=None or 'xla' for the pure-JAX FP8 path"
            )
        out, lse = _fp8_reference(q, k, v, descales, causal=causal, softmax_scale=softmax_scale)
    else:
        path = choose_path(q, softmax_scale, implementation)
        if path is Path.REFERENCE:
            out, lse = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale)
        else:
            out, lse = _differentiable_kernel(
                q, k, v, softmax_scale, bool(causal), path is Path.KERNEL_REQUIRED
            )
    return (out, lse) if return_lse else out
