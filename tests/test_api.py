"""jzyfa.flash_attention on CPU: numerics, dispatch, argument errors, vmap and grad."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_grads_f64, random_qkv, relative_l2

import jzyfa
from jzyfa import _platform
from jzyfa.primitives import FFI_TARGET

reference = jax.jit(jzyfa.attention_reference, static_argnames=("causal", "softmax_scale"))


def attention(implementation=None, **kwargs):
    """A jitted flash_attention returning (out, lse)."""
    return jax.jit(
        functools.partial(jzyfa.flash_attention, return_lse=True, implementation=implementation, **kwargs)
    )


def assert_matches_reference(got, want):
    """Bitwise on CPU, where the primitive lowers to the reference; to kernel precision on a GPU."""
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=1e-4
        )


def binds_primitive(fn, *args) -> bool:
    # A fresh function each time: JAX caches traces per function, and dispatch reads global state.
    return FFI_TARGET in str(jax.make_jaxpr(lambda *a: fn(*a))(*args))


@pytest.mark.parametrize("implementation", [None, "xla"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_reference(rng, implementation, dtype, causal):
    q, k, v = random_qkv(rng, batch=2, seq_q=40, seq_k=72, heads_q=4, heads_kv=2, head_dim=64, dtype=dtype)
    out, lse = attention(implementation, causal=causal, softmax_scale=0.2)(q, k, v)
    want_out, want_lse = reference(q, k, v, causal=causal, softmax_scale=0.2)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == (2, 4, 40)
    assert_matches_reference(out, want_out)
    assert_matches_reference(lse, want_lse)


def test_eager_call_and_default_scale(rng):
    q, k, v = random_qkv(rng, seq_q=9, seq_k=9, head_dim=128)
    out = jzyfa.flash_attention(q, k, v, causal=True)
    want_out, _ = reference(q, k, v, causal=True, softmax_scale=1 / np.sqrt(128))
    assert_matches_reference(out, want_out)


def test_rows_without_keys(rng):
    q, k, v = random_qkv(rng, seq_q=6, seq_k=2)
    out, lse = attention(causal=True)(q, k, v)
    assert np.all(np.asarray(out[:, :4], np.float32) == 0)
    assert np.all(np.isneginf(lse[:, :, :4])) and np.all(np.isfinite(lse[:, :, 4:]))


# --- dispatch --------------------------------------------------------------------------------


def fake_gpu(monkeypatch, compute_capability: str):
    """Makes the default backend look like a GPU whose devices have the given compute capability."""
    device = types.SimpleNamespace(compute_capability=compute_capability, device_kind="fake GPU")
    monkeypatch.setattr(_platform, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *args: [device])


@pytest.mark.parametrize(
    "head_dim,dtype,implementation,expected",
    [
        (64, jnp.bfloat16, None, True),
        (128, jnp.float16, None, True),
        (96, jnp.bfloat16, None, False),  # head_dim the kernel lacks
        (64, jnp.float32, None, False),  # dtype the kernel lacks
        (64, jnp.bfloat16, "xla", False),
        (64, jnp.bfloat16, "kernel", True),
    ],
)
def test_dispatch_on_cpu(rng, cpu_backend, head_dim, dtype, implementation, expected):
    q, k, v = random_qkv(rng, seq_q=4, head_dim=head_dim, dtype=dtype)
    fn = functools.partial(jzyfa.flash_attention, implementation=implementation)
    assert binds_primitive(fn, q, k, v) == expected


def test_non_hopper_gpu_uses_reference_or_refuses_kernel(rng, monkeypatch):
    q, k, v = random_qkv(rng, seq_q=4)
    fake_gpu(monkeypatch, "8.0")
    assert not binds_primitive(jzyfa.flash_attention, q, k, v)
    with pytest.raises(ValueError, match="compute capability 8.0.*Hopper"):
        jzyfa.flash_attention(q, k, v, implementation="kernel")


def test_hopper_without_extension_reports_load_error(rng, monkeypatch):
    q, k, v = random_qkv(rng, seq_q=4)
    fake_gpu(monkeypatch, "9.0")
    monkeypatch.setattr(jzyfa._extension, "load_error", lambda: "the extension could not be imported (why)")
    assert not binds_primitive(jzyfa.flash_attention, q, k, v)
    with pytest.raises(
        ValueError, match=r"implementation='kernel' cannot run here: the extension .* \(why\)"
    ):
        jzyfa.flash_attention(q, k, v, implementation="kernel")


@pytest.mark.skipif(jzyfa.extension_loaded(), reason="the extension is built and registered here")
def test_missing_extension_is_recorded_not_raised():
    assert "jzyfa._jzyfa_ffi could not be imported" in jzyfa._extension.load_error()


def test_hopper_with_extension_binds_primitive(rng, monkeypatch):
    q, k, v = random_qkv(rng, seq_q=4)
    fake_gpu(monkeypatch, "9.0")
    monkeypatch.setattr(jzyfa._extension, "load_error", lambda: None)
    assert binds_primitive(jzyfa.flash_attention, q, k, v)


def test_kernel_demanded_on_cpu_fails_to_compile(rng, cpu_backend):
    q, k, v = random_qkv(rng, seq_q=4)
    traced = jax.jit(functools.partial(jzyfa.flash_attention, implementation="kernel")).trace(q, k, v)
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        traced.lower(lowering_platforms=("cpu",))


@pytest.mark.parametrize(
    "head_dim,dtype,message",
    [
        (
            96,
            jnp.bfloat16,
            r"16-bit \(bf16, f16\) kernels take head dims \(q and k / v\) 64/64, 128/128, .*got 96/96",
        ),
        (64, jnp.float32, "the kernels take bf16, f16 or float8_e4m3fn inputs, got float32"),
    ],
)
def test_kernel_demanded_for_unsupported_config(rng, head_dim, dtype, message):
    q, k, v = random_qkv(rng, seq_q=4, head_dim=head_dim, dtype=dtype)
    with pytest.raises(ValueError, match="implementation='kernel' cannot serve this call: .*" + message):
        jzyfa.flash_attention(q, k, v, implementation="kernel")


# --- argument errors, raised while tracing -----------------------------------------------------

BF16 = jnp.bfloat16
FP8 = jnp.float8_e4m3fn


def spec(shape, dtype=BF16):
    return jax.ShapeDtypeStruct(shape, dtype)


GOOD = dict(q=spec((2, 8, 4, 64)), k=spec((2, 16, 2, 64)), v=spec((2, 16, 2, 64)))
FP8_QKV = {name: spec(s.shape, FP8) for name, s in GOOD.items()}
SCALAR = spec((), jnp.float32)
FP8_DESCALES = dict(descale_q=SCALAR, descale_k=SCALAR, descale_v=SCALAR)

BAD_CALLS = [
    # (arrays to replace, keyword options, error type, message pattern)
    (dict(q=spec((8, 4, 64))), {}, ValueError, "q must have rank 4"),
    (dict(v=spec((2, 15, 2, 64))), {}, ValueError, r"k and v must have the same \[batch, seq_k, kv_heads\]"),
    (dict(v=spec((2, 16, 1, 64))), {}, ValueError, r"k and v must have the same \[batch, seq_k, kv_heads\]"),
    (dict(k=spec((3, 16, 2, 64)), v=spec((3, 16, 2, 64))), {}, ValueError, "same batch size, got 2 and 3"),
    (dict(k=spec((2, 16, 2, 128)), v=spec((2, 16, 2, 128))), {}, ValueError, "same head_dim, got 64 and 128"),
    (
        dict(k=spec((2, 16, 3, 64)), v=spec((2, 16, 3, 64))),
        {},
        ValueError,
        r"q's heads \(4\) must be a multiple",
    ),
    (dict(v=spec((2, 16, 2, 64), jnp.float16)), {}, TypeError, "q, k and v must share a dtype"),
    (
        {n: spec(s.shape, jnp.int8) for n, s in GOOD.items()},
        {},
        TypeError,
        "q has dtype int8; expected one of",
    ),
    ({}, dict(implementation="cudnn"), ValueError, "implementation must be one of"),
    ({}, dict(causal=1), TypeError, "causal must be a bool"),
    ({}, dict(window=(4,)), TypeError, r"window must be None or a pair \(left, right\)"),
    ({}, dict(window=4), TypeError, r"window must be None or a pair \(left, right\)"),
    ({}, dict(window=(4.0, 0)), TypeError, "window's left bound must be a static int"),
    ({}, dict(window=(4, True)), TypeError, "window's right bound must be a static int"),
    ({}, dict(window=(-2, 0)), ValueError, "window's left bound must be >= 0, or -1 for unbounded; got -2"),
    ({}, dict(softmax_scale=np.ones(2)), TypeError, "softmax_scale must be a static"),
    ({}, dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite"),
    ({}, dict(descale_k=SCALAR), ValueError, "descale_k given for bfloat16 inputs"),
    (FP8_QKV, dict(descale_q=SCALAR), ValueError, "missing descale_k, descale_v"),
    (
        FP8_QKV,
        dict(FP8_DESCALES, descale_v=spec((2, 4), jnp.float32)),
        ValueError,
        r"descale_v must have shape \(\), \(1,\) or",
    ),
    (FP8_QKV, dict(FP8_DESCALES, descale_q=spec((), BF16)), TypeError, "descale_q must be float32"),
    (
        {name: spec(s.shape[:3] + (96,), FP8) for name, s in GOOD.items()},
        dict(FP8_DESCALES, implementation="kernel"),
        ValueError,
        r"cannot serve this call: the FP8 \(e4m3\) kernels take head dims \(q and k / v\) 64/64, 128/128, 192/128, "
        r"256/256, got 96/96",
    ),
    (dict(q=spec((2, 8, 4, 64), FP8)), {}, TypeError, "q, k and v must share a dtype"),
]


@pytest.mark.parametrize("arrays,options,error,message", BAD_CALLS)
def test_bad_arguments_fail_while_tracing(arrays, options, error, message):
    args = dict(GOOD, **arrays)
    # Descales are passed as traced arguments, like the device arrays they are in practice.
    options = dict(options)
    descales = {n: options.pop(n) for n in list(options) if n.startswith("descale")}

    def call(q, k, v, descales):
        return jzyfa.flash_attention(q, k, v, **options, **descales)

    with pytest.raises(error, match=message):
        jax.eval_shape(call, args["q"], args["k"], args["v"], descales)


def test_traced_softmax_scale_is_refused(rng):
    q, k, v = random_qkv(rng, seq_q=4)
    with pytest.raises(TypeError, match="softmax_scale must be a static"):
        jax.jit(lambda s: jzyfa.flash_attention(q, k, v, softmax_scale=s))(0.5)


def test_non_array_input_is_refused(rng):
    q, k, v = random_qkv(rng, seq_q=4)
    with pytest.raises(TypeError, match="k must be an array, got list"):
        jzyfa.flash_attention(q, [[1.0]], v)


# --- transformations -----------------------------------------------------------------------------


@pytest.mark.parametrize("kv_axis", [0, None])
def test_vmap_folds_into_batch(rng, monkeypatch, kv_axis):
    q, k, v = random_qkv(rng, batch=2, seq_q=12, seq_k=20, heads_q=4, heads_kv=2)
    qs = jnp.stack([q, -q, 2 * q])  # the mapped axis, size 3
    kvs = (jnp.stack([k, k + 1, -k]), jnp.stack([v, 2 * v, v - 1])) if kv_axis == 0 else (k, v)
    fn = functools.partial(jzyfa.flash_attention, causal=True, return_lse=True)
    batched = jax.vmap(fn, in_axes=(0, kv_axis, kv_axis))

    out, lse = jax.jit(batched)(qs, *kvs)
    monkeypatch.setattr(_platform, "default_backend", lambda: "cpu")  # the primitive on any host
    jaxpr = str(jax.make_jaxpr(lambda *a: batched(*a))(qs, *kvs))
    assert FFI_TARGET in jaxpr and "bf16[6,12,4,64]" in jaxpr  # one call, batch 3 * 2
    for i in range(3):
        ki, vi = (kvs[0][i], kvs[1][i]) if kv_axis == 0 else kvs
        want_out, want_lse = reference(qs[i], ki, vi, causal=True)
        np.testing.assert_allclose(
            np.asarray(out[i], np.float32), np.asarray(want_out, np.float32), atol=1e-2, rtol=1e-2
        )
        np.testing.assert_allclose(lse[i], want_lse, rtol=1e-5)


def test_vmap_over_a_non_leading_axis(rng):
    q, k, v = random_qkv(rng, batch=3, seq_q=8, seq_k=8)
    out = jax.vmap(jzyfa.flash_attention, in_axes=(1, 1, 1), out_axes=1)(q[:, None], k[:, None], v[:, None])
    np.testing.assert_allclose(
        np.asarray(out[:, 0], np.float32), np.asarray(jzyfa.flash_attention(q, k, v), np.float32), atol=1e-2
    )


def _grad_case(rng, dtype):
    """A causal GQA call with Sq != Sk, its weights on out and lse, and a loss of them."""
    q, k, v = random_qkv(rng, batch=1, seq_q=24, seq_k=40, heads_q=4, heads_kv=2, dtype=dtype)
    weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    lse_weights = jnp.asarray(rng.standard_normal((1, 4, 24)), jnp.float32)

    def loss(attention_fn, q, k, v):
        out, lse = attention_fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * weights) + jnp.sum(lse * lse_weights)

    return (q, k, v), weights, lse_weights, loss


def test_grad_of_the_xla_path_is_the_references():
    (q, k, v), _, _, loss = _grad_case(np.random.default_rng(3), jnp.float16)
    ours = functools.partial(jzyfa.flash_attention, causal=True, return_lse=True, implementation="xla")
    theirs = functools.partial(jzyfa.attention_reference, causal=True)
    grads = jax.jit(jax.grad(functools.partial(loss, ours), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(functools.partial(loss, theirs), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(grads, want):
        assert g.dtype == jnp.float16
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_grad_through_the_primitive_is_as_accurate_as_the_references(rng, dtype):
    """The backward primitive works from the residuals (out in the input dtype, lse): its error against
    float64 gradients (out's and lse's cotangents both used) is that of differentiating the float32
    reference, to within 10%."""
    (q, k, v), weights, lse_weights, loss = _grad_case(rng, dtype)
    ours = functools.partial(jzyfa.flash_attention, causal=True, return_lse=True)
    theirs = functools.partial(jzyfa.attention_reference, causal=True)
    assert "jzyfa_attention_bwd" in str(jax.make_jaxpr(jax.grad(functools.partial(loss, ours)))(q, k, v))
    grads = jax.jit(jax.grad(functools.partial(loss, ours), argnums=(0, 1, 2)))(q, k, v)
    references = jax.jit(jax.grad(functools.partial(loss, theirs), argnums=(0, 1, 2)))(q, k, v)
    exact = naive_attention_grads_f64(q, k, v, weights, lse_weights, causal=True)
    for g, r, x in zip(grads, references, exact):
        assert g.dtype == dtype
        assert relative_l2(g, x) <= 1.1 * relative_l2(r, x) + 1e-6


def test_kernel_refuses_nonpositive_scale_but_default_path_serves_it():
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 8, 2, 64)), jnp.bfloat16)
    with pytest.raises(ValueError, match="softmax_scale > 0"):
        jzyfa.flash_attention(q, q, q, softmax_scale=-0.5, implementation="kernel")
    out = jzyfa.flash_attention(q, q, q, softmax_scale=-0.5)
    ref, _ = jzyfa.attention_reference(q, q, q, softmax_scale=-0.5)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=1e-2)
