"""precision="int8": smoothed keys, INT8 Q and K with per-block scales, e4m3 V (jzyfa.int8_quant), the
INT8 kernel's emulation (jzyfa.int8_emulation), which serves the call off Hopper, and the kernel path's
program (the primitive with int8 operands; its CPU lowering is the emulation, its CUDA lowering the
FFI call: tests/test_int8_kernel_gpu.py runs it)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64, offsets, random_qkv, relative_l2
from plan_rows import add_rows

import jzyfa
from jzyfa import fp8_emulation, int8_emulation, int8_quant, plan, primitives
from jzyfa.bench import inputs
from jzyfa.plan import FP8_V_LAYOUT_ENV

# Relative L2 of O against float64 attention on the unquantized inputs, Gaussian inputs at head dim
# 128: the float64 simulation of the quantization alone gives 0.029-0.030 at 128-token blocks (V's
# e4m3 rounding is most of it, tools/int8_block_sim.py) and lean P adds about 0.01 (docs/int8.md).
GAUSSIAN_TOLERANCE = 0.06


# --- quantization -----------------------------------------------------------------------------------


def test_int8_quantize_round_trip_and_scale_layout(rng):
    x = jnp.asarray(rng.standard_normal((2, 300, 3, 64)) * rng.uniform(0.1, 10, (1, 300, 3, 1)), jnp.float32)
    x = x.at[:, 256:].set(0.0).at[1, 256:, 0].set(5.0)  # an all-zero block, and a constant one
    x8, scale = int8_quant.int8_quantize(x, 128)
    assert x8.dtype == jnp.int8 and scale.dtype == jnp.float32
    assert scale.shape == (2, 3, 3)  # [B, H, ceil(300 / 128)]: the last block partial
    assert int(jnp.max(jnp.abs(x8.astype(jnp.int32)))) == 127
    np.testing.assert_array_equal(np.asarray(scale[0, :, 2]), 1.0)  # an all-zero block keeps scale 1
    np.testing.assert_allclose(np.asarray(scale[1, 0, 2]), 5.0 / 127, rtol=1e-7)
    back = int8_quant.int8_dequantize(x8, scale, 128)
    per_token = np.swapaxes(np.asarray(int8_quant.per_token(scale, 300, 128)), 1, 2)[..., None]
    # round to nearest: within half a step (plus float32 rounding of the scale) of every value
    assert np.all(np.abs(np.asarray(back) - np.asarray(x)) <= 0.5001 * per_token)
    # each block's largest magnitude lands on +-127
    blocks = np.abs(np.asarray(x8, np.int32)[:, :256].reshape(2, 2, 128, 3, 64)).max(axis=(2, 4))
    np.testing.assert_array_equal(blocks, 127)


def test_smooth_keys_subtracts_each_heads_mean_over_valid_keys(rng):
    k = jnp.asarray(rng.standard_normal((2, 40, 2, 16)) + 3.0, jnp.bfloat16)
    smoothed, mean = int8_quant.smooth_keys(k)
    np.testing.assert_allclose(np.asarray(mean), np.asarray(k, np.float32).mean(axis=1), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(smoothed).mean(axis=1), 0.0, atol=1e-5)
    smoothed, mean = int8_quant.smooth_keys(k, jnp.asarray([10, 40]))
    np.testing.assert_allclose(np.asarray(mean[0]), np.asarray(k[0, :10], np.float32).mean(axis=0), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(smoothed[0, 10:]), 0.0)  # padding: zeros, not in the mean


def test_smoothing_keeps_out_and_the_corrected_lse_in_float64(rng):
    q, k, v = random_qkv(
        rng, batch=2, seq_q=64, seq_k=96, heads_q=4, heads_kv=2, head_dim=32, dtype=jnp.float32
    )
    k = k + 2.0  # a common key offset, as outlier channels have
    smoothed, mean = int8_quant.smooth_keys(k)
    want_out, want_lse = naive_attention_f64(q, k, v, causal=True)
    out, lse = naive_attention_f64(q, smoothed, v, causal=True)
    np.testing.assert_allclose(out, want_out, atol=1e-6)  # the float32 subtraction's rounding
    shift = np.asarray(int8_quant.lse_shift(q, mean, 1 / np.sqrt(32)))
    np.testing.assert_allclose(lse + shift, want_lse, atol=1e-5)


# --- the emulation ----------------------------------------------------------------------------------


def test_int8_emulation_is_the_fp8_emulation_on_values_both_represent(rng):
    """Integers up to 16 are e4m3 values: with power-of-two scales the INT8 kernel's arithmetic is
    then the FP8 kernel's, bit for bit (the same blocked softmax, the same folded scale)."""
    shape_q, shape_kv = (1, 200, 4, 64), (1, 300, 2, 64)
    q8, k8 = (jnp.asarray(rng.integers(-16, 17, s), jnp.int8) for s in (shape_q, shape_kv))
    v8 = jnp.asarray(rng.standard_normal(shape_kv), jnp.float8_e4m3fn)
    dq, dk, dv = jnp.float32(0.25), jnp.float32(0.125), jnp.ones((1, 2), jnp.float32)
    got = int8_emulation.attention_int8_emulated(
        q8, k8, v8, jnp.full((1, 4, 2), dq), jnp.full((1, 2, 3), dk), dv, causal=True
    )
    want = fp8_emulation.attention_fp8_emulated(
        *(x.astype(jnp.float8_e4m3fn) for x in (q8, k8)), v8, dq, dk, dv, causal=True
    )
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_per_row_query_scales_are_the_block_scales_spread(rng):
    """q_block=1 (one scale per query row, the refinement docs/int8.md weighs) with each row given its
    block's scale is the 128-row-block call, bit for bit: the per-row factor is all the kernel reads."""
    q, k, v = random_qkv(rng, seq_q=200, seq_k=130, heads_q=2, head_dim=64)
    x = int8_quant.int8_quantize_qkv(q, k, v)
    args = (x.k8, x.v8)
    blocks = int8_emulation.attention_int8_emulated(
        x.q8, *args, x.q_scale, x.k_scale, x.descale_v, causal=True
    )
    rows = int8_emulation.attention_int8_emulated(
        x.q8, *args, int8_quant.per_token(x.q_scale, 200), x.k_scale, x.descale_v, causal=True, q_block=1
    )
    for a, b in zip(blocks, rows):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    per_row = int8_quant.int8_quantize_qkv(q, k, v, q_block=1)
    assert per_row.q_scale.shape == (1, 2, 200) and per_row.k_scale.shape == (1, 2, 2)


