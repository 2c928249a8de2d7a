"""The attention implementations that `jzyfa.bench` and `jzyfa.accuracy` put side by side.

Each peer is a small adapter:
- `supports(problem)`: None, or why it cannot serve this problem here (reported as "unsupported");
- `build(problem, options)`: the function to time, the same for every input set (raises
  `Unsupported` for what only shows when tracing, such as a missing kernel);
- `arguments(problem, inputs)`: its arguments for one input set, converted outside the timed call
  (layout changes, FP8 quantization, DLPack hand-off to PyTorch);
- `decode(raw, args)`: the output as float32 O [B, Sq, Hq, D] (JAX or NumPy; packed [total_q, Hq, D]
  for --varlen problems) for the error check, outside the timed call;
- `notes`: what it computes in, when that differs from the run's dtype.

Variable-length (packed) problems (`Problem.packed`, --varlen): jzyfa's peers call
`jzyfa.flash_attention_varlen` with (q, k, v, cu_seqlens_q, cu_seqlens_k), its FP8 peers also with the
descales (lean P only: jzyfa_fp8_exact_p says why not); every other peer says why not ("no varlen: ...").

JAX peers are jitted and timed with CUPTI; PyTorch peers (`framework == "torch"`) get DLPack views
of the same device buffers and are timed with CUDA events.

FP8 inputs: the 16-bit inputs quantized with `jzyfa.fp8_quantize` (one power-of-two descale per
tensor, unless a peer says otherwise); errors are always measured against float64 attention on the
unquantized inputs.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jzyfa import _validation, api, primitive

PRECISIONS = ("16-bit", "fp8")
# jax.nn's XLA attention materialises the [B, Hq, Sq, Sk] scores; beyond this it is not attempted.
XLA_SCORE_BYTES_LIMIT = 40 * 2**30


class Unsupported(Exception):
    """The implementation does not serve this problem (reported, not an error)."""


# ----------------------------------------------------------------------------------------------
# The problem, and its FLOPs


def visible_pairs(seq_q: int, seq_k: int, causal: bool, window: _validation.Window | None = None) -> int:
    """(query, key) pairs the mask leaves visible; causal and windows are bottom-right aligned.

    The mask is jzyfa's (`jzyfa.flash_attention`): query i, at position p = i + seq_k - seq_q, sees
    key j iff p - left <= j <= p + right (-1: that side unbounded), with causal=True the window
    (-1, 0) or, with a window, its right bound set to 0. One clamped range per row: O(Sq).
    """
    if window is None and not causal:
        return seq_q * seq_k
    left, right = _validation.mask_window(causal, window)
    pos = np.arange(seq_q, dtype=np.int64) + (seq_k - seq_q)
    first = np.maximum(pos - left, 0) if left >= 0 else np.zeros_like(pos)
    last = np.minimum(pos + right, seq_k - 1) if right >= 0 else np.full_like(pos, seq_k - 1)
    return int(np.maximum(last - first + 1, 0).sum())


def attention_flops(
    batch: int,
    seq_q: int,
    seq_k: int,
    heads_q: int,
    head_dim: int,
    causal: bool,
    window: _validation.Window | None = None,
) -> float:
    """Forward FLOPs of attention: two matmuls of 2 * D FLOPs per (query, key) pair.

    4 * B * Hq * Sq * Sk * D, halved for causal when Sq == Sk (the convention of FA3, cuDNN and
    Pallas, slightly under the S(S+1)/2 pairs really computed); for causal with Sq != Sk, the
    visible pairs of the bottom-right aligned mask are counted. With a window (even one equal to
    causal or no mask), 4 * B * Hq * D * the visible pairs of the mask (`visible_pairs`).
    """
    if window is not None:
        return 4.0 * batch * heads_q * head_dim * visible_pairs(seq_q, seq_k, causal, window)
    full = 4.0 * batch * heads_q * seq_q * seq_k * head_dim
    if not causal:
        return full
    if seq_q == seq_k:
        return full / 2
    return 4.0 * batch * heads_q * head_dim * visible_pairs(seq_q, seq_k, True)


def parse_window(text: str | None) -> _validation.Window | None:
    """'1024,0' -> (1024, 0): --window's (left, right), each >= 0 or -1 (unbounded); None or '' -> None."""
    if text is None or not text.strip():
        return None
    parts = [p.strip() for p in text.split(",")]
    try:
        bounds = [int(p) for p in parts]
    except ValueError:
        bounds = []
    if len(bounds) != 2 or min(bounds) < -1:
        raise ValueError(
            f"--window: {text!r} is not L,R with two integers >= -1 (the left and right bounds of the "
            "sliding window; -1: unbounded on that side), e.g. --window 1024,0"
        )
    return bounds[0], bounds[1]


def window_text(window) -> str:
    """'window (1024, 0)' for a (left, right) window, '' for none."""
    return "" if window is None else f"window ({window[0]}, {window[1]})"


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """'16x1024,1x512x4096' -> [(16, 1024, 1024), (1, 512, 4096)] as (batch, seq_q, seq_k)."""
    shapes = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        try:
            dims = [int(d) for d in item.split("x")]
        except ValueError:
            dims = []
        if len(dims) not in (2, 3) or min(dims) < 1:
            raise ValueError(f"--shapes: {item!r} is not BxS or BxSqxSk with positive integers")
        shapes.append((dims[0], dims[1], dims[-1]))
    if not shapes:
        raise ValueError("--shapes: no shape given")
    return shapes


