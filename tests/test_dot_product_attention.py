"""jzyfa.dot_product_attention against jax.nn.dot_product_attention on the CPU: values, gradients, the
path taken (jzyfa's primitive in the jaxpr, or not), and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jzyfa
from jzyfa.dot_product_attention import jzyfa_window

TOL = {jnp.bfloat16: 3e-2, jnp.float16: 4e-3, jnp.float32: 1e-5}


def _inputs(rng, b, t, s, n, k, h, dtype):
    def draw(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    if b is None:
        return draw(t, n, h), draw(s, k, h), draw(s, k, h)
    return draw(b, t, n, h), draw(b, s, k, h), draw(b, s, k, h)


def _uses_jzyfa(fn, *args):
    return "jzyfa_attention_fwd" in str(jax.make_jaxpr(fn)(*args))


def _close(a, b, dtype, rows=None):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if rows is not None:
        a, b = a * rows, b * rows
    np.testing.assert_allclose(a, b, atol=TOL[dtype], rtol=TOL[dtype])


CASES = [
    # t, s, is_causal, local_window_size, served by jzyfa
    (16, 16, False, None, True),
    (16, 16, True, None, True),
    (24, 16, True, None, True),
    (16, 24, True, None, False),
    (16, 16, False, 3, True),
    (16, 16, True, (4, 0), True),
    (24, 16, False, (5, 2), False),
    (24, 16, False, (9, 2), True),
    (16, 24, False, (5, 2), False),
    (16, 24, False, (-1, 9), True),
    (24, 16, True, 3, False),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("t,s,is_causal,lws,served", CASES)
def test_matches_jax_nn(cpu_backend, rng, dtype, t, s, is_causal, lws, served):
    q, k, v = _inputs(rng, 2, t, s, 4, 2, 64, dtype)
    kw = {"is_causal": is_causal, "local_window_size": lws}
    ours = jzyfa.dot_product_attention(q, k, v, **kw)
    ref = jax.nn.dot_product_attention(q, k, v, **kw)
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    _close(ours, ref, dtype)
    if dtype != jnp.float32:
        assert _uses_jzyfa(lambda *a: jzyfa.dot_product_attention(*a, **kw), q, k, v) == served

    def loss(f):
        return lambda *a: jnp.sum(f(*a, **kw).astype(jnp.float32) * jnp.cos(jnp.arange(64.0)))

    g_ours = jax.grad(loss(jzyfa.dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    g_ref = jax.grad(loss(jax.nn.dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_ours, g_ref):
        _close(a, b, dtype) if dtype == jnp.float32 else np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), atol=0.1, rtol=0.1
        )


def test_window_mapping_from_definitions():
    """jzyfa_window against the two masks written out: jax.nn's top-left, jzyfa's bottom-right."""
    for t in (3, 5, 8):
        for s in (3, 5, 8):
            for causal in (False, True):
                for lws in (None, (2, 1), (0, 0), (-1, 3), (4, -1)):
                    window = jzyfa_window(t, s, causal, lws)
                    if window is None:
                        continue
                    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
                    want = np.ones((t, s), bool)
                    if causal:
                        want &= j <= i
                    if lws is not None:
                        want &= (i <= j + lws[0]) & (i >= j - lws[1])
                    got = np.ones((t, s), bool)
                    if window is not False:
                        p, (left, right) = i + s - t, window
                        if left >= 0:
                            got &= j >= p - left
                        if right >= 0:
                            got &= j <= p + right
                    assert (got == want).all(), (t, s, causal, lws, window)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("same", [False, True])
def test_seq_lengths(cpu_backend, rng, is_causal, same):
    q, k, v = _inputs(rng, 3, 16, 16, 4, 4, 64, jnp.bfloat16)
    lq = jnp.array([16, 5, 9], jnp.int32)
    lk = lq if same else jnp.array([16, 11, 3], jnp.int32)
    kw = {"is_causal": is_causal, "query_seq_lengths": lq, "key_value_seq_lengths": lk}
    ours = jzyfa.dot_product_attention(q, k, v, **kw)
    ref = jax.nn.dot_product_attention(q, k, v, **kw)
    rows = (np.arange(16)[None, :] < np.asarray(lq)[:, None])[:, :, None, None]
    _close(ours, ref, jnp.bfloat16)  # padded query rows included: 0 on both
    assert not np.asarray(ours, np.float32)[~rows[..., 0, 0]].any()
    served = _uses_jzyfa(lambda *a, kw=kw: jzyfa.dot_product_attention(*a, **kw), q, k, v)
    assert served == (not is_causal or same)
    g = jax.grad(lambda *a: jnp.sum(jzyfa.dot_product_attention(*a, **kw).astype(jnp.float32) * rows))
    g_ref = jax.grad(lambda *a: jnp.sum(jax.nn.dot_product_attention(*a, **kw).astype(jnp.float32) * rows))
    np.testing.assert_allclose(
        np.asarray(g(q, k, v), np.float32), np.asarray(g_ref(q, k, v), np.float32), atol=0.1
    )


def test_key_lengths_only(cpu_backend, rng):
    q, k, v = _inputs(rng, 2, 8, 16, 2, 2, 128, jnp.bfloat16)
    lk = jnp.array([16, 7], jnp.int32)
    ours = jzyfa.dot_product_attention(q, k, v, key_value_seq_lengths=lk)
    _close(ours, jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lk), jnp.bfloat16)
    # causal with lengths on one side only: the alignments can differ, so jax.nn serves it.
    kw = {"is_causal": True, "key_value_seq_lengths": lk}
    assert not _uses_jzyfa(lambda *a, kw=kw: jzyfa.dot_product_attention(*a, **kw), q, k, v)


def test_bias_and_mask_fall_back(cpu_backend, rng):
    q, k, v = _inputs(rng, 2, 8, 8, 2, 2, 64, jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal((2, 2, 8, 8)), jnp.bfloat16)
    mask = jnp.asarray(rng.random((2, 1, 8, 8)) > 0.3) | jnp.eye(8, dtype=bool)
    for kw in ({"bias": bias}, {"mask": mask}, {"bias": bias, "mask": mask, "is_causal": True}):
        _close(
            jzyfa.dot_product_attention(q, k, v, **kw),
            jax.nn.dot_product_attention(q, k, v, **kw),
            jnp.bfloat16,
        )
        assert not _uses_jzyfa(lambda *a, kw=kw: jzyfa.dot_product_attention(*a, **kw), q, k, v)


def test_unbatched_and_scale(cpu_backend, rng):
    q, k, v = _inputs(rng, None, 12, 12, 8, 2, 128, jnp.bfloat16)
    kw = {"is_causal": True, "scale": 0.3}
    ours = jzyfa.dot_product_attention(q, k, v, **kw)
    assert ours.shape == (12, 8, 128)
    _close(ours, jax.nn.dot_product_attention(q, k, v, **kw), jnp.bfloat16)
    assert _uses_jzyfa(lambda *a, kw=kw: jzyfa.dot_product_attention(*a, **kw), q, k, v)


def test_implementation(rng):
    q, k, v = _inputs(rng, 1, 8, 8, 2, 2, 64, jnp.bfloat16)
    _close(
        jzyfa.dot_product_attention(q, k, v, implementation="xla"),
        jax.nn.dot_product_attention(q, k, v),
        jnp.bfloat16,
    )
    assert not _uses_jzyfa(lambda *a: jzyfa.dot_product_attention(*a, implementation="xla"), q, k, v)
    with pytest.raises(ValueError, match="implementation"):
        jzyfa.dot_product_attention(q, k, v, implementation="kernel")


def test_jax_nn_errors(rng):
    q, k, v = _inputs(rng, 1, 8, 8, 3, 2, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        jzyfa.dot_product_attention(q, k, v)
    q, k, v = _inputs(rng, 1, 8, 8, 2, 2, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="query_seq_lengths"):
        jzyfa.dot_product_attention(q, k, v, query_seq_lengths=jnp.array([3, 4], jnp.int32))


def _residual_close(ours, ref, dtype):
    """Residuals (log-sum-exps in the inputs' dtype): equal where jax.nn's row saw no key (its large
    negative number), else within the dtype's rounding of a value of a few units."""
    a, b = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    empty = b < -1e30
    np.testing.assert_array_equal(a[empty], b[empty])
    np.testing.assert_allclose(a[~empty], b[~empty], rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("t,s,is_causal,lws,served", CASES)
def test_return_residual_matches_jax_nn(cpu_backend, rng, dtype, t, s, is_causal, lws, served):
    q, k, v = _inputs(rng, 2, t, s, 4, 2, 64, dtype)  # GQA 4/2
    kw = {"is_causal": is_causal, "local_window_size": lws, "return_residual": True}
    out, residual = jzyfa.dot_product_attention(q, k, v, **kw)
    ref_out, ref_residual = jax.nn.dot_product_attention(q, k, v, **kw)
    assert (out.shape, out.dtype) == (ref_out.shape, ref_out.dtype)
    assert (residual.shape, residual.dtype) == (ref_residual.shape, ref_residual.dtype) == ((2, t, 4), k.dtype)
    _close(out, ref_out, dtype)
    _residual_close(residual, ref_residual, dtype)
    if dtype != jnp.float32:
        assert _uses_jzyfa(lambda *a: jzyfa.dot_product_attention(*a, **kw), q, k, v) == served


@pytest.mark.parametrize("is_causal", [False, True])
def test_return_residual_rows_without_keys(cpu_backend, rng, is_causal):
    """Padded query rows and a batch row of no keys: the residual jax.nn's XLA path gives them (its
    masked logit), in bf16 and in float16 (where it is -inf)."""
    for dtype in (jnp.bfloat16, jnp.float16):
        q, k, v = _inputs(rng, 3, 16, 16, 4, 4, 64, dtype)
        lengths = jnp.array([16, 5, 0], jnp.int32)
        kw = {"is_causal": is_causal, "query_seq_lengths": lengths, "key_value_seq_lengths": lengths}
        kw["return_residual"] = True
        out, residual = jzyfa.dot_product_attention(q, k, v, **kw)
        ref_out, ref_residual = jax.nn.dot_product_attention(q, k, v, **kw)
        assert _uses_jzyfa(lambda *a, kw=kw: jzyfa.dot_product_attention(*a, **kw), q, k, v)
        rows = (np.arange(16)[None, :] < np.asarray(lengths)[:, None])[:, :, None, None]
        _close(out, ref_out, dtype)
        _residual_close(residual, ref_residual, dtype)
        padded = np.asarray(residual, np.float32)[~rows[..., 0, 0]]
        assert padded.size and (padded == np.float32(jnp.float32(-0.7 * np.finfo(np.float32).max).astype(dtype))).all()


def test_return_residual_unbatched_and_gradients(cpu_backend, rng):
    """[T, N] residual for unbatched inputs; the residual is gradient-stopped and the output's
    gradients are those of the call without it."""
    q, k, v = _inputs(rng, None, 12, 12, 8, 2, 128, jnp.bfloat16)
    kw = {"is_causal": True, "scale": 0.3}
    out, residual = jzyfa.dot_product_attention(q, k, v, return_residual=True, **kw)
    ref_out, ref_residual = jax.nn.dot_product_attention(q, k, v, return_residual=True, **kw)
    assert residual.shape == (12, 8)
    _close(out, ref_out, jnp.bfloat16)
    _residual_close(residual, ref_residual, jnp.bfloat16)
    weights = jnp.cos(jnp.arange(128.0))

    def loss(with_residual):
        def f(*a):
            if with_residual:
                o, r = jzyfa.dot_product_attention(*a, return_residual=True, **kw)
                return jnp.sum(o.astype(jnp.float32) * weights) + jnp.sum(r.astype(jnp.float32))
            return jnp.sum(jzyfa.dot_product_attention(*a, **kw).astype(jnp.float32) * weights)

        return f

    g_with = jax.grad(loss(True), argnums=(0, 1, 2))(q, k, v)
    g_without = jax.grad(loss(False), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_with, g_without):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_return_residual_with_xla_and_fallbacks(cpu_backend, rng):
    """implementation="xla" and the calls jax.nn serves (a bias) return jax.nn's tuple unchanged."""
    q, k, v = _inputs(rng, 2, 8, 8, 2, 2, 64, jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal((2, 2, 8, 8)), jnp.bfloat16)
    for kw in ({"implementation": "xla"}, {"bias": bias}):
        out, residual = jzyfa.dot_product_attention(q, k, v, return_residual=True, **kw)
        ref_out, ref_residual = jax.nn.dot_product_attention(q, k, v, return_residual=True, **kw)
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref_out, np.float32))
        np.testing.assert_array_equal(np.asarray(residual, np.float32), np.asarray(ref_residual, np.float32))
