"""The Hopper kernel against float64 attention, on the GPU. Skips without a Hopper GPU.

Every check draws fresh random inputs and runs the kernel into output buffers that were
filled with NaN beforehand (a donated buffer that XLA aliases to the custom call's result),
so an element the kernel fails to write shows up as NaN.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import relative_l2
from gpu_utils import (
    assert_bitwise_reruns,
    assert_equals_per_head_calls,
    ffi_attention,
    kernel_call,
    requires_hopper,
    tile_groups,
)

import jzyfa

pytestmark = [pytest.mark.gpu, requires_hopper]

O_TOLERANCE = 1e-2  # relative L2 error of O for 16-bit inputs
LSE_TOLERANCE = 1e-4  # relative L2 error of the LSE (over rows that see a key)


def attention_float64(q, k, v, *, causal: bool, scale: float):
    """Naive float64 attention with bottom-right causal alignment; O = 0, LSE = -inf on empty rows."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    _, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    k = np.repeat(k, group, axis=2)
    v = np.repeat(v, group, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        visible = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
        s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_safe)
    total = p.sum(axis=-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", p / np.where(total > 0, total, 1.0), v)
    with np.errstate(divide="ignore"):
        lse = np.where(total[..., 0] > 0, np.log(total[..., 0]) + m_safe[..., 0], -np.inf)
    return out, lse


def run_kernel_poisoned_on_device(q, k, v, *, causal: bool, scale: float | None = None):
    """Runs the kernel writing into NaN-filled buffers; returns (out, lse) as device arrays."""

    def call(q, k, v, out_poison, lse_poison):
        del out_poison, lse_poison  # donated: their buffers become the results
        return jzyfa.flash_attention(
            q, k, v, causal=causal, softmax_scale=scale, return_lse=True, implementation="kernel"
        )

    b, sq, hq, _ = q.shape
    out_poison = jnp.full(q.shape, jnp.nan, q.dtype)
    lse_poison = jnp.full((b, hq, sq), jnp.nan, jnp.float32)
    fn = jax.jit(call, donate_argnums=(3, 4), keep_unused=True)
    hlo = fn.lower(q, k, v, out_poison, lse_poison).compile().as_text()
    call_line = kernel_call(hlo)  # the one jzyfa_attention_fwd custom call
    assert "varlen = false" in call_line, call_line
    # The poison only proves something if the kernel writes straight into the donated buffers.
    assert "input_output_alias" in hlo and " copy(" not in hlo, hlo
    return fn(q, k, v, out_poison, lse_poison)


def run_kernel_poisoned(q, k, v, *, causal: bool, scale: float | None = None):
    """Runs the kernel writing into NaN-filled buffers; returns (out, lse) as NumPy arrays."""
    out, lse = run_kernel_poisoned_on_device(q, k, v, causal=causal, scale=scale)
    return np.asarray(out.astype(jnp.float32)), np.asarray(lse)


def random_qkv(rng, batch, sq, sk, hq, hkv, d, dtype):
    q = rng.standard_normal((batch, sq, hq, d), np.float32)
    k = rng.standard_normal((batch, sk, hkv, d), np.float32)
    v = rng.standard_normal((batch, sk, hkv, d), np.float32)
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def check_against_float64(q, k, v, *, causal, scale=None):
    d = q.shape[-1]
    out, lse = run_kernel_poisoned(q, k, v, causal=causal, scale=scale)
    ref_out, ref_lse = attention_float64(
        np.asarray(q.astype(jnp.float32)),
        np.asarray(k.astype(jnp.float32)),
        np.asarray(v.astype(jnp.float32)),
        causal=causal,
        scale=scale if scale is not None else d**-0.5,
    )
    assert not np.isnan(out).any(), "the kernel left elements of O unwritten (NaN poison)"
    assert not np.isnan(lse).any(), "the kernel left LSE entries unwritten (NaN poison)"
    seen = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), seen, "rows with no visible key must give LSE = -inf")
    empty_rows = ~seen.transpose(0, 2, 1)  # [b, sq, h]
    assert np.all(out[empty_rows] == 0), "rows with no visible key must give O = 0"
    err_o = relative_l2(out, ref_out)
    assert err_o < O_TOLERANCE, f"relative L2 error of O {err_o:.2e}"
    if seen.any():
        err_lse = relative_l2(lse[seen], ref_lse[seen])
        assert err_lse < LSE_TOLERANCE, f"relative L2 error of LSE {err_lse:.2e}"
    return err_o


SEQ_PAIRS = [
    (1, 1),
    (127, 127),
    (129, 129),
    (1000, 1000),
    (4096, 4096),
    (100, 300),
    (300, 100),
    (1, 777),
    (177, 353),  # lengths off every key-block size (176 included)
    (64, 1),
]


