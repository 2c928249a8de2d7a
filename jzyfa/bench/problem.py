"""The benchmark's problem: its shapes, its mask, its FLOPs, and the command-line forms of them.

The mask is jzyfa's (`jzyfa.flash_attention`): query i, at position p = i + seq_k - seq_q, sees key j
iff p - left <= j <= p + right (-1: that side unbounded); causal=True is the window (-1, 0), and with a
window it sets the right bound to 0. `mask_window` and `canonical_window` compute that here from
the public semantics, so the bench needs nothing of jzyfa's internals.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

Window = tuple[int, int]
NO_WINDOW: Window = (-1, -1)
CAUSAL_WINDOW: Window = (-1, 0)


def mask_window(causal: bool, window: Window | None) -> Window:
    """The (left, right) window a call with these arguments attends with (causal folded in)."""
    left, right = NO_WINDOW if window is None else window
    return (left, 0) if causal else (left, right)


def canonical_window(window: Window, seq_q: int, seq_k: int) -> Window:
    """The same mask with the bounds that exclude no key for these lengths replaced by -1: positions
    run from seq_k - seq_q to seq_k - 1, so left >= seq_k - 1 and right >= seq_q - 1 exclude nothing."""
    left, right = window
    return (-1 if left >= seq_k - 1 else left, -1 if right >= seq_q - 1 else right)


def visible_pairs(seq_q: int, seq_k: int, causal: bool, window: Window | None = None) -> int:
    """(query, key) pairs the mask leaves visible; causal and windows are bottom-right aligned.

    The mask is jzyfa's (`jzyfa.flash_attention`): query i, at position p = i + seq_k - seq_q, sees
    key j iff p - left <= j <= p + right (-1: that side unbounded), with causal=True the window
    (-1, 0) or, with a window, its right bound set to 0. One clamped range per row: O(Sq).
    """
    if window is None and not causal:
        return seq_q * seq_k
    left, right = mask_window(causal, window)
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
    window: Window | None = None,
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


def parse_window(text: str | None) -> Window | None:
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


def sink_logits(mean: float | None, heads_q: int, seed: int) -> tuple[float, ...] | None:
    """--sinks: one sink logit per query head, `mean` plus a standard normal draw of `seed` (None: no
    sinks), float32-representable as jzyfa.flash_attention's sinks are."""
    if mean is None:
        return None
    draws = np.random.default_rng([seed, 0x5151]).standard_normal(heads_q)
    return tuple(float(np.float32(mean + d)) for d in draws)


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
    window: Window | None = None
    # --varlen: one packed batch, (len_q, len_k) per sequence (`Problem.packed`): q [total_q, Hq, D],
    # k and v [total_k, Hkv, D] with cu_seqlens; batch is the number of sequences, seq_q and seq_k the
    # longest ones (max_seqlen_q/k). None: a dense [B, S, H, D] problem.
    seqlens: tuple[tuple[int, int], ...] | None = None
    # --v_head_dim: v's (and the output's) head dim where it differs from q's and k's (MLA: 128 with
    # head_dim 192); None: head_dim.
    head_dim_v: int | None = None
    # --softcap: c > 0 caps each scaled score s to c * tanh(s / c) (Gemma 2); None: no cap.
    softcap: float | None = None
    # --sinks: one sink logit per query head (gpt-oss; `jzyfa.flash_attention(..., sinks=...)`): each
    # row's softmax denominator also holds e^sink. None: no sinks.
    sinks: tuple[float, ...] | None = None

    @classmethod
    def packed(
        cls, seqlens, heads_q, heads_kv, head_dim, causal, dtype, window=None, head_dim_v=None, softcap=None,
        sinks=None,
    ) -> Problem:  # fmt: skip
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
            softcap,
            sinks,
        )

    def sink(self, head: int) -> float | None:
        """Query head `head`'s sink logit (None without --sinks)."""
        return None if self.sinks is None else self.sinks[head]

    @property
    def sizes(self) -> dict[str, int]:
        """batch, seq_q, seq_k, heads_q, heads_kv and head_dim by name (the keys `jzyfa.bench.inputs`
        takes, and the report's rows hold)."""
        names = ("batch", "seq_q", "seq_k", "heads_q", "heads_kv", "head_dim")
        return {name: getattr(self, name) for name in names}

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
    def mask(self) -> Window:
        """The (left, right) window the mask is, causal folded in: (-1, 0) causal, (-1, -1) none."""
        return mask_window(self.causal, self.window)

    @property
    def sliding_window(self) -> Window | None:
        """The mask when it is a sliding window for these lengths (neither causal nor no mask, bounds
        that exclude no key as -1), else None; e.g. (8192, 0) over 4K keys is causal."""
        if self.window is None:
            return None
        window = canonical_window(self.mask, self.seq_q, self.seq_k)
        return None if window in (NO_WINDOW, CAUSAL_WINDOW) else window

    @property
    def mask_causal(self) -> bool:
        """The causal flag of a call without a window that masks as this problem does (when
        sliding_window is None): --causal, or with a window whether it is causal for these lengths."""
        if self.window is None:
            return self.causal
        return canonical_window(self.mask, self.seq_q, self.seq_k) == CAUSAL_WINDOW

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