def parse_varlen(text: str | None) -> list[tuple[int, int]] | None:
    """'8192,512:1024' -> [(8192, 8192), (512, 1024)]: --varlen's (len_q, len_k) per packed sequence.

    Each item is L (Sq = Sk = L) or Lq:Lk, integers >= 1; None -> None (no --varlen). Raises ValueError
    naming --varlen for empty items, non-integers, lengths < 1, or no item at all.
    """
    if text is None:
        return None
    example = "e.g. --varlen 8192,4096,2048,1024 or --varlen 512:1024,256"
    seqlens = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            raise ValueError(
                f"--varlen: empty item in {text!r}; give comma-separated sequence lengths, {example}"
            )
        try:
            dims = [int(d) for d in item.split(":")]
        except ValueError:
            dims = []
        if len(dims) not in (1, 2) or min(dims) < 1:
            raise ValueError(
                f"--varlen: {item!r} in {text!r} is not a sequence length L or Lq:Lk with integers >= 1, {example}"
            )
        seqlens.append((dims[0], dims[-1]))
    return seqlens


def varlen_label(seqlens) -> str:
    """'varlen 8 seqs, 16320 tokens' (or '..., 300/600 tokens' when query and key totals differ)."""
    total_q = sum(int(q) for q, _ in seqlens)
    total_k = sum(int(k) for _, k in seqlens)
    tokens = f"{total_q}" if total_q == total_k else f"{total_q}/{total_k}"
    return f"varlen {len(seqlens)} seq{'' if len(seqlens) == 1 else 's'}, {tokens} tokens"


@dataclasses.dataclass(frozen=True)
class Problem:
    batch: int
    seq_q: int
    seq_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool
    dtype: str  # the run's precision: "bf16" | "f16" | "fp8" (FP8 runs quantize bf16 inputs)
    # --window: a (left, right) sliding window, combined with causal as jzyfa.flash_attention does
    # (causal sets the right bound to 0); None: none (the mask is causal's or no mask).
    window: _validation.Window | None = None
    # --varlen: one packed batch, (len_q, len_k) per sequence (`Problem.packed`): q [total_q, Hq, D],
    # k and v [total_k, Hkv, D] with cu_seqlens; batch is the number of sequences, seq_q and seq_k the
    # longest ones (max_seqlen_q/k). None: a dense [B, S, H, D] problem.
    seqlens: tuple[tuple[int, int], ...] | None = None
    # --v_head_dim: v's (and the output's) head dim where it differs from q's and k's (MLA: 128 with
    # head_dim 192); None: head_dim.
    head_dim_v: int | None = None

    @classmethod
    def packed(
        cls, seqlens, heads_q, heads_kv, head_dim, causal, dtype, window=None, head_dim_v=None
    ) -> Problem:
        seqlens = tuple((int(q), int(k)) for q, k in seqlens)
        return cls(
            len(seqlens),
            max(q for q, _ in seqlens),
            max(k for _, k in seqlens),
            heads_q,
            heads_kv,
            head_dim,
            causal,
            dtype,
            window,
            seqlens,
            head_dim_v,
        )

    @property
    def v_head_dim(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def flops_head_dim(self) -> float:
        """The head dim of the FLOP count: a visible pair costs 2 D (Q K^T) + 2 Dv (P V) FLOPs, the
        4 D of attention_flops with D the mean of the two."""
        return (self.head_dim + self.v_head_dim) / 2

    @property
    def varlen(self) -> bool:
        return self.seqlens is not None

    @property
    def total_q(self) -> int:
        return sum(q for q, _ in self.seqlens) if self.varlen else self.batch * self.seq_q

    @property
    def total_k(self) -> int:
        return sum(k for _, k in self.seqlens) if self.varlen else self.batch * self.seq_k

    @property
    def cu_seqlens_q(self) -> np.ndarray:
        """int32 [num_seqs + 1] offsets of the packed query tokens (varlen problems)."""
        return np.concatenate([[0], np.cumsum([q for q, _ in self.seqlens])]).astype(np.int32)

    @property
    def cu_seqlens_k(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum([k for _, k in self.seqlens])]).astype(np.int32)

    @property
    def mask(self) -> _validation.Window:
        """The (left, right) window the mask is, causal folded in: (-1, 0) causal, (-1, -1) none."""
        return _validation.mask_window(self.causal, self.window)

    @property
    def sliding_window(self) -> _validation.Window | None:
        """The mask when it is a sliding window for these lengths (neither causal nor no mask, bounds
        that exclude no key as -1), else None; e.g. (8192, 0) over 4K keys is causal."""
        if self.window is None:
            return None
        window = _validation.canonical_window(self.mask, self.seq_q, self.seq_k)
        return None if window in (_validation.NO_WINDOW, _validation.CAUSAL_WINDOW) else window

    @property
    def mask_causal(self) -> bool:
        """The causal flag of a call without a window that masks as this problem does (when
        sliding_window is None): --causal, or with a window whether it is causal for these lengths."""
        if self.window is None:
            return self.causal
        return _validation.canonical_window(self.mask, self.seq_q, self.seq_k) == _validation.CAUSAL_WINDOW

    @property
    def jnp_dtype(self):
        """The dtype of the 16-bit inputs (FP8 runs start from bf16)."""
        return jnp.float16 if self.dtype == "f16" else jnp.bfloat16

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def q_shape(self) -> tuple[int, ...]:
        """[B, Sq, Hq, D], or packed [total_q, Hq, D] for varlen."""
        if self.varlen:
            return (self.total_q, self.heads_q, self.head_dim)
        return (self.batch, self.seq_q, self.heads_q, self.head_dim)

    @property
    def kv_shape(self) -> tuple[int, ...]:
        """k's shape (and v's, but for its head dim: v_shape)."""
        if self.varlen:
            return (self.total_k, self.heads_kv, self.head_dim)
        return (self.batch, self.seq_k, self.heads_kv, self.head_dim)

    @property
    def v_shape(self) -> tuple[int, ...]:
        return (*self.kv_shape[:-1], self.v_head_dim)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (*self.q_shape[:-1], self.v_head_dim)

    @property
    def set_bytes(self) -> int:
        """Bytes a call reads and writes for one input set: q, k, v in the run's dtype, a 16-bit out."""
        itemsize = 1 if self.dtype == "fp8" else 2
        inputs = math.prod(self.q_shape) + math.prod(self.kv_shape) + math.prod(self.v_shape)
        return itemsize * inputs + 2 * math.prod(self.out_shape)

    @property
    def flops(self) -> float:
        """attention_flops (at flops_head_dim); for varlen the sum over sequences, each its own
        (bottom-right) problem."""
        if self.varlen:
            return sum(
                attention_flops(1, q, k, self.heads_q, self.flops_head_dim, self.causal, self.window)
                for q, k in self.seqlens
            )
        return attention_flops(
            self.batch, self.seq_q, self.seq_k, self.heads_q, self.flops_head_dim, self.causal, self.window
        )

    @property
    def label(self) -> str:
        if self.varlen:
            return varlen_label(self.seqlens)
        seq = f"{self.seq_q}" if self.seq_q == self.seq_k else f"{self.seq_q}x{self.seq_k}"
        return f"{self.batch}x{seq}"

    def abstract(self, dtype) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Shape-only q, k, v of the given dtype (for tracing without data); varlen adds the int32
        cu_seqlens_q and cu_seqlens_k."""
        qkv = (
            jax.ShapeDtypeStruct(self.q_shape, dtype),
            jax.ShapeDtypeStruct(self.kv_shape, dtype),
            jax.ShapeDtypeStruct(self.v_shape, dtype),
        )
        if not self.varlen:
            return qkv
        return qkv + (jax.ShapeDtypeStruct((self.batch + 1,), jnp.int32),) * 2


# ----------------------------------------------------------------------------------------------
# Inputs, and their FP8 forms


class Fp8Inputs(NamedTuple):
    """e4m3 q, k, v with float32 descales: the values are x8 * descale (a pytree, so jit returns it)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    descale_q: jax.Array
    descale_k: jax.Array
    descale_v: jax.Array


