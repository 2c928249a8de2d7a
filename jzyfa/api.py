"""`flash_attention` and `flash_attention_varlen`: argument checks, the choice between kernel and pure-JAX
path, and autodiff."""

from __future__ import annotations

import enum
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jzyfa import _platform, _validation
from jzyfa.fp8_primitive import flash_attention_fp8_kernel, fp8_kernel_config_problem
from jzyfa.fp8_varlen_primitive import flash_attention_fp8_varlen_fwd, fp8_varlen_kernel_config_problem
from jzyfa.primitive import MLA_HEAD_DIMS, flash_attention_fwd, is_mla, kernel_config_problem
from jzyfa.quantize import dequantize
from jzyfa.reference import attention_reference
from jzyfa.varlen import fp8_varlen_attention_reference, varlen_attention_reference
from jzyfa.varlen_primitive import flash_attention_varlen_fwd, varlen_kernel_config_problem


class Path(enum.Enum):
    REFERENCE = "reference"  # pure JAX, no primitive
    PRIMITIVE = "primitive"  # the kernel on Hopper; its reference lowering elsewhere
    KERNEL_REQUIRED = "kernel_required"  # the primitive, and lowering anywhere but CUDA is an error


def kernel_causal_flag(
    causal: bool, window: _validation.Window | None, seq_q: int, seq_k: int
) -> bool | None:
    """The kernel's `causal` attribute for this mask, or None if the kernel has no such mask yet.

    The kernel masks nothing or causally; a window is served when, for these lengths, it is one of
    those two (e.g. (8192, 0) over 4K keys is causal).
    """
    if window is None:
        return bool(causal)
    left_right = _validation.canonical_window(_validation.mask_window(causal, window), seq_q, seq_k)
    return {_validation.NO_WINDOW: False, _validation.CAUSAL_WINDOW: True}.get(left_right)


# The 16-bit kernel's sliding-window instantiations (dense and varlen; ffi/flash_fwd_kernel.cuh) passed
# their GPU tests on an H200 on 2026-11-30 (tests/test_window_kernel_gpu.py, 127 passed: against float64
# and the pure-JAX path, poisoned outputs, rows with no key, bitwise reruns). Set False to send windows
# other than causal or none back to the pure-JAX path (implementation="kernel" then needs the variable
# below).
WINDOW_KERNEL_VERIFIED = True
UNVERIFIED_WINDOW_KERNEL_ENV = "JZYFA_UNVERIFIED_WINDOW_KERNEL"


def window_kernel_enabled() -> bool:
    return WINDOW_KERNEL_VERIFIED or os.environ.get(UNVERIFIED_WINDOW_KERNEL_ENV) == "1"


def kernel_mask(
    causal: bool, window: _validation.Window | None, seq_q: int, seq_k: int
) -> tuple[bool, _validation.Window]:
    """The 16-bit kernel's (causal, window) for this mask: (flag, NO_WINDOW) when it is causal or none for
    these lengths (the plain kernels), else (False, the window with bounds that exclude no key as -1)."""
    flag = kernel_causal_flag(causal, window, seq_q, seq_k)
    if flag is not None:
        return flag, _validation.NO_WINDOW
    return False, _validation.canonical_window(_validation.mask_window(causal, window), seq_q, seq_k)


def _window_gate_problem(window: _validation.Window) -> str:
    return (
        "the kernel's sliding windows are switched off (jzyfa.api.WINDOW_KERNEL_VERIFIED is False): "
        f"the sliding window {window} (left, right) runs on it only with {UNVERIFIED_WINDOW_KERNEL_ENV}=1; "
        "or use implementation=None or 'xla' for the pure-JAX path"
    )


# The 16-bit kernel's MLA instantiation (q/k head dim 192, v head dim 128; FlashFwdMlaKernel in
# ffi/flash_fwd_kernel.cuh, dense batches, causal or no mask) passed its GPU tests on an H200 on
# 2026-11-30 (tests/test_mla_kernel_gpu.py, 12 passed: bf16/f16, causal or not, Sq != Sk, GQA/MQA,
# against float64 and the pure-JAX path, poisoned outputs, bitwise reruns). Set False to send MLA calls
# back to the pure-JAX path (implementation="kernel" then needs the variable below).
MLA_KERNEL_VERIFIED = True
UNVERIFIED_MLA_KERNEL_ENV = "JZYFA_UNVERIFIED_MLA_KERNEL"


def mla_kernel_enabled() -> bool:
    return MLA_KERNEL_VERIFIED or os.environ.get(UNVERIFIED_MLA_KERNEL_ENV) == "1"