@pytest.mark.parametrize(
    "dtype,head_dim,causal,seqs",
    [
        (dt, d, c, s)
        for dt, d, c, s in itertools.product([jnp.bfloat16, jnp.float16], [64, 128], [True, False], SEQ_PAIRS)
    ],
    ids=lambda x: getattr(x, "__name__", str(x)),
)
def test_matches_float64(dtype, head_dim, causal, seqs):
    sq, sk = seqs
    rng = np.random.default_rng(hash((sq, sk, head_dim, causal)) % 2**32)
    batch, hq, hkv = (1, 2, 2) if sq * sk > 10**6 else (2, 4, 2)
    q, k, v = random_qkv(rng, batch, sq, sk, hq, hkv, head_dim, dtype)
    check_against_float64(q, k, v, causal=causal)


@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 4), (8, 2), (8, 1)])
def test_gqa_and_mqa(hq, hkv):
    rng = np.random.default_rng(hq * 10 + hkv)
    q, k, v = random_qkv(rng, 2, 257, 257, hq, hkv, 128, jnp.bfloat16)
    check_against_float64(q, k, v, causal=True)


def test_custom_scale_and_large_scores():
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, 1, 300, 300, 2, 2, 128, jnp.bfloat16)
    check_against_float64(q * 4, k, v, causal=True, scale=0.3)


def test_deterministic_across_launches():
    """Bitwise-identical O and LSE over 100 launches, with other GPU work in between."""
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, 2, 1000, 1000, 4, 4, 128, jnp.bfloat16)
    fn = jax.jit(
        lambda q, k, v: jzyfa.flash_attention(q, k, v, causal=True, return_lse=True, implementation="kernel")
    )
    assert_bitwise_reruns(fn, (q, k, v), reruns=100)


@pytest.mark.parametrize(
    "batch,seq,hq,hkv,causal",
    [
        (1, 16384, 16, 16, False),  # 4 groups of 4 heads on the H200
        (2, 8192, 16, 4, True),  # 2 groups of 16 (batch, head) pairs, GQA
    ],
)
def test_tile_groups_cover_every_tile(batch, seq, hq, hkv, causal):
    """Calls whose tile order has several groups of (batch, head) pairs (PlanTile) give, bit for bit,
    what one call per (batch, KV head) gives, each of those a single group."""
    assert tile_groups(batch=batch, seq_q=seq, seq_k=seq, heads_q=hq, causal=causal) > 1
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, batch, seq, seq, hq, hkv, 128, jnp.bfloat16)
    assert_equals_per_head_calls(lambda q, k, v: run_kernel_poisoned(q, k, v, causal=causal), q, k, v)


def test_kernel_and_reference_path_agree_under_jit():
    """The same jitted program through the kernel and through implementation='xla'."""
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 2, 513, 700, 4, 2, 64, jnp.float16)
    kern = jax.jit(lambda *a: jzyfa.flash_attention(*a, causal=True, implementation="kernel"))(q, k, v)
    ref = jax.jit(lambda *a: jzyfa.flash_attention(*a, causal=True, implementation="xla"))(q, k, v)
    err = relative_l2(np.asarray(kern, np.float32), np.asarray(ref, np.float32))
    assert err < O_TOLERANCE


def test_handler_rejects_unsupported_head_dim():
    """The FFI handler itself answers InvalidArgument, not a crash, for what it cannot run (the
    jzyfa_attention_fwd contract: every attribute present, gpu_utils.ffi_attention)."""
    q = jnp.ones((1, 8, 1, 96), jnp.bfloat16)
    with pytest.raises(Exception, match="jzyfa_attention_fwd: head_dim must be 64, 128 or 256 .* got 96"):
        jax.block_until_ready(ffi_attention(q, q, q, causal=True))


def test_handler_checks_the_operand_list():
    """The handler takes descales exactly for float8_e4m3fn q, and V^T only for FP8 (its error names the
    operands it expected)."""
    q = jnp.ones((1, 8, 1, 128), jnp.bfloat16)
    ones = (jnp.ones((1,), jnp.float32),) * 3
    with pytest.raises(Exception, match=r"expected 3 operands \(q, k, v\), got 6"):
        jax.block_until_ready(ffi_attention(q, q, q, descales=ones))
    q8 = q.astype(jnp.float8_e4m3fn)
    with pytest.raises(
        Exception, match=r"expected 6 operands \(q, k, v, descale_q, descale_k, descale_v\), got 3"
    ):
        jax.block_until_ready(ffi_attention(q8, q8, q8))
    with pytest.raises(Exception, match="v_transposed must be false for 16-bit inputs"):
        jax.block_until_ready(ffi_attention(q, q, q, v_transposed=True, out_head_dim=128))
