"""Head dim 256 on the 16-bit kernel, the JAX side on the CPU: the gate (HD256_KERNEL_VERIFIED, on since
tests/test_hd256_kernel_gpu.py passed on an H200; a kill switch, with JZYFA_UNVERIFIED_HD256_KERNEL=1) and the
CUDA custom call it lowers to. (Its sliding windows and varlen batches: tests/test_wide_kernel_path.py. The
kernel itself: tests/test_hd256_kernel_gpu.py and tests/test_kernel_build.py.)"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import random_qkv
from hlo_utils import cuda_hlo, custom_call_lines

import jzyfa
from jzyfa import api
from jzyfa.primitive import FFI_TARGET

pytestmark = pytest.mark.usefixtures("cpu_backend")

Q = jax.ShapeDtypeStruct((2, 300, 8, 256), jnp.bfloat16)
KV = jax.ShapeDtypeStruct((2, 500, 2, 256), jnp.bfloat16)
GATE = r"HD256_KERNEL_VERIFIED is False.*JZYFA_UNVERIFIED_HD256_KERNEL=1"


@pytest.fixture(autouse=True)
def no_gate_variables(monkeypatch):
    """Every test here starts from the defaults: the gates' variables unset."""
    monkeypatch.delenv(api.UNVERIFIED_HD256_KERNEL_ENV, raising=False)
    monkeypatch.delenv(api.UNVERIFIED_WINDOW_KERNEL_ENV, raising=False)


def test_gate_is_on_since_verified():
    assert api.HD256_KERNEL_VERIFIED is True  # tests/test_hd256_kernel_gpu.py on an H200, 2026-12-01
    assert api.UNVERIFIED_HD256_KERNEL_ENV == "JZYFA_UNVERIFIED_HD256_KERNEL"
    assert api.hd256_kernel_enabled()


@pytest.mark.parametrize("causal", [False, True])
def test_gate_off_falls_back_and_kernel_raises(rng, monkeypatch, causal):
    """The kill switch off: implementation=None falls back, "kernel" names the gate and its variable."""
    monkeypatch.setattr(api, "HD256_KERNEL_VERIFIED", False)
    q, k, v = random_qkv(rng, seq_q=40, seq_k=72, heads_q=4, heads_kv=2, head_dim=256)
    assert api.choose_path(q, k, v, 0.0625, causal, None, None) is api.Path.REFERENCE
    fn = functools.partial(jzyfa.flash_attention, causal=causal)
    assert custom_call_lines(cuda_hlo(fn, Q, KV, KV), FFI_TARGET) == []
    with pytest.raises(
        ValueError, match="cannot serve this call: the kernel's head_dim 256 is switched off.*" + GATE
    ):
        jzyfa.flash_attention(q, k, v, causal=causal, implementation="kernel")
    # Head dims 64 and 128 are not gated.
    q, k, v = random_qkv(rng, seq_q=40, seq_k=72, heads_q=4, heads_kv=2, head_dim=128)
    assert api.choose_path(q, k, v, 0.0625, causal, None, None) is api.Path.PRIMITIVE


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_variable_lets_kernel_lower_to_the_custom_call(monkeypatch, dtype, causal):
    """With the kill switch off, the variable still lets implementation="kernel" lower to the 16-bit
    custom call at hd256, while None takes the pure-JAX path (as the windows' gate does)."""
    monkeypatch.setattr(api, "HD256_KERNEL_VERIFIED", False)
    monkeypatch.setenv(api.UNVERIFIED_HD256_KERNEL_ENV, "1")
    q = jax.ShapeDtypeStruct(Q.shape, dtype)
    kv = jax.ShapeDtypeStruct(KV.shape, dtype)
    fn = functools.partial(jzyfa.flash_attention, causal=causal, implementation="kernel")
    (call,) = custom_call_lines(cuda_hlo(fn, q, kv, kv), FFI_TARGET)
    element = "bf16" if dtype == jnp.bfloat16 else "f16"
    assert f"{element}[2,300,8,256]" in call and f"{element}[2,500,2,256]" in call, call
    assert f"causal = {str(causal).lower()}" in call, call
    assert "window_left = -1" in call and "window_right = -1" in call, call
    assert api.choose_path(q, kv, kv, 0.0625, causal, None, None) is api.Path.REFERENCE
    assert (
        custom_call_lines(
            cuda_hlo(functools.partial(jzyfa.flash_attention, causal=causal), q, kv, kv), FFI_TARGET
        )
        == []
    )


@pytest.mark.parametrize("causal", [False, True])
def test_verified_gate_sends_the_default_path_to_the_kernel(causal):
    assert api.choose_path(Q, KV, KV, 0.0625, causal, None, None) is api.Path.PRIMITIVE
    (call,) = custom_call_lines(
        cuda_hlo(functools.partial(jzyfa.flash_attention, causal=causal), Q, KV, KV), FFI_TARGET
    )
    assert "bf16[2,300,8,256]" in call
    # Windows that come down to causal or none for these lengths are the plain kernel's.
    fn = functools.partial(jzyfa.flash_attention, window=(8192, 0))
    (call,) = custom_call_lines(cuda_hlo(fn, Q, KV, KV), FFI_TARGET)
    assert "causal = true" in call


def test_pure_jax_path_matches_the_kernel_path_lowered_for_cpu(rng, monkeypatch):
    """With the gate on, the primitive's CPU lowering (the reference) serves hd256 like the default path."""
    monkeypatch.setattr(api, "HD256_KERNEL_VERIFIED", True)
    q, k, v = random_qkv(rng, seq_q=70, seq_k=33, heads_q=4, heads_kv=2, head_dim=256, dtype=jnp.float16)
    fn = functools.partial(jzyfa.flash_attention, causal=True, return_lse=True)
    assert FFI_TARGET in str(jax.make_jaxpr(fn)(q, k, v))  # the primitive, bound
    out, lse = jax.jit(fn)(q, k, v)
    want_out, want_lse = jzyfa.flash_attention(q, k, v, causal=True, return_lse=True, implementation="xla")
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    assert np.isneginf(np.asarray(lse)[:, :, :37]).all()  # Sq > Sk: the first rows see no key