def _mla_gate_problem() -> str:
    return (
        f"the kernel's MLA head dims {MLA_HEAD_DIMS} (q/k, v) are switched off "
        "(jzyfa.api.MLA_KERNEL_VERIFIED is False): they run on it only with "
        f"{UNVERIFIED_MLA_KERNEL_ENV}=1; or use implementation=None or 'xla' for the pure-JAX path"
    )


# The windowed kernels compute positions and bounds in int32 (ffi/flash_fwd.cu, flash_fwd_varlen.cu).
WINDOW_KERNEL_MAX_TOKENS = 1 << 30


# The 16-bit kernel's head-dim-256 instantiation (dense batches, causal or no mask; 64-key blocks,
# ffi/flash_fwd_kernel.cuh): tests/test_hd256_kernel_gpu.py passed whole on an H200 on 2026-12-01 (49
# tests: lengths, masks, dtypes and GQA against float64 and the pure-JAX path, rows with no key, bitwise
# reruns). A kill switch: False keeps head dim 256 on the pure-JAX path for implementation=None, and
# implementation="kernel" then needs the variable below. It gates head dim 256 as a whole: its sliding
# windows and varlen batches also need the wide gates below.
HD256_KERNEL_VERIFIED = True
UNVERIFIED_HD256_KERNEL_ENV = "JZYFA_UNVERIFIED_HD256_KERNEL"
HD256 = 256


def hd256_kernel_enabled() -> bool:
    return HD256_KERNEL_VERIFIED or os.environ.get(UNVERIFIED_HD256_KERNEL_ENV) == "1"


def _hd256_problem() -> str | None:
    """None when the kernel may serve a head-dim-256 call (its gate is on), else why not."""
    if not hd256_kernel_enabled():
        return (
            "the kernel's head_dim 256 is switched off "
            "(jzyfa.api.HD256_KERNEL_VERIFIED is False): it runs on the kernel only with "
            f"{UNVERIFIED_HD256_KERNEL_ENV}=1; or use implementation=None or 'xla' for the pure-JAX path"
        )
    return None


# The wide head dims (256, and MLA's 192 for q/k with 128 for v) under sliding windows other than causal or
# none (dense and varlen) and over varlen batches: instantiations built without spills (ffi/flash_fwd.cu,
# ffi/flash_fwd_varlen.cu; the window mask by row bounds). tests/test_wide_kernels_gpu.py (38) passed on an
# H200 on 2026-12-01. Kill switches: False keeps these calls on the pure-JAX path for implementation=None,
# and implementation="kernel" then needs the variable (at head dim 256, HD256's gate as well).
WIDE_WINDOW_KERNEL_VERIFIED = True
UNVERIFIED_WIDE_WINDOW_KERNEL_ENV = "JZYFA_UNVERIFIED_WIDE_WINDOW_KERNEL"
WIDE_VARLEN_KERNEL_VERIFIED = True
UNVERIFIED_WIDE_VARLEN_KERNEL_ENV = "JZYFA_UNVERIFIED_WIDE_VARLEN_KERNEL"


def is_wide(q, v) -> bool:
    """Head dim 256 or MLA's head dims: the instantiations behind the wide gates."""
    return q.shape[-1] == HD256 or is_mla(q, v)


def wide_window_kernel_enabled() -> bool:
    return WIDE_WINDOW_KERNEL_VERIFIED or os.environ.get(UNVERIFIED_WIDE_WINDOW_KERNEL_ENV) == "1"


def wide_varlen_kernel_enabled() -> bool:
    return WIDE_VARLEN_KERNEL_VERIFIED or os.environ.get(UNVERIFIED_WIDE_VARLEN_KERNEL_ENV) == "1"


def _wide_gate_problem(what: str, flag: str, env: str) -> str:
    return (
        f"the kernel's {what} at the wide head dims (256, and MLA's {MLA_HEAD_DIMS}) are switched off "
        f"(jzyfa.api.{flag} is False): they run on it only with {env}=1; or use "
        "implementation=None or 'xla' for the pure-JAX path"
    )


def _head_dim_gates_problem(q, v, sliding: bool, varlen: bool) -> str | None:
    """None when every gate of this call's head dims is on (set, or lifted by its variable), else why not:
    head dim 256's and MLA's as a whole, and the wide ones for sliding windows and varlen batches."""
    if q.shape[-1] == HD256 and (problem := _hd256_problem()):
        return problem
    if is_mla(q, v) and not mla_kernel_enabled():
        return _mla_gate_problem()
    if is_wide(q, v) and varlen and not wide_varlen_kernel_enabled():
        return _wide_gate_problem(
            "varlen batches", "WIDE_VARLEN_KERNEL_VERIFIED", UNVERIFIED_WIDE_VARLEN_KERNEL_ENV
        )
    if is_wide(q, v) and sliding and not wide_window_kernel_enabled():
        return _wide_gate_problem(
            "sliding windows", "WIDE_WINDOW_KERNEL_VERIFIED", UNVERIFIED_WIDE_WINDOW_KERNEL_ENV
        )
    return None


