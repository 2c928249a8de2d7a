"""The varlen kernel's JAX side on the CPU: the primitive's reference lowering, its CUDA custom call, the
choice of path (the kernel by default since it passed its GPU tests) and its kill switch. (The kernel
itself: tests/test_varlen_kernel_gpu.py and tests/test_kernel_build.py.)"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_varlen_f64

import jzyfa
from jzyfa import api
from jzyfa.varlen import varlen_attention_reference
from jzyfa.varlen_primitive import FFI_TARGET_VARLEN, flash_attention_varlen_fwd

pytestmark = pytest.mark.usefixtures("cpu_backend")


def offsets(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed(rng, total_q, total_k, heads_q=4, heads_kv=2, head_dim=64, dtype=jnp.bfloat16):
    shapes = [(total_q, heads_q, head_dim), (total_k, heads_kv, head_dim), (total_k, heads_kv, head_dim)]
    return tuple(jnp.asarray(rng.standard_normal(s), dtype) for s in shapes)


def primitive(max_q, max_k, *, causal, scale=0.125, required=False):
    """The primitive, jitted with traced offsets: (out, lse)."""
    call = functools.partial(
        flash_attention_varlen_fwd,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        softmax_scale=scale,
        causal=causal,
        kernel_required=required,
    )
    return jax.jit(call)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "lengths_q, lengths_k, pad_q",
    [
        ([5, 0, 17, 1], [5, 3, 0, 30], 0),  # empty sequences on either side
        ([20, 65], [10, 65], 3),  # more queries than keys; 3 tokens past cu_seqlens_q[-1]
        ([1, 1, 1], [64, 1, 33], 0),
    ],
)
def test_primitive_off_cuda_is_the_reference(rng, causal, lengths_q, lengths_k, pad_q):
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    q, k, v = packed(rng, sum(lengths_q) + pad_q, sum(lengths_k))
    max_q, max_k = max(lengths_q), max(lengths_k)
    out, lse = primitive(max_q, max_k, causal=causal)(q, k, v, cu_q, cu_k)
    window = (-1, 0) if causal else (-1, -1)
    want_out, want_lse = varlen_attention_reference(
        q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), max_q, max_k, window=window, softmax_scale=0.125
    )
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == (4, q.shape[0])
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    # And that is attention per sequence, with zeros / -inf past the last sequence.
    f64_out, f64_lse = naive_varlen_f64(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=0.125)
    np.testing.assert_allclose(np.asarray(out, np.float32), f64_out, atol=2e-2)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(f64_lse))
    if pad_q:
        assert np.all(np.asarray(out[-pad_q:], np.float32) == 0) and np.all(np.isneginf(lse[:, -pad_q:]))


@pytest.mark.parametrize("causal", [False, True])
def test_cuda_lowering_is_the_varlen_custom_call(causal):
    q = jax.ShapeDtypeStruct((300, 8, 128), jnp.float16)
    kv = jax.ShapeDtypeStruct((500, 2, 128), jnp.float16)
    cu = jax.ShapeDtypeStruct((5,), jnp.int32)
    fn = primitive(200, 260, causal=causal, scale=0.25, required=True)
    hlo = fn.trace(q, kv, kv, cu, cu).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")
    (call,) = [line for line in hlo.splitlines() if "custom-call(" in line]
    assert f'custom_call_target="{FFI_TARGET_VARLEN}"' in call
    assert "api_version=API_VERSION_TYPED_FFI" in call
    # Results: out, lse [heads, total_q], the tile counter; operands q, k, v, cu_seqlens_q, cu_seqlens_k.
    assert "(f16[300,8,128]{2,1,0}, f32[8,300]{1,0}, s32[1]{0}) custom-call(" in call
    assert "custom-call(q.1, k.1, v.1, cu_seqlens_q.1, cu_seqlens_k.1)" in call
    layouts = re.search(r"operand_layout_constraints=\{(.*?)\}, api_version", call).group(1)
    assert re.findall(r"(f16|s32)\[([\d,]+)\]", layouts) == [
        ("f16", "300,8,128"),
        ("f16", "500,2,128"),
        ("f16", "500,2,128"),
        ("s32", "5"),
        ("s32", "5"),
    ]
    assert f"causal = {str(causal).lower()}" in call
    assert "max_seqlen_q = 200 : i64" in call and "max_seqlen_k = 260 : i64" in call
    assert re.search(r"softmax_scale = 2.50*e-01 : f32", call)


def varlen_custom_calls(implementation, window=(-1, 0)) -> list[str]:
    """The custom calls of flash_attention_varlen lowered for CUDA (on this CPU host)."""
    q = jax.ShapeDtypeStruct((100, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((90, 4, 64), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((3,), jnp.int32)
    fn = functools.partial(
        jzyfa.flash_attention_varlen,
        max_seqlen_q=64,
        max_seqlen_k=64,
        window=window,
        implementation=implementation,
        return_lse=True,
    )
    hlo = jax.jit(fn).trace(q, kv, kv, cu, cu).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")
    return [line for line in hlo.splitlines() if "custom-call(" in line]


@pytest.mark.parametrize("window", [(-1, 0), (8, 0)])  # the causal window, and a sliding one
def test_api_lowers_to_the_custom_call_by_default(monkeypatch, window):
    """Verified, the kernel needs no variable: implementation="kernel" always lowers to it, and
    implementation=None does where the kernel is available (faked here: this host has no GPU)."""
    monkeypatch.delenv(api.UNVERIFIED_VARLEN_KERNEL_ENV, raising=False)
    monkeypatch.delenv(api.UNVERIFIED_WINDOW_KERNEL_ENV, raising=False)
    assert api.VARLEN_KERNEL_VERIFIED and api.WINDOW_KERNEL_VERIFIED
    causal = "true" if window == (-1, 0) else "false"
    (call,) = varlen_custom_calls("kernel", window)
    assert FFI_TARGET_VARLEN in call and f"causal = {causal}" in call
    # implementation=None: the pure-JAX path where the kernel cannot run (this CPU host), the kernel
    # where it can.
    assert varlen_custom_calls(None, window) == []
    monkeypatch.setattr(api._platform, "kernel_available", lambda: True)
    (call,) = varlen_custom_calls(None, window)
    assert FFI_TARGET_VARLEN in call and f"causal = {causal}" in call


def test_kernel_path_is_the_default(rng, monkeypatch):
    lengths = [7, 0, 12]
    cu = offsets(lengths)
    q, k, v = packed(rng, 19, 19)
    monkeypatch.delenv(api.UNVERIFIED_VARLEN_KERNEL_ENV, raising=False)
    monkeypatch.delenv(api.UNVERIFIED_WINDOW_KERNEL_ENV, raising=False)
    assert api.VARLEN_KERNEL_VERIFIED
    available = [False]
    monkeypatch.setattr(api._platform, "kernel_available", lambda: available[0])
    for window in ((-1, 0), (-1, -1), (4, 0)):
        assert api.choose_varlen_path(q, k, v, 3, 12, 0.125, window, "kernel") is api.Path.KERNEL_REQUIRED
        # implementation=None: the pure-JAX path where the kernel cannot run, the primitive where it can.
        available[0] = False
        assert api.choose_varlen_path(q, k, v, 3, 12, 0.125, window, None) is api.Path.REFERENCE
        available[0] = True
        assert api.choose_varlen_path(q, k, v, 3, 12, 0.125, window, None) is api.Path.PRIMITIVE
    # Lowered for the CPU, a required kernel is an error, as for dense calls: the platform refuses it,
    # not the kill switch.
    with pytest.raises(ValueError, match="non-CUDA platform"):
        jzyfa.flash_attention_varlen(q, k, v, cu, cu, 12, 12, causal=True, implementation="kernel")


def test_kill_switch(rng, monkeypatch):
    """VARLEN_KERNEL_VERIFIED (on since the kernel passed its GPU tests) is a kill switch: off, varlen
    calls stay on the pure-JAX path and implementation="kernel" needs the variable."""
    lengths = [7, 0, 12]
    cu = offsets(lengths)
    q, k, v = packed(rng, 19, 19)
    call = functools.partial(jzyfa.flash_attention_varlen, causal=True)
    monkeypatch.delenv(api.UNVERIFIED_VARLEN_KERNEL_ENV, raising=False)
    monkeypatch.setattr(api, "VARLEN_KERNEL_VERIFIED", False)
    monkeypatch.setattr(api._platform, "kernel_available", lambda: True)
    with pytest.raises(ValueError, match=r"varlen kernel is switched off .*JZYFA_UNVERIFIED_VARLEN_KERNEL=1"):
        call(q, k, v, cu, cu, 12, 12, implementation="kernel")
    # implementation=None stays on the pure-JAX path while switched off, env or not, kernel or not.
    assert api.choose_varlen_path(q, k, v, 3, 12, 0.125, (-1, 0), None) is api.Path.REFERENCE
    monkeypatch.setenv(api.UNVERIFIED_VARLEN_KERNEL_ENV, "1")
    assert api.choose_varlen_path(q, k, v, 3, 12, 0.125, (-1, 0), None) is api.Path.REFERENCE
    assert api.choose_varlen_path(q, k, v, 3, 12, 0.125, (-1, 0), "kernel") is api.Path.KERNEL_REQUIRED
    # The variable lifts the switch: on the CPU a required kernel is then the platform's error.
    with pytest.raises(ValueError, match="non-CUDA platform"):
        call(q, k, v, cu, cu, 12, 12, implementation="kernel")


@pytest.mark.parametrize(
    "dtype, head_dim, head_dim_v, kwargs, message",
    [
        (jnp.float32, 64, 64, {}, "bf16 or f16"),
        (jnp.bfloat16, 96, 96, {}, "head_dim in"),
        (jnp.bfloat16, 128, 64, {}, "v's head_dim"),
        (jnp.bfloat16, 96, 96, {"window": (4, 0)}, "head_dim in"),
    ],
)
def test_kernel_refuses_what_it_cannot_serve(rng, monkeypatch, dtype, head_dim, head_dim_v, kwargs, message):
    # Sliding windows are served (their kill switch: tests/test_window_kernel_path.py).
    monkeypatch.delenv(api.UNVERIFIED_VARLEN_KERNEL_ENV, raising=False)
    q = jnp.asarray(rng.standard_normal((10, 2, head_dim)), dtype)
    k = jnp.asarray(rng.standard_normal((10, 2, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((10, 2, head_dim_v)), dtype)
    cu = offsets([4, 6])
    kwargs = {"causal": True, **kwargs}
    with pytest.raises(ValueError, match=message):
        jzyfa.flash_attention_varlen(q, k, v, cu, cu, 6, 6, implementation="kernel", **kwargs)
    # implementation=None falls back to the pure-JAX path for these.
    out = jzyfa.flash_attention_varlen(q, k, v, cu, cu, 6, 6, **kwargs)
    assert out.shape == q.shape[:2] + (head_dim_v,)


def test_gradients_through_the_primitive_are_the_reference_ones(rng):
    lengths_q, lengths_k = [6, 0, 11], [9, 4, 11]
    cu_q, cu_k = jnp.asarray(offsets(lengths_q)), jnp.asarray(offsets(lengths_k))
    q, k, v = packed(rng, 17, 24, dtype=jnp.float32)
    q, k, v = (x.astype(jnp.bfloat16).astype(jnp.float32) for x in (q, k, v))
    weights = jnp.asarray(rng.standard_normal(q.shape[:2] + (64,)), jnp.float32)

    def loss_kernel_path(q, k, v):
        out, lse = api._differentiable_varlen_kernel(q, k, v, cu_q, cu_k, 11, 11, 0.125, True, False)
        return jnp.sum(out * weights) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

    def loss_reference(q, k, v):
        out, lse = varlen_attention_reference(
            q, k, v, cu_q, cu_k, 11, 11, window=(-1, 0), softmax_scale=0.125
        )
        return jnp.sum(out * weights) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

    got = jax.jit(jax.grad(loss_kernel_path, argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(loss_reference, argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-6)
