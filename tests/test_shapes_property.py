"""Property-based shapes (hypothesis): random batch, lengths, GQA ratios, head dims, masks and dtypes
through the pure-JAX path against float64 attention, and the varlen API against attention sequence by sequence.

Examples are derandomized (the same ones on every run, no example database), so CI is deterministic.
"""

import jax
import jax.numpy as jnp
import numpy as np
from attention_oracle import naive_attention_f64, naive_varlen_f64
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import jzyfa

DETERMINISTIC = settings(
    deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
TOLERANCES = {"float32": (5e-5, 1e-4), "bfloat16": (3e-2, 1e-4)}  # (out atol, lse atol)

bound = st.one_of(st.just(-1), st.integers(0, 8), st.integers(0, 320))
masks = st.one_of(
    st.just((False, None)),
    st.just((True, None)),
    st.tuples(st.booleans(), st.tuples(bound, bound)),  # a window, with or without causal
)


@st.composite
def dense_cases(draw):
    head_dim = draw(st.sampled_from([32, 64, 128, 192]))
    causal, window = draw(masks)
    return dict(
        batch=draw(st.integers(1, 2)),
        seq_q=draw(st.integers(1, 300)),
        seq_k=draw(st.integers(1, 300)),
        heads_kv=draw(st.sampled_from([1, 2])),
        ratio=draw(st.sampled_from([1, 2, 4, 8, 16])),
        head_dim=head_dim,
        head_dim_v=draw(st.sampled_from([head_dim, 128])),
        causal=causal,
        window=window,
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        seed=draw(st.integers(0, 2**31)),
    )


def random_inputs(seed, dtype, *shapes):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(shape), dtype) for shape in shapes]


@settings(DETERMINISTIC, max_examples=16)
@given(dense_cases())
@example(dict(batch=1, seq_q=300, seq_k=1, heads_kv=1, ratio=16, head_dim=192, head_dim_v=128,
              causal=True, window=None, dtype="bfloat16", seed=1))  # fmt: skip
@example(dict(batch=2, seq_q=1, seq_k=300, heads_kv=2, ratio=1, head_dim=64, head_dim_v=64,
              causal=False, window=(0, 0), dtype="float32", seed=2))  # fmt: skip
def test_flash_attention_matches_float64(case):
    heads_q = case["heads_kv"] * case["ratio"]
    q, k, v = random_inputs(
        case["seed"],
        case["dtype"],
        (case["batch"], case["seq_q"], heads_q, case["head_dim"]),
        (case["batch"], case["seq_k"], case["heads_kv"], case["head_dim"]),
        (case["batch"], case["seq_k"], case["heads_kv"], case["head_dim_v"]),
    )
    out, lse = jzyfa.flash_attention(
        q, k, v, causal=case["causal"], window=case["window"], return_lse=True, implementation="xla"
    )
    assert out.shape == q.shape[:3] + v.shape[3:] and out.dtype == q.dtype
    want_out, want_lse = naive_attention_f64(
        *(np.asarray(x, np.float32) for x in (q, k, v)), causal=case["causal"], window=case["window"]
    )
    out, lse = np.asarray(out, np.float64), np.asarray(lse)
    out_atol, lse_atol = TOLERANCES[case["dtype"]]
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(out, want_out, atol=out_atol, rtol=1e-2 if case["dtype"] == "bfloat16" else 0)
    seen = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[seen], want_lse[seen], atol=lse_atol, rtol=1e-5)


@st.composite
def varlen_cases(draw):
    num_seqs = draw(st.integers(1, 4))
    lengths = st.lists(st.integers(0, 80), min_size=num_seqs, max_size=num_seqs)
    head_dim = draw(st.sampled_from([32, 64, 192]))
    causal, window = draw(masks)
    return dict(
        lengths_q=draw(lengths),
        lengths_k=draw(lengths),
        heads_kv=draw(st.sampled_from([1, 2])),
        ratio=draw(st.sampled_from([1, 4, 16])),
        head_dim=head_dim,
        head_dim_v=draw(st.sampled_from([head_dim, 128])),
        causal=causal,
        window=window,
        seed=draw(st.integers(0, 2**31)),
    )


@settings(DETERMINISTIC, max_examples=20)
@given(varlen_cases())
def test_varlen_matches_per_sequence_attention(case):
    cu_q, cu_k = (
        np.concatenate([[0], np.cumsum(case[n])]).astype(np.int32) for n in ("lengths_q", "lengths_k")
    )
    heads_q = case["heads_kv"] * case["ratio"]
    q, k, v = random_inputs(
        case["seed"],
        jnp.float32,
        (cu_q[-1], heads_q, case["head_dim"]),
        (cu_k[-1], case["heads_kv"], case["head_dim"]),
        (cu_k[-1], case["heads_kv"], case["head_dim_v"]),
    )
    max_q, max_k = max(max(case["lengths_q"]), 1), max(max(case["lengths_k"]), 1)
    out, lse = jax.jit(
        lambda *a: jzyfa.flash_attention_varlen(
            *a, max_q, max_k, causal=case["causal"], window=case["window"], return_lse=True
        )
    )(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k))
    assert out.shape == (cu_q[-1], heads_q, case["head_dim_v"]) and lse.shape == (heads_q, cu_q[-1])
    # Sequence by sequence in float64 (tests/test_varlen.py also compares with flash_attention calls;
    # here that would compile once per sequence shape).
    want_out, want_lse = naive_varlen_f64(q, k, v, cu_q, cu_k, causal=case["causal"], window=case["window"])
    np.testing.assert_allclose(out, want_out, atol=5e-5)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    seen = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[seen], want_lse[seen], atol=1e-4, rtol=1e-5)