@pytest.mark.parametrize(
    "mask", [{"causal": True}, {}, {"window": (40, 8)}, {"causal": True, "window": (100, -1)}], ids=str
)
def test_int8_call_against_float64_gqa_masks(rng, mask):
    q, k, v = random_qkv(rng, batch=2, seq_q=130, seq_k=200, heads_q=4, heads_kv=2, head_dim=128)
    out, lse = jzyfa.flash_attention(q, k, v, precision="int8", return_lse=True, **mask)
    want, want_lse = naive_attention_f64(q, k, v, causal=mask.get("causal", False), window=mask.get("window"))
    assert out.dtype == jnp.bfloat16 and lse.shape == (2, 4, 130)
    assert relative_l2(out, want) < GAUSSIAN_TOLERANCE
    seen = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), seen)
    assert np.max(np.abs(np.asarray(lse)[seen] - want_lse[seen])) < 0.15


@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "rotated"])
def test_int8_call_at_head_dim_256_against_float64(rng, rotate):
    """Head dim 256: the kernel's 64-key blocks (two to a K scale block of 128 tokens), lengths off both."""
    assert int8_emulation.kernel_key_block(256) == 64 and int8_emulation.kernel_key_block(128) == 128
    q, k, v = random_qkv(rng, batch=1, seq_q=200, seq_k=333, heads_q=4, heads_kv=2, head_dim=256)
    out, lse = jzyfa.flash_attention(q, k, v, causal=True, precision="int8", rotate=rotate, return_lse=True)
    want, want_lse = naive_attention_f64(q, k, v, causal=True)
    assert out.shape == (1, 200, 4, 256)
    assert relative_l2(out, want) < GAUSSIAN_TOLERANCE
    assert np.max(np.abs(np.asarray(lse) - want_lse)) < 0.15


