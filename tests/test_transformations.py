"""vmap over several leading axes, grad and vjp through the custom_vjp, and their compositions.

Gradients come from the backward primitive, which works from the forward's residuals (out in the
inputs' dtype, lse): they must agree with autodiff of the float32 reference to within that rounding.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import random_qkv, relative_l2

import jzyfa
from jzyfa.primitives import FFI_TARGET

# The primitive path, lowered for a CPU device (the reference), on any host.
pytestmark = pytest.mark.usefixtures("cpu_backend")

F16 = jnp.float16
# Gradients from the backward primitive (residuals: out in f16, lse) and from differentiating the float32
# reference agree to within the f16 rounding of their results and of out.
F16_GRAD_AGREEMENT = 1e-3


@pytest.fixture(autouse=True)
def on_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def primitive_calls(fn, *args) -> list[str]:
    """The primitive's equations in fn's jaxpr, one line each."""
    return [line for line in str(jax.make_jaxpr(fn)(*args)).splitlines() if f"{FFI_TARGET}[" in line]


def stacked(x, rng, *lead):
    """x repeated over new leading axes `lead`, each copy scaled differently."""
    scales = jnp.asarray(rng.uniform(0.5, 1.5, lead), x.dtype)
    return scales.reshape(lead + (1,) * x.ndim) * x


def test_vmap_over_two_leading_axes_is_one_call(rng):
    q, k, v = random_qkv(rng, batch=2, seq_q=12, seq_k=20, heads_q=4, heads_kv=2, dtype=F16)
    qs, ks, vs = (stacked(x, rng, 3, 5) for x in (q, k, v))
    fn = functools.partial(jzyfa.flash_attention, causal=True, return_lse=True)
    batched = jax.vmap(jax.vmap(fn))

    (call,) = primitive_calls(batched, qs, ks, vs)
    assert "f16[30,12,4,64]" in call  # 3 * 5 * batch 2 folded into the batch axis
    out, lse = jax.jit(batched)(qs, ks, vs)
    assert out.shape == (3, 5, 2, 12, 4, 64) and lse.shape == (3, 5, 2, 4, 12)
    for i, j in [(0, 0), (1, 3), (2, 4)]:
        want_out, want_lse = jzyfa.attention_reference(qs[i, j], ks[i, j], vs[i, j], causal=True)
        np.testing.assert_allclose(
            np.asarray(out[i, j], np.float32), np.asarray(want_out, np.float32), atol=1e-3
        )
        np.testing.assert_allclose(lse[i, j], want_lse, rtol=1e-6, atol=1e-6)


def test_vmap_with_kv_shared_across_the_inner_axis(rng):
    # Several query sets per K/V (outer axis maps q, k, v; inner axis maps only q).
    q, k, v = random_qkv(rng, batch=1, seq_q=8, seq_k=16, heads_q=2, dtype=F16)
    qs = stacked(q, rng, 2, 3)
    ks, vs = stacked(k, rng, 2), stacked(v, rng, 2)
    inner = jax.vmap(functools.partial(jzyfa.flash_attention, causal=True), in_axes=(0, None, None))
    batched = jax.vmap(inner)

    (call,) = primitive_calls(batched, qs, ks, vs)
    assert "f16[6,8,2,64]" in call
    out = jax.jit(batched)(qs, ks, vs)
    want = jzyfa.attention_reference(qs[1, 2], ks[1], vs[1], causal=True)[0]
    np.testing.assert_allclose(np.asarray(out[1, 2], np.float32), np.asarray(want, np.float32), atol=1e-3)


@pytest.mark.parametrize(
    "seq_q,seq_k,heads_q,heads_kv",
    [(24, 40, 8, 2), (40, 24, 4, 4)],  # GQA with more keys; rows past the keys see nothing
    ids=["gqa-longer-keys", "rows-without-keys"],
)
def test_vjp_matches_autodiff_of_the_reference(rng, seq_q, seq_k, heads_q, heads_kv):
    q, k, v = random_qkv(
        rng, batch=2, seq_q=seq_q, seq_k=seq_k, heads_q=heads_q, heads_kv=heads_kv, dtype=F16
    )
    out_cotangent = jnp.asarray(rng.standard_normal(q.shape), F16)
    lse_cotangent = jnp.asarray(rng.standard_normal((2, heads_q, seq_q)), jnp.float32)

    def vjp_of(fn):
        _, pullback = jax.vjp(functools.partial(fn, causal=True), q, k, v)
        return pullback((out_cotangent, lse_cotangent))

    ours = jax.jit(lambda: vjp_of(functools.partial(jzyfa.flash_attention, return_lse=True)))()
    theirs = jax.jit(lambda: vjp_of(jzyfa.attention_reference))()
    for got, want, x in zip(ours, theirs, (q, k, v)):
        assert got.dtype == x.dtype and got.shape == x.shape
        assert np.all(np.isfinite(np.asarray(got, np.float32)))
        assert relative_l2(got, want) < F16_GRAD_AGREEMENT


def test_per_example_gradients(rng):
    """vmap of grad: the forward and the backward are each batched into one call."""
    q, k, v = random_qkv(rng, batch=1, seq_q=16, seq_k=16, heads_q=4, heads_kv=2, dtype=F16)
    qs, ks, vs = (stacked(x, rng, 4) for x in (q, k, v))

    def loss(attention, q, k, v):
        return jnp.sum(attention(q, k, v).astype(jnp.float32) ** 2)

    ours = functools.partial(loss, functools.partial(jzyfa.flash_attention, causal=True))
    theirs = functools.partial(loss, lambda q, k, v: jzyfa.attention_reference(q, k, v, causal=True)[0])
    per_example = jax.vmap(jax.grad(ours, argnums=(0, 1, 2)))
    assert len(primitive_calls(per_example, qs, ks, vs)) == 1
    got = jax.jit(per_example)(qs, ks, vs)
    want = jax.jit(jax.vmap(jax.grad(theirs, argnums=(0, 1, 2))))(qs, ks, vs)
    for g, w in zip(got, want):
        assert relative_l2(g, w) < F16_GRAD_AGREEMENT


# --- varlen: vmap maps one call per element (lax.map), grad through the backward primitive ------------------

LENGTHS_Q, LENGTHS_K = [5, 0, 11], [7, 3, 11]


@pytest.fixture
def varlen_primitive(monkeypatch):
    """flash_attention_varlen binds the primitive where a kernel serves it; make one look available so
    that its CPU lowering (the exact reference) runs here."""
    from jzyfa import _platform

    monkeypatch.setattr(_platform, "kernel_available", lambda: True)


def packed(rng, *lead):
    shape = lambda total, heads: lead + (total, heads, 64)
    q = jnp.asarray(rng.standard_normal(shape(sum(LENGTHS_Q), 4)), F16)
    k, v = (jnp.asarray(rng.standard_normal(shape(sum(LENGTHS_K), 2)), F16) for _ in range(2))
    cu = lambda lengths: jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    return q, k, v, cu(LENGTHS_Q), cu(LENGTHS_K)


def varlen_attention(q, k, v, cu_q, cu_k, **options):
    return jzyfa.flash_attention_varlen(q, k, v, cu_q, cu_k, 11, 11, causal=True, return_lse=True, **options)


def test_varlen_vmap_maps_one_call_per_element(rng, varlen_primitive):
    q, k, v, cu_q, cu_k = packed(rng, 3)
    batched = jax.vmap(varlen_attention, in_axes=(0, 0, 0, None, None))
    jaxpr = str(jax.make_jaxpr(batched)(q, k, v, cu_q, cu_k))
    calls = [line for line in jaxpr.splitlines() if f"{FFI_TARGET}[" in line]
    assert len(calls) == 1 and "scan[" in jaxpr  # lax.map over the mapped axis, one element per step
    assert "f16[16,4,64]" in calls[0]  # an element's packed q
    out, lse = jax.jit(batched)(q, k, v, cu_q, cu_k)
    assert out.shape == (3, 16, 4, 64) and lse.shape == (3, 4, 16)
    for i in range(3):
        want = varlen_attention(q[i], k[i], v[i], cu_q, cu_k, implementation="xla")
        np.testing.assert_array_equal(out[i], want[0])
        np.testing.assert_array_equal(lse[i], want[1])


def test_varlen_vmap_over_offsets_too(rng, varlen_primitive):
    q, k, v, cu_q, cu_k = packed(rng, 2)
    cu_qs = jnp.stack([cu_q, jnp.asarray([0, 8, 8, 16], jnp.int32)])
    out, lse = jax.jit(jax.vmap(varlen_attention))(q, k, v, cu_qs, jnp.stack([cu_k, cu_k]))
    for i in range(2):
        want = varlen_attention(q[i], k[i], v[i], cu_qs[i], cu_k, implementation="xla")
        np.testing.assert_array_equal(out[i], want[0])
        np.testing.assert_array_equal(lse[i], want[1])


def test_varlen_grad_matches_autodiff_of_the_reference(rng, varlen_primitive):
    q, k, v, cu_q, cu_k = packed(rng)
    weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def loss(implementation, q, k, v):
        out, lse = varlen_attention(q, k, v, cu_q, cu_k, implementation=implementation)
        return jnp.sum(out.astype(jnp.float32) * weights) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    ours = functools.partial(loss, None)
    assert len(primitive_calls(jax.grad(ours, argnums=(0, 1, 2)), q, k, v)) == 1
    got = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(functools.partial(loss, "xla"), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got, want):
        assert relative_l2(g, w) < F16_GRAD_AGREEMENT