def quantize_qkv(q, k, v, *, granularity: str = "tensor", hadamard_seed: int | None = None) -> Fp8Inputs:
    """FP8 forms of q, k, v through `jzyfa.fp8_quantize`; q and k first Hadamard-rotated if a seed is given.

    granularity "head" gives [B, Hkv] descales (q shares one per KV group). The rotation leaves
    q k^T unchanged, so the result is compared with attention on the unrotated inputs.
    """
    import jzyfa

    if hadamard_seed is not None:
        q, k = jzyfa.hadamard_rotate(q, k, key=hadamard_seed)
    kv_heads = k.shape[2] if granularity == "head" else None
    q8, dq = jzyfa.fp8_quantize(q, granularity, kv_heads=kv_heads)
    k8, dk = jzyfa.fp8_quantize(k, granularity)
    v8, dv = jzyfa.fp8_quantize(v, granularity)
    return Fp8Inputs(q8, k8, v8, dq, dk, dv)


_quantize_jit = jax.jit(quantize_qkv, static_argnames=("granularity", "hadamard_seed"))


class InputSet:
    """One set of q, k, v (the run's 16-bit inputs) and, computed once on demand, its FP8 form."""

    def __init__(self, q: jax.Array, k: jax.Array, v: jax.Array):
        self.q, self.k, self.v = q, k, v
        self._fp8: Fp8Inputs | None = None

    def fp8(self) -> Fp8Inputs:
        if self._fp8 is None:
            self._fp8 = jax.block_until_ready(_quantize_jit(self.q, self.k, self.v))
        return self._fp8


@dataclasses.dataclass(frozen=True)
class Options:
    # On a GPU where jzyfa's kernel cannot serve, time jzyfa's pure-JAX path instead, under a name
    # that says so ("jzyfa[xla-fallback]"); without it the kernel's absence is reported.
    allow_xla_fallback: bool = False