def test_int8_emulation_key_blocks_take_their_scale_blocks_scale(rng):
    """At head dim 256 the emulation walks 64-key blocks, each with the K scale of the 128-token block it
    lies in: with K scale blocks of very different magnitudes, O and the LSE are those of float64
    attention on the dequantized operands (a block given its neighbour's scale would be far off)."""
    q, k, v = random_qkv(rng, seq_q=100, seq_k=333, heads_q=2, head_dim=256)
    magnitude = np.ones((333,), np.float32)
    magnitude[128:256], magnitude[256:] = 8.0, 0.25
    k = (k.astype(jnp.float32) * magnitude[None, :, None, None] * 0.3).astype(k.dtype)
    x = int8_quant.int8_quantize_qkv(q, k, v)
    assert len(set(np.asarray(x.k_scale)[0, 0].round(5))) == 3
    out, lse = int8_emulation.attention_int8_emulated(x.q8, x.k8, x.v8, x.q_scale, x.k_scale, x.descale_v, causal=True)
    dequantized = (
        int8_quant.int8_dequantize(x.q8, x.q_scale),
        int8_quant.int8_dequantize(x.k8, x.k_scale),
        x.v8.astype(jnp.float32) * x.descale_v[:, None, :, None],
    )
    want_out, want_lse = naive_attention_f64(*dequantized, causal=True)
    assert relative_l2(out, want_out) < 0.05
    assert np.max(np.abs(np.asarray(lse) - want_lse)) < 0.15  # lean P's e4m3 sums: as in the other tests


def test_int8_call_f16_and_mla_head_dims(rng):
    q, k, v = random_qkv(rng, seq_q=64, seq_k=64, heads_q=2, head_dim=192, head_dim_v=128, dtype=jnp.float16)
    out = jzyfa.flash_attention(q, k, v, causal=True, precision="int8", rotate=False)
    assert out.dtype == jnp.float16 and out.shape == (1, 64, 2, 128)
    assert relative_l2(out, naive_attention_f64(q, k, v, causal=True)[0]) < GAUSSIAN_TOLERANCE


def test_int8_with_rotation_beats_fp8_on_activation_like_inputs():
    """The point of INT8 (docs/int8.md): on activation-like inputs (outlier key channels, a sink key),
    smoothed and rotated INT8 Q and K leave about two thirds of FP8's error (fixed seed: 0.043 against
    0.064)."""
    q, k, v = inputs.make_qkv("activations", 0, batch=1, seq_q=256, heads_q=4, heads_kv=2, head_dim=128)
    want, _ = naive_attention_f64(q, k, v, causal=True)
    call = functools.partial(jzyfa.flash_attention, q, k, v, causal=True)
    fp8 = relative_l2(call(precision="fp8"), want)  # FP8's better variant here (rotated: 0.071)
    int8 = relative_l2(call(precision="int8", rotate=True), want)
    assert int8 < 0.05 and int8 < 0.75 * fp8, (int8, fp8)


def test_padded_rows_are_their_own_sequences(rng):
    q, k, v = random_qkv(rng, batch=2, seq_q=100, seq_k=160, heads_q=2, head_dim=64)
    k = k.at[1, 150:].set(1e4)  # padding must not set a scale or the mean
    lengths_q, lengths_k = jnp.asarray([100, 37]), jnp.asarray([160, 150])
    out, lse = jzyfa.flash_attention(
        q, k, v, causal=True, precision="int8", return_lse=True, seqlens_q=lengths_q, seqlens_k=lengths_k
    )
    alone, alone_lse = jzyfa.flash_attention(q[1:, :37], k[1:, :150], v[1:, :150], causal=True, precision="int8",
                                             return_lse=True)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out[1, :37], np.float32), np.asarray(alone[0], np.float32))
    np.testing.assert_array_equal(np.asarray(lse[1, :, :37]), np.asarray(alone_lse[0]))
    np.testing.assert_array_equal(np.asarray(out[1, 37:], np.float32), 0.0)
    assert np.all(np.asarray(lse[1, :, 37:]) == -np.inf)


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_no_keys_gives_zero_rows_and_sinks_merge(rng, precision):
    q, k, v = random_qkv(rng, seq_q=8, seq_k=0, heads_q=2, head_dim=64)
    out, lse = jzyfa.flash_attention(q, k, v, precision=precision, return_lse=True)
    np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)
    assert np.all(np.asarray(lse) == -np.inf)
    if precision == "int8":  # sinks merge into the INT8 result as into any other
        q, k, v = random_qkv(rng, seq_q=8, seq_k=16, heads_q=2, head_dim=64)
        sinks = jnp.asarray([0.5, -1.0], jnp.float32)
        out, lse = jzyfa.flash_attention(q, k, v, precision="int8", return_lse=True)
        got = jzyfa.flash_attention(q, k, v, precision="int8", sinks=sinks)
        kept = 1 / (1 + np.exp(np.asarray(sinks)[None, :, None] - np.asarray(lse)))  # [B, H, Sq]
        want = np.asarray(out, np.float32) * np.swapaxes(kept, 1, 2)[..., None]
        np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=1e-2)


