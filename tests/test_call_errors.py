"""Errors that used to be silent or late (issue 31 item 7): max_seqlen below a sequence's length
(concrete offsets: an error; traced ones: the pure-JAX path exact anyway, the kernel path NaN, an
error under checkify), a per-query-head FP8 descale under GQA."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jzyfa
from jzyfa import _platform
from jzyfa.varlen import varlen_attention_bwd_reference


def _packed(rng, lengths, heads_q=4, heads_kv=2, dim=64):
    total = sum(lengths)
    q = jnp.asarray(rng.standard_normal((total, heads_q, dim)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((total, heads_kv, dim)), jnp.bfloat16)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return q, k, k, cu


@pytest.mark.parametrize("kind", ["numpy", "device"])
@pytest.mark.parametrize("side", ["q", "k"])
def test_max_seqlen_below_a_concrete_length(rng, kind, side):
    q, k, v, cu = _packed(rng, [8, 40, 5])
    offsets = {"numpy": cu, "device": jnp.asarray(cu)}[kind]
    maxima = {"max_seqlen_q": 40, "max_seqlen_k": 40}
    maxima[f"max_seqlen_{side}"] = 8
    with pytest.raises(
        ValueError, match=rf"max_seqlen_{side} \(8\).*cu_seqlens_{side} \(40\).*max_seqlen_{side}=40"
    ):
        jzyfa.flash_attention_varlen(
            q, k, v, offsets, offsets, maxima["max_seqlen_q"], maxima["max_seqlen_k"]
        )


def test_max_seqlen_enough_passes_and_traced_offsets_are_not_read(rng):
    q, k, v, cu = _packed(rng, [8, 40, 5])
    out = jzyfa.flash_attention_varlen(q, k, v, jnp.asarray(cu), jnp.asarray(cu), 40, 40)
    assert out.shape == q.shape
    # Inside jit the offsets are tracers: the host cannot read them (the device checks them, below).
    traced = jax.jit(lambda cu: jzyfa.flash_attention_varlen(q, k, v, cu, cu, 40, 40))(jnp.asarray(cu))
    np.testing.assert_allclose(np.asarray(traced, np.float32), np.asarray(out, np.float32), atol=1e-2)


SHORT_MAXIMA = {"q": (8, 64), "k": (64, 8), "both": (8, 8)}
MASKS = {"none": {}, "causal": {"causal": True}, "window": {"window": (5, 3)}}


def _loss_and_grads(q, k, v, cu_q, cu_k, max_q, max_k, **options):
    def loss(q, k, v, cu_q, cu_k):
        out, lse = jzyfa.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, **options)
        finite_lse = jnp.where(jnp.isinf(lse), 0.0, lse)
        return (out.astype(jnp.float32) ** 2).sum() + finite_lse.sum(), (out, lse)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v, cu_q, cu_k)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("short", SHORT_MAXIMA)
def test_traced_offsets_past_the_maxima_stay_exact_on_the_pure_jax_path(rng, short, mask):
    """The reference covers sequences longer than the maxima (a device-side choice of the whole-buffer
    computation): out, lse and gradients equal those of a call with the right maxima."""
    q, k, v, cu = _packed(rng, [8, 40, 0, 5])
    cu_k = jnp.asarray(np.array([0, 12, 30, 45, 53], np.int32))
    k, v = (jnp.asarray(rng.standard_normal((53,) + x.shape[1:]), x.dtype) for x in (k, v))
    cu_q = jnp.asarray(cu)
    (_, (out, lse)), grads = _loss_and_grads(q, k, v, cu_q, cu_k, *SHORT_MAXIMA[short], **MASKS[mask])
    (_, (want_out, want_lse)), want_grads = _loss_and_grads(q, k, v, cu_q, cu_k, 40, 18, **MASKS[mask])
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out, np.float32), atol=1e-2)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=1e-4)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), atol=6e-2, rtol=2e-2
        )


@pytest.mark.parametrize("short", SHORT_MAXIMA)
def test_the_backward_reference_covers_sequences_past_the_maxima(rng, short):
    lengths = [8, 40, 5]
    q, k, v, cu = _packed(rng, lengths)
    cu = jnp.asarray(cu)
    dout = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
    out, lse = jzyfa.flash_attention_varlen(q, k, v, cu, cu, 40, 40, return_lse=True, causal=True)
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1).T
    backward = functools.partial(varlen_attention_bwd_reference, window=(-1, 0), softmax_scale=0.125)
    got = jax.jit(backward, static_argnums=(8, 9))(q, k, v, dout, lse, delta, cu, cu, *SHORT_MAXIMA[short])
    want = backward(q, k, v, dout, lse, delta, cu, cu, 40, 40)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=6e-2, rtol=2e-2)


def test_traced_offsets_past_the_maxima_poison_the_kernel_path(rng, monkeypatch):
    """The kernels need the maxima: out, lse and the gradients are NaN rather than a plausible wrong
    result. (Kernel faked available: the primitive binds, and its CPU lowering trusts the maxima as the
    kernel does.)"""
    monkeypatch.setattr(_platform, "kernel_available", lambda: True)
    q, k, v, cu = _packed(rng, [8, 40, 5])
    cu = jnp.asarray(cu)
    (_, (out, lse)), grads = _loss_and_grads(q, k, v, cu, cu, 8, 64)
    assert np.isnan(np.asarray(out, np.float32)).all() and np.isnan(np.asarray(lse)).all()
    assert all(np.isnan(np.asarray(g, np.float32)).all() for g in grads)
    (_, (out, lse)), grads = _loss_and_grads(q, k, v, cu, cu, 40, 40)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in grads)


def test_traced_offsets_past_the_maxima_poison_int8_calls(rng):
    """precision="int8" computes each sequence in a slot of max_seqlen tokens: a longer one gives NaN,
    not a truncated sequence's result."""
    q, k, v, cu = _packed(rng, [8, 40, 5])
    cu = jnp.asarray(cu)

    def call(q, k, v, cu, max_q, max_k):
        return jzyfa.flash_attention_varlen(q, k, v, cu, cu, max_q, max_k, causal=True, precision="int8")

    short = jax.jit(call, static_argnums=(4, 5))(q, k, v, cu, 8, 40)
    assert np.isnan(np.asarray(short, np.float32)).all()
    assert np.isfinite(np.asarray(jax.jit(call, static_argnums=(4, 5))(q, k, v, cu, 40, 40), np.float32)).all()


