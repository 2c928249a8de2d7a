"""Context-parallel prefill on 8 CPU devices: layouts, both strategies against the reference, HLO.

Inputs are f16 so each shard's attention takes the primitive path, as the kernel would on Hopper.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import random_qkv
from hlo_utils import COLLECTIVES, collective_counts, collective_result_shapes, custom_call_lines
from mesh_utils import MESH_KINDS, cpu_mesh, mesh_of_kind

import jzyfa
from jzyfa import sequence_layout
from jzyfa.primitives import FFI_TARGET
from jzyfa.query_chunks import visible_key_prefix

pytestmark = pytest.mark.usefixtures("cpu_backend")

F16 = jnp.float16
NONE = dict.fromkeys(COLLECTIVES, 0)


def to_layout(x, layout, shards, axis=1):
    return jzyfa.to_balanced_layout(x, shards, axis=axis) if layout == "balanced" else x


def from_layout(x, layout, shards, axis=1):
    x = np.asarray(x)  # gathered to the host: the helpers reorder whole sequences
    return np.asarray(jzyfa.from_balanced_layout(x, shards, axis=axis)) if layout == "balanced" else x


def assert_close_to_reference(out, lse, q, k, v, causal):
    want_out, want_lse = jzyfa.attention_reference(q, k, v, causal=causal)
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(want_out, np.float32), atol=1e-3, rtol=1e-3
    )
    np.testing.assert_allclose(lse, want_lse, atol=1e-5, rtol=1e-6)


def run_context_parallel(mesh, q, k, v, *, layout, **options):
    """Runs jitted context_parallel_attention on natural-order inputs; returns (out, lse, compiled HLO)."""
    shards = mesh.shape[options["seq_axis"]]
    fn = jax.jit(
        functools.partial(
            jzyfa.context_parallel_attention, mesh=mesh, layout=layout, return_lse=True, **options
        )
    )
    args = [to_layout(x, layout, shards) for x in (q, k, v)]
    hlo = fn.lower(*args).compile().as_text()
    out, lse = fn(*args)
    return from_layout(out, layout, shards), from_layout(lse, layout, shards, axis=2), hlo


# --- layouts ----------------------------------------------------------------------------------


def test_balanced_chunk_order():
    np.testing.assert_array_equal(sequence_layout.balanced_chunk_order(4), [0, 7, 1, 6, 2, 5, 3, 4])
    np.testing.assert_array_equal(jzyfa.balanced_positions(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])


def test_balanced_layout_round_trip(rng):
    x = jnp.asarray(rng.standard_normal((2, 48, 3)))
    permuted = jzyfa.to_balanced_layout(x, 3)
    np.testing.assert_array_equal(permuted[:, 8:16], x[:, 40:48])  # shard 0's second chunk is the last
    np.testing.assert_array_equal(jzyfa.from_balanced_layout(permuted, 3), x)
    y = jnp.swapaxes(x, 1, 2)  # the sequence on another axis
    np.testing.assert_array_equal(
        jzyfa.from_balanced_layout(jzyfa.to_balanced_layout(y, 2, axis=2), 2, axis=2), y
    )


def test_balanced_layout_needs_divisible_length():
    with pytest.raises(ValueError, match="length 12 .* not a multiple of 8"):
        jzyfa.to_balanced_layout(jnp.zeros((1, 12)), 4)


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_balanced_layout_equalises_causal_work(shards):
    seq, chunk = 64 * shards, 32

    def keys_read(layout):  # keys each shard's query chunks attend to, summed per shard
        return [
            sum(
                chunk * visible_key_prefix(c * chunk, chunk, seq, seq)
                for c in sequence_layout.shard_chunks(s, shards, layout)
            )
            for s in range(shards)
        ]

    assert len(set(keys_read("balanced"))) == 1
    contiguous = keys_read("contiguous")
    assert contiguous[-1] > contiguous[0]


# --- both strategies against the reference ----------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", ["balanced", "contiguous"])
@pytest.mark.parametrize("strategy", ["allgather", "ring"])
def test_matches_reference_with_expected_collectives(rng, strategy, layout, causal):
    mesh = cpu_mesh((8,), ("seq",))
    q, k, v = random_qkv(rng, seq_q=64, heads_q=4, heads_kv=2, dtype=F16)
    out, lse, hlo = run_context_parallel(
        mesh, q, k, v, seq_axis="seq", strategy=strategy, layout=layout, causal=causal
    )
    assert_close_to_reference(out, lse, q, k, v, causal)
    if strategy == "allgather":  # K and V gathered once each, q stays put
        assert collective_counts(hlo) == dict(NONE, **{"all-gather": 2})
        assert collective_result_shapes(hlo, "all-gather") == ["f16[1,64,2,64]"] * 2
    else:  # K and V passed on in each of the 7 steps, nothing gathered
        assert collective_counts(hlo) == dict(NONE, **{"collective-permute": 14})
        assert collective_result_shapes(hlo, "collective-permute") == ["f16[1,8,2,64]"] * 14


def test_allgather_with_longer_keys(rng):
    # Chunked prefill after a cached prefix: seq_k > seq_q, both split over the shards.
    mesh = cpu_mesh((4,), ("seq",))
    q, k, v = random_qkv(rng, seq_q=32, seq_k=64, heads_q=2, dtype=F16)
    out, lse, _ = run_context_parallel(mesh, q, k, v, seq_axis="seq", strategy="allgather", layout="balanced")
    assert_close_to_reference(out, lse, q, k, v, causal=True)


@pytest.mark.parametrize(
    "strategy,other_axis,option",
    [("ring", "data", "batch_axis"), ("allgather", "tensor", "head_axis")],
)
def test_with_batch_or_head_sharding(rng, strategy, other_axis, option):
    mesh = cpu_mesh((2, 4), (other_axis, "seq"))
    q, k, v = random_qkv(rng, batch=2, seq_q=32, heads_q=4, heads_kv=2, dtype=F16)
    out, lse, hlo = run_context_parallel(
        mesh, q, k, v, seq_axis="seq", strategy=strategy, layout="balanced", **{option: other_axis}
    )
    assert_close_to_reference(out, lse, q, k, v, causal=True)
    # The other axis adds no communication: only the sequence axis moves K/V.
    expected = {"all-gather": 2} if strategy == "allgather" else {"collective-permute": 6}
    assert collective_counts(hlo) == dict(NONE, **expected)


@pytest.mark.parametrize("mesh_kind", MESH_KINDS)
@pytest.mark.parametrize("strategy", ["allgather", "ring"])
def test_grad_matches_reference(rng, strategy, mesh_kind):
    """Through shard_map and the backward primitive (the ring's merges send lse cotangents into it)."""
    shards = 2  # the backward of every shard's branch compiles too: keep it small
    with mesh_of_kind(mesh_kind, (shards,), ("seq",)) as mesh:
        _check_context_parallel_grad(rng, strategy, mesh, shards)


def _check_context_parallel_grad(rng, strategy, mesh, shards):
    q, k, v = random_qkv(rng, seq_q=32, heads_q=4, heads_kv=2, dtype=F16)
    weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def loss(attention, q, k, v):
        return jnp.sum(attention(q, k, v).astype(jnp.float32) * weights)

    def context_parallel(q, k, v):
        out = jzyfa.context_parallel_attention(
            *(jzyfa.to_balanced_layout(x, shards) for x in (q, k, v)),
            mesh=mesh,
            seq_axis="seq",
            strategy=strategy,
        )
        return jzyfa.from_balanced_layout(out, shards)

    reference = lambda q, k, v: jzyfa.attention_reference(q, k, v, causal=True)[0]
    grads = jax.grad(functools.partial(loss, context_parallel), argnums=(0, 1, 2))
    assert "jzyfa_attention_bwd" in str(jax.make_jaxpr(grads)(q, k, v))
    got = jax.jit(grads)(q, k, v)
    want = jax.jit(jax.grad(functools.partial(loss, reference), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got, want):  # f16 gradients of magnitude ~2: a few ulps apart
        assert g.dtype == F16
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("strategy,collective", [("allgather", "all-gather"), ("ring", "collective-permute")])
def test_cuda_lowering_calls_the_kernel_per_shard(strategy, collective):
    mesh = cpu_mesh((8,), ("seq",))
    q = jax.ShapeDtypeStruct((1, 256, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
    fn = functools.partial(jzyfa.context_parallel_attention, mesh=mesh, seq_axis="seq", strategy=strategy)
    hlo = jax.jit(fn).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")
    assert custom_call_lines(hlo, FFI_TARGET)
    assert f" {collective}(" in hlo


def test_returns_out_only_by_default(rng):
    mesh = cpu_mesh((2,), ("seq",))
    q, k, v = random_qkv(rng, seq_q=16, dtype=F16)
    out = jax.jit(functools.partial(jzyfa.context_parallel_attention, mesh=mesh, seq_axis="seq"))(q, k, v)
    assert out.shape == q.shape and out.dtype == F16


# --- argument errors ------------------------------------------------------------------------------


def spec(shape, dtype=F16):
    return jax.ShapeDtypeStruct(shape, dtype)


Q, KV = spec((2, 32, 4, 64)), spec((2, 32, 2, 64))


@pytest.mark.parametrize(
    "args,options,error,message",
    [
        ((Q, KV, KV), {"strategy": "tree"}, ValueError, "strategy must be one of"),
        ((Q, KV, KV), {"layout": "zigzag"}, ValueError, "layout must be one of"),
        (
            (Q, KV, KV),
            {"seq_axis": "sequence"},
            ValueError,
            "seq_axis 'sequence' is not an axis of the mesh",
        ),
        ((Q, KV, KV), {"batch_axis": "seq"}, ValueError, "must name different mesh axes"),
        ((spec((2, 20, 4, 64)), KV, KV), {}, ValueError, "q's sequence length 20 must be a multiple of 8"),
        (
            (Q, spec((2, 48, 2, 64)), spec((2, 48, 2, 64))),
            {"strategy": "ring"},
            ValueError,
            "causal ring needs seq_q == seq_k",
        ),
        (
            (Q, spec((2, 32, 1, 64)), spec((2, 32, 1, 64))),
            {"head_axis": "data"},
            ValueError,
            "heads_kv 1 is not divisible by the 2 shards",
        ),
        (
            (spec((2, 32, 4, 64), jnp.float8_e4m3fn),) + (spec((2, 32, 2, 64), jnp.float8_e4m3fn),) * 2,
            {},
            TypeError,
            "not FP8",
        ),
    ],
)
def test_bad_arguments(args, options, error, message):
    mesh = cpu_mesh((2, 4), ("data", "seq"))
    options = {"mesh": mesh, "seq_axis": "seq", **options}
    with pytest.raises(error, match=message):
        jax.eval_shape(functools.partial(jzyfa.context_parallel_attention, **options), *args)