@dataclasses.dataclass(frozen=True)
class Built:
    fn: Callable  # fn(*args) -> raw output
    path: str | None = None  # what runs, where the peer has a choice: "kernel", "pure-JAX", "xla-fallback"


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _gpu_reason() -> str | None:
    return None if _on_gpu() else f"needs a CUDA GPU (the JAX backend is {jax.default_backend()!r})"


def _rectangular_causal_reason(problem: Problem, who: str) -> str | None:
    if problem.mask_causal and problem.seq_q != problem.seq_k:
        return (
            f"{who} aligns the causal mask top-left; jzyfa's is bottom-right, so Sq != Sk is not comparable"
        )
    return None


def _no_window_reason(problem: Problem, who: str) -> str | None:
    """Why a peer without sliding windows cannot run this problem's mask, or None (no window, or one
    that is causal or no mask for these lengths: it then runs with problem.mask_causal)."""
    if (window := problem.sliding_window) is not None:
        return f"no sliding window: {who} has none, and this run's mask is the window {window} (left, right)"
    return None


def _no_varlen_reason(problem: Problem, why: str) -> str | None:
    """'no varlen: ...' for a --varlen problem that this peer cannot take, else None."""
    return f"no varlen: {why}" if problem.varlen else None


def _one_head_dim_reason(problem: Problem, why: str) -> str | None:
    """Why a peer with one head dim for q, k and v cannot run a --v_head_dim problem (MLA), else None."""
    if problem.v_head_dim != problem.head_dim:
        return f"v's head dim {problem.v_head_dim} != q's and k's {problem.head_dim}: {why}"
    return None


def lse_from_btn(residual) -> jax.Array:
    """jax.nn's residual is the natural-log LSE as [B, Sq, Hq]; ours is [B, Hq, Sq]."""
    return jnp.swapaxes(residual.astype(jnp.float32), 1, 2)


class Peer:
    """Base adapter; see the module docstring."""

    name = ""
    description = ""
    precision = "16-bit"
    framework = "jax"
    notes = ""

    def supports(self, problem: Problem) -> str | None:
        return None

    def build(self, problem: Problem, options: Options) -> Built:
        raise NotImplementedError

    def arguments(self, problem: Problem, inputs: InputSet) -> tuple:
        if self.precision == "fp8":
            f = inputs.fp8()
            return (f.q, f.k, f.v, f.descale_q, f.descale_k, f.descale_v)
        return (inputs.q, inputs.k, inputs.v)

    def decode(self, raw, args: tuple):
        """O as float32 [B, Sq, Hq, D] from what fn returned for these arguments."""
        return raw.astype(jnp.float32)

    def compute_dtype(self, problem: Problem) -> str:
        if self.precision == "fp8":
            return "fp8"
        return "f16" if problem.dtype == "f16" else "bf16"


# ---- jzyfa


# jzyfa.api's kill switch of the FP8 kernel: with FP8_KERNEL_VERIFIED set False, only this variable
# lets implementation="kernel" run it (and jzyfa's refusal names the variable).
UNVERIFIED_FP8_KERNEL_ENV = api.UNVERIFIED_FP8_KERNEL_ENV