def _head_dim_gates_verified(q, v, sliding: bool, varlen: bool) -> bool:
    """Whether every gate of this call's head dims is set (implementation=None ignores the variables)."""
    wide = is_wide(q, v)
    return not (
        (q.shape[-1] == HD256 and not HD256_KERNEL_VERIFIED)
        or (is_mla(q, v) and not MLA_KERNEL_VERIFIED)
        or (wide and sliding and not WIDE_WINDOW_KERNEL_VERIFIED)
        or (wide and varlen and not WIDE_VARLEN_KERNEL_VERIFIED)
    )


def kernel_problem(q, k, v, softmax_scale: float, causal: bool, window) -> str | None:
    """None when the kernel serves this validated non-FP8 call, else why not (windows, MLA and head dim
    256 need their gates on)."""
    if problem := kernel_config_problem(q, k, v, softmax_scale):
        return problem
    sliding = kernel_causal_flag(causal, window, q.shape[1], k.shape[1]) is None
    if problem := _head_dim_gates_problem(q, v, sliding, varlen=False):
        return problem
    if sliding:
        if not window_kernel_enabled():
            return _window_gate_problem(_validation.mask_window(causal, window))
        if q.shape[1] + k.shape[1] > WINDOW_KERNEL_MAX_TOKENS:
            return f"the kernel's sliding windows take seq_q + seq_k <= 2^30, got {q.shape[1] + k.shape[1]}"
    return None


def _required_kernel_path(problem: str | None, what: str) -> Path:
    """implementation="kernel", past its gates: raises naming what the kernel cannot serve in this `what`
    call, or why it cannot run here (a GPU that is not Hopper); else Path.KERNEL_REQUIRED."""
    if problem:
        raise ValueError(f"implementation='kernel' cannot serve this {what}: {problem}")
    if _platform.default_backend() == "gpu" and (reason := _platform.hopper_unavailable_reason()):
        raise ValueError(f"implementation='kernel' cannot run here: {reason}")
    return Path.KERNEL_REQUIRED


def choose_path(
    q: jax.Array, k: jax.Array, v: jax.Array, softmax_scale: float, causal: bool, window, implementation
) -> Path:
    """Which path serves a validated non-FP8 call; raises if the kernel is demanded but cannot serve."""
    if implementation == "xla":
        return Path.REFERENCE
    config_problem = kernel_problem(q, k, v, softmax_scale, causal, window)
    backend = _platform.default_backend()
    sliding = kernel_causal_flag(causal, window, q.shape[1], k.shape[1]) is None
    if implementation == "kernel":
        return _required_kernel_path(config_problem, "call")
    # implementation=None keeps sliding windows on the pure-JAX path while the windowed kernels are switched
    # off (WINDOW_KERNEL_VERIFIED False), whatever the variable says; MLA, head dim 256 and the wide gates
    # likewise.
    if (
        config_problem
        or (sliding and not WINDOW_KERNEL_VERIFIED)
        or not _head_dim_gates_verified(q, v, sliding, varlen=False)
    ):
        return Path.REFERENCE
    if backend == "cpu" or _platform.kernel_available():
        return Path.PRIMITIVE
    return Path.REFERENCE


# The FP8 kernel passed its GPU tests on an H200 on 2026-11-30 (tests/test_fp8_kernel_gpu.py: against
# its emulation and float64, poisoned outputs, rows with no key, bitwise reruns). Set False to send
# FP8 calls back to the exact pure-JAX path (implementation="kernel" then needs the variable below).
FP8_KERNEL_VERIFIED = True
UNVERIFIED_FP8_KERNEL_ENV = "JZYFA_UNVERIFIED_FP8_KERNEL"


def fp8_kernel_enabled() -> bool:
    return FP8_KERNEL_VERIFIED or os.environ.get(UNVERIFIED_FP8_KERNEL_ENV) == "1"


# The FP8 kernel's sliding-window instantiation (FlashFwdFp8WindowKernel, dense batches) passed its GPU
# tests on an H200 on 2026-11-30 (tests/test_fp8_window_kernel_gpu.py: against the windowed FP8 emulation
# and float64, lean and exact P, rows with no key, poisoned outputs, a bitwise rerun). Set False to send
# FP8 sliding windows back to the pure-JAX path (implementation="kernel" then needs the variable below).
FP8_WINDOW_KERNEL_VERIFIED = True
UNVERIFIED_FP8_WINDOW_KERNEL_ENV = "JZYFA_UNVERIFIED_FP8_WINDOW_KERNEL"


