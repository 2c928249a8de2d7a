"""The FP8 kernel's sliding windows on the CPU: the window attributes of the FP8 custom call, the gate
that keeps windows on the pure-JAX path until the windowed FP8 kernel is verified on a GPU
(FP8_WINDOW_KERNEL_VERIFIED, JZYFA_UNVERIFIED_FP8_WINDOW_KERNEL), and the primitive's emulation lowering
with a window. (The kernel itself: tests/test_fp8_window_kernel_gpu.py and tests/test_kernel_build.py.)"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import random_fp8_qkv
from hlo_utils import cuda_hlo, custom_call_lines, window_attributes
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_utils import cpu_mesh

import jzyfa
from jzyfa import api
from jzyfa.fp8_emulation import attention_fp8_emulated
from jzyfa.fp8_primitive import FFI_TARGET_FP8, flash_attention_fp8_kernel

pytestmark = pytest.mark.usefixtures("cpu_backend")

F8 = jnp.float8_e4m3fn
Q = jax.ShapeDtypeStruct((2, 300, 8, 128), F8)
KV = jax.ShapeDtypeStruct((2, 500, 2, 128), F8)
DESCALE = jax.ShapeDtypeStruct((), jnp.float32)


@pytest.fixture(autouse=True)
def no_gate_variables(monkeypatch):
    """Every test starts from the defaults: the gates' variables unset."""
    monkeypatch.delenv(api.UNVERIFIED_FP8_WINDOW_KERNEL_ENV, raising=False)
    monkeypatch.delenv(api.UNVERIFIED_FP8_KERNEL_ENV, raising=False)


@pytest.fixture
def window_gate_on(monkeypatch):
    monkeypatch.setenv(api.UNVERIFIED_FP8_WINDOW_KERNEL_ENV, "1")


def fp8_call(causal, window, implementation):
    def fn(q8, k8, v8, dq, dk, dv):
        return jzyfa.flash_attention(
            q8,
            k8,
            v8,
            descale_q=dq,
            descale_k=dk,
            descale_v=dv,
            causal=causal,
            window=window,
            implementation=implementation,
        )

    return fn


@pytest.mark.parametrize(
    "causal, window, want_causal, want_window",
    [
        (False, None, "false", (-1, -1)),
        (True, None, "true", (-1, -1)),
        (False, (128, 0), "false", (128, 0)),
        (False, (0, 0), "false", (0, 0)),
        (False, (37, 5), "false", (37, 5)),
        (False, (-1, 64), "false", (-1, 64)),
        (True, (127, 5), "false", (127, 0)),  # causal sets the right bound to 0
        (False, (8192, 0), "true", (-1, -1)),  # the whole prefix: the plain causal kernel
        (False, (499, 299), "false", (-1, -1)),  # bounds that exclude no key: no mask
        (False, (497, 298), "false", (497, 298)),
    ],
)
def test_cuda_lowering_carries_the_window(window_gate_on, causal, window, want_causal, want_window):
    hlo = cuda_hlo(fp8_call(causal, window, "kernel"), Q, KV, KV, DESCALE, DESCALE, DESCALE)
    (call,) = custom_call_lines(hlo, FFI_TARGET_FP8)
    assert f"causal = {want_causal}" in call
    assert window_attributes(call) == want_window
    assert "lean_p = true" in call


def test_calls_without_a_window_carry_none_with_the_gate_off():
    """With the gate off, causal and no mask (and windows that come down to them) still reach the kernel,
    with window (-1, -1)."""
    for causal, window in ((False, None), (True, None), (False, (8192, 0)), (True, (-1, 3))):
        hlo = cuda_hlo(fp8_call(causal, window, "kernel"), Q, KV, KV, DESCALE, DESCALE, DESCALE)
        (call,) = custom_call_lines(hlo, FFI_TARGET_FP8)
        assert window_attributes(call) == (-1, -1)


def test_gate_keeps_windows_off_the_kernel(rng, monkeypatch):
    (q8, k8, v8), (dq, dk, dv) = random_fp8_qkv(rng, seq_q=40, seq_k=72, heads_q=4, heads_kv=2)
    monkeypatch.setattr(api, "FP8_WINDOW_KERNEL_VERIFIED", False)  # the kill switch
    call = functools.partial(jzyfa.flash_attention, descale_q=dq, descale_k=dk, descale_v=dv)
    with pytest.raises(
        ValueError,
        match=r"FP8_WINDOW_KERNEL_VERIFIED is False.*window \(8, 0\).*JZYFA_UNVERIFIED_FP8_WINDOW_KERNEL=1",
    ):
        call(q8, k8, v8, window=(8, 0), implementation="kernel")
    # causal=True with a window names the window it runs with (right bound 0).
    with pytest.raises(ValueError, match=r"window \(8, 0\)"):
        call(q8, k8, v8, causal=True, window=(8, 5), implementation="kernel")
    assert api.choose_fp8_path(q8, k8, v8, False, (8, 0), None) is api.Path.REFERENCE
    # Lowered for CUDA, the default path has no FP8 custom call for a window.
    hlo = cuda_hlo(fp8_call(False, (16, 4), None), Q, KV, KV, DESCALE, DESCALE, DESCALE)
    assert custom_call_lines(hlo, FFI_TARGET_FP8) == []

    # The variable lifts the gate for implementation="kernel" only.
    monkeypatch.setenv(api.UNVERIFIED_FP8_WINDOW_KERNEL_ENV, "1")
    assert api.choose_fp8_path(q8, k8, v8, False, (8, 0), "kernel") is api.Path.KERNEL_REQUIRED
    assert api.choose_fp8_path(q8, k8, v8, False, (8, 0), None) is api.Path.REFERENCE
    with pytest.raises(ValueError, match="non-CUDA platform"):  # on the CPU: the platform's refusal
        call(q8, k8, v8, window=(8, 0), implementation="kernel")
    # The whole FP8 kernel's gate still applies.
    monkeypatch.setattr(api, "FP8_KERNEL_VERIFIED", False)
    with pytest.raises(ValueError, match="has not passed its GPU tests"):
        call(q8, k8, v8, window=(8, 0), implementation="kernel")