class Jzyfa(Peer):
    """jzyfa.flash_attention: the kernel on a GPU (or the reason it cannot run), the default path elsewhere.

    FP8 peers pass `lean_p` (the FP8 kernel's rounding of P; the pure-JAX FP8 path ignores it);
    16-bit peers do not pass it. `fp8_only` peers are unsupported in 16-bit runs.
    """

    def __init__(
        self,
        name: str,
        precision: str,
        forced: str | None = None,
        lean_p: bool | None = None,
        fp8_only: bool = False,
    ):
        self.name = name
        self.precision = precision
        self.forced = forced  # "xla": always the pure-JAX path
        fp8 = precision == "fp8"
        if fp8 and lean_p is None:
            lean_p = True  # flash_attention's default, passed explicitly
        if not fp8 and (lean_p is not None or fp8_only):
            raise ValueError(f"{name}: lean_p and fp8_only are for FP8 peers")
        self.lean_p = lean_p
        self.fp8_only = fp8_only
        self.description = "jzyfa.flash_attention" + (
            " on fp8_quantize'd e4m3 inputs with descales (bf16 out)" if fp8 else ""
        )
        if forced:
            self.description += f' (implementation="{forced}")'
        if fp8 and forced != "xla":
            self.description += (
                ", lean_p=True: each probability's e4m3 code from one FFMA"
                if lean_p
                else ", lean_p=False: exact P, exp2 rounded to e4m3"
            )
        if fp8:
            self.notes = "e4m3 q/k/v, one power-of-two descale per tensor; bf16 output"
            if forced != "xla":
                self.notes += "; lean P" if lean_p else "; exact P (lean_p=False)"

    def supports(self, problem: Problem) -> str | None:
        if self.fp8_only and problem.dtype != "fp8":
            return (
                f"an FP8-kernel variant (lean_p={self.lean_p}) that runs only with --dtype fp8; this run is "
                f"{problem.dtype}"
            )
        if self.precision == "fp8" and problem.varlen and self.lean_p is False:
            return "no varlen: flash_attention_varlen's FP8 path is lean P only (jzyfa_fp8 times it)"
        return None

    def arguments(self, problem: Problem, inputs: InputSet) -> tuple:
        if not problem.varlen:
            return super().arguments(problem, inputs)
        cu_q, cu_k = (jnp.asarray(c, jnp.int32) for c in (problem.cu_seqlens_q, problem.cu_seqlens_k))
        if self.precision == "fp8":  # descales after the offsets, as varlen_fn takes them
            f = inputs.fp8()
            return (f.q, f.k, f.v, cu_q, cu_k, f.descale_q, f.descale_k, f.descale_v)
        return (inputs.q, inputs.k, inputs.v, cu_q, cu_k)

    def _call(self, problem: Problem, implementation: str | None) -> Callable:
        import jzyfa

        kwargs = {
            "causal": problem.causal,
            "softmax_scale": problem.softmax_scale,
            "implementation": implementation,
        }
        if problem.window is not None:
            kwargs["window"] = problem.window
        if problem.varlen:  # max_seqlen_q/k are the longest sequences; FP8: lean P, the only varlen path
            max_q, max_k = problem.seq_q, problem.seq_k

            def varlen_fn(q, k, v, cu_q, cu_k, *descales):
                named = dict(zip(("descale_q", "descale_k", "descale_v"), descales))
                return jzyfa.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **named, **kwargs)

            return varlen_fn
        if self.precision == "fp8":
            lean_p = self.lean_p

            def fn(q8, k8, v8, dq, dk, dv):
                return jzyfa.flash_attention(
                    q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, lean_p=lean_p, **kwargs
                )
        else:

            def fn(q, k, v):
                return jzyfa.flash_attention(q, k, v, **kwargs)

        return fn

    def _abstract_args(self, problem: Problem) -> tuple:
        if self.precision == "fp8":
            scalar = jax.ShapeDtypeStruct((), jnp.float32)
            return (*problem.abstract(jnp.float8_e4m3fn), scalar, scalar, scalar)
        return problem.abstract(problem.jnp_dtype)

    def build(self, problem: Problem, options: Options) -> Built:
        if self.forced == "xla":
            return Built(self._call(problem, "xla"), "pure-JAX")
        if not _on_gpu():  # the primitive's CPU lowering (16-bit) or the pure-JAX FP8 path
            return Built(self._call(problem, None), "pure-JAX (no GPU)")
        fp8 = self.precision == "fp8"
        kernel = self._call(problem, "kernel")
        try:  # the kernel's checks run at trace time: nothing launches here
            jax.eval_shape(kernel, *self._abstract_args(problem))
        except ValueError as e:
            if options.allow_xla_fallback and self.lean_p is not False:
                return Built(self._call(problem, "xla"), "xla-fallback")
            if fp8:
                message = str(e)
                if options.allow_xla_fallback:  # lean_p=False differs from jzyfa_fp8 in the kernel only
                    raise Unsupported(
                        f"{message}; no fallback for lean_p=False: the pure-JAX FP8 path has no lean P, so it "
                        "would time what jzyfa_fp8[xla-fallback] times"
                    ) from e
                raise Unsupported(
                    f"{message}; --allow_xla_fallback times the pure-JAX FP8 path instead"
                ) from e
            raise
        # A gate lifted by its environment variable: the FP8 kernel's, or its MLA instantiation's.
        mla = (problem.head_dim, problem.v_head_dim) == primitive.MLA_HEAD_DIMS
        if fp8 and (not api.FP8_KERNEL_VERIFIED or (mla and not api.FP8_MLA_KERNEL_VERIFIED)):
            return Built(kernel, "kernel (unverified)")
        return Built(kernel, "kernel")


# ---- jax.nn.dot_product_attention (cuDNN, XLA)


def jax_nn_mask(problem: Problem, implementation: str) -> tuple[bool, tuple[int, int] | None] | str:
    """(is_causal, local_window_size) for jax.nn.dot_product_attention that mask exactly as the problem
    does, or why it cannot.

    jax.nn's window (left, right) lets query i see keys i - left <= j <= i + right (top-left: its
    position is i), so only Sq == Sk matches jzyfa's bottom-right windows; an unbounded side (-1 in
    jzyfa, which jax.nn does not take) becomes seq_k, beyond every key. Through cuDNN, jax.nn sets
    cuDNN's sliding_window_length to left + 1 (keys pos - left .. pos) with the causal mask and takes
    no other window, so cuDNN runs only windows (left, 0), with is_causal=True.
    """
    window = problem.sliding_window
    if window is None:  # no window, or one that is causal or no mask for these lengths
        return problem.mask_causal, None
    if problem.seq_q != problem.seq_k:
        return (
            "jax.nn.dot_product_attention aligns its window top-left; jzyfa's is bottom-right, so Sq != Sk "
            "is not comparable"
        )
    left, right = window
    if implementation == "cudnn":
        if right != 0:
            return (
                f"cuDNN through jax.nn.dot_product_attention takes only sliding windows (left, 0) (its "
                f"sliding_window_length with the causal mask); this run's mask is the window {window} "
                "(left, right)"
            )
        return True, (left, 0)
    unbounded = problem.seq_k
    return False, (left if left >= 0 else unbounded, right if right >= 0 else unbounded)


