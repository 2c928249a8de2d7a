"""The INT8 kernel (precision="int8": int8 q and k with one scale per 128 tokens and head, e4m3 v) on a
Hopper GPU, through the FFI handler itself with NaN-poisoned outputs: against its emulation
(jzyfa.int8_emulation: the same integer scores, lean P codes from the same FFMA, so closely) and
against float64 attention on the unquantized inputs (loosely: the quantization's error); rows that see
no key; bitwise reruns; the public path; the handler's refusals. And the device quantization
(`jzyfa_int8_quantize`) against jzyfa.int8_quant's XLA ops.

Skipped without a Hopper GPU and the built extension (the plan's "int8" rows, jzyfa.plan.KERNELS).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64, random_qkv, relative_l2
from gpu_utils import assert_bitwise_reruns, ffi_attention, kernel_call, requires_hopper
from plan_rows import add_rows

import jzyfa
from jzyfa import fp8_layout, int8_quant, primitives
from jzyfa._validation import mask_window
from jzyfa.int8_emulation import attention_int8_emulated
from jzyfa.quantize import rotation_signs

pytestmark = [pytest.mark.gpu, requires_hopper]

EMULATION_TOLERANCE = 1e-2  # relative L2 of O against the emulation (float32 sums in other orders)
LSE_TOLERANCE = 1e-3  # relative L2 of the LSE against the emulation's, rows that see a key
# Relative L2 of O against float64 attention on the unquantized Gaussian inputs (tests/test_int8.py's:
# the quantization's ~0.03 and lean P's ~0.01, docs/int8.md).
FLOAT64_TOLERANCE = 0.06


def quantized(q, k, v):
    return int8_quant.int8_quantize_qkv(q, k, v)


def kernel_poisoned(x: int8_quant.Int8Inputs, *, causal: bool, window, softmax_scale: float, v_transposed=False):
    """(out bf16, lse) from the handler, written into NaN-filled donated buffers (every element must be
    written), with the compiled program checked to alias them. v_transposed: V^T in the FP8 kernel's
    layout (`jzyfa.fp8_layout.fp8_value_operand`) instead of V as it is."""
    batch, seq_q, heads_q, _ = x.q8.shape

    def call(q8, k8, v8, q_scale, k_scale, descale_v, out_poison, lse_poison):
        del out_poison, lse_poison  # donated: their buffers become the results
        out, lse, _ = ffi_attention(
            q8, k8, v8, int8_scales=(q_scale, k_scale, descale_v), softmax_scale=softmax_scale, causal=causal,
            window=window, v_transposed=v_transposed,
        )  # fmt: skip
        return out, lse

    out_poison = jnp.full((batch, seq_q, heads_q, x.v8.shape[-1]), jnp.nan, jnp.bfloat16)
    lse_poison = jnp.full((batch, heads_q, seq_q), jnp.nan, jnp.float32)
    v = fp8_layout.fp8_value_operand(x.v8) if v_transposed else x.v8
    args = (x.q8, x.k8, v, x.q_scale, x.k_scale, x.descale_v, out_poison, lse_poison)
    fn = jax.jit(call, donate_argnums=(6, 7), keep_unused=True)
    hlo = fn.lower(*args).compile().as_text()
    assert "input_output_alias" in hlo and " copy(" not in hlo, hlo
    return fn(*args)


CASES = {
    # name: (batch, seq_q, seq_k, heads_q, heads_kv, causal, window)
    "one_token": (1, 1, 1, 2, 1, True, (-1, -1)),
    "short_causal": (1, 127, 129, 4, 2, True, (-1, -1)),
    "no_mask_1000": (1, 1000, 1000, 4, 2, False, (-1, -1)),
    "gqa_causal_unequal": (2, 700, 900, 8, 2, True, (-1, -1)),
    "rows_without_keys": (1, 500, 300, 2, 2, True, (-1, -1)),
    "window": (2, 600, 1500, 4, 1, False, (200, 30)),
    "causal_4k": (1, 4096, 4096, 8, 2, True, (-1, -1)),
}


@pytest.mark.parametrize("v_transposed", [False, True], ids=["v_staged", "v_transposed"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_int8_kernel_against_emulation_and_float64(rng, case, v_transposed):
    check_against_emulation_and_float64(rng, case, head_dim=128, v_transposed=v_transposed)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_int8_hd256_kernel_against_emulation_and_float64(rng, case):
    """Head dim 256: 64-key blocks, two to a K scale; V^T only."""
    check_against_emulation_and_float64(rng, case, head_dim=256, v_transposed=True)


@pytest.mark.parametrize("v_transposed", [False, True], ids=["v_staged", "v_transposed"])
@pytest.mark.parametrize("case", [c for c in CASES.values() if c[6] == (-1, -1)], ids=lambda c: f"{c[1]}x{c[2]}")
def test_int8_mla_kernel_against_emulation_and_float64(rng, case, v_transposed):
    """MLA's 192/128: q and k of 192, v of 128; causal or no mask."""
    check_against_emulation_and_float64(rng, case, head_dim=192, head_dim_v=128, v_transposed=v_transposed)


