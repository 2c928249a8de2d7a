"""softcap in the 16-bit kernels (ffi/softcap.cuh), on a Hopper GPU against float64: the forward
(out and lse, into NaN-filled donated buffers) through jzyfa.flash_attention and
flash_attention_varlen, and the backward custom call (dq, dk, dv into NaN-filled buffers) and
jax.grad of the public call. Fresh random inputs with scores large enough for the cap to bite."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import (
    naive_attention_f64,
    naive_attention_grads_f64,
    naive_varlen_f64,
    offsets,
    random_qkv,
    relative_l2,
)
from gpu_utils import assert_bitwise_reruns, kernel_call, requires_hopper
from test_bwd_kernel_gpu import bwd_call

import jzyfa

pytestmark = [pytest.mark.gpu, requires_hopper]

O_TOLERANCE = 1e-2  # relative L2 of O, as for the kernels without a cap
LSE_TOLERANCE = 1e-4
GRAD_TOLERANCE = 2e-2
Q_GAIN = 3.0  # q scaled up: scores of several units, where c tanh(s / c) departs from s at c = 5


def capped_inputs(seed, *, batch=1, seq_q, seq_k, heads_q=4, heads_kv=2, head_dim=128, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, batch=batch, seq_q=seq_q, seq_k=seq_k, heads_q=heads_q, heads_kv=heads_kv,
                         head_dim=head_dim, dtype=dtype)  # fmt: skip
    return (q.astype(jnp.float32) * Q_GAIN).astype(dtype), k, v


def forward_poisoned(q, k, v, **options):
    """(out, lse) of the kernel call, written into NaN-filled donated buffers."""

    def call(q, k, v, out_poison, lse_poison):
        del out_poison, lse_poison
        return jzyfa.flash_attention(q, k, v, return_lse=True, implementation="kernel", **options)

    b, sq, hq, _ = q.shape
    poison = (jnp.full(q.shape, jnp.nan, q.dtype), jnp.full((b, hq, sq), jnp.nan, jnp.float32))
    fn = jax.jit(call, donate_argnums=(3, 4), keep_unused=True)
    hlo = fn.lower(q, k, v, *poison).compile().as_text()
    assert f"softcap = {np.float32(options['softcap']):.6e} : f32" in kernel_call(hlo)
    assert "input_output_alias" in hlo and " copy(" not in hlo
    return fn(q, k, v, *poison)


def check_forward(out, lse, want_out, want_lse):
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    assert not np.isnan(out).any() and not np.isnan(lse).any(), "an element left unwritten (NaN poison)"
    seen = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(lse), seen)
    assert relative_l2(out, want_out) < O_TOLERANCE
    assert relative_l2(lse[seen], want_lse[seen]) < LSE_TOLERANCE


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "none"])
@pytest.mark.parametrize("softcap", [5.0, 50.0])
def test_forward(head_dim, dtype, causal, softcap):
    q, k, v = capped_inputs(head_dim + int(softcap), seq_q=700, seq_k=900, head_dim=head_dim, dtype=dtype)
    out, lse = forward_poisoned(q, k, v, causal=causal, softcap=softcap)
    want_out, want_lse = naive_attention_f64(q, k, v, causal=causal, softmax_scale=head_dim**-0.5, softcap=softcap)
    check_forward(out, lse, want_out, want_lse)
    if softcap == 5.0:  # the cap moved the result well beyond the tolerance
        plain, _ = naive_attention_f64(q, k, v, causal=causal, softmax_scale=head_dim**-0.5)
        assert relative_l2(np.asarray(out, np.float64), plain) > 10 * O_TOLERANCE


@pytest.mark.parametrize("window", [(100, 0), (50, 30)])
def test_forward_windowed(window):
    q, k, v = capped_inputs(7, seq_q=600, seq_k=600)
    out, lse = forward_poisoned(q, k, v, window=window, softcap=8.0)
    want = naive_attention_f64(q, k, v, causal=False, softmax_scale=128**-0.5, window=window, softcap=8.0)
    check_forward(out, lse, *want)


def test_forward_varlen():
    cu = offsets([300, 1, 0, 517])
    rng = np.random.default_rng(11)
    q, k, v = (jnp.asarray(rng.standard_normal((cu[-1], h, 128)) * g, jnp.bfloat16)
               for h, g in ((4, Q_GAIN), (2, 1.0), (2, 1.0)))  # fmt: skip
    out, lse = jzyfa.flash_attention_varlen(q, k, v, cu, cu, 517, 517, causal=True, softcap=6.0, return_lse=True,
                                            implementation="kernel")  # fmt: skip
    want = naive_varlen_f64(q, k, v, cu, cu, causal=True, softmax_scale=128**-0.5, softcap=6.0)
    check_forward(out, lse, *want)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "none"])
@pytest.mark.parametrize("softcap", [5.0, 30.0])
def test_backward_custom_call(head_dim, causal, softcap):
    q, k, v = capped_inputs(head_dim + int(softcap) + causal, batch=2, seq_q=333, seq_k=517, head_dim=head_dim)
    rng = np.random.default_rng(1)
    dout = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
    scale = head_dim**-0.5
    out, lse = naive_attention_f64(q, k, v, causal=causal, softmax_scale=scale, softcap=softcap)
    delta = np.einsum("bshd,bshd->bhs", np.asarray(dout, np.float64), out)
    lse, delta = jnp.asarray(lse, jnp.float32), jnp.asarray(delta, jnp.float32)
    grads = bwd_call(q, k, v, dout, lse, delta, causal=causal, softmax_scale=scale, softcap=softcap)
    want = naive_attention_grads_f64(q, k, v, dout, causal=causal, softmax_scale=scale, softcap=softcap)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        got = np.asarray(got, np.float64)
        assert np.isfinite(got).all(), f"{name}: NaN or inf (an element left unwritten?)"
        assert relative_l2(got, ref) < GRAD_TOLERANCE, name
    plain = naive_attention_grads_f64(q, k, v, dout, causal=causal, softmax_scale=scale)
    assert relative_l2(np.asarray(grads[0], np.float64), plain[0]) > 5 * GRAD_TOLERANCE  # the cap's slope


def test_backward_windowed_is_deterministic():
    q, k, v = capped_inputs(5, seq_q=800, seq_k=800)
    rng = np.random.default_rng(2)
    dout = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
    out, lse = naive_attention_f64(q, k, v, causal=False, softmax_scale=128**-0.5, window=(200, 0), softcap=4.0)
    delta = jnp.asarray(np.einsum("bshd,bshd->bhs", np.asarray(dout, np.float64), out), jnp.float32)
    lse = jnp.asarray(lse, jnp.float32)
    run = lambda *operands: bwd_call(*operands, causal=False, softmax_scale=128**-0.5, window=(200, 0),
                                     softcap=4.0)  # fmt: skip
    want = naive_attention_grads_f64(q, k, v, dout, causal=False, softmax_scale=128**-0.5, window=(200, 0),
                                     softcap=4.0)  # fmt: skip
    operands = (q, k, v, dout, lse, delta)
    for got, ref in zip(run(*operands), want):
        assert relative_l2(np.asarray(got, np.float64), ref) < GRAD_TOLERANCE
    assert_bitwise_reruns(run, operands, reruns=5)


@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_grad_of_the_public_call(layout):
    """jax.grad through jzyfa.flash_attention(softcap=...) runs both kernels and matches float64."""
    q, k, v = capped_inputs(9, seq_q=640, seq_k=640)
    rng = np.random.default_rng(4)
    dout = rng.standard_normal(q.shape)
    if layout == "dense":
        call = lambda q, k, v: jzyfa.flash_attention(q, k, v, causal=True, softcap=20.0, implementation="kernel")
    else:
        cu = offsets([640])
        call = lambda q, k, v: jzyfa.flash_attention_varlen(q[0], k[0], v[0], cu, cu, 640, 640, causal=True,
                                                            softcap=20.0, implementation="kernel")[None]  # fmt: skip
    loss = lambda q, k, v: jnp.sum(call(q, k, v).astype(jnp.float32) * dout)
    grad_fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    assert "jzyfa_attention_bwd" in grad_fn.lower(q, k, v).as_text(dialect="hlo")
    got = grad_fn(q, k, v)
    want = naive_attention_grads_f64(q, k, v, dout, causal=True, softmax_scale=128**-0.5, softcap=20.0)
    for g, w in zip(got, want):
        assert relative_l2(np.asarray(g, np.float64), w) < GRAD_TOLERANCE
