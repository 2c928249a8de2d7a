"""Right-padded dense batches with per-sequence lengths (`seqlens_q`, `seqlens_k`): against one call per
sequence on its valid tokens, on every path (primitive, pure JAX, FP8), forward and gradients, vmap,
the packed kernel's custom call for CUDA, and batch sharding with no collective."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64, random_fp8_qkv, random_qkv, relative_l2
from hlo_utils import collective_counts, custom_call_lines
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_utils import MESH_KINDS, mesh_of_kind

import jzyfa
from jzyfa import padded, primitives

pytestmark = pytest.mark.usefixtures("cpu_backend")

LENGTHS_Q, LENGTHS_K = [24, 0, 9, 17], [40, 12, 9, 3]


def _lengths():
    return jnp.asarray(LENGTHS_Q, jnp.int32), jnp.asarray(LENGTHS_K, jnp.int32)


@pytest.mark.parametrize("implementation", [None, "xla"])
@pytest.mark.parametrize("options", [{"causal": True}, {}, {"window": (5, 2)}])
def test_padded_batch_equals_each_sequence_alone(rng, implementation, options):
    q, k, v = random_qkv(rng, batch=4, seq_q=24, seq_k=40, heads_q=4, heads_kv=2, dtype=jnp.float16)
    seqlens_q, seqlens_k = _lengths()
    out, lse = jzyfa.flash_attention(q, k, v, seqlens_q=seqlens_q, seqlens_k=seqlens_k, return_lse=True,
                                     implementation=implementation, **options)  # fmt: skip
    for b, (len_q, len_k) in enumerate(zip(LENGTHS_Q, LENGTHS_K)):
        if len_q:
            want_out, want_lse = naive_attention_f64(
                q[b : b + 1, :len_q], k[b : b + 1, :len_k], v[b : b + 1, :len_k],
                causal=options.get("causal", False), window=options.get("window"),
            )  # fmt: skip
            assert relative_l2(out[b, :len_q], want_out[0]) < 2e-3
            seen = np.isfinite(want_lse[0])
            np.testing.assert_array_equal(np.isfinite(np.asarray(lse[b, :, :len_q])), seen)
            np.testing.assert_allclose(np.asarray(lse[b, :, :len_q])[seen], want_lse[0][seen], rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(out[b, len_q:], np.float32), 0)
        assert np.all(np.isneginf(np.asarray(lse[b, :, len_q:])))


def test_padded_batch_binds_the_primitive_and_lowers_to_the_packed_kernel_for_cuda():
    q = jax.ShapeDtypeStruct((4, 64, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((4, 96, 2, 128), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((4,), jnp.int32)
    call = functools.partial(jzyfa.flash_attention, causal=True)
    fn = lambda q, k, v, lq, lk: call(q, k, v, seqlens_q=lq, seqlens_k=lk)
    text = jax.jit(fn).trace(q, kv, kv, lengths, lengths).lower(lowering_platforms=("cuda",)).as_text("hlo")
    (line,) = custom_call_lines(text, primitives.FFI_TARGET)
    assert "varlen=true" in line.replace(" ", "") and "bf16[256,8,128]" in line and "s32[9]" in line


def test_padded_gradients_equal_each_sequence_alone(rng):
    q, k, v = random_qkv(rng, batch=4, seq_q=24, seq_k=40, heads_q=4, heads_kv=2, dtype=jnp.float32)
    seqlens_q, seqlens_k = _lengths()
    weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    spec = primitives.make_spec(
        softmax_scale=0.125, causal=True, seqlens=True
    )  # float32 through the primitive

    def loss(q, k, v):
        from jzyfa import api

        return jnp.sum(api._differentiable(spec, q, k, v, (seqlens_q, seqlens_k))[0] * weights)

    assert "jzyfa_attention_bwd" in str(jax.make_jaxpr(jax.grad(loss))(q, k, v))
    dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for b, (len_q, len_k) in enumerate(zip(LENGTHS_Q, LENGTHS_K)):
        one = lambda q, k, v: jnp.sum(jzyfa.attention_reference(q, k, v, causal=True, softmax_scale=0.125)[0]
                                      * weights[b : b + 1, :len_q])  # fmt: skip
        if len_q == 0:
            want = (
                jnp.zeros_like(q[b : b + 1, :0]),
                jnp.zeros_like(k[b : b + 1, :len_k]),
                jnp.zeros_like(v[b : b + 1, :len_k]),
            )
        else:
            want = jax.grad(one, argnums=(0, 1, 2))(
                q[b : b + 1, :len_q], k[b : b + 1, :len_k], v[b : b + 1, :len_k]
            )
        np.testing.assert_allclose(dq[b, :len_q], want[0][0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(dk[b, :len_k], want[1][0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(dv[b, :len_k], want[2][0], rtol=1e-4, atol=1e-5)
        for grad, length in ((dq, len_q), (dk, len_k), (dv, len_k)):
            np.testing.assert_array_equal(np.asarray(grad[b, length:]), 0)


def test_padded_fp8_batch_matches_each_sequence_alone(rng):
    (q8, k8, v8), descales = random_fp8_qkv(
        rng, batch=4, seq_q=24, seq_k=40, heads_q=4, heads_kv=2, granularity="head"
    )
    seqlens_q, seqlens_k = _lengths()
    names = dict(zip(("descale_q", "descale_k", "descale_v"), descales))
    out = jzyfa.flash_attention(q8, k8, v8, causal=True, seqlens_q=seqlens_q, seqlens_k=seqlens_k, **names)
    for b, (len_q, len_k) in enumerate(zip(LENGTHS_Q, LENGTHS_K)):
        if len_q:
            one = {name: d[b : b + 1] for name, d in names.items()}
            want = jzyfa.flash_attention(q8[b : b + 1, :len_q], k8[b : b + 1, :len_k], v8[b : b + 1, :len_k],
                                         causal=True, **one)  # fmt: skip
            np.testing.assert_allclose(np.asarray(out[b, :len_q], np.float32), np.asarray(want[0], np.float32),
                                       rtol=1e-2, atol=1e-2)  # fmt: skip


def test_one_length_given_means_the_other_is_full(rng):
    q, k, v = random_qkv(rng, batch=2, seq_q=16, seq_k=16, heads_q=2, dtype=jnp.float16)
    lengths = jnp.asarray([16, 7], jnp.int32)
    got = jzyfa.flash_attention(q, k, v, causal=True, seqlens_k=lengths)
    want = jzyfa.flash_attention(q, k, v, causal=True, seqlens_q=jnp.full((2,), 16), seqlens_k=lengths)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    np.testing.assert_array_equal(
        np.asarray(got[0], np.float32), np.asarray(jzyfa.flash_attention(q, k, v, causal=True)[0], np.float32)
    )


def test_vmap_folds_the_lengths_with_the_batch(rng):
    q, k, v = random_qkv(rng, batch=4, seq_q=24, seq_k=40, heads_q=4, heads_kv=2, dtype=jnp.float16)
    seqlens_q, seqlens_k = _lengths()
    fn = lambda q, k, v, lq, lk: jzyfa.flash_attention(q, k, v, causal=True, seqlens_q=lq, seqlens_k=lk)
    stacked = [x.reshape((2, 2) + x.shape[1:]) for x in (q, k, v, seqlens_q, seqlens_k)]
    got = jax.vmap(fn)(*stacked).reshape(q.shape[:3] + v.shape[3:])
    want = fn(q, k, v, seqlens_q, seqlens_k)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("mesh_kind", MESH_KINDS)
def test_batch_sharded_padded_call_needs_no_collective(rng, mesh_kind):
    q, k, v = random_qkv(rng, batch=4, seq_q=24, seq_k=40, heads_q=8, heads_kv=4, dtype=jnp.float16)
    seqlens_q, seqlens_k = _lengths()
    fn = lambda q, k, v, lq, lk: jzyfa.flash_attention(
        q, k, v, causal=True, seqlens_q=lq, seqlens_k=lk, return_lse=True
    )
    with mesh_of_kind(mesh_kind, (2, 4), ("data", "tensor")) as mesh:
        qkv = NamedSharding(mesh, P("data", None, "tensor"))
        lengths = NamedSharding(mesh, P("data"))
        sharded = jax.jit(fn, in_shardings=(qkv, qkv, qkv, lengths, lengths))
        hlo = sharded.lower(q, k, v, seqlens_q, seqlens_k).compile().as_text()
        assert all(count == 0 for count in collective_counts(hlo).values()), collective_counts(hlo)
        got = sharded(q, k, v, seqlens_q, seqlens_k)
    want = jax.jit(fn)(q, k, v, seqlens_q, seqlens_k)
    np.testing.assert_allclose(
        np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), atol=1e-3, rtol=1e-3
    )


@pytest.mark.parametrize(
    "seqlens_q,error,message",
    [
        (np.zeros(3, np.int32), ValueError, r"seqlens_q must have shape \[batch\] = \(2,\)"),
        (np.zeros(2, np.float32), TypeError, "seqlens_q must be an integer array, got float32"),
        ([1, 2], TypeError, "seqlens_q must be None or an int array"),
    ],
)
def test_seqlens_errors_name_the_argument(rng, seqlens_q, error, message):
    q, k, v = random_qkv(rng, batch=2, seq_q=8, heads_q=2)
    with pytest.raises(error, match=message):
        jzyfa.flash_attention(q, k, v, seqlens_q=seqlens_q)


def test_packed_offsets_interleave_valid_tokens_and_padding():
    cu = padded.packed_offsets(jnp.asarray([3, 0, 9, 5]), 5)  # 9 is clipped to the padded length
    np.testing.assert_array_equal(cu, [0, 3, 5, 5, 10, 15, 15, 20, 20])
