"""Argument checks for `flash_attention`: every bad input fails at trace time, naming the argument."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jzyfa.plan import surely
from jzyfa.quantize import FP8_DTYPE

SIXTEEN_BIT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# float32 has no kernel but runs on the pure-JAX path, which is convenient for tests and tools.
NON_FP8_DTYPES = SIXTEEN_BIT_DTYPES + (jnp.dtype(jnp.float32),)
FP8_DTYPES = (jnp.dtype(FP8_DTYPE),)
IMPLEMENTATIONS = (None, "kernel", "xla")
DESCALE_NAMES = ("descale_q", "descale_k", "descale_v")
FP8_VARLEN_HEAD_DIMS = (64, 128, 256)


def _dtype_names(dtypes: Sequence[np.dtype]) -> str:
    return ", ".join(d.name for d in dtypes)


def check_qkv(q, k, v) -> None:
    """Checks ranks, dtypes and that q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv] agree.

    v's head dim may differ from q's and k's (MLA: 192 for q/k, 128 for v); the output takes v's.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 [batch, seq, heads, head_dim], got shape {x.shape}")
    check_qkv_heads(q, k, v, axes="[batch, seq_k, kv_heads]")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")


def check_qkv_heads(q, k, v, *, axes: str) -> None:
    """The checks dense and packed (varlen) layouts share: dtypes, head dims, heads, k/v agreement.

    `axes` names k's and v's leading axes, which must be equal, for the error message.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.dtype(x.dtype) not in NON_FP8_DTYPES + FP8_DTYPES:
            raise TypeError(
                f"{name} has dtype {x.dtype}; expected one of {_dtype_names(NON_FP8_DTYPES + FP8_DTYPES)}"
            )
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"k and v must have the same {axes} (their head dims may differ), got {k.shape} and {v.shape}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[-1]} and {k.shape[-1]}")
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(
            f"q's heads ({heads_q}) must be a multiple of k's and v's heads ({heads_kv}) for GQA/MQA"
        )


def check_packed_qkv(q, k, v) -> None:
    """Packed (varlen) layout: q [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv]; FP8 inputs
    need one head_dim of 64, 128 or 256 for q, k and v (the FP8 varlen kernels')."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if x.ndim != 3:
            raise ValueError(
                f"{name} must have rank 3 [total_tokens, heads, head_dim] (packed sequences), got shape {x.shape}"
            )
    check_qkv_heads(q, k, v, axes="[total_k, kv_heads]")
    if is_fp8(q.dtype) and (q.shape[-1] != v.shape[-1] or q.shape[-1] not in FP8_VARLEN_HEAD_DIMS):
        raise ValueError(
            "flash_attention_varlen takes FP8 inputs with one head_dim of 64, 128 or 256 for q, k and v, "
            f"got {q.shape[-1]} (q, k) and {v.shape[-1]} (v)"
        )


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int) -> None:
    """int32 [num_seqs + 1] offsets, the same number of sequences for q and k.

    Device arrays are never read (that would wait for the device); NumPy arrays are checked for
    values too: non-negative, non-decreasing, within the packed tokens.
    """
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, total_q), ("cu_seqlens_k", cu_seqlens_k, total_k)):
        if not hasattr(cu, "shape") or not hasattr(cu, "dtype"):
            raise TypeError(f"{name} must be an int32 array, got {type(cu).__name__}")
        if jnp.dtype(cu.dtype) != jnp.int32:
            raise TypeError(f"{name} must be int32, got {cu.dtype}")
        if cu.ndim != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name} must have shape [num_seqs + 1] with num_seqs >= 1, got {cu.shape}")
        # Host values can be checked for free; device arrays are not read.
        if isinstance(cu, np.ndarray) and (cu[0] < 0 or np.any(np.diff(cu) < 0) or cu[-1] > total):
            raise ValueError(
                f"{name} must be non-negative, never decrease and end at most at the {total} packed "
                f"tokens, got {cu.tolist()}"
            )
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            "cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got shapes "
            f"{cu_seqlens_q.shape} and {cu_seqlens_k.shape}"
        )


