"""softcap (Gemma 2's tanh cap of the scores) against a float64 oracle, in every layout: 16-bit calls
through the attention primitives (their CPU lowering is the reference, their CUDA one the 16-bit kernels,
forward and backward), float32 and FP8 calls through the pure-JAX path."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import offsets, random_qkv, relative_l2, visible_f64

import jzyfa
from jzyfa.reference import attention_bwd_reference, attention_delta, attention_reference

pytestmark = pytest.mark.usefixtures("cpu_backend")


def softcap_oracle(q, k, v, cap: float, *, causal: bool):
    """float64: scores s * scale capped to cap * tanh(s * scale / cap), then softmax; GQA."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = (np.repeat(x, group, axis=2) for x in (k, v))
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    scores = cap * np.tanh(scores / cap)
    if causal:
        scores = np.where(visible_f64(q.shape[1], k.shape[1], causal=True), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", probs / probs.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_softcap_matches_the_oracle_and_differentiates(rng, dtype):
    q, k, v = random_qkv(rng, batch=2, seq_q=24, seq_k=40, heads_q=4, heads_kv=2, dtype=dtype)
    q = q * 4  # scores large enough for the cap to matter
    out = jzyfa.flash_attention(q, k, v, causal=True, softcap=2.0)
    want = softcap_oracle(q, k, v, 2.0, causal=True)
    assert out.dtype == dtype
    assert relative_l2(out, want) < (1e-6 if dtype == jnp.float32 else 1e-2)
    assert relative_l2(out, softcap_oracle(q, k, v, 50.0, causal=True)) > 0.05  # the cap changed something
    jaxpr = str(jax.make_jaxpr(lambda q: jzyfa.flash_attention(q, k, v, causal=True, softcap=2.0))(q))
    # 16-bit calls bind the primitive (the kernels' path); float32 ones run the pure-JAX reference.
    assert ("jzyfa_attention_fwd" in jaxpr) == (dtype == jnp.bfloat16)
    grads = jax.grad(lambda q: jnp.sum(jzyfa.flash_attention(q, k, v, softcap=2.0).astype(jnp.float32) ** 2))(
        q
    )
    assert np.all(np.isfinite(np.asarray(grads, np.float32)))


def test_softcap_in_a_packed_batch(rng):
    cu = jnp.asarray(offsets([11, 0, 17]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((28, 4, 64)) * 4, jnp.float32)
    kv = jnp.asarray(rng.standard_normal((28, 2, 64)), jnp.float32)
    out = jzyfa.flash_attention_varlen(q, kv, kv, cu, cu, 17, 17, causal=True, softcap=3.0)
    for rows in (slice(0, 11), slice(11, 28)):
        want = softcap_oracle(q[None, rows], kv[None, rows], kv[None, rows], 3.0, causal=True)[0]
        assert relative_l2(out[rows], want) < 1e-6


def test_reference_backward_with_softcap_is_the_forwards_vjp(rng):
    """attention_bwd_reference (the backward primitive's CPU lowering) against autodiff of the forward,
    with lse's cotangent too (delta carries it), a window and GQA."""
    q, k, v = random_qkv(rng, batch=2, seq_q=24, seq_k=40, heads_q=4, heads_kv=2, dtype=jnp.float32)
    q = q * 4
    options = {"causal": True, "window": (9, 0), "softcap": 2.5}
    (out, lse), pullback = jax.vjp(lambda q, k, v: attention_reference(q, k, v, **options), q, k, v)
    dout = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
    dlse = jnp.asarray(rng.standard_normal(lse.shape), jnp.float32)
    want = pullback((dout, dlse))
    delta = attention_delta(out, dout, dlse)
    got = attention_bwd_reference(q, k, v, dout, lse, delta, **options)
    for g, w in zip(got, want):
        assert relative_l2(g, w) < 1e-5
    uncapped = attention_bwd_reference(q, k, v, dout, lse, delta, causal=True, window=(9, 0))
    assert relative_l2(uncapped[0], want[0]) > 0.05  # the cap's derivative matters


@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_softcap_gradients_through_the_primitives(rng, layout):
    """jax.grad of a bf16 softcap call runs the backward primitive; its gradients match autodiff of the
    float32 reference on the same inputs."""
    q, k, v = random_qkv(rng, batch=1, seq_q=48, seq_k=48, heads_q=4, heads_kv=2, dtype=jnp.bfloat16)
    q = (q * 4).astype(jnp.bfloat16)
    dout = jnp.asarray(rng.standard_normal(q.shape[:3] + (v.shape[-1],)), jnp.float32)
    if layout == "dense":
        call = lambda q, k, v, impl=None: jzyfa.flash_attention(q, k, v, causal=True, softcap=3.0,
                                                                implementation=impl)  # fmt: skip
        reference = lambda q, k, v: attention_reference(q, k, v, causal=True, softcap=3.0)[0]
    else:
        cu = jnp.asarray(offsets([20, 28]), jnp.int32)
        call = lambda q, k, v, impl=None: jzyfa.flash_attention_varlen(
            q[0], k[0], v[0], cu, cu, 28, 28, causal=True, softcap=3.0, implementation=impl)[None]  # fmt: skip
        reference = lambda q, k, v: jnp.concatenate(
            [attention_reference(q[:, r], k[:, r], v[:, r], causal=True, softcap=3.0)[0]
             for r in (slice(0, 20), slice(20, 48))], axis=1)  # fmt: skip
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * dout)
    grad_fn = jax.grad(loss(call), argnums=(0, 1, 2))
    # Dense calls bind the backward primitive on a CPU too (packed ones take the reference there).
    if layout == "dense":
        assert "jzyfa_attention_bwd" in str(jax.make_jaxpr(grad_fn)(q, k, v))
    kernel_grad = jax.grad(loss(functools.partial(call, impl="kernel")), argnums=(0, 1, 2))
    cuda_text = jax.jit(kernel_grad).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")
    assert cuda_text.count("softcap = 3.000000e+00 : f32") == 2  # the forward's and the backward's calls
    got = grad_fn(q, k, v)
    want = jax.grad(loss(reference), argnums=(0, 1, 2))(*(x.astype(jnp.float32) for x in (q, k, v)))
    for g, w in zip(got, want):
        assert g.dtype == jnp.bfloat16
        assert relative_l2(g, w) < 2e-2


def test_fp8_softcap_has_no_kernel_and_says_so(rng):
    q, k, v = random_qkv(rng, seq_q=8, heads_q=2)
    (q8, dq), (k8, dk), (v8, dv) = (jzyfa.fp8_quantize(x) for x in (q, k, v))
    with pytest.raises(ValueError, match="the FP8 kernel has no softcap"):
        jzyfa.flash_attention(q8, k8, v8, softcap=30.0, implementation="kernel", descale_q=dq, descale_k=dk,
                              descale_v=dv)  # fmt: skip


@pytest.mark.parametrize(
    "softcap,error,message",
    [
        (0.0, ValueError, "softcap must be a finite float > 0"),
        ("30", TypeError, "softcap must be None or a static"),
    ],
)
def test_softcap_errors(rng, softcap, error, message):
    q, k, v = random_qkv(rng, seq_q=8, heads_q=2)
    with pytest.raises(error, match=message):
        jzyfa.flash_attention(q, k, v, softcap=softcap)