@pytest.mark.parametrize("kernel", [False, True])
def test_checkify_reports_traced_offsets_past_the_maxima(rng, monkeypatch, kernel):
    monkeypatch.setattr(_platform, "kernel_available", lambda: kernel)
    q, k, v, cu = _packed(rng, [8, 40, 5])

    def call(cu, max_q):
        return jzyfa.flash_attention_varlen(q, k, v, cu, cu, max_q, 64)

    checked = checkify.checkify(jax.jit(call, static_argnums=1), errors=checkify.user_checks)
    error, _ = checked(jnp.asarray(cu), 8)
    with pytest.raises(
        checkify.JaxRuntimeError, match=r"max_seqlen_q=8, max_seqlen_k=64.*hold 40 / 40 tokens"
    ):
        error.throw()
    error, _ = checked(jnp.asarray(cu), 40)
    error.throw()


def test_per_query_head_descale_under_gqa_names_kv_heads(rng):
    q = jnp.asarray(rng.standard_normal((2, 16, 8, 64)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((2, 16, 2, 64)), jnp.bfloat16)
    q8, dq = jzyfa.fp8_quantize(q, "head")
    k8, dk = jzyfa.fp8_quantize(k, "head")
    assert dq.shape == (2, 8)
    with pytest.raises(ValueError, match=r"\[batch, kv_heads\] = \[2, 2\].*kv_heads=2"):
        jzyfa.flash_attention(q8, k8, k8, descale_q=dq, descale_k=dk, descale_v=dk)
    q8, dq = jzyfa.fp8_quantize(q, "head", kv_heads=2)
    assert jzyfa.flash_attention(q8, k8, k8, descale_q=dq, descale_k=dk, descale_v=dk).shape == q.shape


def test_symbolic_token_counts_export_and_stay_exact(rng):
    """Packed token counts symbolic (jax.export): whether the maxima cover every sequence is undecidable
    at export time, so the exported pure-JAX path keeps the device-side choice."""
    fn = jax.jit(lambda q, k, v, cu: jzyfa.flash_attention_varlen(q, k, v, cu, cu, 16, 16, causal=True))
    specs = jax.export.symbolic_args_specs(
        [jax.ShapeDtypeStruct((1, h, 64), jnp.bfloat16) for h in (4, 2, 2)]
        + [jax.ShapeDtypeStruct((3,), jnp.int32)],
        ["t, 4, 64", "t, 2, 64", "t, 2, 64", "3"],
    )
    exported = jax.export.export(fn, platforms=("cpu",))(*specs)
    q, k, v, cu = _packed(rng, [30, 10])
    want = jzyfa.flash_attention_varlen(q, k, v, cu, cu, 30, 30, causal=True)
    got = exported.call(q, k, v, jnp.asarray(cu))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=1e-2)
