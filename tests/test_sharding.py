"""flash_attention under a sharded jit on 8 CPU devices: numerics and the collectives in compiled HLO.

Batch and head sharding must need no collective at all; a sequence-sharded q stays local while K and V
are all-gathered. Inputs are f16, so the primitive (not the pure-JAX path) is what gets partitioned;
its CPU lowering is the reference on each shard's blocks, which rounds like the unsharded reference
up to an ulp of the output (XLA vectorizes other shapes differently).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import random_qkv
from hlo_utils import collective_counts, collective_result_shapes, custom_call_lines
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_utils import cpu_mesh

import jzyfa
from jzyfa import primitive, sharding
from jzyfa.primitive import FFI_TARGET

# Dispatch as on a CPU host (the primitive path), even when these tests run on a GPU host.
pytestmark = pytest.mark.usefixtures("cpu_backend")

F16 = jnp.float16
NO_COLLECTIVES = dict.fromkeys(
    ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter"), 0
)


def sharded_attention(mesh, q_spec, kv_spec, **options):
    """flash_attention jitted with its inputs sharded as given; returns (out, lse)."""
    fn = functools.partial(jzyfa.flash_attention, return_lse=True, **options)
    q_sharding, kv_sharding = NamedSharding(mesh, q_spec), NamedSharding(mesh, kv_spec)
    return jax.jit(fn, in_shardings=(q_sharding, kv_sharding, kv_sharding))


def compiled_hlo(fn, *args) -> str:
    lowered = fn.lower(*args)
    assert "CustomSPMDPartitioning" in lowered.as_text(), "the primitive was not partitioned"
    return lowered.compile().as_text()


def assert_close_to_reference(got, want):
    """Within an f16 ulp for out; lse (float32 throughout) to float32 rounding."""
    np.testing.assert_allclose(
        np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), atol=1e-3, rtol=1e-3
    )
    np.testing.assert_allclose(got[1], want[1], atol=1e-5, rtol=1e-6)


def test_eight_cpu_devices():
    assert len(jax.devices("cpu")) == 8


# (mesh shape, mesh axes, q spec, k/v spec, heads_q, heads_kv, causal)
BATCH_AND_HEADS = [
    pytest.param((8,), ("data",), P("data"), P("data"), 4, 2, True, id="batch"),
    pytest.param(
        (2, 4),
        ("data", "tensor"),
        P("data", None, "tensor"),
        P("data", None, "tensor"),
        16,
        4,
        True,
        id="batch-x-heads-gqa",
    ),
    pytest.param(
        (2, 4),
        ("data", "tensor"),
        P("data", None, "tensor"),
        P("data", None, "tensor"),
        16,
        4,
        False,
        id="batch-x-heads-gqa-noncausal",
    ),
    # More query-head shards than KV heads: each device keeps all KV heads and uses its own.
    pytest.param(
        (2, 4), ("data", "tensor"), P("data", None, "tensor"), P("data"), 8, 2, True, id="heads-past-kv-heads"
    ),
    pytest.param((8,), ("tensor",), P(None, None, "tensor"), P(), 8, 1, True, id="mqa"),
    pytest.param((8,), ("tensor",), P(None, None, "tensor"), P(None, None, "tensor"), 8, 8, True, id="mha"),
]


@pytest.mark.parametrize("mesh_shape,axes,q_spec,kv_spec,heads_q,heads_kv,causal", BATCH_AND_HEADS)
def test_batch_and_head_sharding_needs_no_collective(
    rng, mesh_shape, axes, q_spec, kv_spec, heads_q, heads_kv, causal
):
    mesh = cpu_mesh(mesh_shape, axes)
    q, k, v = random_qkv(rng, batch=8, seq_q=24, seq_k=40, heads_q=heads_q, heads_kv=heads_kv, dtype=F16)
    fn = sharded_attention(mesh, q_spec, kv_spec, causal=causal)
    assert collective_counts(compiled_hlo(fn, q, k, v)) == NO_COLLECTIVES
    out, lse = fn(q, k, v)
    assert_close_to_reference((out, lse), jzyfa.attention_reference(q, k, v, causal=causal))
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, q_spec), 4)


def test_kv_computed_in_the_program_with_more_head_shards_than_kv_heads(rng):
    """K/V from replicated weights, q heads over 4 devices, 2 KV heads: no collective, no reshard."""
    mesh = cpu_mesh((4,), ("tensor",))
    x = jnp.asarray(rng.standard_normal((1, 32, 64)), F16)
    w_q = jnp.asarray(rng.standard_normal((64, 8 * 64)) / 8, F16)
    w_kv = jnp.asarray(rng.standard_normal((64, 2 * 64)) / 8, F16)

    def attention(x, w_q, w_kv):
        q = (x @ w_q).reshape(1, 32, 8, 64)
        kv = (x @ w_kv).reshape(1, 32, 2, 64)
        return jzyfa.flash_attention(q, kv, kv, causal=True, return_lse=True)

    shardings = (NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "tensor")), NamedSharding(mesh, P()))
    fn = jax.jit(attention, in_shardings=shardings)
    assert collective_counts(compiled_hlo(fn, x, w_q, w_kv)) == NO_COLLECTIVES
    q, kv = (x @ w_q).reshape(1, 32, 8, 64), (x @ w_kv).reshape(1, 32, 2, 64)
    assert_close_to_reference(fn(x, w_q, w_kv), jzyfa.attention_reference(q, kv, kv, causal=True))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq_q,seq_k", [(64, 64), (32, 64)])
def test_sequence_sharded_q_stays_local_and_gathers_kv(rng, seq_q, seq_k, causal):
    mesh = cpu_mesh((2, 4), ("data", "seq"))
    q, k, v = random_qkv(rng, batch=2, seq_q=seq_q, seq_k=seq_k, heads_q=4, heads_kv=2, dtype=F16)
    fn = sharded_attention(mesh, P("data", "seq"), P("data", "seq"), causal=causal)
    hlo = compiled_hlo(fn, q, k, v)
    # K and V gathered along the sequence (per data shard), q never: nothing else moves.
    assert collective_counts(hlo) == dict(NO_COLLECTIVES, **{"all-gather": 2})
    assert collective_result_shapes(hlo, "all-gather") == [f"f16[1,{seq_k},2,64]"] * 2
    out, lse = fn(q, k, v)
    assert out.sharding.spec[:2] == ("data", "seq")
    assert_close_to_reference((out, lse), jzyfa.attention_reference(q, k, v, causal=causal))


def test_sharded_head_dim_is_gathered(rng):
    mesh = cpu_mesh((8,), ("model",))
    q, k, v = random_qkv(rng, batch=2, seq_q=16, heads_q=2, dtype=F16)
    fn = sharded_attention(mesh, P(None, None, None, "model"), P(None, None, None, "model"), causal=True)
    compiled_hlo(fn, q, k, v)
    assert_close_to_reference(fn(q, k, v), jzyfa.attention_reference(q, k, v, causal=True))


def test_gspmd_partitioner_uses_the_same_plan(rng):
    mesh = cpu_mesh((2, 4), ("data", "tensor"))
    q, k, v = random_qkv(rng, batch=4, seq_q=16, heads_q=8, heads_kv=4, dtype=F16)
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        fn = sharded_attention(mesh, P("data", None, "tensor"), P("data", None, "tensor"), causal=True)
        hlo = compiled_hlo(fn, q, k, v)
        got = fn(q, k, v)
    finally:
        jax.config.update("jax_use_shardy_partitioner", previous)
    assert collective_counts(hlo) == NO_COLLECTIVES
    assert_close_to_reference(got, jzyfa.attention_reference(q, k, v, causal=True))


def test_grad_of_sharded_call_matches_unsharded(rng):
    mesh = cpu_mesh((2, 4), ("data", "tensor"))
    q, k, v = random_qkv(rng, batch=2, seq_q=16, seq_k=24, heads_q=8, heads_kv=4, dtype=F16)

    def loss(q, k, v):
        return jnp.sum(jzyfa.flash_attention(q, k, v, causal=True).astype(jnp.float32) ** 2)

    spec = NamedSharding(mesh, P("data", None, "tensor"))
    grads = jax.grad(loss, argnums=(0, 1, 2))
    sharded = jax.jit(grads, in_shardings=(spec,) * 3, out_shardings=(spec,) * 3)
    # The forward is partitioned by the rule, the reference backward by Shardy: neither communicates.
    assert collective_counts(compiled_hlo(sharded, q, k, v)) == NO_COLLECTIVES
    for got, want in zip(sharded(q, k, v), jax.jit(grads)(q, k, v)):  # f16 gradients: a few ulps apart
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), atol=5e-3, rtol=5e-3
        )


# --- the CUDA program of a sharded call, lowered on this CPU machine ----------------------------


def test_cuda_lowering_of_sharded_call_carries_the_rule():
    mesh = cpu_mesh((2, 4), ("data", "tensor"))
    q = jax.ShapeDtypeStruct(
        (2, 64, 16, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P("data", None, "tensor"))
    )
    kv = jax.ShapeDtypeStruct(
        (2, 64, 4, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P("data", None, "tensor"))
    )
    fn = jax.jit(functools.partial(jzyfa.flash_attention, causal=True))
    text = fn.trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    # The partitioner expands this call per shard when it compiles for the GPUs.
    assert 'call_target_name = "CustomSPMDPartitioning"' in text or "@CustomSPMDPartitioning" in text
    # b, sq, hq, d / b, sk, h, d / b, sk, h, dv -> out [b, sq, hq, dv], lse [b, hq, sq]; v's head
    # dim is a factor of its own (MLA); d, sk and dv replicated.
    assert (
        "sdy.op_sharding_rule<([i, j, k, l], [i, m, n, l], [i, m, n, o])->([i, j, k, o], [i, k, j])" in text
    )
    assert "need_replication={l, m, o}" in text


@pytest.mark.parametrize(
    "q_spec,kv_spec,local_q,local_kvs",
    [
        (P("data", None, "tensor"), P("data", None, "tensor"), "bf16[1,64,4,128]", ["bf16[1,64,1,128]"]),
        # Sequence shard s of 4 attends to the 16 * (s + 1) keys it sees: one branch per shard.
        (
            P("data", "tensor"),
            P("data", "tensor"),
            "bf16[1,16,16,128]",
            [f"bf16[1,{n},4,128]" for n in (16, 32, 48, 64)],
        ),
    ],
)
def test_per_shard_program_lowers_to_the_kernel_for_cuda(q_spec, kv_spec, local_q, local_kvs):
    """What the partitioner's callback returns, run under shard_map and lowered for CUDA."""
    mesh = cpu_mesh((2, 4), ("data", "tensor"))
    q = jax.ShapeDtypeStruct((2, 64, 16, 128), jnp.bfloat16, sharding=NamedSharding(mesh, q_spec))
    kv = jax.ShapeDtypeStruct((2, 64, 4, 128), jnp.bfloat16, sharding=NamedSharding(mesh, kv_spec))
    _, run, (out_sharding, lse_sharding), arg_shardings = sharding.partition(
        primitive.flash_attention_shard, 0.125, True, False, (-1, -1), mesh, (q, kv, kv), None
    )
    per_shard = jax.shard_map(
        run,
        mesh=mesh,
        in_specs=tuple(s.spec for s in arg_shardings),
        out_specs=(out_sharding.spec, lse_sharding.spec),
    )
    hlo = jax.jit(per_shard).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")
    calls = custom_call_lines(hlo, FFI_TARGET)
    assert len(calls) == len(local_kvs)
    assert all(local_q in call for call in calls)
    # Operand layouts list each call's q, k, v shapes.
    assert sorted(kv for call in calls for kv in local_kvs if f"{kv}{{3,2,1,0}}" in call) == sorted(local_kvs)


def test_inside_shard_map_with_kv_replicated(rng):
    """q varies over the manual axis, K/V do not: the primitive makes them vary alike."""
    mesh = cpu_mesh((4,), ("seq",))
    q, k, v = random_qkv(rng, seq_q=32, seq_k=16, heads_q=2, dtype=F16)
    attention = functools.partial(jzyfa.flash_attention, return_lse=True)
    fn = jax.jit(
        jax.shard_map(
            attention,
            mesh=mesh,
            in_specs=(P(None, "seq"), P(), P()),
            out_specs=(P(None, "seq"), P(None, None, "seq")),
        )
    )
    assert_close_to_reference(fn(q, k, v), jzyfa.attention_reference(q, k, v))
