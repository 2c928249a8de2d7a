"""FP8 attention computed as the Hopper FP8 kernel will compute it, in pure JAX.

This pins the FP8 algorithm down on the CPU before the kernel exists (docs/fp8.md explains it):
scores in float32 from the e4m3 inputs, an online softmax over 128-key blocks in the log2 domain
with one reference exponent r per row (an integer for lean P), probabilities rounded to e4m3 as
P~ = 2^(t - r) (t the score in log2 units), per-block scaling by moving r down for blocks far
below the row maximum, lean P (the e4m3 code from one FFMA), and the row sum taken over exactly the
rounded probabilities. The switches turn each ingredient off for ablations; with block scaling and
rounded sums off (and FIXED_OFFSET_OPTIONS) it is the FA3-style scheme (a fixed 2^8 offset from the
running maximum, sum of the unrounded probabilities). Masks: causal or a sliding window (left, right), bottom-right aligned; a
block with no visible key for a row leaves that row's state as it was, as in a windowed kernel that
skips the blocks outside its tile's windows.

What is bit-exact: the integer reference exponents and, given the float32 scores, every lean-P code
(the kernel's two-FFMA form differs by one code within 2^-17 of a half-integer: docs/fp8.md 10.7).
What is not: the float32 scores themselves (the tensor cores sum q k products in another order), the
exact path's exp2, and the order of the float32 sums in O and l.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jzyfa import _validation, e4m3_codes, reference
from jzyfa.quantize import FP8_MAX

BLOCK_N = 128
# A fresh reference exponent puts the block's largest probability at 2^E (real reference) or in
# (2^(E-1), 2^E] (integer reference): E = 7 leaves 13 doublings of normal e4m3 values below 2^7.
P_EXPONENT = 7
# The reference is raised only when a block's largest probability would pass 2^(E + tau). The
# ceiling is log2(448) - E = 1.807; 1.75 keeps P~ <= 2^8.75 = 430.5. The largest lean code is then
# RNE(8 * 8.75 + 56) = 126 = 0x7E (126.46 at the ceiling still rounds to it), so the kernel needs no
# upper clamp (0x7F is NaN). E + tau = 8.75 is the cap; E trades headroom (fewer raises, so fewer O
# rescales) against the normal range left below a block's maximum, which matters in a block that
# holds a dominant key (docs/fp8.md section 5: E = 8, 7, 6 give O rescales in 38%, 12%, 2% of a
# warp's Gaussian blocks at 4K, and lean errors 0.071, 0.094, 0.123 on a zero-value sink 14 nats up;
# the same error on Gaussian inputs).
LAZY_RESCALE_THRESHOLD = 1.75
# Block scaling lowers the reference only when a block's largest probability would fall below
# 2^(E - H): the scale of O then changes rarely on ordinary inputs, so O is rarely rescaled.
BLOCK_SCALE_HYSTERESIS = 4
# The reference never goes further than this many doublings below the fresh reference of the row's
# running maximum, so O (scaled by 2^-r) stays far from float32 overflow; keys more than about
# 2^-47 below the row maximum flush to zero (without block scaling: 2^-15 for lean P, 2^-18 exact).
MAX_BLOCK_EXPONENT = 32
# The FA3-style scheme's fixed offset: the running maximum's probability at 2^8 (E = 8, tau = 0.75,
# the largest that fit below 448). The ablations without block scaling take these options.
FIXED_OFFSET_OPTIONS = {"p_exponent": 8, "lazy_rescale_threshold": 0.75}


def max_lazy_rescale_threshold(p_exponent: int = P_EXPONENT) -> float:
    """The largest tau for which P~ <= 2^(E + tau) stays within e4m3's 448."""
    return math.log2(FP8_MAX) - p_exponent


@dataclasses.dataclass(frozen=True)
class Fp8Options:
    """The algorithm's switches and constants (see `attention_fp8_emulated`); hashable, so static."""

    block_n: int = BLOCK_N
    lean_p: bool = True
    block_scaling: bool = True
    rounded_sum: bool = True
    integer_reference: bool | None = None
    lazy_rescale_threshold: float = LAZY_RESCALE_THRESHOLD
    block_scale_hysteresis: int = BLOCK_SCALE_HYSTERESIS
    p_exponent: int = P_EXPONENT

    def __post_init__(self):
        if self.integer_reference is None:  # the natural choice of each path (docs/fp8.md)
            object.__setattr__(self, "integer_reference", self.lean_p)
        if self.lean_p and not self.integer_reference:
            raise ValueError(
                "lean_p needs integer_reference: the one-FFMA code takes c0 = 56 - 8 r as an integer"
            )
        for name in ("block_n", "block_scale_hysteresis", "p_exponent"):
            value = getattr(self, name)
            if int(value) != value or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}")
        if self.p_exponent > 8:
            raise ValueError(f"p_exponent must be at most 8 (2^9 > 448), got {self.p_exponent}")
        ceiling = max_lazy_rescale_threshold(self.p_exponent)
        if not 0 <= self.lazy_rescale_threshold <= ceiling:
            raise ValueError(
                f"lazy_rescale_threshold must lie in [0, {ceiling:.4f}] "
                f"(P~ <= 2^({self.p_exponent} + threshold) <= 448), got {self.lazy_rescale_threshold}"
            )