def test_varlen_is_each_sequence_alone(rng):
    lengths = [20, 0, 133, 11]
    cu = jnp.asarray(offsets(lengths), jnp.int32)
    q = jnp.asarray(rng.standard_normal((170, 4, 64)), jnp.bfloat16)  # 6 tokens of no sequence at the end
    kv = jnp.asarray(rng.standard_normal((164, 2, 64)), jnp.bfloat16)
    out, lse = jzyfa.flash_attention_varlen(
        q, kv, kv, cu, cu, 133, 133, causal=True, precision="int8", return_lse=True
    )
    assert out.shape == (170, 4, 64) and lse.shape == (4, 170)
    start = 20  # the third sequence
    alone, alone_lse = jzyfa.flash_attention(*(x[None, start : start + 133] for x in (q, kv, kv)), causal=True,
                                             precision="int8", return_lse=True)  # fmt: skip
    np.testing.assert_array_equal(
        np.asarray(out[start : start + 133], np.float32), np.asarray(alone[0], np.float32)
    )
    # The LSE's shift back (softmax_scale * q . key_mean, jzyfa.int8_quant.lse_shift) is a float32 dot
    # product whose summation order XLA picks by the operands' shapes: the packed and the alone call
    # may round it an ulp apart.
    np.testing.assert_allclose(np.asarray(lse[:, start : start + 133]), np.asarray(alone_lse[0]), rtol=1e-6, atol=0)
    np.testing.assert_array_equal(np.asarray(out[164:], np.float32), 0.0)
    assert np.all(np.asarray(lse[:, 164:]) == -np.inf)


def test_jit_and_vmap(rng):
    """Batch rows are quantized and attended independently, so mapping one-row calls over the batch gives
    the batched call."""
    q, k, v = random_qkv(rng, batch=3, seq_q=64, heads_q=2, head_dim=64)
    call = functools.partial(jzyfa.flash_attention, causal=True, precision="int8", rotate=True)
    eager = np.asarray(call(q, k, v), np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(call)(q, k, v), np.float32), eager)
    mapped = jax.vmap(lambda q, k, v: call(q[None], k[None], v[None])[0])(q, k, v)
    np.testing.assert_array_equal(np.asarray(mapped, np.float32), eager)


# --- errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options,error,message",
    [
        (
            {"implementation": "kernel"},
            ValueError,
            (
                r"^implementation='kernel' cannot serve this call: the INT8 \(int8 q and k, e4m3 v\) kernels take "
                r"head dims \(q and k / v\) 128/128, 192/128, got 64/64"
            ),
        ),
        ({"softcap": 30.0}, ValueError, "softcap is not available with precision='int8'"),
        ({"lean_p": 1}, TypeError, "lean_p must be a bool"),
        ({"rotate": "yes"}, TypeError, "rotate must be a bool"),
        (
            {"descale_q": jnp.ones(())},
            ValueError,
            "precision='int8' quantizes .* got bfloat16 inputs with descales",
        ),
        ({"softmax_scale": -1.0}, ValueError, "precision='int8' needs softmax_scale > 0"),
    ],
)
def test_int8_errors_name_the_argument(rng, options, error, message):
    q, k, v = random_qkv(rng, seq_q=8, heads_q=2, head_dim=64)
    with pytest.raises(error, match=message):
        jzyfa.flash_attention(q, k, v, precision="int8", **options)


def test_int8_refuses_fp8_inputs_and_gradients(rng):
    q, k, v = random_qkv(rng, seq_q=8, heads_q=2, head_dim=64)
    with pytest.raises(ValueError, match="got float8_e4m3fn inputs"):
        jzyfa.flash_attention(*(x.astype(jnp.float8_e4m3fn) for x in (q, k, v)), precision="int8")
    loss = lambda q: jnp.sum(jzyfa.flash_attention(q, k, v, precision="int8").astype(jnp.float32))
    with pytest.raises(TypeError, match="precision='int8' is not differentiable"):
        jax.grad(loss)(q)


