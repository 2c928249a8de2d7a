"""Lowering the kernel path for CUDA on this CPU machine: the custom call the FFI handler receives."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jzyfa
from jzyfa.primitives import FFI_TARGET, FFI_TARGET_BWD

# Dispatch as on a CPU host (the kernel path is taken), even when these tests run on a GPU host.
pytestmark = pytest.mark.usefixtures("cpu_backend")

Q = jax.ShapeDtypeStruct((2, 40, 8, 128), jnp.bfloat16)
KV = jax.ShapeDtypeStruct((2, 72, 2, 128), jnp.bfloat16)


def lower(fn, *args, platforms=("cuda",)):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=platforms)


def custom_calls(hlo_text: str) -> list[str]:
    return [line for line in hlo_text.splitlines() if "custom-call(" in line]


def softmax_scale_attribute(call: str) -> np.float32:
    (value,) = re.findall(r"softmax_scale = ([-+.\de]+) : f32", call)
    return np.float32(value)


@pytest.mark.parametrize("implementation", [None, "kernel"])
def test_cuda_lowering_is_the_typed_ffi_custom_call(implementation):
    fn = functools.partial(
        jzyfa.flash_attention, causal=True, softmax_scale=0.25, implementation=implementation
    )
    lowered = lower(fn, Q, KV, KV)
    (call,) = custom_calls(lowered.as_text(dialect="hlo"))
    assert f'custom_call_target="{FFI_TARGET}"' in call
    assert "api_version=API_VERSION_TYPED_FFI" in call
    # Operands and results as in docs/architecture.md (out, lse, the scheduler's tile counter);
    # row-major layouts.
    assert "(bf16[2,40,8,128]{3,2,1,0}, f32[2,8,40]{2,1,0}, s32[1]{0}) custom-call(" in call
    assert "bf16[2,72,2,128]{3,2,1,0}" in call
    # Attribute types are part of the contract: causal a bool, softmax_scale an f32; every attribute is
    # always present (a dense 16-bit call: no window, no varlen maxima, no FP8 choices).
    assert "causal = true" in call
    assert softmax_scale_attribute(call) == np.float32(0.25)
    (config,) = re.findall(r"backend_config=\{(.*)\}", call)
    attributes = dict(item.split(" = ", 1) for item in config.split(", "))
    del attributes["softmax_scale"]
    assert attributes == {
        "causal": "true",
        "window_left": "-1 : i64",
        "window_right": "-1 : i64",
        "varlen": "false",
        "max_seqlen_q": "0 : i64",
        "max_seqlen_k": "0 : i64",
        "lean_p": "true",
        "v_transposed": "false",
        "key_block": "0 : i64",
        "softcap": "0.000000e+00 : f32",
    }


def test_non_causal_attribute():
    fn = functools.partial(jzyfa.flash_attention, causal=False)
    (call,) = custom_calls(lower(fn, Q, KV, KV).as_text(dialect="hlo"))
    assert "causal = false" in call
    assert softmax_scale_attribute(call) == np.float32(1 / np.sqrt(128))


def test_stablehlo_carries_the_target():
    text = lower(jzyfa.flash_attention, Q, KV, KV).as_text()
    assert f"stablehlo.custom_call @{FFI_TARGET}" in text


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_cpu_lowering_has_no_custom_call(implementation):
    fn = functools.partial(jzyfa.flash_attention, implementation=implementation)
    assert FFI_TARGET not in lower(fn, Q, KV, KV, platforms=("cpu",)).as_text(dialect="hlo")


def test_xla_implementation_never_lowers_to_the_kernel():
    fn = functools.partial(jzyfa.flash_attention, implementation="xla")
    assert FFI_TARGET not in lower(fn, Q, KV, KV).as_text(dialect="hlo")


def test_vmap_lowers_to_one_call_with_folded_batch():
    fn = jax.vmap(jzyfa.flash_attention, in_axes=(0, None, None))
    qs = jax.ShapeDtypeStruct((3,) + Q.shape, Q.dtype)
    (call,) = custom_calls(lower(fn, qs, KV, KV).as_text(dialect="hlo"))
    assert "bf16[6,40,8,128]" in call


def test_grad_lowers_forward_and_backward_to_the_kernels():
    def loss(q, k, v):
        return jnp.sum(jzyfa.flash_attention(q, k, v, causal=True).astype(jnp.float32))

    text = lower(jax.value_and_grad(loss, argnums=(0, 1, 2)), Q, KV, KV).as_text(dialect="hlo")
    assert len(custom_calls(text)) == 2 and FFI_TARGET in text and FFI_TARGET_BWD in text


def test_softcap_reaches_both_custom_calls():
    def loss(q, k, v):
        return jnp.sum(jzyfa.flash_attention(q, k, v, causal=True, softcap=30.0).astype(jnp.float32))

    calls = custom_calls(lower(jax.value_and_grad(loss, argnums=(0, 1, 2)), Q, KV, KV).as_text(dialect="hlo"))
    assert len(calls) == 2
    for call in calls:
        assert re.findall(r"softcap = ([-+.\de]+) : f32", call) == ["3.000000e+01"], call


def test_grad_without_a_backward_kernel_lowers_the_backward_to_xla(monkeypatch):
    """A configuration with a forward kernel and no backward one (here MLA's head dims, 192/128, with
    their backward rows taken out of the plan) differentiates through the pure-JAX backward; with the
    rows, through the backward kernel."""
    from jzyfa import plan

    q = jax.ShapeDtypeStruct((2, 40, 8, 192), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 72, 2, 192), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((2, 72, 2, 128), jnp.bfloat16)

    def loss(q, k, v):
        return jnp.sum(jzyfa.flash_attention(q, k, v, causal=True).astype(jnp.float32))

    text = lower(jax.value_and_grad(loss, argnums=(0, 1, 2)), q, k, v).as_text(dialect="hlo")
    assert len(custom_calls(text)) == 2 and FFI_TARGET in text and FFI_TARGET_BWD in text
    rows = {row for row in plan.KERNELS if row.direction == "bwd" and row.head_dims == (192, 128)}
    assert rows
    monkeypatch.setattr(plan, "KERNELS", plan.KERNELS - rows)
    jax.clear_caches()  # the trace above decided with the rows
    text = lower(jax.value_and_grad(loss, argnums=(0, 1, 2)), q, k, v).as_text(dialect="hlo")
    assert len(custom_calls(text)) == 1 and FFI_TARGET in text and FFI_TARGET_BWD not in text


def test_export_for_cpu_and_cuda_runs_on_cpu():
    # One artifact for both platforms: the CPU branch is the reference, the CUDA one the kernel.
    fn = jax.jit(functools.partial(jzyfa.flash_attention, causal=True))
    # The FFI target has no JAX compatibility guarantee, so exporting it is an explicit choice.
    checks = [jax.export.DisabledSafetyCheck.custom_call(FFI_TARGET)]
    exported = jax.export.export(fn, platforms=("cpu", "cuda"), disabled_checks=checks)(Q, KV, KV)
    assert FFI_TARGET in exported.mlir_module()
    cpu = jax.devices("cpu")[0]  # runs the CPU branch on any host
    q = jax.device_put(jnp.ones(Q.shape, Q.dtype), cpu)
    k = jax.device_put(jnp.ones(KV.shape, KV.dtype), cpu)
    v = jax.device_put(
        jnp.arange(KV.size, dtype=jnp.float32).reshape(KV.shape).astype(KV.dtype) / KV.size, cpu
    )
    assert jnp.array_equal(exported.call(q, k, v), fn(q, k, v))
