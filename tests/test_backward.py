"""The backward: the pure-JAX backward from residuals against float64 gradients, the backward primitive
(what jax.grad of a 16-bit call binds: no forward recomputed, vmap, checkpoint names, the CUDA custom
call where the plan has a backward kernel), FP8 calls refusing to be differentiated, and sharded
gradients on 8 CPU devices with Auto and Explicit mesh axes."""

import contextlib
import functools
import re

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from attention_oracle import naive_attention_grads_f64, offsets, random_qkv, relative_l2
from hlo_utils import collective_counts, custom_call_lines
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_utils import cpu_mesh

import jzyfa
from jzyfa import api, plan, primitives
from jzyfa import reference as reference_module
from jzyfa.api import RESIDUAL_NAMES
from jzyfa.reference import attention_bwd_reference, attention_delta, attention_reference
from jzyfa.varlen import varlen_attention_bwd_reference, varlen_attention_reference

# Dispatch as on a CPU host (the primitive path), even when these tests run on a GPU host.
pytestmark = pytest.mark.usefixtures("cpu_backend")

F16 = jnp.float16
# Relative L2 error of float32 gradients of float32 inputs against float64 ones.
FLOAT32_GRAD_TOLERANCE = 2e-5


def _float32_case(rng, *, seq_q, seq_k, heads_q, heads_kv, head_dim=64, head_dim_v=None, batch=1):
    q, k, v = random_qkv(rng, batch=batch, seq_q=seq_q, seq_k=seq_k, heads_q=heads_q, heads_kv=heads_kv,
                         head_dim=head_dim, head_dim_v=head_dim_v, dtype=jnp.float32)  # fmt: skip
    dout = jnp.asarray(rng.standard_normal(q.shape[:3] + v.shape[3:]), jnp.float32)
    dlse = jnp.asarray(rng.standard_normal((batch, heads_q, seq_q)), jnp.float32)
    return q, k, v, dout, dlse


# ---- the pure-JAX backward from residuals


@pytest.mark.parametrize(
    "seq_q,seq_k,heads_q,heads_kv,causal,window,chunk_rows",
    [
        (33, 47, 4, 2, True, None, None),  # GQA, Sq < Sk
        (50, 20, 4, 1, True, None, None),  # MQA, Sq > Sk: rows that see no key
        (50, 20, 4, 1, True, None, 7),  # the same over query chunks
        (40, 40, 6, 3, False, (5, 3), 9),  # a window, chunked
        (24, 64, 2, 2, False, None, None),  # no mask
    ],
)
def test_reference_backward_matches_float64(
    rng, monkeypatch, seq_q, seq_k, heads_q, heads_kv, causal, window, chunk_rows
):
    q, k, v, dout, dlse = _float32_case(
        rng, seq_q=seq_q, seq_k=seq_k, heads_q=heads_q, heads_kv=heads_kv, head_dim_v=8
    )
    out, lse = attention_reference(q, k, v, causal=causal, window=window)
    if chunk_rows:
        monkeypatch.setattr(reference_module, "CHUNK_SCORE_ENTRIES", heads_q * seq_k * chunk_rows)
    grads = attention_bwd_reference(
        q, k, v, dout, lse, attention_delta(out, dout, dlse), causal=causal, window=window
    )
    exact = naive_attention_grads_f64(q, k, v, dout, dlse, causal=causal, window=window)
    for got, want in zip(grads, exact):
        assert relative_l2(got, want) < FLOAT32_GRAD_TOLERANCE
    if causal and seq_q > seq_k:  # rows that see no key get dq = 0
        np.testing.assert_array_equal(np.asarray(grads[0])[:, : seq_q - seq_k], 0)


