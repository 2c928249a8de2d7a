"""`python -m jzyfa.bench --direction`: the backward and forward+backward timing functions, their FLOPs,
the float64 gradient reference, and a smoke run (CPU: jzyfa's primitive path and jax.nn's XLA path)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_grads_f64, random_qkv
from bench_helpers import ON_GPU
from test_bench import resolve_config

from jzyfa.bench import directions, float64, peers, speed
from jzyfa.bench.problem import Problem, sink_logits


@pytest.mark.parametrize(
    "seq_q,seq_k,window",
    [(40, 40, (-1, 0)), (24, 56, (-1, 0)), (56, 24, (-1, 0)), (33, 47, (-1, -1)), (48, 48, (6, 2))],
)
def test_float64_gradients_match_the_oracle(rng, seq_q, seq_k, window):
    q, k, v = (np.asarray(x, np.float64)[0, :, 0] for x in random_qkv(rng, seq_q=seq_q, seq_k=seq_k, heads_q=1,
                                                                       head_dim=16, dtype=jnp.float32))  # fmt: skip
    dout = rng.standard_normal((seq_q, 16))
    got = directions.attention_grads_float64(q, k, v, dout, 0.3, window=window)
    causal, oracle_window = window == (-1, 0), None if window in ((-1, 0), (-1, -1)) else window
    want = naive_attention_grads_f64(q[None, :, None], k[None, :, None], v[None, :, None], dout[None, :, None],
                                     causal=causal, softmax_scale=0.3, window=oracle_window)  # fmt: skip
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w[0, :, 0], rtol=1e-10, atol=1e-12)


def test_gradient_reference_sums_dk_dv_over_each_kv_heads_group(rng):
    problem = Problem(2, 32, 32, 4, 2, 64, True, "bf16", None)
    q, k, v = random_qkv(rng, batch=2, seq_q=32, heads_q=4, heads_kv=2, dtype=jnp.float32)
    dout = directions.cotangent(problem, 0, seed=0).astype(jnp.float32)
    ref = directions.gradient_reference(problem, q, k, v, dout, requested=0)
    assert ref.groups == [(0, 0), (0, 1), (1, 0), (1, 1)]
    exact = naive_attention_grads_f64(q, k, v, dout, causal=True, softmax_scale=problem.softmax_scale)
    err = directions.gradient_error(exact, ref, heads_q=4, heads_kv=2)
    assert err["rel_l2"] < 1e-12 and err["finite"]
    wrong = (exact[0], exact[1] * 1.01, exact[2])
    assert directions.gradient_error(wrong, ref, heads_q=4, heads_kv=2)["dk_rel_l2"] == pytest.approx(0.01)


def test_backward_timing_functions_return_the_gradients(rng):
    forward = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
    q, k, v = random_qkv(rng, seq_q=16, heads_q=2, dtype=jnp.float32)
    dout = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    want = jax.vjp(forward, q, k, v)[1](dout)
    for direction in ("bwd", "fwd+bwd"):
        fn, args = directions.timed_call(forward, [(q, k, v)], [dout], direction)
        for got, w in zip(jax.jit(fn)(*args[0]), want):
            np.testing.assert_allclose(got, w, rtol=1e-6, atol=1e-6)
    fn, args = directions.timed_call(forward, [(q, k, v)], [], "fwd")
    assert fn is forward and args == [(q, k, v)]


def test_parse_directions():
    assert directions.parse_directions("fwd+bwd, bwd,bwd") == ["fwd+bwd", "bwd"]
    with pytest.raises(ValueError, match="--direction: unknown"):
        directions.parse_directions("backward")


def test_who_is_not_differentiated_says_why():
    dense = Problem(1, 64, 64, 2, 2, 64, True, "bf16", None)
    assert directions.no_backward_reason(peers.PEERS["jzyfa"], dense) is None
    assert directions.no_backward_reason(peers.PEERS["cudnn"], dense) is None
    assert "not differentiable" in directions.no_backward_reason(peers.PEERS["jzyfa_fp8"], dense)
    assert "JAX peers only" in directions.no_backward_reason(peers.PEERS["flash_attn3"], dense)
    assert "causal" in directions.no_backward_reason(peers.PEERS["pallas"], dense)


# The event JAX records for each backend compile (jax._src.dispatch.BACKEND_COMPILE_EVENT).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def test_compile_stats_compiles_what_was_compiled_before():
    compiles = []

    def listener(event, seconds, **_):
        if event == BACKEND_COMPILE_EVENT:
            compiles.append(seconds)

    def fn(x):
        return jnp.sin(x) @ x

    x = jnp.ones((32, 32))
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        jax.jit(fn)(x).block_until_ready()
        before = len(compiles)
        memory, seconds = directions.compile_stats(fn, (x,))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(compiles) == before + 1  # a backend compile, not a cache hit
    assert seconds >= compiles[-1]
    assert memory is None or memory > 0


def test_smoke_run_times_every_direction():
    config = resolve_config(["--smoke", "--shapes", "1x64", "--inputs", "gaussian", "--impls", "jzyfa,xla",
                             "--direction", "fwd,bwd,fwd+bwd", "--kv_heads", "2"])  # fmt: skip
    report = speed.run(config)
    rows = {r["impl"]: r for r in report["results"]}
    assert list(rows) == ["jzyfa", "jzyfa bwd", "jzyfa fwd+bwd", "xla", "xla bwd", "xla fwd+bwd"]
    forward_flops = rows["jzyfa"]["flops"]
    for name, r in rows.items():
        assert r["status"] == "ok", r
        assert r["rel_err"] < 2e-2
        assert r["flops"] == forward_flops * directions.FLOP_FACTORS[r["direction"]]
        if not ON_GPU:
            assert r["memory_mb"] > 0
        assert r["compile_s"] > 0  # the first call's compile time (issue 30: within 1.5x of cuDNN's)
    assert rows["jzyfa bwd"]["dq_rel_l2"] < 2e-2 and rows["jzyfa bwd"]["dk_rel_l2"] < 2e-2
    assert "mem MB" in speed.format_plain(report["results"])
    assert "compile s" in speed.format_plain(report["results"])


def smoke_run_with(flags, *, refusal):
    """A 1x64 forward and backward smoke run of jzyfa and jax.nn's XLA peer with `flags`: jzyfa's rows
    pass their float64 checks, the XLA peer refuses with `refusal`. Returns (report, config)."""
    config = resolve_config(["--smoke", "--shapes", "1x64", "--inputs", "gaussian", "--impls", "jzyfa,xla",
                             "--direction", "fwd,bwd", *flags])  # fmt: skip
    report = speed.run(config)
    rows = {r["impl"]: r for r in report["results"]}
    for name in ("jzyfa", "jzyfa bwd"):
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["rel_err"] < 2e-2
    assert rows["jzyfa bwd"]["dq_rel_l2"] < 2e-2 and rows["jzyfa bwd"]["dk_rel_l2"] < 2e-2
    assert rows["xla"]["status"] == "unsupported" and refusal in rows["xla"]["message"]
    return report, config


def test_softcap_run_checks_the_capped_reference():
    """--softcap: jzyfa's rows against float64 with the cap (c = 0.5 moves every score, so a call or a
    reference without it would fail the check); peers without a softcap say so."""
    report, config = smoke_run_with(["--softcap", "0.5"], refusal="no softcap")
    assert "softcap 0.5" in speed.format_markdown(report["results"], report["env"], config)


def test_softcap_flag_is_checked():
    with pytest.raises(ValueError, match="--softcap must be a finite number > 0"):
        resolve_config(["--smoke", "--softcap", "-1"])


def test_float64_sink_is_one_more_logit_without_a_value(rng):
    """attention_float64's sink (and the gradients from it) against a softmax with an extra column: a key
    whose score is the sink and whose value is 0, seen by every row (`window` masks the real keys only)."""
    seq_q, seq_k, d, scale, sink = 24, 40, 16, 0.3, 2.5
    q, k, v = (rng.standard_normal((n, d)) for n in (seq_q, seq_k, seq_k))
    dout = rng.standard_normal((seq_q, d))
    out, lse = float64.attention_float64(q, k, v, scale, True, return_lse=True, sink=sink)
    scores = q @ k.T * scale
    scores = np.where(np.arange(seq_k)[None] <= np.arange(seq_q)[:, None] + seq_k - seq_q, scores, -np.inf)
    full = np.concatenate([scores, np.full((seq_q, 1), sink)], axis=1)
    np.testing.assert_allclose(lse, np.log(np.exp(full).sum(1)), rtol=1e-12)
    probs = np.exp(full - lse[:, None])
    np.testing.assert_allclose(out, probs[:, :seq_k] @ v, rtol=1e-10, atol=1e-12)
    dq, dk, dv = directions.attention_grads_float64(q, k, v, dout, scale, window=(-1, 0), sink=sink)
    p = probs[:, :seq_k]
    d_scores = p * (dout @ v.T - (dout * out).sum(1, keepdims=True))
    np.testing.assert_allclose(dv, p.T @ dout, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dq, d_scores @ k * scale, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dk, d_scores.T @ q * scale, rtol=1e-10, atol=1e-12)


def test_sinks_run_checks_the_reference_with_sinks():
    """--sinks: jzyfa's rows against float64 with a sink per head (mean 5 at 64 keys: the sinks take a
    large share of each row, so a call or a reference without them would fail the check); peers
    without sinks say so."""
    report, config = smoke_run_with(["--sinks", "5"], refusal="no sinks")
    assert "sinks 5 + N(0, 1) per head" in speed.format_markdown(report["results"], report["env"], config)
    # The sinks move the output far past the check's tolerance (it could fail without them).
    sinks = sink_logits(5.0, 4, 0)
    assert len(set(sinks)) == 4
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((64, 128)) for _ in range(3))
    plain = float64.attention_float64(q, k, v, 128**-0.5, True)
    for sink in sinks:
        with_sink = float64.attention_float64(q, k, v, 128**-0.5, True, sink=sink)
        assert np.linalg.norm(with_sink - plain) > 0.1 * np.linalg.norm(plain)


def test_sinks_flag_is_checked():
    with pytest.raises(ValueError, match="--sinks must be a finite number"):
        resolve_config(["--smoke", "--sinks", "nan"])