def check_against_emulation_and_float64(rng, case, *, head_dim: int, v_transposed: bool, head_dim_v=None) -> None:
    batch, seq_q, seq_k, heads_q, heads_kv, causal, window = case
    q, k, v = random_qkv(rng, batch=batch, seq_q=seq_q, seq_k=seq_k, heads_q=heads_q, heads_kv=heads_kv,
                         head_dim=head_dim, head_dim_v=head_dim_v)  # fmt: skip
    scale = head_dim**-0.5
    x = quantized(q, k, v)
    out, lse = kernel_poisoned(x, causal=causal, window=window, softmax_scale=scale, v_transposed=v_transposed)
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    folded = mask_window(causal, window)
    want_out, want_lse = attention_int8_emulated(
        x.q8, x.k8, x.v8, x.q_scale, x.k_scale, x.descale_v, causal=False, window=folded, softmax_scale=scale,
        out_dtype=jnp.bfloat16,
    )  # fmt: skip
    want_out, want_lse = np.asarray(want_out, np.float64), np.asarray(want_lse, np.float64)
    assert not np.isnan(out).any() and not np.isnan(lse).any(), "an element left unwritten (NaN poison)"
    # Rows that see no key: out 0 and lse -inf in both.
    empty = ~np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(lse), ~empty)
    np.testing.assert_array_equal(np.swapaxes(out, 1, 2)[empty], 0.0)
    assert relative_l2(out, want_out) < EMULATION_TOLERANCE
    if (~empty).any():
        assert relative_l2(lse[~empty], want_lse[~empty]) < LSE_TOLERANCE
    # Against float64 on the unquantized inputs: the quantization's error.
    ref_out, _ = naive_attention_f64(q, k, v, causal=causal, softmax_scale=scale, window=window)
    assert relative_l2(out, ref_out) < FLOAT64_TOLERANCE


@pytest.mark.parametrize("head_dim", [128, 256])
def test_int8_kernel_is_bitwise_deterministic(rng, head_dim):
    q, k, v = random_qkv(rng, batch=2, seq_q=1500, seq_k=1700, heads_q=8, heads_kv=2, head_dim=head_dim)
    x = quantized(q, k, v)
    v_transposed = head_dim != 128  # head dim 256 reads V^T only
    v8 = fp8_layout.fp8_value_operand(x.v8) if v_transposed else x.v8

    def fn(*operands):
        out, lse, _ = ffi_attention(
            *operands[:3], int8_scales=operands[3:], softmax_scale=0.09, causal=True, v_transposed=v_transposed
        )
        return out, lse

    assert_bitwise_reruns(fn, (x.q8, x.k8, v8, x.q_scale, x.k_scale, x.descale_v), reruns=100)


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("rotate", [False, True])
def test_public_path_runs_the_kernel(rng, monkeypatch, rotate, head_dim):
    """flash_attention(precision="int8") on a Hopper GPU: one program with the INT8 custom call, close to
    the emulation path (implementation="xla") in O and the unsmoothed keys' LSE."""
    add_rows(monkeypatch, "int8", (head_dim, head_dim), layouts=("dense",))  # built, planned or not yet
    q, k, v = random_qkv(rng, batch=1, seq_q=900, seq_k=1300, heads_q=4, heads_kv=2, head_dim=head_dim)
    run = jax.jit(lambda q, k, v: jzyfa.flash_attention(q, k, v, causal=True, precision="int8", rotate=rotate,
                                                        return_lse=True, implementation="kernel"))  # fmt: skip
    call = kernel_call(run.lower(q, k, v).compile().as_text())
    assert f"s8[1,900,4,{head_dim}]" in call, call
    out, lse = run(q, k, v)
    want_out, want_lse = jzyfa.flash_attention(q, k, v, causal=True, precision="int8", rotate=rotate, return_lse=True,
                                               implementation="xla")  # fmt: skip
    assert out.dtype == q.dtype
    assert relative_l2(np.asarray(out, np.float64), np.asarray(want_out, np.float64)) < EMULATION_TOLERANCE
    finite = np.isfinite(np.asarray(want_lse))
    assert relative_l2(np.asarray(lse)[finite], np.asarray(want_lse)[finite]) < LSE_TOLERANCE


