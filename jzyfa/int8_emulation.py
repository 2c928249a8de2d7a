"""INT8 attention computed as the Hopper INT8 kernel will compute it, in pure JAX.

The kernel (docs/int8.md) takes INT8 Q and K with one float32 scale per block of tokens and head
(`jzyfa.int8_quant`) and e4m3 V with a power-of-two descale. Its scores are exact integer dot
products (s8 wgmma, int32 accumulators): a 128-deep product of int8 values fits in 22 bits, so the
emulation's float32 sums of them are exact whatever their order, and the kernel turns them into
floats exactly too (an integer add of a magic constant). From there everything is the FP8 kernel's
(`jzyfa.fp8_emulation.blocked_attention`): the factor to log2 units of a (query row, key block),
(scale_q * scale_k) * f32(softmax_scale * log2 e), is the one multiply lean P's FFMA takes, then the
online softmax with integer reference exponents, per-block P scaling, e4m3 probabilities, rounded
row sums and the FP8 P V. So unlike the FP8 emulation, the scores here are bit-exact too; what is
not is the exact path's exp2 and the order of the float32 sums in O and l.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jzyfa import _extension, _validation, fp8_emulation, int8_quant, varlen
from jzyfa.fp8_emulation import Fp8Options

# The depth up to which int8 dot products sum exactly in float32: 127^2 * 1040 < 2^24.
MAX_EXACT_HEAD_DIM = 1040


def kernel_key_block(head_dim: int) -> int:
    """Keys per block of the INT8 kernel at this head dim: the FP8 tile's default block, 128 (one K scale
    per block) or 64 at head dim 256 (two blocks per K scale)."""
    return _extension.fp8_default_key_block(head_dim)


@functools.partial(
    jax.jit, static_argnames=("window", "softmax_scale", "block", "q_block", "options", "out_dtype", "padded")
)
def _emulate(q8, k8, v8, q_scale, k_scale, descale_v, seqlens_q, seqlens_k, *, window, softmax_scale, block,
             q_block, options, out_dtype, padded):  # fmt: skip
    heads_kv = k8.shape[2]
    batch, seq_q, heads_q, _ = q8.shape
    # [B, Hq, Sq] per-row Q scales -> [B, Hkv, G, Sq]; [B, Hkv, blocks] K scales -> one per key block of
    # the kernel (a scale block holds block / block_n of them) -> [key blocks, B, Hkv]
    row_scale = int8_quant.per_token(q_scale, seq_q, q_block).reshape(
        batch, heads_kv, heads_q // heads_kv, seq_q
    )
    key_blocks = -(-k8.shape[1] // options.block_n)
    k_scale = jnp.repeat(k_scale, block // options.block_n, axis=2)[:, :, :key_blocks]
    if k_scale.shape[2] == 0:  # no keys: the emulation still visits one (empty) block
        k_scale = jnp.ones((batch, heads_kv, 1), jnp.float32)
    return fp8_emulation.blocked_attention(
        fp8_emulation.query_groups(q8, heads_kv),
        fp8_emulation.key_blocks(k8, options.block_n),
        fp8_emulation.key_blocks(v8, options.block_n),
        row_scale,
        jnp.moveaxis(k_scale, 2, 0),
        jnp.asarray(descale_v, jnp.float32)[:, :, None, None],
        seq_k=k8.shape[1],
        window=window,
        softmax_scale=softmax_scale,
        options=options,
        out_dtype=out_dtype,
        seqlens=(seqlens_q, seqlens_k) if padded else None,
    )


def trace_attention_int8_emulated(
    q8: jax.Array,
    k8: jax.Array,
    v8: jax.Array,
    q_scale: jax.Array,
    k_scale: jax.Array,
    descale_v: jax.Array,
    *,
    causal: bool,
    window: tuple[int, int] | None = None,
    softmax_scale: float | None = None,
    block: int = int8_quant.INT8_BLOCK,
    q_block: int | None = None,
    seqlens_q: jax.Array | None = None,
    seqlens_k: jax.Array | None = None,
    out_dtype=jnp.bfloat16,
    lean_p: bool = True,
) -> fp8_emulation.Fp8AttentionTrace:
    """`attention_int8_emulated`, also returning the reference exponents and rescale events
    (`jzyfa.fp8_emulation.Fp8AttentionTrace`)."""
    for name, x, dtype in (("q8", q8, jnp.int8), ("k8", k8, jnp.int8), ("v8", v8, jnp.float8_e4m3fn)):
        if getattr(x, "dtype", None) != dtype:
            raise TypeError(
                f"{name} must be {jnp.dtype(dtype).name}, got {getattr(x, 'dtype', type(x).__name__)}"
            )
    # The shapes as the float calls check them.
    _validation.check_qkv(*(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q8, k8, v8)))
    if q8.shape[-1] > MAX_EXACT_HEAD_DIM:
        raise ValueError(
            f"head_dim must be at most {MAX_EXACT_HEAD_DIM} (exact float32 sums), got {q8.shape[-1]}"
        )
    (batch, seq_q, heads_q, _), (_, seq_k, heads_kv, _) = q8.shape, k8.shape
    options = Fp8Options(lean_p=lean_p, block_n=kernel_key_block(q8.shape[-1]))
    if int(block) != block or block < 1 or block % options.block_n:
        raise ValueError(
            f"block must be a multiple of the kernel's key block, {options.block_n} keys at head dim "
            f"{q8.shape[-1]}: one K scale per key block folds into lean P's FFMA; got {block}"
        )
    q_block = block if q_block is None else q_block
    if int(q_block) != q_block or q_block < 1:
        raise ValueError(f"q_block must be a positive integer, got {q_block}")
    blocks = lambda seq, block: -(-seq // block)
    for name, scale, shape in (
        ("q_scale", q_scale, (batch, heads_q, blocks(seq_q, q_block))),
        ("k_scale", k_scale, (batch, heads_kv, blocks(seq_k, block))),
        ("descale_v", descale_v, (batch, heads_kv)),
    ):
        if tuple(jnp.shape(scale)) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(jnp.shape(scale))}")
    _validation.check_causal(causal)
    window = _validation.mask_window(bool(causal), _validation.check_window(window))
    softmax_scale = _validation.resolve_softmax_scale(softmax_scale, q8.shape[-1])
    if softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be positive, got {softmax_scale}")
    padded = seqlens_q is not None or seqlens_k is not None
    lengths = [
        jnp.full((batch,), seq, jnp.int32) if n is None else n
        for n, seq in ((seqlens_q, seq_q), (seqlens_k, seq_k))
    ]
    return _emulate(
        q8, k8, v8, q_scale, k_scale, descale_v, *lengths, window=window, softmax_scale=float(softmax_scale),
        block=int(block), q_block=int(q_block), options=options, out_dtype=jnp.dtype(out_dtype), padded=padded,
    )  # fmt: skip


def attention_int8_emulated(*args, **kwargs) -> tuple[jax.Array, jax.Array]:
    """INT8 attention as the Hopper INT8 kernel will compute it; returns (out, lse).

    Args:
      q8: int8 [B, Sq, Hq, D]; k8: int8 [B, Sk, Hkv, D]; v8: float8_e4m3fn [B, Sk, Hkv, Dv].
      q_scale: float32 [B, Hq, ceil(Sq / q_block)]; k_scale: float32 [B, Hkv, ceil(Sk / block)]: the
        values used are x8 * the scale of the token's block (`jzyfa.int8_quant.int8_quantize`).
      descale_v: float32 [B, Hkv], v's values are v8 * descale_v.
      causal, window, softmax_scale: as in `jzyfa.fp8_emulation.attention_fp8_emulated`.
      block: tokens per K scale: the kernel's key block (128).
      q_block: tokens per Q scale (default: block); any block size, 1 for one scale per query row.
      seqlens_q, seqlens_k: None, or int [B]: right-padded batch rows (as in `jzyfa.flash_attention`);
        padded query rows give out = 0 and lse = -inf.
      out_dtype: the output's dtype (the 16-bit inputs' dtype in `flash_attention`).
      lean_p: the e4m3 code of each probability from one FFMA (the kernel's); False rounds exp2.

    Returns:
      out [B, Sq, Hq, Dv] in out_dtype and lse float32 [B, Hq, Sq] (natural log) of the *quantized*
      (smoothed) keys: `jzyfa.int8_quant.lse_shift` gives the unsmoothed keys' back.
    """
    trace = trace_attention_int8_emulated(*args, **kwargs)
    return trace.out, trace.lse


def attention_int8_varlen_emulated(
    q8: jax.Array,
    k8: jax.Array,
    v8: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    q_scale: jax.Array,
    k_scale: jax.Array,
    descale_v: jax.Array,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    window: tuple[int, int],
    softmax_scale: float,
    lean_p: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """`attention_int8_emulated` of a packed batch as the INT8 varlen kernel computes it: packed codes
    (q8 [Tq, Hq, D], k8 and v8 [Tk, Hkv, D]) with per-sequence scales (`jzyfa.int8_quant
    .int8_quantize_packed`), each sequence in a right-padded slot of the maxima (its scale blocks and
    key blocks from its first token, as the kernel's). window: the effective (left, right) mask.
    Returns (out bf16 [Tq, Hq, Dv], lse float32 [Hq, Tq]); tokens of no sequence give 0 and -inf."""

    def attend_slots(q, k, v, seqlens_q, seqlens_k):
        return attention_int8_emulated(
            q, k, v, q_scale, k_scale, descale_v, causal=False, window=window, softmax_scale=softmax_scale,
            seqlens_q=seqlens_q, seqlens_k=seqlens_k, out_dtype=jnp.bfloat16, lean_p=lean_p,
        )  # fmt: skip

    return varlen.through_slots(attend_slots, q8, k8, v8, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


# One program for the quantization, the emulation and the LSE correction (not dispatched op by op).
@functools.partial(jax.jit, static_argnames=("window", "softmax_scale", "rotate", "lean_p"))
def int8_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    window: tuple[int, int],
    softmax_scale: float,
    rotate: bool = False,
    lean_p: bool = True,
    seqlens_q: jax.Array | None = None,
    seqlens_k: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """precision="int8" end to end on 16-bit (or float32) q, k, v [B, S, H, D]: quantize
    (`jzyfa.int8_quant.int8_quantize_qkv`), attend as the kernel will, and give the LSE of the
    unsmoothed keys back. window: the effective (left, right) mask (causal folded in). Returns
    (out in q's dtype, lse float32 [B, Hq, Sq])."""
    x = int8_quant.int8_quantize_qkv(q, k, v, rotate=rotate, seqlens_q=seqlens_q, seqlens_k=seqlens_k)
    out, lse = attention_int8_emulated(
        x.q8, x.k8, x.v8, x.q_scale, x.k_scale, x.descale_v, causal=False, window=window,
        softmax_scale=softmax_scale, seqlens_q=seqlens_q, seqlens_k=seqlens_k, out_dtype=q.dtype, lean_p=lean_p,
    )  # fmt: skip
    shift = int8_quant.lse_shift(int8_quant.zero_padding(q, seqlens_q), x.key_mean, softmax_scale)
    return out, jnp.where(jnp.isfinite(lse), lse + shift, lse)