def test_verified_gate_runs_windows_on_the_primitive(rng, monkeypatch):
    """Once FP8_WINDOW_KERNEL_VERIFIED is True, implementation=None takes the primitive wherever the kernel
    runs (on the CPU, kernel_available is False: the pure-JAX path)."""
    (q8, k8, v8), _ = random_fp8_qkv(rng, seq_q=40, seq_k=72, heads_q=4, heads_kv=2)
    monkeypatch.setattr(api, "FP8_WINDOW_KERNEL_VERIFIED", True)
    monkeypatch.setattr(api._platform, "kernel_available", lambda: True)
    assert api.choose_fp8_path(q8, k8, v8, False, (8, 0), None) is api.Path.PRIMITIVE
    assert api.choose_fp8_path(q8, k8, v8, False, (8, 0), "kernel") is api.Path.KERNEL_REQUIRED


def test_window_token_limit_is_named(window_gate_on):
    q = jax.ShapeDtypeStruct((1, 1024, 1, 128), F8)
    k = jax.ShapeDtypeStruct((1, 1 << 30, 1, 128), F8)
    with pytest.raises(ValueError, match=r"seq_q \+ seq_k <= 2\^30"):
        api.choose_fp8_path(q, k, k, False, (8, 0), "kernel")


@pytest.mark.parametrize("window", [(-2, 0), (3, -5)])
def test_bad_windows_name_the_argument(rng, window_gate_on, window):
    (q8, k8, v8), (dq, dk, dv) = random_fp8_qkv(rng, seq_q=16, heads_q=2)
    with pytest.raises(ValueError, match="window"):
        jzyfa.flash_attention(
            q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, window=window, implementation="kernel"
        )


@pytest.mark.parametrize("lean_p", [True, False])
@pytest.mark.parametrize(
    "seq_q, seq_k, causal, window",
    [
        (40, 300, False, (37, 5)),
        (300, 300, False, (128, 0)),  # two key blocks, a window of one block
        (90, 20, False, (0, 0)),  # Sq > Sk: the first rows see no key
        (33, 260, False, (-1, 64)),
        (64, 64, True, (10, 7)),  # causal sets the right bound to 0
    ],
)
def test_primitive_off_cuda_is_the_emulation_with_the_window(rng, lean_p, seq_q, seq_k, causal, window):
    (q8, k8, v8), descales = random_fp8_qkv(
        rng, seq_q=seq_q, seq_k=seq_k, heads_q=4, heads_kv=2, granularity="head"
    )
    scale = 128**-0.5
    fn = functools.partial(
        flash_attention_fp8_kernel,
        softmax_scale=scale,
        causal=causal,
        window=window,
        lean_p=lean_p,
        kernel_required=False,
    )
    out, lse = jax.jit(fn)(q8, k8, v8, descales)
    want_out, want_lse = attention_fp8_emulated(
        q8,
        k8,
        v8,
        *descales,
        causal=causal,
        window=window,
        softmax_scale=scale,
        lean_p=lean_p,
        integer_reference=True,
    )
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    if seq_q > seq_k:
        assert np.isneginf(np.asarray(lse)).any()  # rows left of every key: LSE = -inf


def test_vmap_keeps_the_window(window_gate_on):
    fn = jax.vmap(fp8_call(False, (16, 4), "kernel"), in_axes=(0, 0, 0, None, None, None))
    q = jax.ShapeDtypeStruct((3,) + Q.shape, F8)
    kv = jax.ShapeDtypeStruct((3,) + KV.shape, F8)
    (call,) = custom_call_lines(cuda_hlo(fn, q, kv, kv, DESCALE, DESCALE, DESCALE), FFI_TARGET_FP8)
    assert window_attributes(call) == (16, 4)


def test_head_sharding_keeps_the_window(rng):
    """Under a sharded jit (CPU devices: the emulation lowering) the window reaches every shard."""
    mesh = cpu_mesh((4,), ("model",))
    (q8, k8, v8), descales = random_fp8_qkv(
        rng, batch=2, seq_q=64, seq_k=200, heads_q=4, heads_kv=4, granularity="head"
    )
    fn = functools.partial(
        flash_attention_fp8_kernel,
        softmax_scale=0.1,
        causal=False,
        window=(20, 3),
        lean_p=True,
        kernel_required=False,
    )
    heads = NamedSharding(mesh, P(None, None, "model"))
    per_head = NamedSharding(mesh, P(None, "model"))
    sharded = jax.jit(lambda q, k, v, d: fn(q, k, v, d), in_shardings=(heads, heads, heads, [per_head] * 3))
    got = sharded(q8, k8, v8, list(descales))
    want = jax.jit(fn)(q8, k8, v8, descales)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