def test_varlen_int8_errors():
    cu = jnp.asarray(offsets([8]), jnp.int32)
    x = jnp.zeros((8, 2, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"the INT8 .* kernels have no varlen layout at head dims 128/128"):
        jzyfa.flash_attention_varlen(x, x, x, cu, cu, 8, 8, precision="int8", implementation="kernel")
    with pytest.raises(ValueError, match="softcap is not available with precision='int8'"):
        jzyfa.flash_attention_varlen(x, x, x, cu, cu, 8, 8, precision="int8", softcap=5.0)


def test_emulation_checks_its_operands(rng):
    q8 = jnp.zeros((1, 8, 2, 64), jnp.int8)
    v8 = jnp.zeros((1, 8, 2, 64), jnp.float8_e4m3fn)
    scale = jnp.ones((1, 2, 1), jnp.float32)
    with pytest.raises(TypeError, match="k8 must be int8"):
        int8_emulation.attention_int8_emulated(q8, v8, v8, scale, scale, jnp.ones((1, 2)), causal=True)
    with pytest.raises(ValueError, match=r"k_scale must have shape \(1, 2, 1\)"):
        int8_emulation.attention_int8_emulated(
            q8, q8, v8, scale, scale[..., :0], jnp.ones((1, 2)), causal=True
        )
    with pytest.raises(ValueError, match="block must be a multiple of the kernel's key block, 128 keys at head dim 64"):
        int8_emulation.attention_int8_emulated(
            q8, q8, v8, scale, scale, jnp.ones((1, 2)), causal=True, block=64
        )


# --- the kernel path: dense calls at head dim 128 ------------------------------------------------------


@pytest.fixture
def primitive_path(monkeypatch):
    """INT8 calls the plan's kernel serves bind the primitive on this CPU too (its CPU lowering is the
    emulation), as they do on a Hopper GPU."""
    original = plan.choose_path
    monkeypatch.setattr(
        plan, "choose_path", lambda problem, implementation, *, cpu_primitive: original(
            problem, implementation, cpu_primitive=True
        ),
    )  # fmt: skip


def test_kernel_rows_are_the_dense_fp8_tiles():
    rows = {row for row in plan.KERNELS if row.family == "int8"}
    assert rows == {plan.Config("int8", (128, 128), mask, "dense") for mask in plan.MASKS} | {
        plan.Config("int8", (192, 128), mask, "dense") for mask in ("none", "causal")
    }


@pytest.mark.parametrize("v_layout", ["staged", "transposed"])
@pytest.mark.parametrize("window", [None, (-1, 0), (200, 30)], ids=["none", "causal", "window"])
def test_kernel_path_is_the_emulation_bit_for_bit(rng, primitive_path, monkeypatch, window, v_layout):
    """The primitive's program (quantize, int8 operands, V as it is or V^T, LSE shift) on the CPU gives
    exactly what the emulation path gives: the same quantization and, as its CPU lowering, the same
    emulation."""
    del primitive_path
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, v_layout)
    jax.clear_caches()
    q, k, v = random_qkv(rng, seq_q=300, seq_k=400, heads_q=4, heads_kv=2, head_dim=128)
    kernel = jax.jit(lambda q, k, v: jzyfa.flash_attention(q, k, v, window=window, precision="int8", return_lse=True))
    assert "jzyfa_attention_fwd" in str(jax.make_jaxpr(kernel)(q, k, v))  # the primitive was bound
    got = kernel(q, k, v)
    want = jzyfa.flash_attention(q, k, v, window=window, precision="int8", return_lse=True, implementation="xla")
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_cuda_lowering_passes_int8_operands_and_scales(primitive_path):
    """Lowered for CUDA: one forward custom call on int8 q and k, e4m3 v, the q and k scales per 128
    tokens and head and v's per (batch, KV head), bf16 out."""
    del primitive_path
    q = jax.ShapeDtypeStruct((2, 300, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 260, 2, 128), jnp.bfloat16)
    fn = lambda q, k, v: jzyfa.flash_attention(q, k, v, causal=True, precision="int8", rotate=True)
    text = jax.jit(fn).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")
    (call,) = [line for line in text.splitlines() if 'custom_call_target="jzyfa_attention_fwd"' in line]
    for operand in ("s8[2,300,8,128]", "s8[2,260,2,128]", "f8e4m3fn[2,260,2,128]", "f32[2,8,3]", "f32[2,2,3]",
                    "f32[2,2]", "bf16[2,300,8,128]"):  # fmt: skip
        assert operand in call, (operand, call)
    # The quantization: one device call on the bf16 q, k, v and the rotation's signs, its results the
    # attention's operands, the key mean and a workspace of one row of sums per 512-key chunk.
    (quantize,) = [line for line in text.splitlines() if 'custom_call_target="jzyfa_int8_quantize"' in line]
    for shape in ("bf16[2,300,8,128]", "bf16[2,260,2,128]", "f32[128]", "s8[2,300,8,128]", "f32[2,2,128]",
                  "f32[2,2,1,129]"):  # fmt: skip
        assert shape in quantize, (shape, quantize)
    assert "rotate = true" in quantize
    assert "window_right = 0" in call or "causal = true" in call
    assert "v_transposed = false" in call  # 300 x 4 rows per KV head: V as it is (the FP8 rule)


