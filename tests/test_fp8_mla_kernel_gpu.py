"""MLA's head dims (q/k 192, v 128) on the FP8 kernel (FlashFwdFp8MlaKernel), on a Hopper GPU: against its
emulation (the same algorithm: closely) and against float64 attention of the dequantized inputs (loosely),
outputs NaN-poisoned beforehand (donated buffers the kernel writes into), rows that see no key give O = 0
and LSE = -inf, causal and not, Sq != Sk both ways, lengths off the 128-row and 128-key tiles, GQA and MQA,
lean and exact P, bitwise-identical reruns, and the FFI handler's refusals.

Skipped without a Hopper GPU and the built extension. Runs the kernel through implementation="kernel"
(the plan's FP8 MLA rows: dense, no mask or causal). Tolerances are tests/test_fp8_kernel_gpu.py's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64
from gpu_utils import ffi_attention, requires_hopper
from test_fp8_kernel_gpu import (
    EMULATION_TOLERANCE,
    FLOAT64_TOLERANCE,
    assert_fp8_kernel_reruns_bitwise,
    assert_matches_emulation,
    emulated_on_cpu,
    run_poisoned,
)
from test_kernel_gpu import relative_l2

from jzyfa.primitives import fp8_value_operand_p
from jzyfa.quantize import fp8_quantize

pytestmark = [pytest.mark.gpu, requires_hopper]

HEAD_DIM, HEAD_DIM_V = 192, 128


def fp8_mla_qkv(seed, batch, seq_q, seq_k, heads_q, heads_kv, granularity):
    """e4m3 q, k [.., 192] and v [.., 128] (standard normal, quantized) with their descales."""
    rng = np.random.default_rng(seed)
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape, np.float32))
        for shape in (
            (batch, seq_q, heads_q, HEAD_DIM),
            (batch, seq_k, heads_kv, HEAD_DIM),
            (batch, seq_k, heads_kv, HEAD_DIM_V),
        )
    )
    q8, dq = fp8_quantize(q, granularity, kv_heads=heads_kv if granularity == "head" else None)
    k8, dk = fp8_quantize(k, granularity)
    v8, dv = fp8_quantize(v, granularity)
    return (q8, k8, v8), (dq, dk, dv)


def dequantized(x8, d, heads):
    d = np.asarray(d, np.float64)
    if d.ndim == 2:  # [B, Hkv] -> per head of x
        d = np.repeat(d, heads // d.shape[1], axis=1)[:, None, :, None]
    return np.asarray(x8.astype(jnp.float32), np.float64) * d


# (batch, seq_q, seq_k, heads_q, heads_kv, causal, granularity): lengths around the 128-row and 128-key
# tiles and off them (1000), Sq != Sk both ways (bottom-right causal; Sq > Sk leaves the first rows
# without keys), GQA 8/2 and MQA 8/1, per-tensor and per-head descales, a long row of key blocks.
CASES = [
    (2, 300, 300, 4, 2, True, "tensor"),
    (1, 1000, 1000, 8, 2, True, "head"),
    (1, 1000, 1000, 8, 1, False, "tensor"),
    (1, 77, 333, 2, 1, True, "tensor"),  # Sk > Sq, Sk not a multiple of 32
    (1, 200, 64, 2, 2, True, "tensor"),  # Sq > Sk: the first 136 rows see no key
    (1, 1000, 129, 8, 1, True, "head"),  # 871 rows see no key
    (2, 257, 513, 4, 4, False, "head"),
    (1, 128, 128, 8, 2, False, "tensor"),
    (1, 1, 1, 8, 2, True, "tensor"),
    (1, 4097, 4097, 4, 1, True, "tensor"),  # 33 key blocks: promotions of O's float32 copy
]


def case_id(case):
    batch, sq, sk, hq, hkv, causal, granularity = case
    return f"{'causal' if causal else 'full'}-b{batch}-{sq}x{sk}-h{hq}/{hkv}-{granularity}"


@pytest.mark.parametrize("lean_p", [True, False], ids=["lean", "exact"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fp8_mla_kernel_against_emulation_and_float64(fp8_v_layout, case, lean_p):
    batch, seq_q, seq_k, heads_q, heads_kv, causal, granularity = case
    seed = seq_q * 7 + seq_k
    (q8, k8, v8), descales = fp8_mla_qkv(seed, batch, seq_q, seq_k, heads_q, heads_kv, granularity)
    out, lse = run_poisoned(q8, k8, v8, descales, causal=causal, lean_p=lean_p)
    assert out.shape == (batch, seq_q, heads_q, HEAD_DIM_V)
    # The emulation's default scale is 1/sqrt(192), q's and k's head dim, as flash_attention's.
    assert_matches_references(out, lse, q8, k8, v8, descales, causal=causal, lean_p=lean_p)


def assert_matches_references(out, lse, q8, k8, v8, descales, *, causal, lean_p, window=None):
    """A poisoned kernel run's (out, lse) [B, Sq, Hq, Dv] and [B, Hq, Sq]: nothing left unwritten, the
    emulation closely and float64 attention of the dequantized inputs loosely (softmax scale 1/sqrt of
    q's head dim), the same rows without keys (O = 0, LSE = -inf)."""
    assert not np.isnan(out).any(), "the kernel left elements of O unwritten (NaN poison)"
    assert not np.isnan(lse).any(), "the kernel left LSE entries unwritten (NaN poison)"
    seen = assert_matches_emulation(out, lse, q8, k8, v8, descales, causal=causal, lean_p=lean_p, window=window)
    seq_q, heads_q, seq_k, heads_kv = q8.shape[1], q8.shape[2], k8.shape[1], k8.shape[2]
    if causal and seq_q > seq_k:
        assert not np.isfinite(lse).all()  # the case does test empty rows
    ref_out, ref_lse = naive_attention_f64(
        dequantized(q8, descales[0], heads_q),
        dequantized(k8, descales[1], heads_kv),
        dequantized(v8, descales[2], heads_kv),
        causal=causal,
        window=window,
        softmax_scale=q8.shape[-1] ** -0.5,
    )
    np.testing.assert_array_equal(np.isfinite(ref_lse), seen)
    err = relative_l2(out, ref_out)
    assert err < FLOAT64_TOLERANCE, f"relative L2 of O against float64 {err:.2e}"


def test_fp8_mla_kernel_is_bitwise_deterministic():
    qkv, descales = fp8_mla_qkv(11, 2, 1000, 1000, 8, 2, "tensor")
    assert_fp8_kernel_reruns_bitwise(*qkv, descales, reruns=20)


def handler_call(q8, k8, v8, descales, *, window=(-1, -1), out_head_dim=None, v_transposed=False):
    """The FFI handler itself (no dispatch in between; gpu_utils.ffi_attention), out taking v's head dim
    (or out_head_dim); with v_transposed, v8 is V^T [B, Hkv, 128, keys]."""
    return ffi_attention(
        q8,
        k8,
        v8,
        descales=descales,
        out_head_dim=out_head_dim,
        softmax_scale=0.1,
        causal=False,
        window=window,
        lean_p=True,
        v_transposed=v_transposed,
    )


def test_handler_runs_mla_and_refuses_what_it_has_no_kernel_for():
    """InvalidArgument, not a crash: head-dim pairs other than (128, 128) and (192, 128), MLA with a
    sliding window, q and k with different head dims, out without v's head dim."""
    (q8, k8, v8), descales = fp8_mla_qkv(3, 1, 200, 300, 4, 2, "tensor")
    out, lse, _ = jax.block_until_ready(handler_call(q8, k8, v8, descales))
    want_out, _, _ = emulated_on_cpu(q8, k8, v8, descales, causal=False, lean_p=True, softmax_scale=0.1)
    assert relative_l2(np.asarray(out.astype(jnp.float32)), want_out) < EMULATION_TOLERANCE
    assert np.isfinite(np.asarray(lse)).all()
    with pytest.raises(Exception, match="not a sliding window"):
        jax.block_until_ready(handler_call(q8, k8, v8, descales, window=(16, 4)))
    with pytest.raises(Exception, match="got 192 for q and k, 64 for v"):
        jax.block_until_ready(handler_call(q8, k8, v8[..., :64], descales))
    with pytest.raises(Exception, match="got 128 for q and k, 64 for v"):
        jax.block_until_ready(handler_call(q8[..., :128], k8[..., :128], v8[..., :64], descales))
    with pytest.raises(Exception, match="disagree on batch or head_dim"):
        jax.block_until_ready(handler_call(q8, k8[..., :128], v8, descales))
    with pytest.raises(Exception, match="out .* must have the shape of q .* with head_dim 128"):
        jax.block_until_ready(handler_call(q8, k8, v8, descales, out_head_dim=192))
    # v_transposed: vt [B, Hkv, 128, roundup32(Sk)] from the layout kernel, the same result.
    vt8 = fp8_value_operand_p.bind(v8)
    out_t, _, _ = jax.block_until_ready(handler_call(q8, k8, vt8, descales, v_transposed=True))
    np.testing.assert_array_equal(np.asarray(out_t.astype(jnp.float32)), np.asarray(out.astype(jnp.float32)))
    with pytest.raises(Exception, match="vt must hold seqlen_k rounded up to a multiple of 32 keys"):
        jax.block_until_ready(handler_call(q8, k8, vt8[..., :288], descales, v_transposed=True))
    with pytest.raises(Exception, match="and vt .* disagree"):
        jax.block_until_ready(handler_call(q8, k8, v8, descales, v_transposed=True))