class JaxNn(Peer):
    def __init__(self, name: str, implementation: str):
        self.name = name
        self.implementation = implementation
        self.description = f'jax.nn.dot_product_attention(implementation="{implementation}")'

    def supports(self, problem: Problem) -> str | None:
        if reason := _no_varlen_reason(
            problem,
            "jax.nn.dot_product_attention has no packed (cu_seqlens) API in JAX, only padded batches "
            "(query_seq_lengths / key_value_seq_lengths; a padded baseline is not run)"
            + ("; cuDNN's own varlen is not reachable through it" if self.implementation == "cudnn" else ""),
        ):
            return reason
        if reason := _one_head_dim_reason(
            problem,
            "jax.nn.dot_product_attention checks that v has k's shape"
            + (
                "; cuDNN's own unequal head dims are not reachable through it"
                if self.implementation == "cudnn"
                else ""
            ),
        ):
            return reason
        if isinstance(mask := jax_nn_mask(problem, self.implementation), str):
            return mask
        if self.implementation == "cudnn" and (reason := _gpu_reason()):
            return reason
        if self.implementation == "xla":
            score_bytes = 4 * problem.batch * problem.heads_q * problem.seq_q * problem.seq_k
            if score_bytes > XLA_SCORE_BYTES_LIMIT:
                return f"would materialise {score_bytes / 2**30:.0f} GiB of float32 scores"
        return _rectangular_causal_reason(problem, "jax.nn.dot_product_attention")

    def build(self, problem: Problem, options: Options) -> Built:
        mask = jax_nn_mask(problem, self.implementation)
        if isinstance(mask, str):
            raise Unsupported(mask)
        is_causal, local_window_size = mask
        window_kwargs = {} if local_window_size is None else {"local_window_size": local_window_size}

        def fn(q, k, v):
            out = jax.nn.dot_product_attention(
                q,
                k,
                v,
                scale=problem.softmax_scale,
                is_causal=is_causal,
                implementation=self.implementation,
                **window_kwargs,
            )
            return out

        return Built(fn)


# ---- cuDNN FP8 through JAX's private module


def cudnn_fp8_params(fp8: Fp8Inputs) -> dict[str, jax.Array]:
    """The fp8_params of JAX's cuDNN FP8 attention for per-tensor descales.

    cuDNN computes S = (q8 k8^T) * descale_q * descale_k * scale, P = softmax(S), quantizes P * scale_s
    to e4m3 (scale_s = 448 uses e4m3's range; descale_s = 1/448 undoes it), O = (P8 v8) * descale_s
    * descale_v, and returns O * scale_o in e4m3. With scale_o = 1 / descale_v (a power of two), the
    e4m3 output is P v8, whose magnitude is bounded by max|v8| <= 448, so it neither overflows nor
    wastes range; O = out8 * descale_v (`decode`). The backward-only entries are ones.
    """
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    def cell(x):
        return jnp.asarray(x, jnp.float32).reshape(1, 1, 1, 1)

    params = {key: cell(1.0) for key in cudnn_attention.fp8_params_keys}
    params.update(
        descale_q=cell(fp8.descale_q),
        descale_k=cell(fp8.descale_k),
        descale_v=cell(fp8.descale_v),
        scale_s=cell(448.0),
        descale_s=cell(1.0 / 448.0),
        scale_o=cell(1.0 / jnp.asarray(fp8.descale_v, jnp.float32)),
    )
    return params


