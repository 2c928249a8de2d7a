"""softcap (Gemma 2's tanh cap of the scores): the pure-JAX path serves it (the kernels have none), in
every layout and precision, against a float64 oracle; gradients by autodiff."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import offsets, random_qkv, relative_l2, visible_f64

import jzyfa

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
    assert "jzyfa_attention_fwd" not in jaxpr and "tanh" in jaxpr
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


def test_softcap_has_no_kernel_and_says_so(rng):
    q, k, v = random_qkv(rng, seq_q=8, heads_q=2)
    with pytest.raises(ValueError, match="the kernels have no softcap"):
        jzyfa.flash_attention(q, k, v, softcap=30.0, implementation="kernel")


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
