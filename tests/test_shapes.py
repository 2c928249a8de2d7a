"""Every shape a prefill brings, on CPU: sliding windows, MLA head dims, head dim 256, chunked prefill,
slices of a fused QKV projection, and sequence-length regressions, against float64 attention.

Variable-length batches: tests/test_varlen.py; random shapes: tests/test_shapes_property.py; the
same checks on the Hopper kernel: tests/test_shapes_gpu.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64, random_qkv, visible_f64
from hlo_utils import collective_counts, custom_call_lines
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_utils import cpu_mesh

import jzyfa
import jzyfa.fp8_emulation
from jzyfa import api, primitives
from jzyfa.primitives import FFI_TARGET

merge = jax.jit(jzyfa.merge_attention_states)


def attention(**options):
    """A jitted flash_attention returning (out, lse)."""
    return jax.jit(functools.partial(jzyfa.flash_attention, return_lse=True, **options))


def assert_matches_f64(got, want, *, atol):
    """out and lse against the float64 oracle; -inf (rows that see no key) must match exactly."""
    out, lse = (np.asarray(x, np.float64) for x in got)
    want_out, want_lse = want
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(out, want_out, atol=atol)
    seen = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[seen], want_lse[seen], atol=atol)


def cuda_custom_calls(fn, *args) -> list[str]:
    """The kernel's custom calls in fn's program lowered for CUDA (possible on a CPU host)."""
    hlo = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")
    return custom_call_lines(hlo, FFI_TARGET)


# --- sliding windows ---------------------------------------------------------------------------

WINDOWS = [(3, 0), (0, 0), (5, 2), (-1, 3), (2, -1), (0, -1), (16, 16), (-1, -1)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("seq_q,seq_k", [(37, 37), (50, 20)])
def test_window_matches_float64(rng, window, seq_q, seq_k):
    q, k, v = random_qkv(rng, seq_q=seq_q, seq_k=seq_k, heads_q=4, heads_kv=2, head_dim=32, dtype=jnp.float32)
    got = attention(window=window)(q, k, v)
    assert_matches_f64(got, naive_attention_f64(q, k, v, causal=False, window=window), atol=2e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_causal_is_the_window_minus_one_zero(rng, dtype):
    q, k, v = random_qkv(rng, seq_q=24, seq_k=40, dtype=dtype)
    want = attention(causal=True)(q, k, v)
    for got in (attention(window=(-1, 0))(q, k, v), attention(causal=True, window=(-1, 0))(q, k, v)):
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


def test_causal_sets_the_windows_right_bound_to_zero(rng):
    # flash-attention's convention: Hugging Face passes causal=True, window=(w - 1, w - 1).
    q, k, v = random_qkv(rng, seq_q=30, seq_k=30, dtype=jnp.float32)
    got = attention(causal=True, window=(7, 7))(q, k, v)
    for a, b in zip(got, attention(window=(7, 0))(q, k, v)):
        np.testing.assert_array_equal(a, b)
    assert_matches_f64(got, naive_attention_f64(q, k, v, causal=True, window=(7, 7)), atol=2e-5)


@pytest.mark.parametrize(
    "seq_q,seq_k,window",
    [
        (8, 4, (0, 0)),  # rows 0-3 sit at positions -4..-1: nothing at or left of them
        (10, 3, (2, 1)),  # windows left of key 0 for the first rows
        (5, 12, (0, 0)),  # a window of one key: never empty here
        (6, 6, (1, 1)),
    ],
)
def test_rows_with_empty_windows_give_zero_and_minus_inf(rng, seq_q, seq_k, window):
    q, k, v = random_qkv(rng, seq_q=seq_q, seq_k=seq_k, dtype=jnp.float32)
    out, lse = attention(window=window)(q, k, v)
    empty = ~visible_f64(seq_q, seq_k, causal=False, window=window).any(axis=1)
    assert np.all(np.asarray(out)[:, empty] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[:, :, empty]))
    assert np.all(np.isfinite(np.asarray(lse)[:, :, ~empty]))

    def loss(q, k, v):
        out, lse = jzyfa.flash_attention(q, k, v, window=window, return_lse=True)
        return jnp.sum(out**2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    for g in jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v):
        assert np.isfinite(np.asarray(g)).all()


@pytest.mark.parametrize(
    "causal,window,seq_q,seq_k,kernel_causal,kernel_window",
    [
        # (options, lengths, the kernel's causal attribute and window: (-1, -1) for the plain kernels)
        (False, None, 8, 16, False, (-1, -1)),
        (True, None, 8, 16, True, (-1, -1)),
        (False, (-1, -1), 8, 16, False, (-1, -1)),
        (False, (-1, 0), 8, 16, True, (-1, -1)),
        (True, (-1, 5), 8, 16, True, (-1, -1)),  # causal sets right to 0
        (False, (100, 0), 8, 16, True, (-1, -1)),  # a left bound past every key is no bound
        (False, (15, 0), 8, 16, True, (-1, -1)),
        (False, (-1, 7), 8, 16, False, (-1, -1)),  # a right bound past every key is no bound
        # Other windows: the kernel's windowed instantiation.
        (False, (14, 0), 8, 16, False, (14, 0)),
        (False, (4, 0), 8, 16, False, (4, 0)),
        (False, (-1, 3), 8, 16, False, (-1, 3)),
        (True, (4, 4), 8, 16, False, (4, 0)),
    ],
)
def test_windows_the_kernel_serves(
    cpu_backend, monkeypatch, causal, window, seq_q, seq_k, kernel_causal, kernel_window
):
    q = jax.ShapeDtypeStruct((1, seq_q, 2, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, seq_k, 2, 64), jnp.bfloat16)
    fn = functools.partial(jzyfa.flash_attention, causal=causal, window=window)
    (call,) = cuda_custom_calls(fn, q, kv, kv)
    assert f"causal = {str(kernel_causal).lower()}" in call
    assert f"window_left = {kernel_window[0]} : i64" in call
    assert f"window_right = {kernel_window[1]} : i64" in call


def test_window_on_fp8_inputs(rng):
    q, k, v = random_qkv(rng, seq_q=20, seq_k=20, dtype=jnp.float32)
    (q8, dq), (k8, dk), (v8, dv) = (jzyfa.fp8_quantize(x) for x in (q, k, v))
    out, lse = jzyfa.flash_attention(
        q8, k8, v8, window=(4, 0), descale_q=dq, descale_k=dk, descale_v=dv, return_lse=True
    )
    dequantized = [jzyfa.dequantize(x, d) for x, d in ((q8, dq), (k8, dk), (v8, dv))]
    want_out, want_lse = naive_attention_f64(*dequantized, causal=False, window=(4, 0))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float64), want_out, atol=2e-2)
    np.testing.assert_allclose(lse, want_lse, atol=1e-4)


# --- MLA: q/k head dim 192, v head dim 128 ------------------------------------------------------


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("causal", [False, True])
def test_mla_matches_float64(rng, dtype, atol, causal):
    q, k, v = random_qkv(
        rng, batch=2, seq_q=33, seq_k=70, heads_q=8, heads_kv=2, head_dim=192, head_dim_v=128, dtype=dtype
    )
    out, lse = attention(causal=causal)(q, k, v)
    assert out.shape == (2, 33, 8, 128) and out.dtype == dtype
    # The default scale is 1/sqrt(192), q's and k's head dim (the oracle's default too).
    want = naive_attention_f64(
        *(np.asarray(x, np.float32) for x in (q, k, v)), causal=causal, softmax_scale=192**-0.5
    )
    assert_matches_f64((out, lse), want, atol=atol)


def test_kernel_refuses_v_head_dim_it_lacks(rng):
    # A head dim the kernels have for q/k, another for v: not a row of jzyfa.plan.KERNELS.
    q, k, v = random_qkv(rng, seq_q=8, head_dim=128, head_dim_v=64)
    with pytest.raises(
        ValueError,
        match=r"cannot serve this call: the 16-bit \(bf16, f16\) kernels take head dims .*got 128/64",
    ):
        jzyfa.flash_attention(q, k, v, implementation="kernel")


def mla_primitive(causal=True, softmax_scale=0.1):
    """The primitive itself (custom_vjp around the kernel's call), with MLA-like shapes: the dispatch
    binds it only for head dims in jzyfa.plan.KERNELS (MLA's (192, 128)), but its abstract eval, vmap,
    vjp and sharding rule serve any pair of head dims."""
    spec = primitives.make_spec(softmax_scale=softmax_scale, causal=causal)
    return lambda q, k, v: api._differentiable(spec, q, k, v, ())


def test_mla_through_the_primitive_abstract_eval_and_numerics(rng):
    q, k, v = random_qkv(rng, batch=2, seq_q=12, seq_k=20, heads_q=4, heads_kv=2, head_dim=96, head_dim_v=32)
    out_shape, lse_shape = jax.eval_shape(mla_primitive(), q, k, v)
    assert out_shape.shape == (2, 12, 4, 32) and out_shape.dtype == jnp.bfloat16
    assert lse_shape.shape == (2, 4, 12) and lse_shape.dtype == jnp.float32
    got = jax.jit(mla_primitive())(q, k, v)
    want = jax.jit(functools.partial(jzyfa.attention_reference, causal=True, softmax_scale=0.1))(q, k, v)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)  # the CPU lowering is the reference


def test_mla_through_the_primitive_vmap_and_grad(rng):
    q, k, v = random_qkv(
        rng, batch=1, seq_q=10, seq_k=14, heads_q=4, heads_kv=1, head_dim=48, head_dim_v=16, dtype=jnp.float32
    )
    qs, ks, vs = (jnp.stack([x, 2 * x, -x]) for x in (q, k, v))
    jaxpr = str(jax.make_jaxpr(jax.vmap(mla_primitive()))(qs, ks, vs))
    assert FFI_TARGET in jaxpr and "f32[3,10,4,16]" in jaxpr  # one call, batch folded, v's head dim
    out, _ = jax.jit(jax.vmap(mla_primitive()))(qs, ks, vs)
    for i in range(3):
        want, _ = jzyfa.attention_reference(qs[i], ks[i], vs[i], causal=True, softmax_scale=0.1)
        np.testing.assert_allclose(out[i], want, atol=1e-6)

    weights = jnp.asarray(rng.standard_normal((1, 10, 4, 16)), jnp.float32)

    def loss(fn, q, k, v):
        out, lse = fn(q, k, v)
        return jnp.sum(out * weights) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    reference = functools.partial(jzyfa.attention_reference, causal=True, softmax_scale=0.1)
    grads = jax.jit(jax.grad(functools.partial(loss, mla_primitive()), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(functools.partial(loss, reference), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(grads, want):  # the backward from residuals: float32 rounding apart
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


def test_mla_through_the_primitive_sharded_over_batch_and_heads(rng):
    mesh = cpu_mesh((2, 4), ("data", "tensor"))
    q, k, v = random_qkv(
        rng, batch=2, seq_q=16, seq_k=24, heads_q=8, heads_kv=4, head_dim=96, head_dim_v=32, dtype=jnp.float16
    )
    spec = NamedSharding(mesh, P("data", None, "tensor"))
    fn = jax.jit(mla_primitive(), in_shardings=(spec, spec, spec))
    lowered = fn.lower(q, k, v)
    assert "CustomSPMDPartitioning" in lowered.as_text()
    assert not any(collective_counts(lowered.compile().as_text()).values())  # batch and heads stay put
    out, lse = fn(q, k, v)
    assert out.sharding.is_equivalent_to(spec, 4) and lse.sharding.is_equivalent_to(
        NamedSharding(mesh, P("data", "tensor")), 3
    )
    want_out, want_lse = jzyfa.attention_reference(q, k, v, causal=True, softmax_scale=0.1)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out, np.float32), atol=1e-3)
    np.testing.assert_allclose(lse, want_lse, atol=1e-5)


def test_mla_on_fp8_inputs_and_in_the_fp8_emulation(rng):
    q, k, v = random_qkv(rng, seq_q=40, heads_q=4, heads_kv=2, head_dim=128, dtype=jnp.float32)
    (q8, dq), (k8, dk), (v8, dv) = (jzyfa.fp8_quantize(x) for x in (q, k, v))
    descales = dict(descale_q=dq, descale_k=dk, descale_v=dv)
    # v's first 64 dims as MLA's v: every output column depends on its own column of v only.
    out, lse = jzyfa.flash_attention(q8, k8, v8[..., :64], causal=True, return_lse=True, **descales)
    full_out, full_lse = jzyfa.flash_attention(q8, k8, v8, causal=True, return_lse=True, **descales)
    assert out.shape == (1, 40, 4, 64)
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(full_out[..., :64], np.float32), atol=1e-2
    )
    np.testing.assert_allclose(lse, full_lse, atol=1e-6)
    emulated = jzyfa.fp8_emulation.attention_fp8_emulated(q8, k8, v8[..., :64], dq, dk, dv, causal=True)
    full = jzyfa.fp8_emulation.attention_fp8_emulated(q8, k8, v8, dq, dk, dv, causal=True)
    np.testing.assert_array_equal(emulated[0], full[0][..., :64])
    np.testing.assert_array_equal(emulated[1], full[1])


@pytest.mark.parametrize("strategy", ["allgather", "ring"])
def test_mla_context_parallel(rng, strategy):
    mesh = cpu_mesh((4,), ("seq",))
    q, k, v = random_qkv(rng, seq_q=64, heads_q=4, heads_kv=2, head_dim=96, head_dim_v=32, dtype=jnp.float32)
    balanced = [jzyfa.to_balanced_layout(x, 4) for x in (q, k, v)]
    cp = functools.partial(
        jzyfa.context_parallel_attention,
        mesh=mesh,
        seq_axis="seq",
        causal=True,
        strategy=strategy,
        return_lse=True,
    )
    out, lse = jax.jit(cp)(*balanced)
    want_out, want_lse = naive_attention_f64(q, k, v, causal=True)
    np.testing.assert_allclose(jzyfa.from_balanced_layout(out, 4), want_out, atol=2e-5)
    np.testing.assert_allclose(jzyfa.from_balanced_layout(lse, 4, axis=2), want_lse, atol=2e-5)


# --- head dim 256 ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dim_256_on_the_cpu(rng, cpu_backend, dtype, causal):
    q, k, v = random_qkv(rng, batch=2, seq_q=40, seq_k=65, heads_q=4, heads_kv=2, head_dim=256, dtype=dtype)
    fn = functools.partial(jzyfa.flash_attention, causal=causal, return_lse=True)
    # The kernel's primitive since hd256 was verified; on the CPU it lowers to the reference.
    assert FFI_TARGET in str(jax.make_jaxpr(lambda *a: fn(*a))(q, k, v))
    got = jax.jit(fn)(q, k, v)
    want = naive_attention_f64(*(np.asarray(x, np.float32) for x in (q, k, v)), causal=causal)
    assert_matches_f64(got, want, atol=2e-2)
    # On the CPU, implementation="kernel" has no kernel to run (the kernel's hd256: tests/test_hd256_kernel_*).
    with pytest.raises(ValueError, match="implementation='kernel'"):
        jzyfa.flash_attention(q, k, v, implementation="kernel")


# --- chunked prefill: key ranges attended apart and merged --------------------------------------


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
def test_chunk_over_cached_prefix_and_own_keys_merges_to_the_whole(rng, dtype, atol):
    # A 48-token chunk after 80 cached tokens: every query sees the whole prefix (non-causal part)
    # and its own keys causally (Sq = Sk, so the diagonal is the chunk's own).
    q, k, v = random_qkv(rng, batch=2, seq_q=48, seq_k=128, heads_q=4, heads_kv=2, dtype=dtype)
    whole_out, whole_lse = attention(causal=True)(q, k, v)
    prefix = attention(causal=False)(q, k[:, :80], v[:, :80])
    own = attention(causal=True)(q, k[:, 80:], v[:, 80:])
    out, lse = merge(*prefix, *own)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(whole_out, np.float32), atol=atol)
    np.testing.assert_allclose(lse, whole_lse, atol=1e-5)


def test_chunk_by_chunk_prefill_equals_one_call(rng):
    # Each chunk attends causally to every earlier key plus its own (Sk > Sq, bottom-right).
    q, k, v = random_qkv(rng, seq_q=100, heads_q=4, heads_kv=1, dtype=jnp.float32)
    whole_out, whole_lse = attention(causal=True)(q, k, v)
    for start, end in [(0, 30), (30, 64), (64, 65), (65, 100)]:
        out, lse = attention(causal=True)(q[:, start:end], k[:, :end], v[:, :end])
        np.testing.assert_allclose(out, whole_out[:, start:end], atol=2e-6)
        np.testing.assert_allclose(lse, whole_lse[:, :, start:end], atol=2e-6)


@pytest.mark.parametrize("width", [5, 16, 21, 45])
def test_windowed_chunk_over_a_cache_merges_to_the_whole(rng, width):
    # A 16-query chunk after 40 cached keys with a sliding window of `width` keys to the left.
    # Query i sits at p = i + 40. The chunk's own keys end at the last key, so they keep the whole
    # call's bottom-right alignment and window. The cache part has its own alignment,
    # p' = i + 40 - 16 = p - 16, so the same keys j >= p - width are j >= p' - (width - 16) there,
    # and every cached key is left of p (right bound unbounded). A window narrower than the chunk
    # reaches the cache from its first `width` queries only: j >= p - width is, for those rows
    # attended alone (p'' = i + 40 - width), the window (0, -1).
    q, k, v = random_qkv(rng, seq_q=16, seq_k=56, heads_q=4, heads_kv=2, dtype=jnp.float32)
    whole_out, whole_lse = attention(causal=True, window=(width, 0))(q, k, v)
    if width >= 16:
        cache = attention(window=(width - 16, -1))(q, k[:, :40], v[:, :40])
    else:
        head_out, head_lse = attention(window=(0, -1))(q[:, :width], k[:, :40], v[:, :40])
        cache = (
            jnp.zeros_like(q).at[:, :width].set(head_out),
            jnp.full((1, 4, 16), -jnp.inf).at[:, :, :width].set(head_lse),
        )
    own = attention(causal=True, window=(width, 0))(q, k[:, 40:], v[:, 40:])
    out, lse = merge(*cache, *own)
    np.testing.assert_allclose(out, whole_out, atol=2e-6)
    np.testing.assert_allclose(lse, whole_lse, atol=2e-6)
    want = naive_attention_f64(q, k, v, causal=True, window=(width, 0))
    assert_matches_f64((out, lse), want, atol=2e-5)


def test_merging_with_an_empty_part_is_exact(rng):
    q, k, v = random_qkv(rng, batch=2, seq_q=16, seq_k=24, heads_q=4, heads_kv=2, dtype=jnp.float32)
    part = attention(causal=True)(q, k, v)
    empty = attention(causal=True)(q, k[:, :0], v[:, :0])  # no keys at all: 0 and -inf
    np.testing.assert_array_equal(empty[0], 0)
    assert np.all(np.isneginf(empty[1]))
    for merged in (merge(*part, *empty), merge(*empty, *part)):
        for a, b in zip(merged, part):
            np.testing.assert_array_equal(a, b)


# --- slices of a fused QKV projection -----------------------------------------------------------


def fused_qkv_along_a_new_axis(qkv):  # [B, S, 3, H, D]
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


def fused_qkv_along_heads(qkv):  # [B, S, Hq + 2 * Hkv, D], Hq = 8, Hkv = 2
    return qkv[:, :, :8], qkv[:, :, 8:10], qkv[:, :, 10:]


@pytest.mark.parametrize(
    "split,shape",
    [(fused_qkv_along_a_new_axis, (2, 40, 3, 4, 64)), (fused_qkv_along_heads, (2, 40, 12, 64))],
    ids=["new_axis", "heads"],
)
def test_slices_of_a_fused_projection(rng, cpu_backend, split, shape):
    qkv = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    fn = lambda qkv: jzyfa.flash_attention(*split(qkv), causal=True, return_lse=True)
    dense = [jnp.array(x, copy=True) for x in split(qkv)]
    for a, b in zip(jax.jit(fn)(qkv), attention(causal=True)(*dense)):
        np.testing.assert_array_equal(a, b)

    # Lowered for CUDA: one custom call whose operands are the slices themselves (XLA's `slice`,
    # plus a `reshape` dropping the size-1 axis); XLA materialises each as a dense buffer when it
    # compiles (docs/shapes.md). No copy or transpose appears before that.
    hlo = jax.jit(fn).trace(qkv).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")
    (call,) = custom_call_lines(hlo, FFI_TARGET)
    operands = call.split("custom-call(")[1].split(")")[0].split(", ")
    assert len(operands) == 3
    instructions = {line.split(" = ")[0].strip(): line for line in hlo.splitlines() if " = " in line}
    for name in operands:
        producer = instructions[name]
        if " reshape(" in producer:  # the squeeze of qkv[:, :, i]
            producer = instructions[producer.split(" reshape(")[1].rstrip(")")]
        assert " slice(" in producer, producer
    assert " copy(" not in hlo and " transpose(" not in hlo
    assert hlo.count(" slice(") == 3


# --- sequence-length regressions ---------------------------------------------------------------

LENGTHS = [1, 2, 63, 64, 65, 127, 128, 129, 4095, 4097]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length", LENGTHS)
def test_sequence_length_regressions(rng, length, causal):
    # Long ones with one head and a small head dim, in float32, to stay fast.
    heads, head_dim = (1, 16) if length > 1000 else (4, 64)
    q, k, v = random_qkv(rng, seq_q=length, heads_q=heads, heads_kv=1, head_dim=head_dim, dtype=jnp.float32)
    got = attention(causal=causal, implementation="xla")(q, k, v)
    assert_matches_f64(got, naive_attention_f64(q, k, v, causal=causal), atol=2e-5)


@pytest.mark.parametrize("seq_q,seq_k", [(65, 1), (1, 65), (129, 63), (63, 129), (128, 2), (2, 128)])
def test_unequal_length_regressions(rng, seq_q, seq_k):
    q, k, v = random_qkv(rng, seq_q=seq_q, seq_k=seq_k, heads_q=4, heads_kv=2, dtype=jnp.float32)
    for causal in (False, True):
        got = attention(causal=causal)(q, k, v)
        assert_matches_f64(got, naive_attention_f64(q, k, v, causal=causal), atol=2e-5)