def test_varlen_reference_backward_matches_float64_per_sequence(rng):
    """Sequences of different lengths (one empty, one without keys), tokens past the packed end."""
    lengths_q, lengths_k = [5, 0, 12, 13], [9, 3, 0, 14]
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    total_q, total_k = cu_q[-1] + 2, cu_k[-1] + 1  # padding tokens at the end
    q = jnp.asarray(rng.standard_normal((total_q, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((total_k, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((total_k, 2, 8)), jnp.float32)
    dout = jnp.asarray(rng.standard_normal((total_q, 4, 8)), jnp.float32)
    dlse = jnp.asarray(rng.standard_normal((4, total_q)), jnp.float32)
    options = dict(window=(-1, 0), softmax_scale=0.3)
    out, lse = varlen_attention_reference(q, k, v, cu_q, cu_k, 13, 14, **options)
    delta = attention_delta(out, dout, dlse, varlen=True)
    dq, dk, dv = varlen_attention_bwd_reference(q, k, v, dout, lse, delta, cu_q, cu_k, 13, 14, **options)
    for s in range(len(lengths_q)):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        if lengths_q[s] == 0 or lengths_k[s] == 0:
            for grad, part in ((dq, rows), (dk, keys), (dv, keys)):
                np.testing.assert_array_equal(np.asarray(grad[part]), 0)
            continue
        exact = naive_attention_grads_f64(
            q[None, rows], k[None, keys], v[None, keys], dout[None, rows], dlse[None, :, rows],
            causal=True, softmax_scale=0.3,
        )  # fmt: skip
        for got, want in zip((dq[rows], dk[keys], dv[keys]), exact):
            assert relative_l2(got, want[0]) < FLOAT32_GRAD_TOLERANCE
    for grad, total in ((dq, cu_q[-1]), (dk, cu_k[-1]), (dv, cu_k[-1])):
        np.testing.assert_array_equal(np.asarray(grad[total:]), 0)


# ---- jax.grad through the primitive


def _loss(q, k, v, dout, dlse, **options):
    out, lse = jzyfa.flash_attention(q, k, v, return_lse=True, **options)
    return jnp.sum(out.astype(jnp.float32) * dout) + jnp.sum(lse * dlse)


def _primitive_names(fn, *args) -> list[str]:
    """The primitives fn's jaxpr binds, nested jaxprs included, one entry per equation."""
    return re.findall(r"\b(jzyfa_attention_(?:fwd|bwd))\[", str(jax.make_jaxpr(fn)(*args)))


def test_grad_binds_the_backward_primitive_and_recomputes_no_forward(rng):
    q, k, v, dout, dlse = _float32_case(rng, seq_q=24, seq_k=40, heads_q=4, heads_kv=2)
    q, k, v = (x.astype(F16) for x in (q, k, v))
    names = _primitive_names(
        jax.grad(functools.partial(_loss, causal=True), argnums=(0, 1, 2)), q, k, v, dout, dlse
    )
    assert names.count("jzyfa_attention_fwd") == 1
    assert names.count("jzyfa_attention_bwd") == 1


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize(
    "seq_q,seq_k,heads_q,heads_kv,options",
    [
        (24, 40, 4, 2, dict(causal=True)),
        (40, 24, 4, 1, dict(causal=True)),  # rows that see no key
        (32, 32, 2, 2, dict(window=(4, 2))),
        (16, 48, 8, 2, {}),
    ],
)
def test_grad_through_the_primitive_matches_float64(rng, dtype, seq_q, seq_k, heads_q, heads_kv, options):
    """16-bit gradients to the error that rounding the inputs' dtype allows (the outputs' rounding)."""
    q, k, v, dout, dlse = _float32_case(
        rng, seq_q=seq_q, seq_k=seq_k, heads_q=heads_q, heads_kv=heads_kv, head_dim=32
    )
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    grads = jax.jit(jax.grad(functools.partial(_loss, **options), argnums=(0, 1, 2)))(q, k, v, dout, dlse)
    window = options.get("window")
    exact = naive_attention_grads_f64(q, k, v, dout, dlse, causal=options.get("causal", False), window=window)
    tolerance = 2 * float(jnp.finfo(dtype).eps)
    for got, want in zip(grads, exact):
        assert got.dtype == dtype
        assert relative_l2(got, want) < tolerance


def test_varlen_grad_through_the_primitive_matches_the_pure_jax_path(rng):
    cu = jnp.asarray(offsets([7, 0, 20, 5]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((32, 4, 64)), F16)
    k = jnp.asarray(rng.standard_normal((32, 2, 64)), F16)
    v = jnp.asarray(rng.standard_normal((32, 2, 64)), F16)

    def loss(q, k, v, implementation):
        out = jzyfa.flash_attention_varlen(
            q, k, v, cu, cu, 20, 20, causal=True, implementation=implementation
        )
        return jnp.sum(out.astype(jnp.float32) ** 2)

    primitive_path = functools.partial(loss, implementation=None)
    with mock_primitive_path():
        assert "jzyfa_attention_bwd" in _primitive_names(jax.grad(primitive_path), q, k, v)
        grads = jax.jit(jax.grad(primitive_path, argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(functools.partial(loss, implementation="xla"), argnums=(0, 1, 2)))(q, k, v)
    for got, w in zip(grads, want):
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(w, np.float32), atol=2e-3, rtol=2e-3
        )


@contextlib.contextmanager
def mock_primitive_path():
    """Varlen 16-bit calls take the pure-JAX path on a CPU; this makes them bind the primitive (whose CPU
    lowering is the same reference) as on a GPU."""
    original = plan.choose_path

    def primitive_where_it_serves(problem, implementation, *, cpu_primitive):
        del cpu_primitive
        return original(problem, implementation, cpu_primitive=True)

    plan.choose_path = primitive_where_it_serves
    try:
        yield
    finally:
        plan.choose_path = original


def test_vmap_of_grad_folds_into_one_backward_call(rng):
    q, k, v = random_qkv(rng, batch=3, seq_q=16, seq_k=24, heads_q=2, dtype=F16)
    loss = lambda q, k, v: jnp.sum(jzyfa.flash_attention(q, k, v, causal=True).astype(jnp.float32) ** 2)
    per_example = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(1, 1, 1), out_axes=1)
    args = (q[:, None], k[:, None], v[:, None])
    assert _primitive_names(per_example, *args).count("jzyfa_attention_bwd") == 1
    got = jax.jit(per_example)(*args)
    want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(
            np.asarray(g[:, 0], np.float32), np.asarray(w, np.float32), atol=1e-3, rtol=1e-3
        )


@pytest.mark.parametrize(
    "policy,forward_calls",
    [
        (jax.checkpoint_policies.save_only_these_names(*RESIDUAL_NAMES), 1),
        (jax.checkpoint_policies.nothing_saveable, 2),
    ],
)
def test_checkpoint_policies_keep_or_drop_the_residuals_by_name(rng, policy, forward_calls):
    q, k, v = random_qkv(rng, seq_q=16, heads_q=2, dtype=F16)
    inner = lambda q, k, v: jnp.sin(jzyfa.flash_attention(q, k, v, causal=True).astype(jnp.float32))
    loss = lambda q, k, v: jnp.sum(jax.checkpoint(inner, policy=policy)(q, k, v))
    names = _primitive_names(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
    assert names.count("jzyfa_attention_fwd") == forward_calls
    assert names.count("jzyfa_attention_bwd") == 1


# ---- the CUDA program


def _lowered_for_cuda(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")


def test_cuda_lowering_calls_the_backward_kernel_where_the_plan_has_one(monkeypatch):
    q = jax.ShapeDtypeStruct((2, 64, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 96, 2, 128), jnp.bfloat16)
    grad = jax.grad(
        lambda q, k, v: jnp.sum(jzyfa.flash_attention(q, k, v, causal=True).astype(jnp.float32)),
        argnums=(0, 1, 2),
    )
    row = plan.Config("16bit", (128, 128), "causal", "dense", "bwd")
    if row not in plan.KERNELS:
        assert not custom_call_lines(_lowered_for_cuda(grad, q, kv, kv), primitives.FFI_TARGET_BWD)
        monkeypatch.setattr(plan, "KERNELS", plan.KERNELS | {row})
        jax.clear_caches()  # the trace above decided without the row
    (call,) = custom_call_lines(_lowered_for_cuda(grad, q, kv, kv), primitives.FFI_TARGET_BWD)
    # operands q, k, v, dout, lse, delta; results dq, dk, dv and the two tile counters
    for shape in ("bf16[2,64,8,128]", "bf16[2,96,2,128]", "f32[2,8,64]", "s32[2]"):
        assert shape in call
    for attribute in ("softmax_scale", "causal = true", "window_left", "max_seqlen_q"):
        assert attribute in call
    assert "lean_p" not in call and "key_block" not in call


def test_cuda_lowering_of_a_varlen_grad_passes_the_sequence_offsets():
    q = jax.ShapeDtypeStruct((300, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((200, 2, 64), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((4,), jnp.int32)

    def loss(q, k, v, cu_q, cu_k):
        out = jzyfa.flash_attention_varlen(q, k, v, cu_q, cu_k, 150, 100, causal=True, window=(64, 0))
        return jnp.sum(out.astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    assert plan.Config("16bit", (64, 64), "window", "varlen", "bwd") in plan.KERNELS
    with mock_primitive_path():  # varlen calls on a CPU backend take the pure-JAX path
        (call,) = custom_call_lines(_lowered_for_cuda(grad, q, kv, kv, cu, cu), primitives.FFI_TARGET_BWD)
    # operands q, k, v, dout, lse [Hq, Tq], delta, cu_seqlens_q, cu_seqlens_k
    assert call.count("s32[4]") == 2 and "f32[4,300]" in call
    for attribute in ("varlen = true", "max_seqlen_q = 150", "max_seqlen_k = 100", "window_left = 64"):
        assert attribute in call


# ---- FP8 calls are not differentiable


def test_fp8_calls_refuse_to_be_differentiated_on_every_path(rng):
    q, k, v = random_qkv(rng, seq_q=16, heads_q=2, dtype=jnp.float32)
    q8, k8, v8 = (x.astype(jnp.float8_e4m3fn) for x in (q, k, v))
    ones = jnp.ones((), jnp.float32)

    def loss(descale):
        out = jzyfa.flash_attention(
            q8, k8, v8, causal=True, descale_q=descale, descale_k=ones, descale_v=ones
        )
        return jnp.sum(out.astype(jnp.float32))

    with pytest.raises(TypeError, match="float8_e4m3fn inputs is not differentiable"):
        jax.grad(loss)(ones)
    spec = primitives.make_spec(softmax_scale=0.125, causal=True, fp8=True)
    with pytest.raises(TypeError, match="float8_e4m3fn inputs is not differentiable"):
        jax.jvp(lambda d: primitives.attention_fwd(q8, k8, v8, d, ones, ones, spec=spec)[0], (ones,), (ones,))


# ---- sharded gradients on 8 CPU devices


def _grads(q, k, v, **options):
    loss = lambda q, k, v: jnp.sum(jnp.sin(jzyfa.flash_attention(q, k, v, **options).astype(jnp.float32)))
    return jax.grad(loss, argnums=(0, 1, 2))


def _assert_close(got, want):
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize(
    "q_spec,kv_spec,heads_kv,options,collectives",
    [
        # Batch and heads: no collective, forward or backward.
        (P("data", None, "tensor"), P("data", None, "tensor"), 4, dict(causal=True), {}),
        # More query-head shards than KV heads: each KV head's dk, dv summed over its shards.
        (P("data", None, "tensor"), P("data"), 2, dict(causal=True), {"all-reduce": 1}),
        # A sequence-sharded q: K/V gathered, dk and dv summed over the sequence shards.
        (P("data", "tensor"), P("data"), 4, dict(causal=True), {"all-reduce": 1}),
        (P("data", "tensor"), P("data"), 4, dict(window=(5, 3)), {"all-reduce": 1}),
    ],
)
def test_sharded_grad_matches_unsharded(rng, q_spec, kv_spec, heads_kv, options, collectives):
    mesh = cpu_mesh((2, 4), ("data", "tensor"))
    q, k, v = random_qkv(rng, batch=2, seq_q=32, seq_k=40, heads_q=8, heads_kv=heads_kv, dtype=F16)
    grads = _grads(q, k, v, **options)
    shardings = (NamedSharding(mesh, q_spec), NamedSharding(mesh, kv_spec), NamedSharding(mesh, kv_spec))
    sharded = jax.jit(grads, in_shardings=shardings, out_shardings=shardings)
    hlo = sharded.lower(q, k, v).compile().as_text()
    counts = collective_counts(hlo)
    for name, count in counts.items():
        if name == "all-gather":  # K/V gathered for sequence shards (forward and backward)
            continue
        assert count == collectives.get(name, 0), (name, counts)
    _assert_close(sharded(q, k, v), jax.jit(grads)(q, k, v))


@pytest.mark.parametrize("context", ["set_mesh", "none"])
def test_explicit_axes_forward_and_grad(rng, context):
    """jax.make_mesh's default Explicit axes, inside jax.set_mesh and without a context mesh."""
    mesh = jax.make_mesh(
        (2, 4), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices("cpu")[:8]
    )
    q, k, v = random_qkv(rng, batch=2, seq_q=24, seq_k=40, heads_q=8, heads_kv=4, dtype=F16)
    want_out = jzyfa.flash_attention(q, k, v, causal=True)
    want_grads = jax.jit(_grads(q, k, v, causal=True))(q, k, v)
    spec = NamedSharding(mesh, P("data", None, "tensor"))
    with jax.set_mesh(mesh) if context == "set_mesh" else contextlib.nullcontext():
        qs, ks, vs = (jax.device_put(x, spec) for x in (q, k, v))
        out = jax.jit(functools.partial(jzyfa.flash_attention, causal=True))(qs, ks, vs)
        grads = jax.jit(_grads(q, k, v, causal=True))(qs, ks, vs)
    assert all(x.sharding.is_equivalent_to(spec, 4) for x in (out, *grads))
    _assert_close((out,), (want_out,))
    _assert_close(grads, want_grads)


def test_explicit_axes_varlen_head_sharding(rng):
    mesh = jax.make_mesh((4,), ("tensor",), axis_types=(AxisType.Explicit,), devices=jax.devices("cpu")[:4])
    cu = jnp.asarray(offsets([9, 14, 0, 9]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((32, 8, 64)), F16)
    kv = jnp.asarray(rng.standard_normal((32, 4, 64)), F16)

    def loss(q, k, v):
        out = jzyfa.flash_attention_varlen(q, k, v, cu, cu, 16, 16, causal=True)
        return jnp.sum(jnp.sin(out.astype(jnp.float32)))

    grads = jax.grad(loss, argnums=(0, 1, 2))
    spec = NamedSharding(mesh, P(None, "tensor"))
    with mock_primitive_path():
        want = jax.jit(grads)(q, kv, kv)
        with jax.set_mesh(mesh):
            got = jax.jit(grads)(*(jax.device_put(x, spec) for x in (q, kv, kv)))
    _assert_close(got, want)


def test_cuda_lowering_of_sharded_grad_carries_the_backward_rule():
    """q, k, v, dout, lse, delta -> dq, dk, dv: batch and heads shard through; d, sk and dv replicated."""
    mesh = cpu_mesh((2, 4), ("data", "tensor"))
    sharded = lambda shape: jax.ShapeDtypeStruct(
        shape, jnp.bfloat16, sharding=NamedSharding(mesh, P("data", None, "tensor"))
    )
    q, kv = sharded((2, 64, 16, 128)), sharded((2, 64, 4, 128))
    text = (
        jax.jit(_grads(q, kv, kv, causal=True)).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    )
    rule = (
        "sdy.op_sharding_rule<([i, j, k, l], [i, m, n, l], [i, m, n, o], [i, j, k, o], [i, k, j], [i, k, j])"
        "->([i, j, k, l], [i, m, n, l], [i, m, n, o])"
    )
    assert rule in text


def test_long_sequences_backward_holds_no_score_matrix():
    """16 heads x 32K x 32K causal through jax.grad of the primitive: the pure-JAX backward compiles to a
    few GiB of temporaries (the scores alone would be 64 GiB; nothing runs)."""
    spec = jax.ShapeDtypeStruct((1, 32768, 16, 128), jnp.bfloat16)
    memory = (
        jax.jit(_grads(spec, spec, spec, causal=True)).lower(spec, spec, spec).compile().memory_analysis()
    )
    if memory is None:
        pytest.skip("this backend reports no memory analysis")
    assert memory.temp_size_in_bytes < 8 * 2**30, memory.temp_size_in_bytes / 2**30


# ---- numerical checks of the primitive's gradients (float32 through the primitive itself)


def _primitive_attention(causal: bool, window=(-1, -1), scale: float = 0.125):
    """(q, k, v) -> (out, lse) through the custom_vjp and the backward primitive, any float dtype."""
    spec = primitives.make_spec(softmax_scale=scale, causal=causal, window=window)
    return lambda q, k, v: api._differentiable(spec, q, k, v, ())


def test_check_grads_of_the_primitive(rng):
    q, k, v = random_qkv(rng, seq_q=12, seq_k=20, heads_q=4, heads_kv=2, head_dim=8, dtype=jnp.float32)
    attention = _primitive_attention(causal=True)
    weights = jnp.asarray(rng.standard_normal((1, 4, 12)), jnp.float32)
    loss = lambda q, k, v: (attention(q, k, v)[0], attention(q, k, v)[1] * weights)
    jax.test_util.check_grads(loss, (q, k, v), order=1, modes=["rev"], atol=2e-2, rtol=2e-2, eps=1e-2)


@hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
@hypothesis.given(
    seq_q=st.integers(1, 70),
    seq_k=st.integers(1, 70),
    heads_kv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 3]),
    mask=st.sampled_from(["none", "causal", "window"]),
    left=st.integers(0, 20),
    right=st.integers(0, 20),
    seed=st.integers(0, 2**16),
)
def test_backward_primitive_matches_float64_property(seq_q, seq_k, heads_kv, group, mask, left, right, seed):
    """Any lengths (Sq != Sk both ways, rows that see no key), GQA/MQA ratios and masks."""
    rng = np.random.default_rng(seed)
    heads_q = heads_kv * group
    q, k, v, dout, dlse = _float32_case(
        rng, seq_q=seq_q, seq_k=seq_k, heads_q=heads_q, heads_kv=heads_kv, head_dim=8
    )
    window = {"none": (-1, -1), "causal": (-1, 0), "window": (left, right)}[mask]
    attention = _primitive_attention(causal=mask == "causal", window=window if mask == "window" else (-1, -1))

    def loss(q, k, v):
        out, lse = attention(q, k, v)
        return jnp.sum(out * dout) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * dlse)

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    exact = naive_attention_grads_f64(
        q,
        k,
        v,
        dout,
        dlse,
        causal=mask == "causal",
        softmax_scale=0.125,
        window=window if mask == "window" else None,
    )
    for got, want in zip(grads, exact):
        assert np.all(np.isfinite(np.asarray(got)))
        if np.linalg.norm(want) > 0:
            assert relative_l2(got, want) < 1e-4
        else:
            np.testing.assert_array_equal(np.asarray(got), 0)