def test_cuda_lowering_of_long_rows_takes_v_transposed(primitive_path):
    """Past FP8_STAGED_V_MAX_ROWS query rows per KV head, V^T from the layout target (as FP8 calls)."""
    del primitive_path
    jax.clear_caches()
    q = jax.ShapeDtypeStruct((1, 2100, 2, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 2100, 2, 128), jnp.bfloat16)
    fn = lambda q, k, v: jzyfa.flash_attention(q, k, v, causal=True, precision="int8")
    text = jax.jit(fn).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")
    (call,) = [line for line in text.splitlines() if 'custom_call_target="jzyfa_attention_fwd"' in line]
    assert "v_transposed = true" in call and "f8e4m3fn[1,2,128,2112]" in call, call
    assert 'custom_call_target="jzyfa_fp8_value_operand"' in text


@pytest.mark.parametrize("head_dims", [(256, 256), (192, 128)], ids=["hd256", "mla"])
def test_other_head_dims_kernel_path_lowers_and_is_the_emulation(rng, primitive_path, monkeypatch, head_dims):
    """Head dim 256 and MLA's 192/128 (the kernel's rows added for this test where the plan lacks them):
    int8 q and k at their head dim, V^T from the layout target at head dim 256 whatever the rows (V as it
    is for MLA's few rows), the quantization in XLA ops (the device quantizer takes head dim 128 alone),
    the scales per 128 tokens; on the CPU the primitive's program is the emulation path bit for bit."""
    del primitive_path
    qk, dv = head_dims
    add_rows(monkeypatch, "int8", head_dims, layouts=("dense",))
    q = jax.ShapeDtypeStruct((2, 300, 8, qk), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 260, 2, qk), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((2, 260, 2, dv), jnp.bfloat16)
    fn = lambda q, k, v: jzyfa.flash_attention(q, k, v, causal=True, precision="int8", rotate=qk == dv)
    text = jax.jit(fn).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")
    (call,) = [line for line in text.splitlines() if 'custom_call_target="jzyfa_attention_fwd"' in line]
    v_operand = "f8e4m3fn[2,2,256,288]" if dv == 256 else "f8e4m3fn[2,260,2,128]"
    for operand in (f"s8[2,300,8,{qk}]", f"s8[2,260,2,{qk}]", v_operand, "f32[2,8,3]", "f32[2,2,3]"):
        assert operand in call, (operand, call)
    assert f"v_transposed = {str(dv == 256).lower()}" in call
    assert 'custom_call_target="jzyfa_int8_quantize"' not in text
    q, k, v = random_qkv(rng, seq_q=150, seq_k=200, heads_q=4, heads_kv=2, head_dim=qk, head_dim_v=dv)
    kernel = jax.jit(lambda q, k, v: jzyfa.flash_attention(q, k, v, causal=True, precision="int8", return_lse=True))
    assert "jzyfa_attention_fwd" in str(jax.make_jaxpr(kernel)(q, k, v))
    want = jzyfa.flash_attention(q, k, v, causal=True, precision="int8", return_lse=True, implementation="xla")
    for g, w in zip(kernel(q, k, v), want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


# --- packed and padded batches: the INT8 varlen kernel's program -------------------------------------


def packed_qkv(rng, lengths_q, lengths_k, *, heads_q=4, heads_kv=2, head_dim=128, pad_q=0):
    """bf16 packed q, k (with a shared offset to smooth away), v and int32 offsets."""
    cu_q, cu_k = (jnp.asarray(offsets(lengths), jnp.int32) for lengths in (lengths_q, lengths_k))
    total_q, total_k = int(cu_q[-1]) + pad_q, int(cu_k[-1])
    q = jnp.asarray(rng.standard_normal((total_q, heads_q, head_dim)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((total_k, heads_kv, head_dim)) + rng.standard_normal(head_dim), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((total_k, heads_kv, head_dim)), jnp.bfloat16)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "rotated"])