def fp8_window_kernel_enabled() -> bool:
    return FP8_WINDOW_KERNEL_VERIFIED or os.environ.get(UNVERIFIED_FP8_WINDOW_KERNEL_ENV) == "1"


def _fp8_window_problem(q, k, causal: bool, window) -> str | None:
    """None when the FP8 kernel may serve this sliding window (neither causal nor none), else why not."""
    if not fp8_window_kernel_enabled():
        return (
            "the FP8 kernel's sliding windows are switched off "
            "(jzyfa.api.FP8_WINDOW_KERNEL_VERIFIED is False): the sliding window "
            f"{_validation.mask_window(causal, window)} (left, right) runs on it only with "
            f"{UNVERIFIED_FP8_WINDOW_KERNEL_ENV}=1; or use implementation=None or 'xla' for the pure-JAX path"
        )
    if q.shape[1] + k.shape[1] > WINDOW_KERNEL_MAX_TOKENS:
        return f"the FP8 kernel's sliding windows take seq_q + seq_k <= 2^30, got {q.shape[1] + k.shape[1]}"
    return None


# The FP8 kernel's MLA instantiation (q/k head dim 192, v head dim 128; FlashFwdFp8MlaKernel in
# ffi/flash_fwd_fp8_kernel.cuh, dense batches, causal or no mask, lean and exact P) passed its GPU tests on
# an H200 on 2026-12-01 (tests/test_fp8_mla_kernel_gpu.py, 22 passed: against its emulation and float64,
# lean and exact P, Sq != Sk, GQA, rows with no key, poisoned outputs, a bitwise rerun). Set False (the kill
# switch) to run FP8 MLA calls on the pure-JAX path (implementation="kernel" then needs the variable below).
FP8_MLA_KERNEL_VERIFIED = True
UNVERIFIED_FP8_MLA_KERNEL_ENV = "JZYFA_UNVERIFIED_FP8_MLA_KERNEL"


def fp8_mla_kernel_enabled() -> bool:
    return FP8_MLA_KERNEL_VERIFIED or os.environ.get(UNVERIFIED_FP8_MLA_KERNEL_ENV) == "1"


def _fp8_mla_gate_problem() -> str:
    return (
        f"the FP8 kernel's MLA head dims {MLA_HEAD_DIMS} (q/k, v) are switched off "
        "(jzyfa.api.FP8_MLA_KERNEL_VERIFIED is False): they run on it only with "
        f"{UNVERIFIED_FP8_MLA_KERNEL_ENV}=1; or use implementation=None or 'xla' for the pure-JAX path"
    )


def choose_fp8_path(q, k, v, causal: bool, window, implementation) -> Path:
    """Which path serves a validated FP8 call; raises if the kernel is demanded but cannot serve."""
    if implementation == "xla":
        return Path.REFERENCE
    sliding = kernel_causal_flag(causal, window, q.shape[1], k.shape[1]) is None
    problem = fp8_kernel_config_problem(q, k, v, sliding)
    if problem is None and sliding:
        problem = _fp8_window_problem(q, k, causal, window)
    if problem is None and is_mla(q, v) and not fp8_mla_kernel_enabled():
        problem = _fp8_mla_gate_problem()
    if implementation == "kernel":
        if not fp8_kernel_enabled():
            raise ValueError(
                "implementation='kernel' cannot serve FP8 inputs yet: the FP8 kernel has not passed its GPU "
                f"tests; set {UNVERIFIED_FP8_KERNEL_ENV}=1 to run it anyway, or use implementation=None "
                "or 'xla' for the pure-JAX FP8 path"
            )
        return _required_kernel_path(problem, "FP8 call")
    # implementation=None keeps sliding windows on the pure-JAX path while FP8_WINDOW_KERNEL_VERIFIED is
    # False, whatever the variable says (as for the 16-bit kernel's windows); MLA likewise.
    if (
        problem
        or not FP8_KERNEL_VERIFIED
        or (sliding and not FP8_WINDOW_KERNEL_VERIFIED)
        or (is_mla(q, v) and not FP8_MLA_KERNEL_VERIFIED)
    ):
        return Path.REFERENCE
    if not _platform.kernel_available():
        return Path.REFERENCE
    return Path.PRIMITIVE


