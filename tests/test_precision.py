"""precision="fp8": bf16/f16/float32 inputs quantized to e4m3 inside the call (one power-of-two descale
per batch and KV head), optionally Hadamard-rotated first; the output keeps the inputs' dtype."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64, offsets, random_qkv, relative_l2

import jzyfa


def _manual(q, k, v, *, rotate=False, **options):
    """What precision="fp8" promises, spelled out with the public quantization helpers."""
    if rotate:
        q, k = jzyfa.hadamard_rotate(q, k)
    heads_kv = k.shape[2]
    (q8, dq), (k8, dk), (v8, dv) = (jzyfa.fp8_quantize(x, "head", kv_heads=heads_kv) for x in (q, k, v))
    return jzyfa.flash_attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, **options)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rotate", [False, True])
def test_fp8_precision_is_quantize_then_the_fp8_call(rng, dtype, rotate):
    q, k, v = random_qkv(rng, batch=2, seq_q=48, seq_k=64, heads_q=8, heads_kv=2, head_dim=128, dtype=dtype)
    out, lse = jzyfa.flash_attention(q, k, v, causal=True, precision="fp8", rotate=rotate, return_lse=True)
    want_out, want_lse = _manual(q, k, v, rotate=rotate, causal=True, return_lse=True)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out.astype(dtype), np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    exact, _ = naive_attention_f64(q, k, v, causal=True)
    assert relative_l2(out, exact) < 0.08  # e4m3 rounding of q, k and v on Gaussian inputs


def test_fp8_precision_of_a_packed_batch(rng):
    cu = jnp.asarray(offsets([20, 0, 33, 11]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((64, 4, 128)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((64, 2, 128)), jnp.bfloat16)
    call = functools.partial(jzyfa.flash_attention_varlen, causal=True, return_lse=True)
    out, lse = call(q, kv, kv, cu, cu, 33, 33, precision="fp8")
    (q8, dq), (k8, dk), (v8, dv) = (jzyfa.fp8_quantize(x[None], "head", kv_heads=2) for x in (q, kv, kv))
    per_seq = lambda d: jnp.broadcast_to(d, (4, 2))
    want_out, want_lse = call(q8[0], k8[0], v8[0], cu, cu, 33, 33, descale_q=per_seq(dq), descale_k=per_seq(dk),
                              descale_v=per_seq(dv))  # fmt: skip
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))


def test_fp8_precision_is_not_differentiable(rng):
    q, k, v = random_qkv(rng, seq_q=16, heads_q=2, head_dim=128)
    loss = lambda q: jnp.sum(jzyfa.flash_attention(q, k, v, precision="fp8").astype(jnp.float32))
    with pytest.raises(TypeError, match="not differentiable"):
        jax.grad(loss)(q)


@pytest.mark.parametrize(
    "options,error,message",
    [
        ({"precision": "int4"}, ValueError, r"precision must be one of \(None, 'fp8', 'int8'\), got 'int4'"),
        (
            {"rotate": True},
            ValueError,
            "rotate=True rotates q and k before quantizing them: it needs precision='fp8'",
        ),
        ({"precision": "fp8", "rotate": 1}, TypeError, "rotate must be a bool, got int"),
        ({"precision": "fp8", "descale_q": jnp.ones(())}, ValueError, "got bfloat16 inputs with descales"),
    ],
)
def test_precision_errors_name_the_argument(rng, options, error, message):
    q, k, v = random_qkv(rng, seq_q=8, heads_q=2, head_dim=128)
    with pytest.raises(error, match=message):
        jzyfa.flash_attention(q, k, v, **options)


def test_precision_refuses_prequantized_inputs(rng):
    q, k, v = random_qkv(rng, seq_q=8, heads_q=2, head_dim=128)
    q8, k8, v8 = (x.astype(jnp.float8_e4m3fn) for x in (q, k, v))
    with pytest.raises(ValueError, match="got float8_e4m3fn inputs"):
        jzyfa.flash_attention(q8, k8, v8, precision="fp8")