def test_packed_quantization_is_each_sequence_alone(rng, rotate):
    """int8_quantize_packed: each sequence's codes, scales, v descale and key mean are the dense
    quantization's of that sequence alone (scale blocks from its first token); tokens of no sequence get
    zero codes; blocks without tokens (and empty sequences) scale 1."""
    lengths = [130, 0, 257, 5]
    q, k, v, cu_q, cu_k = packed_qkv(rng, lengths, lengths, pad_q=3)
    x = int8_quant.int8_quantize_packed(q, k[:392], v[:392], cu_q, cu_k, 300, 300, rotate=rotate)
    assert x.q_scale.shape == (4, 4, 3) and x.k_scale.shape == (4, 2, 3) and x.descale_v.shape == (4, 2)
    assert x.q8.shape == q.shape and x.key_mean.shape == (4, 2, 128)
    for s, (start, end) in enumerate(zip(np.asarray(cu_q[:-1]), np.asarray(cu_q[1:]))):
        if start == end:
            np.testing.assert_array_equal(np.asarray(x.q_scale[s]), 1.0)
            np.testing.assert_array_equal(np.asarray(x.descale_v[s]), 1.0)
            continue
        alone = int8_quant.int8_quantize_qkv(*(t[None, start:end] for t in (q, k, v)), rotate=rotate)
        blocks = -(-(end - start) // 128)
        for name in ("q8", "k8", "v8"):
            np.testing.assert_array_equal(
                np.asarray(getattr(x, name)[start:end], np.float32), np.asarray(getattr(alone, name)[0], np.float32)
            )
        np.testing.assert_array_equal(np.asarray(x.q_scale[s, :, :blocks]), np.asarray(alone.q_scale[0]))
        np.testing.assert_array_equal(np.asarray(x.q_scale[s, :, blocks:]), 1.0)
        np.testing.assert_array_equal(np.asarray(x.k_scale[s, :, :blocks]), np.asarray(alone.k_scale[0]))
        np.testing.assert_array_equal(np.asarray(x.descale_v[s]), np.asarray(alone.descale_v[0]))
        np.testing.assert_allclose(np.asarray(x.key_mean[s]), np.asarray(alone.key_mean[0]), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(x.q8[392:], np.int32), 0)


def varlen_rows(monkeypatch):
    add_rows(monkeypatch, "int8", (128, 128), layouts=("varlen",))  # built, planned or not yet


@pytest.mark.parametrize("v_layout", ["staged", "transposed"])
@pytest.mark.parametrize(
    "causal, window, heads_q, heads_kv, rotate",
    [(True, None, 4, 2, False), (False, None, 4, 4, True), (False, (100, 20), 4, 1, False)],
    ids=["causal-gqa", "none-rotated", "window-mqa"],
)
def test_varlen_kernel_path_is_the_emulation_path(rng, primitive_path, monkeypatch, causal, window, heads_q,
                                                  heads_kv, rotate, v_layout):  # fmt: skip
    """flash_attention_varlen(precision="int8") on the kernel's program (quantized on the packed tokens,
    the varlen int8 operands, V as it is or the varlen V^T, the LSE shift; the CPU lowering emulates each
    sequence in a slot) gives what the emulation path (each sequence in a slot from the start) gives: out
    bit for bit, the LSE to its shift's float32 rounding."""
    del primitive_path
    varlen_rows(monkeypatch)
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, v_layout)
    lengths_q, lengths_k = [130, 0, 257, 5, 1], [200, 9, 257, 0, 129]
    q, k, v, cu_q, cu_k = packed_qkv(rng, lengths_q, lengths_k, heads_q=heads_q, heads_kv=heads_kv, pad_q=4)

    def call(q, k, v, cu_q, cu_k, implementation=None):
        return jzyfa.flash_attention_varlen(q, k, v, cu_q, cu_k, 257, 257, causal=causal, window=window,
                                            precision="int8", rotate=rotate, return_lse=True,
                                            implementation=implementation)  # fmt: skip

    kernel = jax.jit(call)
    assert "jzyfa_attention_fwd" in str(jax.make_jaxpr(kernel)(q, k, v, cu_q, cu_k))
    got_out, got_lse = kernel(q, k, v, cu_q, cu_k)
    want_out, want_lse = call(q, k, v, cu_q, cu_k, implementation="xla")
    np.testing.assert_array_equal(np.asarray(got_out, np.float32), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(np.isfinite(got_lse), np.isfinite(want_lse))
    finite = np.isfinite(np.asarray(want_lse))
    np.testing.assert_allclose(np.asarray(got_lse)[finite], np.asarray(want_lse)[finite], rtol=1e-6)


def test_padded_kernel_path_is_the_emulation_path(rng, primitive_path, monkeypatch):
    """Padded dense batches take the varlen kernel's program (each row's valid tokens a sequence, its
    padding another, `jzyfa.padded`): the emulation path's out bit for bit, padded rows 0 and -inf."""
    del primitive_path
    varlen_rows(monkeypatch)
    q, k, v = random_qkv(rng, batch=3, seq_q=300, seq_k=260, heads_q=4, heads_kv=2, head_dim=128)
    lengths_q, lengths_k = jnp.asarray([300, 1, 150], jnp.int32), jnp.asarray([260, 129, 0], jnp.int32)

    def call(q, k, v, lq, lk, implementation=None):
        return jzyfa.flash_attention(q, k, v, causal=True, precision="int8", seqlens_q=lq, seqlens_k=lk,
                                     return_lse=True, implementation=implementation)  # fmt: skip

    kernel = jax.jit(call)
    assert "jzyfa_attention_fwd" in str(jax.make_jaxpr(kernel)(q, k, v, lengths_q, lengths_k))
    got_out, got_lse = kernel(q, k, v, lengths_q, lengths_k)
    want_out, want_lse = call(q, k, v, lengths_q, lengths_k, implementation="xla")
    np.testing.assert_array_equal(np.asarray(got_out, np.float32), np.asarray(want_out, np.float32))
    finite = np.isfinite(np.asarray(want_lse))
    np.testing.assert_array_equal(np.isfinite(got_lse), finite)
    assert not finite[1, :, 1:].any() and not finite[2].any()  # padded rows, and a row with no keys
    np.testing.assert_allclose(np.asarray(got_lse)[finite], np.asarray(want_lse)[finite], rtol=1e-6)


@pytest.mark.parametrize("v_layout", ["staged", "transposed"])
def test_cuda_lowering_of_varlen_int8(primitive_path, monkeypatch, v_layout):
    """Lowered for CUDA: one varlen forward custom call on packed int8 q and k, e4m3 v (or the varlen
    V^T), the offsets, then q_scale and k_scale per (sequence, head) over the maxima's 128-token blocks
    and descale_v per (sequence, KV head); no device quantization call (XLA ops quantize packed tokens)."""
    del primitive_path
    varlen_rows(monkeypatch)
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, v_layout)
    q = jax.ShapeDtypeStruct((700, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((600, 2, 128), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((4,), jnp.int32)
    fn = lambda q, k, v, cu_q, cu_k: jzyfa.flash_attention_varlen(q, k, v, cu_q, cu_k, 400, 300, causal=True,
                                                                  precision="int8", rotate=True)  # fmt: skip
    text = jax.jit(fn).trace(q, kv, kv, cu, cu).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")
    (call,) = [line for line in text.splitlines() if 'custom_call_target="jzyfa_attention_fwd"' in line]
    transposed = v_layout == "transposed"
    v_operand = "f8e4m3fn[2,128,736]" if transposed else "f8e4m3fn[600,2,128]"  # roundup32(600) + 32 * 4 keys
    for operand in ("s8[700,8,128]", "s8[600,2,128]", v_operand, "s32[4]", "f32[3,8,4]", "f32[3,2,3]", "f32[3,2]",
                    "bf16[700,8,128]"):  # fmt: skip
        assert operand in call, (operand, call)
    assert "varlen = true" in call and "max_seqlen_q = 400" in call
    assert f"v_transposed = {str(transposed).lower()}" in call
    assert 'custom_call_target="jzyfa_int8_quantize"' not in text


def test_kernel_path_refusals(rng):
    """implementation="kernel" with lean_p=False or off CUDA says why; padded calls run the emulation."""
    q, k, v = random_qkv(rng, seq_q=64, heads_q=2, head_dim=128)
    with pytest.raises(ValueError, match="the INT8 kernel computes lean P only"):
        jzyfa.flash_attention(q, k, v, precision="int8", lean_p=False, implementation="kernel")
    with pytest.raises(ValueError, match="implementation='kernel' needs a Hopper GPU"):
        jzyfa.flash_attention(q, k, v, precision="int8", implementation="kernel")
    with pytest.raises(ValueError, match="kernels have no varlen layout"):
        lengths = jnp.asarray([50], jnp.int32)
        jzyfa.flash_attention(q, k, v, precision="int8", seqlens_q=lengths, seqlens_k=lengths, implementation="kernel")


def test_primitive_refuses_to_be_differentiated(rng, primitive_path):
    del primitive_path
    q, k, v = random_qkv(rng, seq_q=64, heads_q=2, head_dim=128)
    loss = lambda q: jnp.sum(jzyfa.flash_attention(q, k, v, precision="int8").astype(jnp.float32))
    with pytest.raises(TypeError, match="precision='int8' is not differentiable"):
        jax.grad(loss)(q)
    spec = primitives.make_spec(softmax_scale=0.1, causal=True, int8=True)
    assert spec.eight_bit and spec.num_extras == 3