def cudnn_fp8_attention(q8, k8, v8, params, *, causal: bool, softmax_scale: float) -> jax.Array:
    """JAX's cuDNN FP8 attention forward (inference: no LSE); returns the e4m3 output."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    mask = cudnn_attention.MaskType.CAUSAL if causal else cudnn_attention.MaskType.NO_MASK
    out, _, _ = cudnn_attention.dot_product_attention(
        q8, k8, v8, fp8_params=params, scale=softmax_scale, mask_type=mask, qkv_layout="BTNH", use_fp8=True
    )
    return out


class CudnnFp8(Peer):
    name = "cudnn_fp8"
    precision = "fp8"
    description = "cuDNN FP8 attention (jax._src.cudnn.fused_attention_stablehlo, use_fp8=True)"
    notes = "e4m3 q/k/v, per-tensor descales; e4m3 output (scale_o = 1/descale_v), so its error includes the output rounding; no LSE"

    def supports(self, problem: Problem) -> str | None:
        if reason := _no_varlen_reason(
            problem, "JAX's cuDNN FP8 attention takes dense [B, S, H, D] batches only"
        ):
            return reason
        if reason := _no_window_reason(problem, "JAX's cuDNN FP8 attention"):
            return reason
        if reason := _gpu_reason():
            return reason
        try:
            importlib.import_module("jax._src.cudnn.fused_attention_stablehlo")
        except Exception as e:  # noqa: BLE001 - a private module may move
            return f"cannot import JAX's cuDNN attention module: {e}"
        if reason := _one_head_dim_reason(
            problem, "JAX's cuDNN FP8 attention is not wired for unequal head dims"
        ):
            return reason
        if problem.head_dim > 256 or problem.head_dim % 16:
            return f"cuDNN FP8 inference needs head_dim <= 256 and a multiple of 16, got {problem.head_dim}"
        return _rectangular_causal_reason(problem, "cuDNN FP8 attention")

    def arguments(self, problem: Problem, inputs: InputSet) -> tuple:
        f = inputs.fp8()
        return (f.q, f.k, f.v, cudnn_fp8_params(f))

    def build(self, problem: Problem, options: Options) -> Built:
        def fn(q8, k8, v8, params):
            return cudnn_fp8_attention(
                q8, k8, v8, params, causal=problem.mask_causal, softmax_scale=problem.softmax_scale
            )

        return Built(fn)

    def decode(self, raw, args: tuple):
        descale_v = args[3]["descale_v"].reshape(())
        return raw.astype(jnp.float32) * descale_v

    def compute_dtype(self, problem: Problem) -> str:
        return "fp8"


# ---- Pallas Mosaic GPU attention


class Pallas(Peer):
    name = "pallas"
    description = "jax.experimental.pallas.ops.gpu.attention_mgpu (block 64x128, 2 stages)"
    notes = "computes in f16 (its scratch is f16; bf16 fails): inputs converted and q pre-scaled outside the timed call"
    block_q, block_kv = 64, 128

    def supports(self, problem: Problem) -> str | None:
        if reason := _no_varlen_reason(
            problem, "Pallas attention_mgpu takes dense [B, S, H, D] batches only"
        ):
            return reason
        if reason := _no_window_reason(problem, "Pallas attention_mgpu"):
            return reason
        if reason := _one_head_dim_reason(problem, "Pallas attention_mgpu takes one head dim for q, k and v"):
            return reason
        if reason := _gpu_reason():
            return reason
        if problem.head_dim % 64:
            return f"needs head_dim a multiple of 64, got {problem.head_dim}"
        if problem.seq_q % (2 * self.block_q) or problem.seq_k % self.block_kv:
            return f"needs Sq a multiple of {2 * self.block_q} and Sk a multiple of {self.block_kv}"
        try:
            importlib.import_module("jax.experimental.pallas.ops.gpu.attention_mgpu")
        except Exception as e:  # noqa: BLE001
            return f"cannot import attention_mgpu: {e}"
        return _rectangular_causal_reason(problem, "Pallas attention")

    def arguments(self, problem: Problem, inputs: InputSet) -> tuple:
        # It takes no softmax scale: fold it into q (in float32, then one rounding to f16).
        q = (inputs.q.astype(jnp.float32) * problem.softmax_scale).astype(jnp.float16)
        return (q, inputs.k.astype(jnp.float16), inputs.v.astype(jnp.float16))

    def build(self, problem: Problem, options: Options) -> Built:
        from jax.experimental.pallas.ops.gpu import attention_mgpu

        config = attention_mgpu.TuningConfig(
            block_q=self.block_q, block_kv=self.block_kv, max_concurrent_steps=2, causal=problem.mask_causal
        )
        return Built(lambda q, k, v: attention_mgpu.attention(q, k, v, config))

    def compute_dtype(self, problem: Problem) -> str:
        return "f16"


# ---- PyTorch peers (SDPA, FlashAttention), through DLPack


def _torch_reason() -> str | None:
    if reason := _gpu_reason():
        return reason
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return f"PyTorch is not importable ({type(e).__name__}: {e})"
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA device"
    return None


def to_torch(x: jax.Array):
    """A PyTorch view of a JAX device array (DLPack; FP8 travels as uint8 bits and is viewed back)."""
    import torch

    if jnp.dtype(x.dtype) == jnp.dtype(jnp.float8_e4m3fn):
        return torch.from_dlpack(jax.lax.bitcast_convert_type(x, jnp.uint8)).view(torch.float8_e4m3fn)
    return torch.from_dlpack(x)


def torch_to_numpy(t) -> np.ndarray:
    return t.detach().float().cpu().numpy()


class TorchSdpa(Peer):
    framework = "torch"

    def __init__(self, name: str, backend: str):
        self.name = name
        self.backend = backend  # a torch.nn.attention.SDPBackend member name
        self.description = f"torch.nn.functional.scaled_dot_product_attention, {backend} backend"
        self.notes = "layout [B, H, S, D] made contiguous outside the timed call"

    def supports(self, problem: Problem) -> str | None:
        if reason := _no_varlen_reason(
            problem, "PyTorch SDPA takes dense [B, H, S, D] batches (nested tensors are not wired here)"
        ):
            return reason
        if reason := _no_window_reason(problem, "PyTorch SDPA (without an explicit mask)"):
            return reason
        if reason := _one_head_dim_reason(
            problem, "this peer is not wired for unequal head dims (untested without PyTorch)"
        ):
            return reason
        if reason := _torch_reason():
            return reason
        return _rectangular_causal_reason(problem, "PyTorch SDPA")

    def arguments(self, problem: Problem, inputs: InputSet) -> tuple:
        return tuple(to_torch(x).transpose(1, 2).contiguous() for x in (inputs.q, inputs.k, inputs.v))

    def build(self, problem: Problem, options: Options) -> Built:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, self.backend)
        gqa = problem.heads_q != problem.heads_kv

        def fn(q, k, v):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=problem.mask_causal, scale=problem.softmax_scale, enable_gqa=gqa
                )

        return Built(fn)

    def decode(self, raw, args: tuple):
        return np.swapaxes(torch_to_numpy(raw), 1, 2)


class FlashAttn(Peer):
    """FlashAttention 2 (`flash_attn`) or 3 (`flash_attn_interface`, Hopper), if importable."""

    framework = "torch"

    def __init__(self, name: str, module: str, precision: str = "16-bit"):
        self.name = name
        self.module = module
        self.precision = precision
        self.description = f"{module}.flash_attn_func"
        if precision == "fp8":
            self.notes = "e4m3 q/k/v with [B, Hkv] descales (the per-tensor ones broadcast); bf16 output"

    def supports(self, problem: Problem) -> str | None:
        # flash_attn_varlen_func exists (FA2 and FA3) but is not wired here: it could not be tested
        # (no PyTorch on the CPU machine), and an untested peer is not timed.
        if reason := _no_varlen_reason(
            problem,
            f"{self.module}.flash_attn_varlen_func exists but this peer does not call it yet (not wired: "
            "untested without PyTorch)",
        ):
            return reason
        # flash_attn_func has a window_size, not passed here yet (not measured): a sliding window is refused.
        if reason := _no_window_reason(problem, f"the {self.name} peer"):
            return reason
        # FlashAttention 3 takes v's own head dim ((192, 128) among them); FlashAttention 2 and FA3's FP8
        # path are not known to.
        one_head_dim = self.module != "flash_attn_interface" or self.precision == "fp8"
        if one_head_dim and (
            reason := _one_head_dim_reason(
                problem, f"{self.module}.flash_attn_func ({self.precision}) needs one head dim"
            )
        ):
            return reason
        if reason := _torch_reason():
            return reason
        try:
            importlib.import_module(self.module)
        except Exception as e:  # noqa: BLE001
            return f"{self.module} is not importable ({type(e).__name__}: {e})"
        return None  # bottom-right causal alignment, like jzyfa

    def arguments(self, problem: Problem, inputs: InputSet) -> tuple:
        if self.precision == "fp8":
            f = inputs.fp8()
            per_head = (problem.batch, problem.heads_kv)
            descales = [
                jnp.broadcast_to(d.reshape(()) if d.ndim < 2 else d, per_head)
                for d in (f.descale_q, f.descale_k, f.descale_v)
            ]
            return tuple(
                to_torch(x) for x in (f.q, f.k, f.v, *(jnp.asarray(d, jnp.float32) for d in descales))
            )
        return tuple(to_torch(x) for x in (inputs.q, inputs.k, inputs.v))

    def build(self, problem: Problem, options: Options) -> Built:
        flash_attn_func = importlib.import_module(self.module).flash_attn_func
        scale, causal = problem.softmax_scale, problem.mask_causal

        if self.precision == "fp8":

            def fn(q, k, v, dq, dk, dv):
                out = flash_attn_func(
                    q, k, v, softmax_scale=scale, causal=causal, q_descale=dq, k_descale=dk, v_descale=dv
                )
                return out[0] if isinstance(out, tuple) else out  # some versions also return the LSE
        else:

            def fn(q, k, v):
                out = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)
                return out[0] if isinstance(out, tuple) else out

        return Built(fn)

    def decode(self, raw, args: tuple):
        return torch_to_numpy(raw)


# ----------------------------------------------------------------------------------------------
# The registry


PEERS: dict[str, Peer] = {
    peer.name: peer
    for peer in [
        Jzyfa("jzyfa", "16-bit"),
        Jzyfa("jzyfa_xla", "16-bit", forced="xla"),
        Jzyfa("jzyfa_fp8", "fp8", lean_p=True),
        Jzyfa("jzyfa_fp8_exact_p", "fp8", lean_p=False, fp8_only=True),
        Jzyfa("jzyfa_fp8_xla", "fp8", forced="xla"),
        JaxNn("cudnn", "cudnn"),
        JaxNn("xla", "xla"),
        CudnnFp8(),
        Pallas(),
        TorchSdpa("torch_sdpa_cudnn", "CUDNN_ATTENTION"),
        TorchSdpa("torch_sdpa_flash", "FLASH_ATTENTION"),
        FlashAttn("flash_attn", "flash_attn"),
        FlashAttn("flash_attn3", "flash_attn_interface"),
        FlashAttn("flash_attn3_fp8", "flash_attn_interface", precision="fp8"),
    ]
}

# What `--impls auto` runs: every peer of the run's precision (unsupported ones say why), and in
# FP8 runs the 16-bit jzyfa and cuDNN as baselines.
AUTO_16BIT = [
    "jzyfa",
    "cudnn",
    "xla",
    "pallas",
    "torch_sdpa_cudnn",
    "torch_sdpa_flash",
    "flash_attn",
    "flash_attn3",
]
AUTO_FP8 = ["jzyfa_fp8", "jzyfa_fp8_exact_p", "cudnn_fp8", "flash_attn3_fp8", "jzyfa", "cudnn"]


def auto_peers(dtype: str) -> list[str]:
    return list(AUTO_FP8 if dtype == "fp8" else AUTO_16BIT)


def uses_torch(names) -> bool:
    return any(PEERS[name].framework == "torch" for name in names if name in PEERS)