# The 16-bit kernel's variable-length instantiation (ffi/flash_fwd_varlen.cu) passed its GPU tests on an
# H200 on 2026-11-30 (tests/test_varlen_kernel_gpu.py, 64 passed: against float64 per sequence and the
# pure-JAX path, poisoned outputs, empty sequences, bitwise reruns). Set False to send varlen calls back to
# the pure-JAX path (implementation="kernel" then needs the variable below).
VARLEN_KERNEL_VERIFIED = True
UNVERIFIED_VARLEN_KERNEL_ENV = "JZYFA_UNVERIFIED_VARLEN_KERNEL"


def varlen_kernel_enabled() -> bool:
    return VARLEN_KERNEL_VERIFIED or os.environ.get(UNVERIFIED_VARLEN_KERNEL_ENV) == "1"


def choose_varlen_path(
    q, k, v, num_seqs: int, max_seqlen_q: int, softmax_scale: float, window, implementation
) -> Path:
    """Which path serves a validated varlen call (`window`: the effective mask); raises if the kernel is
    demanded but cannot serve."""
    if implementation == "xla":
        return Path.REFERENCE
    problem = varlen_kernel_config_problem(q, k, v, num_seqs, max_seqlen_q, softmax_scale, window)
    sliding = window not in (_validation.NO_WINDOW, _validation.CAUSAL_WINDOW)
    if problem is None:
        problem = _head_dim_gates_problem(q, v, sliding, varlen=True)
    if problem is None and sliding and not window_kernel_enabled():
        problem = _window_gate_problem(window)
    if problem is None and sliding and q.shape[0] + k.shape[0] > WINDOW_KERNEL_MAX_TOKENS:
        problem = (
            f"the kernel's sliding windows take total_q + total_k <= 2^30, got {q.shape[0] + k.shape[0]}"
        )
    if implementation == "kernel":
        if not varlen_kernel_enabled():
            raise ValueError(
                "implementation='kernel' cannot serve flash_attention_varlen: the varlen kernel is "
                "switched off (jzyfa.api.VARLEN_KERNEL_VERIFIED is False); set "
                f"{UNVERIFIED_VARLEN_KERNEL_ENV}=1 to run it anyway, or use implementation=None or 'xla' for "
                "the pure-JAX path"
            )
        return _required_kernel_path(problem, "varlen call")
    if (
        problem
        or not VARLEN_KERNEL_VERIFIED
        or (sliding and not WINDOW_KERNEL_VERIFIED)
        or not _head_dim_gates_verified(q, v, sliding, varlen=True)
    ):
        return Path.REFERENCE
    if not _platform.kernel_available():
        return Path.REFERENCE
    return Path.PRIMITIVE


# The FP8 kernel's variable-length instantiations (FlashFwdFp8VarlenKernel and its sliding window,
# ffi/flash_fwd_fp8_varlen.cu): tests/test_fp8_varlen_kernel_gpu.py passed on an H200 on 2026-12-01. A
# kill switch: False runs FP8 varlen calls on the pure-JAX path for implementation=None, and
# implementation="kernel" then needs the variable below.
FP8_VARLEN_KERNEL_VERIFIED = True
UNVERIFIED_FP8_VARLEN_KERNEL_ENV = "JZYFA_UNVERIFIED_FP8_VARLEN_KERNEL"


def fp8_varlen_kernel_enabled() -> bool:
    return FP8_VARLEN_KERNEL_VERIFIED or os.environ.get(UNVERIFIED_FP8_VARLEN_KERNEL_ENV) == "1"


def choose_fp8_varlen_path(q8, k8, num_seqs: int, max_seqlen_q: int, window, implementation) -> Path:
    """Which path serves a validated FP8 varlen call (`window`: the kernel's mask, bounds that exclude no key
    as -1); raises if the kernel is demanded but cannot serve. One gate, FP8_VARLEN_KERNEL_VERIFIED, covers
    the plain and the sliding-window instantiation."""
    if implementation == "xla":
        return Path.REFERENCE
    problem = fp8_varlen_kernel_config_problem(q8, k8, num_seqs, max_seqlen_q)
    sliding = window not in (_validation.NO_WINDOW, _validation.CAUSAL_WINDOW)
    if problem is None and sliding and q8.shape[0] + k8.shape[0] > WINDOW_KERNEL_MAX_TOKENS:
        problem = (
            "the FP8 kernel's sliding windows take total_q + total_k <= 2^30, "
            f"got {q8.shape[0] + k8.shape[0]}"
        )
    if implementation == "kernel":
        if not fp8_varlen_kernel_enabled():
            raise ValueError(
                "implementation='kernel' cannot serve FP8 inputs in flash_attention_varlen: the FP8 "
                "varlen kernel is switched off (jzyfa.api.FP8_VARLEN_KERNEL_VERIFIED is False); "
                f"set {UNVERIFIED_FP8_VARLEN_KERNEL_ENV}=1 to run it anyway, or use implementation=None or "
                "'xla' for the pure-JAX path"
            )
        return _required_kernel_path(problem, "FP8 varlen call")
    if problem or not FP8_VARLEN_KERNEL_VERIFIED or not _platform.kernel_available():
        return Path.REFERENCE
    return Path.PRIMITIVE


