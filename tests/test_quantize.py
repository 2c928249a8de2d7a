"""fp8_quantize, dequantize, hadamard_rotate, and FP8 flash_attention on the pure-JAX path."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64, random_qkv
from hypothesis import given, settings
from hypothesis import strategies as st

import jzyfa
from jzyfa.quantize import FP8_MAX

SHAPE = (2, 32, 4, 64)


@functools.partial(jax.jit, static_argnames=("granularity", "kv_heads"))
def round_trip(x, granularity="tensor", kv_heads=None):
    x8, descale = jzyfa.fp8_quantize(x, granularity, kv_heads=kv_heads)
    return x8, descale, jzyfa.dequantize(x8, descale)


def assert_smallest_power_of_two(descale, amax):
    descale, amax = np.asarray(descale, np.float64), np.asarray(amax, np.float64)
    exponent = np.log2(descale)
    np.testing.assert_array_equal(exponent, np.round(exponent))
    assert np.all(amax / descale <= FP8_MAX)
    assert np.all(amax / descale > FP8_MAX / 2)  # half the descale would overflow


@settings(max_examples=25, deadline=None)
@given(log2_scale=st.floats(-12, 12), seed=st.integers(0, 2**16))
def test_tensor_round_trip(log2_scale, seed):
    x = np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32) * np.float32(2.0**log2_scale)
    x8, descale, restored = round_trip(jnp.asarray(x))
    assert x8.dtype == jnp.float8_e4m3fn and descale.shape == () and descale.dtype == jnp.float32
    assert_smallest_power_of_two(descale, np.abs(x).max())
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values; subnormal codes are
    # spaced 2^-9, so values below 2^-6 (times descale) are off by at most 2^-10 * descale.
    bound = np.maximum(np.abs(x) / 16, float(descale) * 2.0**-10)
    assert np.all(np.abs(np.asarray(restored) - x) <= bound)


@pytest.mark.parametrize("kv_heads,groups", [(None, 4), (2, 2), (1, 1)])
def test_head_round_trip(rng, kv_heads, groups):
    # Heads of very different magnitudes, so a shared descale would be wrong for most of them.
    magnitudes = 2.0 ** rng.integers(-8, 8, size=(2, 1, 4, 1))
    x = (rng.standard_normal(SHAPE) * magnitudes).astype(np.float32)
    x8, descale, restored = round_trip(jnp.asarray(x), "head", kv_heads)
    assert descale.shape == (2, groups)
    grouped = np.abs(x).reshape(2, 32, groups, 4 // groups, 64)
    assert_smallest_power_of_two(descale, grouped.max(axis=(1, 3, 4)))
    per_head_descale = np.repeat(np.asarray(descale), 4 // groups, axis=1)[:, None, :, None]
    assert np.all(np.abs(np.asarray(restored) - x) <= np.maximum(np.abs(x) / 16, per_head_descale * 2.0**-10))


def test_zero_tensor_and_exact_power_of_two():
    _, descale, restored = round_trip(jnp.zeros(SHAPE))
    assert float(descale) == 1.0 and not np.any(np.asarray(restored))
    x = jnp.zeros(SHAPE).at[0, 0, 0, 0].set(FP8_MAX * 4)  # amax / 448 is exactly 4
    x8, descale, _ = round_trip(x)
    assert float(descale) == 4.0 and float(x8[0, 0, 0, 0].astype(jnp.float32)) == FP8_MAX


def test_quantize_argument_errors():
    with pytest.raises(ValueError, match="granularity must be one of"):
        jzyfa.fp8_quantize(jnp.ones(SHAPE), "channel")
    with pytest.raises(ValueError, match="rank 4"):
        jzyfa.fp8_quantize(jnp.ones((4, 64)), "head")
    with pytest.raises(ValueError, match="kv_heads=3 must divide the 4 heads"):
        jzyfa.fp8_quantize(jnp.ones(SHAPE), "head", kv_heads=3)
    with pytest.raises(ValueError, match="kv_heads applies only to"):
        jzyfa.fp8_quantize(jnp.ones(SHAPE), kv_heads=2)


# --- Hadamard rotation -------------------------------------------------------------------------


def test_hadamard_rotation_keeps_scores(rng):
    q, k, _ = random_qkv(rng, seq_q=16, seq_k=24, heads_q=2, head_dim=128, dtype=jnp.float32)
    q_rot, k_rot = jax.jit(jzyfa.hadamard_rotate)(q, k, jax.random.key(3))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest")
    rotated = jnp.einsum("bqhd,bkhd->bhqk", q_rot, k_rot, precision="highest")
    np.testing.assert_allclose(rotated, scores, atol=1e-4)
    assert not np.allclose(q_rot, q)  # it did rotate
    np.testing.assert_array_equal(jzyfa.hadamard_rotate(q, k, 3)[0], q_rot)  # int seed == key
    assert not np.allclose(jzyfa.hadamard_rotate(q, k, 4)[0], q_rot)  # another seed, other signs


def test_hadamard_rotation_spreads_outlier_channels(rng):
    q, k, _ = random_qkv(rng, seq_q=64, seq_k=64, heads_q=2, head_dim=64, dtype=jnp.float32)
    k = k.at[..., 5].multiply(50.0)  # an outlier channel, as in real keys
    k_rot = jzyfa.hadamard_rotate(q, k)[1]
    # The outlier's energy is shared by all 64 channels: the largest entry shrinks by about 8x.
    assert float(jnp.abs(k_rot).max()) < float(jnp.abs(k).max()) / 4
    channel_rms = jnp.sqrt(jnp.mean(k_rot**2, axis=(0, 1, 2)))
    assert float(channel_rms.max()) < 2 * float(channel_rms.min())


def test_hadamard_needs_power_of_two_and_equal_head_dims():
    with pytest.raises(ValueError, match="power of two, got 96"):
        jzyfa.hadamard_rotate(jnp.ones((1, 4, 1, 96)), jnp.ones((1, 4, 1, 96)))
    with pytest.raises(ValueError, match="share head_dim, got 64 and 128"):
        jzyfa.hadamard_rotate(jnp.ones((1, 4, 1, 64)), jnp.ones((1, 4, 1, 128)))


# --- FP8 attention on the pure-JAX path ------------------------------------------------------------


@pytest.mark.parametrize("implementation", [None, "xla"])
@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_fp8_attention_matches_reference_on_dequantized_inputs(rng, implementation, granularity):
    q, k, v = random_qkv(rng, batch=2, seq_q=33, seq_k=65, heads_q=4, heads_kv=2, dtype=jnp.float32)
    kv_heads = {"tensor": None, "head": 2}[granularity]
    (q8, dq), (k8, dk), (v8, dv) = (
        jzyfa.fp8_quantize(x, granularity, kv_heads=kv_heads) for x in (q, k, v)
    )

    @jax.jit
    def fp8_attention(q8, k8, v8, dq, dk, dv):
        return jzyfa.flash_attention(
            q8, k8, v8, causal=True, return_lse=True, implementation=implementation,
            descale_q=dq, descale_k=dk, descale_v=dv,
        )

    assert jzyfa.primitives.FFI_TARGET not in str(jax.make_jaxpr(fp8_attention)(q8, k8, v8, dq, dk, dv))
    out, lse = fp8_attention(q8, k8, v8, dq, dk, dv)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    dequantized = [jzyfa.dequantize(x, d) for x, d in ((q8, dq), (k8, dk), (v8, dv))]
    want_out, want_lse = naive_attention_f64(*dequantized, causal=True)
    np.testing.assert_allclose(np.asarray(out, np.float64), want_out, atol=8e-3)  # bf16 output rounding
    np.testing.assert_allclose(lse, want_lse, atol=1e-5)
    # And against the unquantized inputs: FP8's error, a few percent.
    exact, _ = naive_attention_f64(q, k, v, causal=True)
    assert np.linalg.norm(np.asarray(out, np.float64) - exact) / np.linalg.norm(exact) < 0.08


def test_fp8_scalar_descales_of_shape_one(rng):
    q, k, v = random_qkv(rng, seq_q=8, seq_k=8, dtype=jnp.float8_e4m3fn)
    half = jnp.full((1,), 0.5, jnp.float32)
    out = jzyfa.flash_attention(q, k, v, descale_q=half, descale_k=half, descale_v=half)
    want, _ = naive_attention_f64(*(np.asarray(x, np.float64) * 0.5 for x in (q, k, v)), causal=False)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=8e-3)