def check_max_seqlen(name: str, max_seqlen, cu_seqlens) -> int:
    """A static positive int, at least every length when the offsets are concrete (NumPy, or a
    jax.Array that is not a tracer). Traced offsets (inside jit) cannot be read at trace time: for
    them `jzyfa.api.flash_attention_varlen` checks on the device (`jzyfa.varlen.lengths_fit`)."""
    if isinstance(max_seqlen, (bool, np.bool_)) or not isinstance(max_seqlen, (int, np.integer)):
        raise TypeError(f"{name} must be a static Python int, got {type(max_seqlen).__name__}")
    if max_seqlen < 1:
        raise ValueError(f"{name} must be >= 1, got {max_seqlen}")
    offsets = _concrete(cu_seqlens)
    if offsets is not None and offsets.size > 1 and np.diff(offsets).max() > max_seqlen:
        cu_name = "cu_seqlens_" + name[-1]
        raise ValueError(
            f"{name} ({max_seqlen}) is shorter than the longest sequence in {cu_name} "
            f"({int(np.diff(offsets).max())}); pass {name}={int(np.diff(offsets).max())} or more"
        )
    return int(max_seqlen)


def is_concrete(x) -> bool:
    """Whether x's values can be read at trace time: NumPy, or a fully addressable jax.Array outside a
    trace (not a tracer; no other host holds part of it)."""
    if isinstance(x, jax.core.Tracer):
        return False
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return False
    return isinstance(x, (np.ndarray, jax.Array))


def _concrete(x) -> np.ndarray | None:
    """x's values when concrete (`is_concrete`; a jax.Array is read back from the device: one wait, in
    eager calls only). None for tracers."""
    return np.asarray(x) if is_concrete(x) else None


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in FP8_DTYPES


def check_implementation(implementation) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")


def check_sinks(sinks, heads_q: int) -> None:
    """None, or a floating [heads_q] array of sink logits (one per query head)."""
    if sinks is None:
        return
    if not hasattr(sinks, "shape") or not hasattr(sinks, "dtype"):
        raise TypeError(f"sinks must be None or an array of shape [heads_q], got {type(sinks).__name__}")
    if tuple(sinks.shape) != (heads_q,):
        raise ValueError(
            f"sinks must have shape [heads_q] = ({heads_q},), one logit per query head, got {tuple(sinks.shape)}"
        )
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(f"sinks must be a floating array, got {jnp.dtype(sinks.dtype).name}")


def check_softcap(softcap) -> float | None:
    """None, or a static finite float > 0."""
    if softcap is None:
        return None
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(
        softcap, (int, float, np.integer, np.floating)
    ):
        raise TypeError(f"softcap must be None or a static positive float, got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(
            f"softcap must be a finite float > 0 (scores are capped to c * tanh(s / c)), got {softcap}"
        )
    return float(softcap)