# The backward recomputes through the reference until a backward kernel exists.
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def _differentiable_varlen_kernel(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale,
    causal,
    kernel_required,
    window=_validation.NO_WINDOW,
):
    return flash_attention_varlen_fwd(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        softmax_scale=softmax_scale,
        causal=causal,
        kernel_required=kernel_required,
        window=window,
    )


def _differentiable_varlen_kernel_fwd(
    q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, required, window=_validation.NO_WINDOW
):
    out = _differentiable_varlen_kernel(
        q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, required, window
    )
    return out, (q, k, v, cu_q, cu_k)


def _differentiable_varlen_kernel_bwd(
    max_q, max_k, softmax_scale, causal, required, window, residuals, cotangents
):
    q, k, v, cu_q, cu_k = residuals
    window = _validation.mask_window(causal, window)

    def reference(q, k, v):
        return varlen_attention_reference(
            q, k, v, cu_q, cu_k, max_q, max_k, window=window, softmax_scale=softmax_scale
        )

    _, vjp = jax.vjp(reference, q, k, v)
    # Integer offsets take float0 cotangents.
    zero = [np.zeros(x.shape, jax.dtypes.float0) for x in (cu_q, cu_k)]
    return (*vjp(cotangents), *zero)


_differentiable_varlen_kernel.defvjp(_differentiable_varlen_kernel_fwd, _differentiable_varlen_kernel_bwd)


# The backward recomputes through the reference until a backward kernel exists.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _differentiable_kernel(
    q, k, v, softmax_scale: float, causal: bool, kernel_required: bool, window=_validation.NO_WINDOW
):
    return flash_attention_fwd(
        q, k, v, softmax_scale=softmax_scale, causal=causal, kernel_required=kernel_required, window=window
    )


def _differentiable_kernel_fwd(q, k, v, softmax_scale, causal, kernel_required, window=_validation.NO_WINDOW):
    return _differentiable_kernel(q, k, v, softmax_scale, causal, kernel_required, window), (q, k, v)


def _differentiable_kernel_bwd(softmax_scale, causal, kernel_required, window, residuals, cotangents):
    reference = functools.partial(
        attention_reference, causal=causal, softmax_scale=softmax_scale, window=window
    )
    _, vjp = jax.vjp(reference, *residuals)
    return vjp(cotangents)


_differentiable_kernel.defvjp(_differentiable_kernel_fwd, _differentiable_kernel_bwd)