_HIGHEST = lax.Precision.HIGHEST
_LOG2_E = math.log2(math.e)
_LN_2 = math.log(2.0)


class Fp8AttentionTrace(NamedTuple):
    """The emulation's result and the per-(row, block) state a kernel debug dump can be checked against.

    out: [B, Sq, Hq, D] in out_dtype; lse: float32 [B, Hq, Sq], natural log, -inf for rows that see
    no key. reference_exponent: float32 [B, Hq, Sq, blocks], r after each block (-inf
    until the row sees a key); P~ = 2^(t - r). rescaled: bool [B, Hq, Sq, blocks], whether the
    block changed r after the row had seen a key, that is whether O and l were rescaled.
    """

    out: jax.Array
    lse: jax.Array
    reference_exponent: jax.Array
    rescaled: jax.Array


def scale_log2(softmax_scale: float, descale_q: jax.Array, descale_k: jax.Array) -> jax.Array:
    """Factor from raw float32 scores to log2 units: (descale_q * descale_k) * f32(scale * log2 e).

    softmax_scale * log2(e) is rounded to float32 once, on the host; the descale product is exact
    for the power-of-two descales `fp8_quantize` makes.
    """
    return (descale_q * descale_k) * np.float32(softmax_scale * _LOG2_E)


def _per_kv_head(descale: jax.Array) -> jax.Array:
    """A () / (1,) / [B, Hkv] descale as [B or 1, Hkv or 1, 1, 1] to broadcast over [B, Hkv, G, Sq]."""
    descale = jnp.asarray(descale, jnp.float32)
    if descale.ndim < 2:
        return descale.reshape(1, 1, 1, 1)
    return descale[:, :, None, None]


def _next_reference(r, running_max, block_max, options: Fp8Options):
    """The reference exponent after a block whose largest score (log2 units) is block_max.

    For an integer reference the decision takes comparisons only, against integers (plus tau), so
    no rounding enters it. Rows whose block is fully masked (block_max = -inf) keep r.
    """
    if options.integer_reference:
        fresh, floor = jnp.ceil(block_max), jnp.ceil(running_max)
    else:
        fresh, floor = block_max, running_max
    top = options.p_exponent
    fresh = fresh - top
    change = block_max > r + top + options.lazy_rescale_threshold  # r = -inf before the first key
    if options.block_scaling:
        fresh = jnp.maximum(fresh, floor - top - MAX_BLOCK_EXPONENT)
        change |= (block_max < r + top - options.block_scale_hysteresis) & (fresh < r)
    change &= block_max > -jnp.inf
    return jnp.where(change, fresh, r)


def _rescale_factor(r: jax.Array, new_r: jax.Array, options: Fp8Options) -> jax.Array:
    """2^(r - new_r), exactly for integer references; 0 before the row's first visible key."""
    finite = jnp.isfinite(r)
    difference = jnp.where(finite, r - new_r, 0.0)
    if options.integer_reference:
        factor = jnp.ldexp(jnp.float32(1), jnp.clip(difference, -200, 200).astype(jnp.int32))
    else:
        factor = jnp.exp2(difference)
    return jnp.where(finite, factor, 0.0)


def _block_probabilities(s, r, row_scale, options: Fp8Options):
    """(P~ as float32 e4m3 values, the unrounded 2^(t - r)) for scores s [..., Sq, N], r [..., Sq]."""
    finite_r = jnp.where(jnp.isfinite(r), r, 0.0)[..., None]  # rows with r = -inf have s = -inf
    scale = row_scale[..., None]
    exact = jnp.exp2(s * scale - finite_r)
    if options.lean_p:
        c1 = e4m3_codes.CODE_SLOPE * scale  # exact: a power-of-two multiple
        c0 = e4m3_codes.CODE_OF_ONE - e4m3_codes.CODE_SLOPE * finite_r
        rounded = e4m3_codes.decode(e4m3_codes.lean_codes(s, c1, c0))
    else:
        rounded = e4m3_codes.round_to_e4m3(exact)
    return rounded, exact


