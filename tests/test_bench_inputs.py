"""jzyfa.bench.inputs (activation-like inputs): determinism, RoPE, outlier channels, the attention sink, head scale spread."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jzyfa.bench import float64
from jzyfa.bench import inputs as ri

KNOBS = ri.ActivationKnobs()


def _float(x):
    return np.asarray(x, np.float64)


def _generate(seed=0, knobs=KNOBS, **shape):
    defaults = dict(batch=1, seq_q=256, heads_q=4, heads_kv=2, head_dim=64)
    defaults.update(shape)
    return ri.activation_qkv(seed, knobs=knobs, **defaults)


def test_shapes_dtypes_and_determinism():
    a = _generate(seed=7, batch=2, seq_q=48, seq_k=80, heads_q=8, heads_kv=2, head_dim=128)
    assert a.q.shape == (2, 48, 8, 128) and a.k.shape == a.v.shape == (2, 80, 2, 128)
    assert a.q.dtype == a.k.dtype == a.v.dtype == jnp.bfloat16
    assert a.outlier_pairs.shape == (2, KNOBS.outlier_pairs)
    b = _generate(seed=7, batch=2, seq_q=48, seq_k=80, heads_q=8, heads_kv=2, head_dim=128)
    c = _generate(seed=8, batch=2, seq_q=48, seq_k=80, heads_q=8, heads_kv=2, head_dim=128)
    for x, y, z in zip(a[:3], b[:3], c[:3]):
        assert np.array_equal(_float(x), _float(y)) and not np.array_equal(_float(x), _float(z))
    f16 = ri.activation_qkv(7, batch=1, seq_q=16, heads_q=2, head_dim=32, dtype=jnp.float16)
    assert f16.q.dtype == jnp.float16 and np.all(np.isfinite(_float(f16.k)))


def test_rope_frequencies_and_relative_positions():
    freqs = ri.rope_frequencies(8, 10000.0)
    np.testing.assert_allclose(freqs, [1.0, 0.1, 0.01, 0.001])
    # For fixed vectors a and b, rope(a at m) . rope(b at n) depends only on m - n.
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(64), rng.standard_normal(64)
    positions = jnp.arange(300)
    qa = _float(
        ri.apply_rope(jnp.broadcast_to(jnp.asarray(a, jnp.float32), (1, 300, 1, 64)), positions, 500.0)
    )
    kb = _float(
        ri.apply_rope(jnp.broadcast_to(jnp.asarray(b, jnp.float32), (1, 300, 1, 64)), positions, 500.0)
    )
    dots = qa[0, :, 0] @ kb[0, :, 0].T  # [m, n]
    for delta in (0, 3, 57):
        diagonal = np.diagonal(dots, offset=-delta)  # m - n = delta
        np.testing.assert_allclose(diagonal, diagonal[0], atol=2e-3 * np.abs(a).sum() * np.abs(b).max())
    assert abs(dots[0, 0] - a @ b) < 1e-4 and abs(dots[5, 0] - dots[0, 0]) > 1e-2  # and it does rotate


def _pair_rms(k, head):
    """RMS per rotary pair (channels i and i + D/2) of one KV head, over tokens: [D/2]."""
    half = k.shape[-1] // 2
    x = _float(k)[:, :, head]
    return np.sqrt(np.mean(x[..., :half] ** 2 + x[..., half:] ** 2, axis=(0, 1)) / 2)


def test_outlier_channels_of_k():
    a = _generate(seq_q=512, heads_q=8, heads_kv=4, head_dim=128)
    for head in range(4):
        rms = _pair_rms(a.k, head)
        outliers = np.asarray(a.outlier_pairs[head])
        ordinary = np.delete(rms, np.concatenate([outliers, a.sink_pairs]))
        ratio = rms[outliers] / np.median(ordinary)
        # The gain (20) over ordinary channels, which also carry the locality component.
        assert np.all((ratio > 0.6 * KNOBS.outlier_gain) & (ratio < 1.2 * KNOBS.outlier_gain)), ratio
        assert np.all(np.delete(rms, outliers) < 0.35 * rms[outliers].min())
    # q stays ordinary there (the outliers shift scores per row, they do not dominate them).
    q_rms = np.sqrt(np.mean(_float(a.q) ** 2, axis=(0, 1)))  # [Hq, D]
    assert q_rms.max() < 8
    off = ri.activation_qkv(
        0, batch=1, seq_q=256, heads_q=2, head_dim=64, knobs=dataclasses.replace(KNOBS, outlier_gain=1.0)
    )
    assert _pair_rms(off.k, 0).max() < 4


def _attention_probabilities(q, k, head_q, head_kv):
    """float64 causal softmax(q k^T / sqrt(D)) of one head: [Sq, Sk]."""
    qh, kh = _float(q)[0, :, head_q], _float(k)[0, :, head_kv]
    scores = qh @ kh.T / np.sqrt(qh.shape[-1])
    scores = np.where(np.tril(np.ones_like(scores)) > 0, scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=1, keepdims=True))
    return probs / probs.sum(axis=1, keepdims=True)


def test_the_first_token_is_an_attention_sink():
    a = _generate(seq_q=512, heads_q=4, heads_kv=2, head_dim=64)
    sink_mass = [_attention_probabilities(a.q, a.k, h, h // 2)[1:, 0].mean() for h in range(4)]
    assert np.mean(sink_mass) > 0.5 and min(sink_mass) > 0.3, sink_mass
    # The float64 reference agrees: O is then close to the sink token's (small) value.
    out, lse = float64.attention_float64(
        _float(a.q)[0, :, 0], _float(a.k)[0, :, 0], _float(a.v)[0, :, 0], 1 / 8, True, return_lse=True
    )
    assert np.all(np.isfinite(lse)) and out.shape == (512, 64)
    no_sink = _generate(
        seq_q=512, heads_q=4, heads_kv=2, head_dim=64, knobs=dataclasses.replace(KNOBS, sink_logit=0.0)
    )
    plain_mass = [_attention_probabilities(no_sink.q, no_sink.k, h, h // 2)[1:, 0].mean() for h in range(4)]
    assert max(plain_mass) < 0.1, plain_mass
    # The sink's value is small.
    v = _float(a.v)[0]
    assert np.abs(v[0]).mean() < 0.3 * np.abs(v[1:]).mean()


def test_locality_favours_nearby_keys():
    knobs = dataclasses.replace(KNOBS, sink_logit=0.0, local_logit=3.0, head_scale_sigma=0.0)
    a = _generate(seq_q=512, heads_q=2, heads_kv=2, head_dim=64, knobs=knobs)
    probs = _attention_probabilities(a.q, a.k, 0, 0)
    rows = np.arange(256, 512)
    near = probs[rows, rows].mean()
    far = probs[rows, rows - 200].mean()
    assert near > 3 * far, (near, far)


def test_head_scale_spread_is_log_normal():
    a = _generate(seq_q=64, heads_q=64, heads_kv=64, head_dim=32)
    log_rms = np.log(np.sqrt(np.mean(_float(a.q) ** 2, axis=(0, 1, 3))))
    assert 0.6 * KNOBS.head_scale_sigma < np.std(log_rms) < 1.4 * KNOBS.head_scale_sigma
    flat = _generate(
        seq_q=64, heads_q=64, heads_kv=64, head_dim=32, knobs=dataclasses.replace(KNOBS, head_scale_sigma=0.0)
    )
    assert np.std(np.log(np.sqrt(np.mean(_float(flat.q) ** 2, axis=(0, 1, 3))))) < 0.05


def test_gqa_groups_share_the_sink():
    a = _generate(seq_q=256, heads_q=8, heads_kv=2, head_dim=64)
    for h in range(8):
        assert _attention_probabilities(a.q, a.k, h, h // 4)[1:, 0].mean() > 0.2


def test_make_qkv_kinds():
    shape = dict(batch=1, seq_q=16, heads_q=2, head_dim=32)
    q, k, v = ri.make_qkv("gaussian", 0, **shape)
    assert q.shape == (1, 16, 2, 32) and abs(float(jnp.std(q.astype(jnp.float32))) - 1) < 0.2
    q2, _, _ = ri.make_qkv("activations", jax.random.key(0), **shape)
    assert q2.shape == q.shape
    with pytest.raises(ri.ModelInputsUnavailable, match="no installable package"):
        ri.make_qkv("model", 0, **shape)
    with pytest.raises(ValueError, match="unknown input kind"):
        ri.make_qkv("noise", 0, **shape)
    with pytest.raises(ValueError, match="multiple"):
        ri.activation_qkv(0, batch=1, seq_q=16, heads_q=3, heads_kv=2, head_dim=32)