def _fp8_reference(q, k, v, descales, *, causal: bool, softmax_scale: float, window):
    """FP8 through the pure-JAX path: dequantize to float32, exact attention, bf16 output."""
    dequantized = [dequantize(x, d) for x, d in zip((q, k, v), descales)]
    out, lse = attention_reference(*dequantized, causal=causal, softmax_scale=softmax_scale, window=window)
    return out.astype(jnp.bfloat16), lse


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
      implementation: None uses the kernel where it can (Hopper GPU, bf16/f16, head_dim 64 or 128
        for q, k and v alike, any mask: none, causal or a sliding window) and the pure-JAX path
        elsewhere; "kernel" raises a ValueError naming what the kernel cannot serve; "xla" always uses
        the pure-JAX path. Sliding windows other than causal or none run on the kernel's windowed
        instantiation, verified on an H200 on 2026-11-30 (tests/test_window_kernel_gpu.py, 127
        passed); `jzyfa.api.WINDOW_KERNEL_VERIFIED = False` is its kill switch: None then runs them on
        the pure-JAX path and "kernel" needs JZYFA_UNVERIFIED_WINDOW_KERNEL=1. MLA's head dims (192
        for q/k, 128 for v; bf16/f16, causal or no mask, no sliding window) run on the kernel's MLA
        instantiation, verified on an H200 on 2026-11-30 (`jzyfa.api.MLA_KERNEL_VERIFIED = False` is its
        kill switch). FP8 sliding windows likewise (`FP8_WINDOW_KERNEL_VERIFIED`). FP8 (e4m3) inputs
        run on the FP8 kernel at head dim 128 and, causal or no mask, MLA's head dims; its MLA
        instantiation was verified on an H200 on 2026-12-01 (`jzyfa.api.FP8_MLA_KERNEL_VERIFIED = False`
        is its kill switch: None then runs FP8 MLA calls on the pure-JAX path and "kernel" needs
        JZYFA_UNVERIFIED_FP8_MLA_KERNEL=1; FP8 MLA with a sliding window always runs on the pure-JAX
        path, and "kernel" refuses it). Head dim 256
        (bf16/f16, causal or no mask) runs on the kernel's hd256 instantiation, verified on an H200 on
        2026-12-01 (`jzyfa.api.HD256_KERNEL_VERIFIED = False` is its kill switch; "kernel" then needs
        JZYFA_UNVERIFIED_HD256_KERNEL=1). Sliding windows (other than causal or none) at head dim 256
        and MLA's head dims run on their windowed instantiations, verified on an H200 on 2026-12-01
        (`jzyfa.api.WIDE_WINDOW_KERNEL_VERIFIED = False` is their kill switch).
      descale_q, descale_k, descale_v: float32 descales, required for FP8 inputs and refused for
        others: shape () or (1,), or [batch, heads_kv] (one per batch and KV head; for q, one per
        group of query heads sharing a KV head). The values used are x_fp8 * descale.
      lean_p: FP8 kernel only: each probability's e4m3 code from one FFMA (True, the default) or
        exp2 rounded to e4m3 (False). See docs/fp8.md.

    Returns:
      out [batch, seq_q, heads_q, head_dim_v] in q's dtype (bf16 for FP8 inputs), or (out, lse).
    """
    _validation.check_qkv(q, k, v)
    _validation.check_causal(causal)
    window = _validation.check_window(window)
    _validation.check_implementation(implementation)
    softmax_scale = _validation.resolve_softmax_scale(softmax_scale, q.shape[-1])
    descales = _validation.check_descales(q, k, (descale_q, descale_k, descale_v))

    if descales is not None:
        path = choose_fp8_path(q, k, v, causal, window, implementation)
        if path is Path.REFERENCE:
            out, lse = _fp8_reference(
                q, k, v, descales, causal=causal, softmax_scale=softmax_scale, window=window
            )
        else:
            kernel_causal, kernel_window = kernel_mask(causal, window, q.shape[1], k.shape[1])
            out, lse = flash_attention_fp8_kernel(
                q,
                k,
                v,
                descales,
                softmax_scale=softmax_scale,
                causal=kernel_causal,
                window=kernel_window,
                lean_p=lean_p,
                kernel_required=path is Path.KERNEL_REQUIRED,
            )
    else:
        path = choose_path(q, k, v, softmax_scale, causal, window, implementation)
        if path is Path.REFERENCE:
            out, lse = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window)
        else:
            kernel_causal, kernel_window = kernel_mask(causal, window, q.shape[1], k.shape[1])
            out, lse = _differentiable_kernel(
                q, k, v, softmax_scale, kernel_causal, path is Path.KERNEL_REQUIRED, kernel_window
            )
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
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention over a packed batch of sequences of different lengths (flash-attention's varlen).

    Args:
      q: [total_q, heads_q, head_dim], the batch's query tokens back to back; bf16, f16, float32 or
        float8_e4m3fn (FP8: head_dim 128 only, with descales).
      k: [total_k, heads_kv, head_dim]; v: [total_k, heads_kv, head_dim_v]; q's dtype, GQA/MQA and
        MLA head dims as in `flash_attention`.
      cu_seqlens_q, cu_seqlens_k: int32 [num_seqs + 1] cumulative offsets: sequence s holds query
        tokens cu_seqlens_q[s]:cu_seqlens_q[s + 1] and key tokens cu_seqlens_k[s]:cu_seqlens_k[s + 1].
        Device arrays, never read by the host (they may be traced); sequences may be empty.
      max_seqlen_q, max_seqlen_k: static ints >= 1, at least the longest query / key sequence.
      causal, window, softmax_scale: as in `flash_attention`, per sequence: query t of a sequence
        with lengths (len_q, len_k) sits at position t + len_k - len_q (bottom-right alignment).
      return_lse: also return the log-sum-exp, float32 [heads_q, total_q] (flash-attention's varlen
        layout: heads first, then packed tokens).
      implementation: as in `flash_attention`: None uses the 16-bit kernel's varlen instantiation
        where it can (Hopper GPU, bf16/f16, head dims 64, 128, 256 or MLA's 192/128, any mask; e4m3 at
        128) and the pure-JAX path (`jzyfa.varlen`) elsewhere; "kernel" raises a ValueError naming
        what the kernel cannot serve; "xla" always uses the pure-JAX path. Head dim 256 and MLA's
        varlen instantiations were verified on an H200 on 2026-12-01
        (`jzyfa.api.WIDE_VARLEN_KERNEL_VERIFIED = False` is their kill switch; "kernel" then needs
        JZYFA_UNVERIFIED_WIDE_VARLEN_KERNEL=1).
        The varlen kernel was verified on an H200 on 2026-11-30 (tests/test_varlen_kernel_gpu.py, 64
        passed; its sliding windows in tests/test_window_kernel_gpu.py, 127 passed).
        `jzyfa.api.VARLEN_KERNEL_VERIFIED = False` is its kill switch: None then runs the pure-JAX
        path and "kernel" raises unless JZYFA_UNVERIFIED_VARLEN_KERNEL=1 (with
        `WINDOW_KERNEL_VERIFIED = False`, sliding windows other than causal likewise need
        JZYFA_UNVERIFIED_WINDOW_KERNEL=1).
        FP8 inputs run on the FP8 kernel's varlen instantiation (any mask, lean P), verified on an
        H200 on 2026-12-01; `jzyfa.api.FP8_VARLEN_KERNEL_VERIFIED = False` is its kill switch (None
        then runs the pure-JAX path: dequantize, exact attention, bf16 output; "kernel" needs
        JZYFA_UNVERIFIED_FP8_VARLEN_KERNEL=1).
      descale_q, descale_k, descale_v: float32 descales, required for FP8 inputs and refused for
        others: shape () or (1,), or [num_seqs, heads_kv] (one per sequence and KV head; for q, one
        per group of query heads sharing a KV head). The values used are x_fp8 * descale.

    Returns:
      out [total_q, heads_q, head_dim_v] in q's dtype (bf16 for FP8 inputs), or (out, lse). Queries
      that see no key (a sequence with no keys, an empty window) and tokens past cu_seqlens_q[-1] give
      out = 0 and lse = -inf.
    """
    _validation.check_packed_qkv(q, k, v)
    _validation.check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
    max_seqlen_q = _validation.check_max_seqlen("max_seqlen_q", max_seqlen_q, cu_seqlens_q)
    max_seqlen_k = _validation.check_max_seqlen("max_seqlen_k", max_seqlen_k, cu_seqlens_k)
    _validation.check_causal(causal)
    window = _validation.check_window(window)
    _validation.check_implementation(implementation)
    softmax_scale = _validation.resolve_softmax_scale(softmax_scale, q.shape[-1])
    num_seqs = cu_seqlens_q.shape[0] - 1
    descales = _validation.check_descales(
        q,
        k,
        (descale_q, descale_k, descale_v),
        per_head_shape=(num_seqs, k.shape[1]),
        per_head_axes="num_seqs",
    )
    effective_window = _validation.mask_window(causal, window)
    # The kernel's mask: bounds that exclude no key of sequences up to the maxima as -1, so that windows
    # that come down to causal or none run the plain kernel.
    kernel_window = _validation.canonical_window(effective_window, max_seqlen_q, max_seqlen_k)
    kernel_causal = kernel_window == _validation.CAUSAL_WINDOW
    # The plain kernel (causal or not) takes NO_WINDOW; other windows run the windowed instantiation.
    plain = kernel_window in (_validation.NO_WINDOW, _validation.CAUSAL_WINDOW)
    kernel_only_window = _validation.NO_WINDOW if plain else kernel_window
    cu_q, cu_k = jnp.asarray(cu_seqlens_q, jnp.int32), jnp.asarray(cu_seqlens_k, jnp.int32)
    if descales is not None:
        path = choose_fp8_varlen_path(q, k, num_seqs, max_seqlen_q, kernel_window, implementation)
        if path is Path.REFERENCE:
            out, lse = fp8_varlen_attention_reference(
                q,
                k,
                v,
                cu_q,
                cu_k,
                descales,
                max_seqlen_q,
                max_seqlen_k,
                window=effective_window,
                softmax_scale=softmax_scale,
            )
        else:
            out, lse = flash_attention_fp8_varlen_fwd(
                q,
                k,
                v,
                cu_q,
                cu_k,
                descales,
                max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k,
                softmax_scale=softmax_scale,
                causal=kernel_causal,
                kernel_required=path is Path.KERNEL_REQUIRED,
                window=kernel_only_window,
            )
        return (out, lse) if return_lse else out
    path = choose_varlen_path(q, k, v, num_seqs, max_seqlen_q, softmax_scale, kernel_window, implementation)
    if path is Path.REFERENCE:
        out, lse = varlen_attention_reference(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_seqlen_q,
            max_seqlen_k,
            window=effective_window,
            softmax_scale=softmax_scale,
        )
    else:
        out, lse = _differentiable_varlen_kernel(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
            kernel_causal,
            path is Path.KERNEL_REQUIRED,
            kernel_only_window,
        )
    return (out, lse) if return_lse else out