def key_blocks(x: jax.Array, block_n: int) -> jax.Array:
    """[B, Sk, Hkv, D] -> float32 [blocks, B, Hkv, N, D], zero padded to whole blocks of N keys."""
    batch, seq_k, heads_kv, dim = x.shape
    num_blocks = max(1, -(-seq_k // block_n))
    x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, num_blocks * block_n - seq_k), (0, 0), (0, 0)))
    return jnp.transpose(x.reshape(batch, num_blocks, block_n, heads_kv, dim), (1, 0, 3, 2, 4))


def query_groups(q: jax.Array, heads_kv: int) -> jax.Array:
    """[B, Sq, Hq, D] -> float32 [B, Hkv, G, Sq, D]: each KV head's group of query heads."""
    batch, seq_q, heads_q, dim = q.shape
    qf = q.astype(jnp.float32).reshape(batch, seq_q, heads_kv, heads_q // heads_kv, dim)
    return jnp.transpose(qf, (0, 2, 3, 1, 4))


def blocked_attention(
    qf, k_blocks, v_blocks, descale_q, descale_k, descale_v, *, seq_k, window, softmax_scale, options,
    out_dtype, seqlens=None,
) -> Fp8AttentionTrace:  # fmt: skip
    """The kernel's online softmax and P V over key blocks, shared by the FP8 and INT8 emulations.

    qf float32 [B, Hkv, G, Sq, D] and k_blocks [blocks, B, Hkv, N, D] (`query_groups`, `key_blocks`)
    hold values whose products sum exactly in float32 (e4m3, or int8 up to head dim 1024): the raw
    scores. descale_q broadcasts to [B, Hkv, G, Sq] (at most one per query row), descale_k to
    [blocks, B, Hkv] (at most one per key block): a (row, block)'s factor to log2 units is
    `scale_log2` of the two, the one multiply the kernel folds into lean P's FFMA. v_blocks
    [blocks, B, Hkv, N, Dv]; descale_v broadcasts to [B, Hkv, G, Sq]. seq_k: the keys before padding
    to whole blocks. seqlens: None, or (seqlens_q, seqlens_k) int [B]: batch row b holds its first
    seqlens_q[b] queries and seqlens_k[b] keys, the mask aligned bottom-right per row; padded query
    rows give out = 0 and lse = -inf.
    """
    num_blocks, batch, heads_kv, block_n, _ = k_blocks.shape
    _, _, group, seq_q, _ = qf.shape
    value_dim = v_blocks.shape[-1]
    if seqlens is None:
        len_q, len_k = seq_q, seq_k
    else:  # [B, 1, 1, 1, 1]: per batch row, against s [B, Hkv, G, Sq, N]
        len_q, len_k = (jnp.clip(n, 0, size).astype(jnp.int32).reshape(-1, 1, 1, 1, 1)
                        for n, size in zip(seqlens, (seq_q, seq_k)))  # fmt: skip
    positions = jnp.arange(seq_q)[:, None] + (len_k - len_q)  # bottom-right aligned
    descale_q = jnp.asarray(descale_q, jnp.float32)

    def step(carry, block):
        r, running_max, row_sum, o = carry
        index, k_block, v_block, block_descale_k = block
        keys = index * block_n + jnp.arange(block_n)[None, :]
        # Every row visits every block in increasing order. A block with no visible key for a row
        # (outside its window, or past the keys) is a no-op for it: block_max = -inf keeps r and the
        # running maximum, alpha = 1 and P~ = 0 leave l and O exactly as they were. So the result
        # and the trace equal those of a kernel that visits only the blocks a 128-row tile's
        # windows reach (WindowBlocks: from first_block, aligned to multiples of 128 keys).
        visible = (keys < len_k) & reference.window_visible(positions, keys, window)
        s = jnp.einsum("bhgqd,bhkd->bhgqk", qf, k_block, precision=_HIGHEST)
        s = jnp.where(visible, s, -jnp.inf)
        row_scale = scale_log2(softmax_scale, descale_q, block_descale_k[..., None, None])
        # max commutes with the positive scale: one FMUL per row, as the kernel does it.
        block_max = jnp.max(s, axis=-1) * row_scale
        running_max = jnp.maximum(running_max, block_max)
        new_r = _next_reference(r, running_max, block_max, options)
        rescaled = (new_r != r) & jnp.isfinite(r)
        alpha = _rescale_factor(r, new_r, options)
        rounded, exact = _block_probabilities(s, new_r, row_scale, options)
        summed = rounded if options.rounded_sum else exact
        row_sum = alpha * row_sum + jnp.sum(summed, axis=-1)
        o = alpha[..., None] * o + jnp.einsum("bhgqk,bhkd->bhgqd", rounded, v_block, precision=_HIGHEST)
        return (new_r, running_max, row_sum, o), (new_r, rescaled)

    state_shape = (batch, heads_kv, group, seq_q)
    init = (
        jnp.full(state_shape, -jnp.inf, jnp.float32),
        jnp.full(state_shape, -jnp.inf, jnp.float32),
        jnp.zeros(state_shape, jnp.float32),
        jnp.zeros((*state_shape, value_dim), jnp.float32),
    )
    descale_k = jnp.broadcast_to(jnp.asarray(descale_k, jnp.float32), (num_blocks, batch, heads_kv))
    xs = (jnp.arange(num_blocks), k_blocks, v_blocks, descale_k)
    (r, _, row_sum, o), (references, rescaled) = lax.scan(step, init, xs)

    seen = row_sum > 0
    if seqlens is not None:  # padded query rows (their rows may see keys)
        seen &= jnp.arange(seq_q) < len_q[..., 0]
    safe_sum = jnp.where(seen, row_sum, 1.0)
    out = jnp.where(seen[..., None], o * (descale_v[..., None] / safe_sum[..., None]), 0.0)
    heads_q = heads_kv * group
    out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(batch, seq_q, heads_q, value_dim)
    lse = jnp.where(seen, (r + jnp.log2(safe_sum)) * np.float32(_LN_2), -jnp.inf)

    def per_row(x):  # [blocks, B, Hkv, G, Sq] -> [B, Hq, Sq, blocks]
        return jnp.moveaxis(x, 0, -1).reshape(batch, heads_q, seq_q, num_blocks)

    return Fp8AttentionTrace(
        out.astype(out_dtype), lse.reshape(batch, heads_q, seq_q), per_row(references), per_row(rescaled)
    )


@functools.partial(jax.jit, static_argnames=("window", "softmax_scale", "options", "out_dtype"))
def _emulate(q8, k8, v8, descale_q, descale_k, descale_v, *, window, softmax_scale, options, out_dtype):
    """window: the mask as (left, right), -1 unbounded (`_validation.mask_window`: causal is (-1, 0))."""
    # e4m3 products are exact in float32; only the order of the sums is unspecified.
    return blocked_attention(
        query_groups(q8, k8.shape[2]), key_blocks(k8, options.block_n), key_blocks(v8, options.block_n),
        _per_kv_head(descale_q), _per_kv_head(descale_k)[..., 0, 0], _per_kv_head(descale_v),
        seq_k=k8.shape[1], window=window, softmax_scale=softmax_scale, options=options, out_dtype=out_dtype,
    )  # fmt: skip


def trace_attention_fp8_emulated(
    q8: jax.Array,
    k8: jax.Array,
    v8: jax.Array,
    descale_q: jax.Array,
    descale_k: jax.Array,
    descale_v: jax.Array,
    *,
    causal: bool,
    window: tuple[int, int] | None = None,
    softmax_scale: float | None = None,
    out_dtype=jnp.bfloat16,
    **options,
) -> Fp8AttentionTrace:
    """`attention_fp8_emulated`, also returning the reference exponents and rescale events.

    The trace has one entry per key block for every row, also for blocks the row's window does not
    reach (r unchanged there, rescaled False).
    """
    _validation.check_qkv(q8, k8, v8)
    if not _validation.is_fp8(q8.dtype):
        raise TypeError(f"q8, k8 and v8 must be float8_e4m3fn, got {q8.dtype}")
    _validation.check_causal(causal)
    window = _validation.mask_window(bool(causal), _validation.check_window(window))
    softmax_scale = _validation.resolve_softmax_scale(softmax_scale, q8.shape[-1])
    if softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be positive, got {softmax_scale}")
    descales = _validation.check_descales(q8, k8, (descale_q, descale_k, descale_v))
    return _emulate(
        q8,
        k8,
        v8,
        *descales,
        window=window,
        softmax_scale=softmax_scale,
        options=Fp8Options(**options),
        out_dtype=jnp.dtype(out_dtype),
    )


def trace_attention_fp8_emulated_on_cpu(*arrays: jax.Array, **kwargs) -> Fp8AttentionTrace:
    """`trace_attention_fp8_emulated` of (q8, k8, v8, descale_q, descale_k, descale_v) on the CPU, whatever
    the default backend: XLA's GPU backend may keep excess precision across the emulation's f32 -> e4m3 ->
    f32 rounding, so an oracle for the GPU kernel runs where every rounding is honoured."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        return trace_attention_fp8_emulated(*(jax.device_put(x, cpu) for x in arrays), **kwargs)


def attention_fp8_emulated(
    q8: jax.Array,
    k8: jax.Array,
    v8: jax.Array,
    descale_q: jax.Array,
    descale_k: jax.Array,
    descale_v: jax.Array,
    *,
    causal: bool,
    window: tuple[int, int] | None = None,
    softmax_scale: float | None = None,
    block_n: int = BLOCK_N,
    lean_p: bool = True,
    block_scaling: bool = True,
    rounded_sum: bool = True,
    integer_reference: bool | None = None,
    lazy_rescale_threshold: float = LAZY_RESCALE_THRESHOLD,
    block_scale_hysteresis: int = BLOCK_SCALE_HYSTERESIS,
    p_exponent: int = P_EXPONENT,
    out_dtype=jnp.bfloat16,
) -> tuple[jax.Array, jax.Array]:
    """FP8 attention as the Hopper FP8 kernel computes it; returns (out, lse).

    Args:
      q8: float8_e4m3fn [B, Sq, Hq, D]; k8, v8: float8_e4m3fn [B, Sk, Hkv, D], Hq a multiple of Hkv.
      descale_q, descale_k, descale_v: float32, shape (), (1,) or [B, Hkv]; the values used are
        x8 * descale, as `flash_attention` takes them.
      causal: bottom-right aligned mask (query i sees key j iff j <= i + Sk - Sq).
      window: None or a static (left, right): query i, at p = i + Sk - Sq, sees keys p - left ..
        p + right (-1: unbounded); with causal=True the right bound becomes 0 (flash_attention's
        convention, `_validation.mask_window`). Masked scores are -inf; blocks stay aligned to
        multiples of block_n keys, and a block with no visible key for a row leaves its r, l and O
        unchanged, as in a windowed kernel that visits only the blocks its tile's windows reach.
      softmax_scale: static, positive; default 1 / sqrt(D).
      block_n: keys per block (the kernel's is 128); blocks are visited in increasing key order.
      lean_p: the e4m3 code of each probability from one FFMA (piecewise-linear 2^x); False rounds
        the exact exp2 to the nearest e4m3 value.
      block_scaling: move the reference exponent down for blocks far below the running maximum, so
        their probabilities stay normal; False keeps it at the running maximum minus E (FA3 style:
        E = 8, FIXED_OFFSET_OPTIONS).
      rounded_sum: the denominator sums the rounded probabilities (weights sum to one); False sums
        the unrounded 2^(t - r) (FA3 style).
      integer_reference: keep the reference exponent r an integer (power-of-two rescales, the
        one-FFMA lean code, lean results independent of where key ranges are split); False sets r
        to the block maximum minus E itself, so that maximum's P~ is exactly 2^E (FA3 style). None
        (default): integer for lean P, which needs it, real for exact P, where it is more accurate.
      lazy_rescale_threshold: tau; r is raised only when a block's largest probability would pass
        2^(E + tau). At most log2(448) - E.
      block_scale_hysteresis: H; block scaling lowers r only when a block's largest probability
        would fall below 2^(E - H).
      p_exponent: E, where a fresh reference puts the block's largest probability (at most 8).
      out_dtype: bf16 like the kernel; float32 skips the final rounding (for merging tests).

    Returns:
      out [B, Sq, Hq, D] in out_dtype, and lse float32 [B, Hq, Sq] (natural log) of exactly the
      probabilities in the denominator, so results over key ranges that split at block boundaries
      merge with `merge_attention_states`. Rows that see no key give out = 0 and lse = -inf.
    """
    trace = trace_attention_fp8_emulated(
        q8,
        k8,
        v8,
        descale_q,
        descale_k,
        descale_v,
        causal=causal,
        window=window,
        softmax_scale=softmax_scale,
        out_dtype=out_dtype,
        block_n=block_n,
        lean_p=lean_p,
        block_scaling=block_scaling,
        rounded_sum=rounded_sum,
        integer_reference=integer_reference,
        lazy_rescale_threshold=lazy_rescale_threshold,
        block_scale_hysteresis=block_scale_hysteresis,
        p_exponent=p_exponent,
    )
    return trace.out, trace.lse