def check_seqlens(seqlens_q, seqlens_k, q_batch_seq: tuple[int, int], seq_k: int) -> tuple:
    """() when neither is given, else (seqlens_q, seqlens_k) as int32 [batch] arrays, a missing one
    filled with the full length."""
    if seqlens_q is None and seqlens_k is None:
        return ()
    batch, seq_q = q_batch_seq
    lengths = []
    for name, value, full in (("seqlens_q", seqlens_q, seq_q), ("seqlens_k", seqlens_k, seq_k)):
        if value is None:
            lengths.append(jnp.full((batch,), full, jnp.int32))
            continue
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            raise TypeError(
                f"{name} must be None or an int array of shape [batch], got {type(value).__name__}"
            )
        if tuple(value.shape) != (batch,):
            raise ValueError(
                f"{name} must have shape [batch] = ({batch},), one length per sequence, got {tuple(value.shape)}"
            )
        if not jnp.issubdtype(value.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got {jnp.dtype(value.dtype).name}")
        lengths.append(jnp.asarray(value, jnp.int32))
    return tuple(lengths)


PRECISIONS = (None, "fp8", "int8")


def check_precision(precision, rotate, dtype, descales_given: bool) -> None:
    """`precision` (None: the inputs' own; "fp8": quantize 16-bit inputs to e4m3 inside the call; "int8":
    INT8 q and k, e4m3 v) and `rotate` (a Hadamard rotation of q and k before that quantization)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if not isinstance(rotate, (bool, np.bool_)):
        raise TypeError(f"rotate must be a bool, got {type(rotate).__name__}")
    if precision is None:
        if rotate:
            raise ValueError(
                "rotate=True rotates q and k before quantizing them: it needs precision='fp8' or 'int8'"
            )
        return
    if is_fp8(dtype) or descales_given:
        raise ValueError(
            f"precision={precision!r} quantizes bf16/f16/float32 q, k, v inside the call; got "
            f"{jnp.dtype(dtype).name} inputs{' with descales' if descales_given else ''}. Pass the unquantized "
            "inputs without descales, or pre-quantized float8_e4m3fn inputs with descales and precision=None"
        )


def resolve_softmax_scale(softmax_scale, head_dim: int) -> float:
    """The static scale the kernel is compiled with: 1/sqrt(head_dim) by default."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, jax.core.Tracer) or not np.isscalar(softmax_scale):
        raise TypeError(
            "softmax_scale must be a static Python or NumPy real number (or None), "
            f"got {type(softmax_scale).__name__}"
        )
    scale = float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    return scale


def check_causal(causal) -> None:
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")


# A window (left, right): query i, at bottom-right aligned position p = i + seq_k - seq_q, sees key j
# iff p - left <= j <= p + right; -1 leaves that side unbounded.
Window = tuple[int, int]
NO_WINDOW: Window = (-1, -1)
CAUSAL_WINDOW: Window = (-1, 0)


def check_window(window) -> Window | None:
    """None, or (left, right) as two Python ints, each >= 0 or -1 (unbounded)."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be None or a pair (left, right) of ints, got {window!r}")
    for side, bound in zip(("left", "right"), window):
        if isinstance(bound, (bool, np.bool_)) or not isinstance(bound, (int, np.integer)):
            raise TypeError(f"window's {side} bound must be a static int, got {type(bound).__name__}")
        if bound < -1:
            raise ValueError(f"window's {side} bound must be >= 0, or -1 for unbounded; got {bound}")
    return int(window[0]), int(window[1])


def mask_window(causal: bool, window: Window | None) -> Window:
    """The (left, right) window a call attends with; causal and window combined as flash-attention does.

    causal=True is the window (-1, 0); with a window as well, causal sets its right bound to 0 (so
    `causal=True, window=(w - 1, w - 1)`, as Hugging Face passes for sliding-window models, means the
    last w keys up to the diagonal).
    """
    left, right = NO_WINDOW if window is None else window
    return (left, 0) if causal else (left, right)


def canonical_window(window: Window, seq_q: int, seq_k: int) -> Window:
    """The same mask with bounds that exclude no key for these lengths replaced by -1.

    Positions run from seq_k - seq_q (row 0) to seq_k - 1 (last row), so a left bound >= seq_k - 1
    and a right bound >= seq_q - 1 never exclude a key; e.g. (8192, 0) on 4K tokens is causal. A
    comparison symbolic lengths (jax.export) leave undecidable keeps the bound: the same mask.
    """
    left, right = window
    if surely(lambda: left >= seq_k - 1):
        left = -1
    if surely(lambda: right >= seq_q - 1):
        right = -1
    return left, right


def check_descales(
    q, k, descales: Sequence, *, per_head_shape: tuple[int, int] | None = None, per_head_axes: str = "batch"
) -> tuple[jax.Array, ...] | None:
    """For FP8 inputs, returns the three float32 descales; for other inputs, insists there are none.

    Each descale is a scalar (shape () or (1,)) or one value per (batch, kv_head), shape [B, Hkv]; packed
    (varlen) calls give per_head_shape (num_seqs, Hkv) and per_head_axes "num_seqs".
    """
    given = [name for name, d in zip(DESCALE_NAMES, descales) if d is not None]
    if not is_fp8(q.dtype):
        if given:
            raise ValueError(
                f"{', '.join(given)} given for {q.dtype} inputs; descales apply only to FP8 inputs"
            )
        return None
    missing = [name for name, d in zip(DESCALE_NAMES, descales) if d is None]
    if missing:
        raise ValueError(f"FP8 inputs need descale_q, descale_k and descale_v; missing {', '.join(missing)}")
    if per_head_shape is None:
        per_head_shape = (q.shape[0], k.shape[2])
    checked = []
    for name, d in zip(DESCALE_NAMES, descales):
        d = jnp.asarray(d, jnp.float32) if isinstance(d, (int, float)) else d
        if jnp.dtype(d.dtype) != jnp.float32:
            raise TypeError(f"{name} must be float32, got {d.dtype}")
        if d.shape not in ((), (1,), per_head_shape):
            hint = ""
            if name == "descale_q" and len(d.shape) == 2 and d.shape[1] == q.shape[-2] != per_head_shape[1]:
                hint = (
                    f"; a per-query-head descale [.., heads_q={q.shape[-2]}] is not accepted: quantize q with "
                    f'fp8_quantize(q, "head", kv_heads={per_head_shape[1]}) for one descale per KV group'
                )
            raise ValueError(
                f"{name} must have shape (), (1,) or [{per_head_axes}, kv_heads] = {list(per_head_shape)}, "
                f"got {tuple(d.shape)}{hint}"
            )
        checked.append(d)
    return tuple(checked)