def test_handler_refuses_bad_int8_operands(rng):
    """InvalidArgument naming the operand, never a launch on wrong shapes or types."""
    q, k, v = random_qkv(rng, seq_q=300, seq_k=200, heads_q=4, heads_kv=2, head_dim=128)
    x = quantized(q, k, v)
    scales = (x.q_scale, x.k_scale, x.descale_v)
    with pytest.raises(Exception, match=r"q_scale must be float32 \[1, 4, 3\], got \[1, 4, 2\]"):
        jax.block_until_ready(ffi_attention(x.q8, x.k8, x.v8, int8_scales=(x.q_scale[..., :2], *scales[1:])))
    with pytest.raises(Exception, match=r"k_scale must be float32 \[1, 2, 2\]"):
        jax.block_until_ready(ffi_attention(x.q8, x.k8, x.v8, int8_scales=(x.q_scale, x.q_scale, x.descale_v)))
    with pytest.raises(Exception, match="int8 q takes int8 k and float8_e4m3fn v"):
        jax.block_until_ready(ffi_attention(x.q8, x.k8, v, int8_scales=scales))
    with pytest.raises(Exception, match="lean_p must be true for int8 inputs"):
        jax.block_until_ready(ffi_attention(x.q8, x.k8, x.v8, int8_scales=scales, lean_p=False))
    with pytest.raises(Exception, match="v_transposed must be true for the INT8 kernel at head dim 256"):
        q, k, v = random_qkv(rng, seq_q=300, seq_k=200, heads_q=4, heads_kv=2, head_dim=256)
        x256 = quantized(q, k, v)
        jax.block_until_ready(
            ffi_attention(x256.q8, x256.k8, x256.v8, int8_scales=(x256.q_scale, x256.k_scale, x256.descale_v))
        )
    q64 = x.q8[..., :64]
    with pytest.raises(Exception, match=r"head_dim must be 128 or 256 for q, k and v, or 192 .*jzyfa INT8 kernel"):
        jax.block_until_ready(ffi_attention(q64, x.k8[..., :64], x.v8[..., :64], int8_scales=scales))


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize(("seq_q", "seq_k"), [(300, 1100), (1, 129), (4096, 4096)])
def test_device_quantization_matches_the_xla_ops(rng, rotate, dtype, seq_q, seq_k):
    """The device quantization (ffi/int8_quantize.cu) against int8_quantize_qkv in XLA ops on the same
    inputs: v's e4m3 codes and descales exactly (power-of-two scaling); the key mean and the scales to
    float32 rounding (sums in other orders, the rotation as butterflies rather than a matmul, XLA's
    division), so an int8 code may move by one where a value sits near a rounding boundary."""
    q, k, v = random_qkv(rng, batch=2, seq_q=seq_q, seq_k=seq_k, heads_q=8, heads_kv=2, head_dim=128, dtype=dtype)
    k = k + jnp.asarray(rng.standard_normal((1, 1, 2, 128)) * 3, dtype)  # a shared key offset to remove
    signs = rotation_signs(128)
    device = jax.jit(lambda q, k, v: int8_quantize_p_bind(q, k, v, signs, rotate))
    text = device.lower(q, k, v).compile().as_text()
    assert 'custom_call_target="jzyfa_int8_quantize"' in text
    got = device(q, k, v)
    x = jax.jit(lambda q, k, v: int8_quant.int8_quantize_qkv(q, k, v, rotate=rotate))(q, k, v)
    want = (x.q8, x.q_scale, x.k8, x.k_scale, x.v8, x.descale_v, x.key_mean)
    names = ("q8", "q_scale", "k8", "k_scale", "v8", "descale_v", "key_mean")
    got = dict(zip(names, (np.asarray(g.astype(jnp.float32) if g.dtype == jnp.float8_e4m3fn else g) for g in got)))
    want = dict(zip(names, (np.asarray(w.astype(jnp.float32) if w.dtype == jnp.float8_e4m3fn else w) for w in want)))
    np.testing.assert_array_equal(got["v8"], want["v8"])
    np.testing.assert_array_equal(got["descale_v"], want["descale_v"])
    np.testing.assert_allclose(got["key_mean"], want["key_mean"], rtol=1e-5, atol=1e-6)
    for scale in ("q_scale", "k_scale"):
        np.testing.assert_allclose(got[scale], want[scale], rtol=1e-5)
    for codes in ("q8", "k8"):
        diff = np.abs(got[codes].astype(np.int32) - want[codes].astype(np.int32))
        # At most one code, in at most 0.1% of the values (a few where there are only a few thousand:
        # seq_q = 1 has 2048 q values, and 3 of them sat on a boundary on the H100).
        moved = int((diff > 0).sum())
        assert diff.max() <= 1 and moved <= max(4, 1e-3 * diff.size), (codes, diff.max(), moved, diff.size)


def int8_quantize_p_bind(q, k, v, signs, rotate):
    return primitives.int8_quantize_p.bind(q, k, v, signs, rotate=rotate)


def test_device_quantization_is_bitwise_deterministic(rng):
    q, k, v = random_qkv(rng, batch=1, seq_q=2000, seq_k=3000, heads_q=4, heads_kv=2, head_dim=128)
    signs = rotation_signs(128)
    fn = jax.jit(lambda q, k, v: int8_quantize_p_bind(q, k, v, signs, True))
    assert_bitwise_reruns(fn, (q, k, v), reruns=20)
