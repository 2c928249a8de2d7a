"""The kernel inside real programs on Hopper: CUDA graphs, host overhead per call, sharding over GPUs.

Skipped without a Hopper GPU and the built extension. The measured numbers (handler runs, host
overhead per call) are printed past pytest's capture, so they reach the log without `-s`.
`python -m jzyfa.bench.overhead` measures per-call overhead next to cuDNN's and XLA's.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import random_qkv
from gpu_utils import requires_hopper
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jzyfa
from jzyfa.bench.overhead import wall_us_per_call
from jzyfa.primitives import FFI_TARGET

pytestmark = [pytest.mark.gpu, requires_hopper]

# XLA's command buffers (CUDA graphs) for fusions and custom calls, even for a short sequence of them;
# the empty list turns command buffers off. (compiler_options take DebugOptions fields; a repeated
# enum is given as comma-separated names and replaces the default list.)
WITH_GRAPHS = {"xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL", "xla_gpu_graph_min_graph_size": 1}
WITHOUT_GRAPHS = {"xla_gpu_enable_command_buffer": ""}


def prefill_like(q, k, v):
    """The kernel between elementwise work, as in a model layer."""
    out = jzyfa.flash_attention(q * 1.5, k, v, causal=True, implementation="kernel")
    return (out.astype(jnp.float32) + 1.0).astype(q.dtype)


# Calls per compiled program in the command-buffer test.
CALLS = 5


def runs_and_handler_calls(compiled, *args, calls: int = CALLS) -> tuple[list[np.ndarray], int]:
    """The outputs of `calls` calls on the same inputs, and how often the FFI handler ran meanwhile.

    Each output is copied to the host and its device buffer dropped before the next call, so the next
    call gets the same addresses and a graph can be replayed as recorded. (Keeping every output alive
    gives each call new addresses, and XLA then re-traces the custom call, running the handler.)
    """
    before = jzyfa.handler_calls()
    outs = [np.asarray(compiled(*args)) for _ in range(calls)]
    return outs, jzyfa.handler_calls() - before


def test_command_buffers_capture_the_kernel_and_match_bitwise(rng, capsys):
    q, k, v = random_qkv(rng, batch=2, seq_q=1000, seq_k=1536, heads_q=8, heads_kv=2, head_dim=128)
    lowered = jax.jit(prefill_like).lower(q, k, v)
    graphs = lowered.compile(compiler_options=WITH_GRAPHS)
    plain = lowered.compile(compiler_options=WITHOUT_GRAPHS)
    # The compiled HLO cannot show the capture: this XLA turns thunks into command buffers after HLO.
    # What shows it is the handler: a thunk runs it on every call, a replayed graph never does.
    assert f'custom_call_target="{FFI_TARGET}"' in graphs.as_text()

    plain_outs, plain_calls = runs_and_handler_calls(plain, q, k, v)
    graph_outs, graph_calls = runs_and_handler_calls(graphs, q, k, v)
    with capsys.disabled():
        print(f"\nhandler runs in {CALLS} calls: {plain_calls} without command buffers, {graph_calls} with")
    assert plain_calls == CALLS, "without command buffers the handler must run on every call"
    # With them it runs when the graph is recorded (and in a warm-up run before, if XLA makes one).
    assert 1 <= graph_calls <= 2, (
        f"with command buffers the handler ran {graph_calls} times in {CALLS} calls: expected 1 (recording) "
        "or 2 (a warm-up run, then recording), the later calls replaying the graph"
    )
    for out in plain_outs[1:] + graph_outs:
        np.testing.assert_array_equal(out, plain_outs[0])
    # New buffers: the graph is updated with the new addresses, not re-planned from device data.
    q2, k2, v2 = (x * 0.5 for x in (q, k, v))
    np.testing.assert_array_equal(np.asarray(graphs(q2, k2, v2)), np.asarray(plain(q2, k2, v2)))


def test_command_buffers_run_the_backward_kernel_bitwise(rng):
    """jax.grad (the forward and the backward custom calls) under command buffers gives the bits of the same
    program without them, call after call."""
    q, k, v = random_qkv(rng, batch=2, seq_q=1000, seq_k=1536, heads_q=8, heads_kv=2, head_dim=128)

    def loss(q, k, v):
        return jnp.sum(prefill_like(q, k, v).astype(jnp.float32) ** 2)

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v)
    assert "jzyfa_attention_bwd" in lowered.as_text()
    graphs = lowered.compile(compiler_options=WITH_GRAPHS)
    plain = lowered.compile(compiler_options=WITHOUT_GRAPHS)
    want = [np.asarray(g) for g in plain(q, k, v)]
    for _ in range(3):
        for got, ref in zip(graphs(q, k, v), want):
            np.testing.assert_array_equal(np.asarray(got), ref)


@pytest.mark.parametrize("options", [WITHOUT_GRAPHS, WITH_GRAPHS], ids=["thunks", "graphs"])
def test_host_overhead_per_call(rng, options, capsys, record_property):
    """A tiny call is host-bound: its time over a trivial jitted op is the handler's host work."""
    q, k, v = random_qkv(rng, batch=1, seq_q=128, heads_q=1, head_dim=128)
    attention = jax.jit(functools.partial(jzyfa.flash_attention, causal=True, implementation="kernel"))
    attention = attention.lower(q, k, v).compile(compiler_options=options)
    trivial = jax.jit(lambda q, k, v: q + 1).lower(q, k, v).compile(compiler_options=options)
    overhead = wall_us_per_call(attention, (q, k, v), calls=2000, rounds=3) - wall_us_per_call(
        trivial, (q, k, v), calls=2000, rounds=3
    )
    # Printed past pytest's capture, so the number reaches the log without -s (and the JUnit XML).
    record_property("overhead_us_per_call", round(overhead, 2))
    with capsys.disabled():
        print(
            f"\njzyfa call over a trivial jitted op ({'graphs' if options is WITH_GRAPHS else 'thunks'}): "
            f"{overhead:.1f} us per call"
        )
    # Planning per shape, device checks and tensor-map encoding are a few microseconds of host time;
    # tens would mean per-call work that belongs in a per-call-site stage.
    assert overhead < 25


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs two or more GPUs")
def test_batch_and_head_sharding_over_gpus_is_bitwise(rng):
    """Each (batch, head) is computed alike wherever it runs, so sharding changes no bit."""
    count = len(jax.devices())
    mesh = jax.make_mesh((count,), ("tensor",), axis_types=(jax.sharding.AxisType.Auto,))
    q, k, v = random_qkv(rng, batch=2, seq_q=2048, heads_q=2 * count, heads_kv=count, head_dim=128)
    spec = NamedSharding(mesh, P(None, None, "tensor"))
    attention = functools.partial(jzyfa.flash_attention, causal=True, implementation="kernel")
    sharded = jax.jit(attention, in_shardings=(spec, spec, spec))
    hlo = sharded.lower(q, k, v).compile().as_text()
    assert not re.search(r"(all-gather|all-reduce|collective-permute|all-to-all)(-start)?\(", hlo)
    np.testing.assert_array_equal(np.asarray(sharded(q, k, v)), np.asarray(jax.jit(attention)(q, k, v)))


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs two or more GPUs")
@pytest.mark.parametrize("strategy", ["allgather", "ring"])
def test_context_parallel_over_gpus(rng, strategy):
    count = len(jax.devices())
    mesh = jax.make_mesh((count,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    q, k, v = random_qkv(rng, seq_q=1024 * count, heads_q=8, heads_kv=2, head_dim=128)
    fn = jax.jit(
        functools.partial(jzyfa.context_parallel_attention, mesh=mesh, seq_axis="seq", strategy=strategy)
    )
    balanced = [jzyfa.to_balanced_layout(x, count) for x in (q, k, v)]
    out = jzyfa.from_balanced_layout(np.asarray(fn(*balanced)), count)
    want = jzyfa.attention_reference(q, k, v, causal=True)[0]
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2
    )
