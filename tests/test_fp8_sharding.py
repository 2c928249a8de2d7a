"""The FP8 kernel's primitive under a sharded jit on 8 CPU devices (its CPU lowering is the kernel's
emulation): batch and head sharding need no collective and give the unsharded bits; descales shard
with K/V; a sequence-sharded q is gathered."""

import functools

import jax
import numpy as np
import pytest
from attention_oracle import random_fp8_qkv
from hlo_utils import collective_counts
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_utils import cpu_mesh

from jzyfa.fp8_primitive import flash_attention_fp8_kernel

NO_COLLECTIVES = dict.fromkeys(
    ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter"), 0
)


def call(q8, k8, v8, dq, dk, dv, *, lean_p=True):
    return flash_attention_fp8_kernel(
        q8, k8, v8, (dq, dk, dv), softmax_scale=128**-0.5, causal=True, lean_p=lean_p, kernel_required=False
    )


# (mesh shape, axes, q spec, k/v spec, descale spec, heads_q, heads_kv)
LAYOUTS = [
    ((8,), ("data",), P("data"), P("data"), P("data"), 2, 1),
    ((2, 4), ("data", "model"), P("data", None, "model"), P("data", None, "model"), P("data", "model"), 8, 4),
    # More query-head shards than KV heads: each shard keeps all KV heads (and descales) and slices one.
    ((4,), ("model",), P(None, None, "model"), P(), P(), 4, 2),
]


@pytest.mark.parametrize("shape, axes, q_spec, kv_spec, d_spec, heads_q, heads_kv", LAYOUTS)
def test_batch_and_head_sharding_match_unsharded(
    rng, shape, axes, q_spec, kv_spec, d_spec, heads_q, heads_kv
):
    mesh = cpu_mesh(shape, axes)
    batch = 8 if "data" in axes else 1
    (q8, k8, v8), (dq, dk, dv) = random_fp8_qkv(
        rng, batch=batch, seq_q=64, heads_q=heads_q, heads_kv=heads_kv, granularity="head"
    )
    shardings = [NamedSharding(mesh, s) for s in (q_spec, kv_spec, kv_spec, d_spec, d_spec, d_spec)]
    sharded = jax.jit(call, in_shardings=shardings)
    lowered = sharded.lower(q8, k8, v8, dq, dk, dv)
    assert "CustomSPMDPartitioning" in lowered.as_text(), "the primitive was not partitioned"
    hlo = lowered.compile().as_text()
    if heads_kv % np.prod([mesh.shape[a] for a in axes if a == "model"] or [1]) == 0:
        assert collective_counts(hlo) == NO_COLLECTIVES
    got = sharded(q8, k8, v8, dq, dk, dv)
    want = jax.jit(call)(q8, k8, v8, dq, dk, dv)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_sequence_sharded_q_is_gathered_and_correct(rng):
    mesh = cpu_mesh((4,), ("seq",))
    (q8, k8, v8), (dq, dk, dv) = random_fp8_qkv(rng, seq_q=128, heads_q=2, granularity="head")
    q_sharding = NamedSharding(mesh, P(None, "seq"))
    rest = [NamedSharding(mesh, P())] * 5
    sharded = jax.jit(functools.partial(call, lean_p=False), in_shardings=[q_sharding, *rest])
    got = sharded(q8, k8, v8, dq, dk, dv)
    want = jax.jit(functools.partial(call, lean_p=False))(q8, k8, v8, dq, dk, dv)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
