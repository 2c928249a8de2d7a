"""The primitive that builds the FP8 kernel's V operand, on the CPU: off CUDA it is
`fp8_layout.fp8_value_operand` bit for bit; lowered for CUDA it is the custom call
`jzyfa_fp8_value_operand` (the kernel itself: tests/test_fp8_value_operand_gpu.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import random_fp8_qkv
from hlo_utils import cuda_hlo, custom_call_lines

from jzyfa.fp8_layout import KEY_GROUP, KEY_PERMUTATION, fp8_value_operand, padded_keys
from jzyfa.fp8_primitive import (
    FFI_TARGET_FP8,
    FFI_TARGET_VALUE_OPERAND,
    FP8_V_LAYOUT_ENV,
    flash_attention_fp8_kernel,
    fp8_value_operand_p,
)

pytestmark = pytest.mark.usefixtures("cpu_backend")

# NaN in float8_e4m3fn (0xFF is the other one): what a poisoned output is filled with.
E4M3_NAN_BYTE = 0x7F


def random_e4m3(rng: np.random.Generator, shape, *, avoid: int | None = None) -> jax.Array:
    """e4m3 values from uniformly random bytes: every code (NaNs, -0, subnormals), `avoid` excepted."""
    codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
    if avoid is not None:
        codes[codes == avoid] = avoid ^ 0x01
    return jnp.asarray(codes.view(jnp.float8_e4m3fn))


def value_operand_bytes(v: np.ndarray) -> np.ndarray:
    """The operand's definition on bytes: vt[b, h, d, 32 g + k] = v[b, 32 g + physical_key(k), h, d]
    (zero past seq_k)."""
    v = np.asarray(v).view(np.uint8)
    batch, seq_k, heads_kv, head_dim = v.shape
    padded = np.zeros((batch, padded_keys(seq_k), heads_kv, head_dim), np.uint8)
    padded[:, :seq_k] = v
    keys = (np.arange(padded.shape[1]) // KEY_GROUP) * KEY_GROUP + np.tile(
        KEY_PERMUTATION, padded.shape[1] // KEY_GROUP
    )
    return padded[:, keys].transpose(0, 2, 3, 1)


def as_bytes(x) -> np.ndarray:
    return np.asarray(x).view(np.uint8)


@pytest.mark.parametrize("seq_k", [1, 31, 32, 33, 300])
@pytest.mark.parametrize("batch, heads_kv", [(1, 1), (2, 3)])
def test_primitive_off_cuda_is_the_pure_jax_layout(rng, batch, seq_k, heads_kv):
    v = random_e4m3(rng, (batch, seq_k, heads_kv, 128))
    vt = jax.jit(fp8_value_operand_p.bind)(v)
    assert vt.shape == (batch, heads_kv, 128, padded_keys(seq_k)) and vt.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(as_bytes(vt), as_bytes(jax.jit(fp8_value_operand)(v)))
    np.testing.assert_array_equal(as_bytes(vt), value_operand_bytes(v))
    np.testing.assert_array_equal(as_bytes(fp8_value_operand_p.bind(v)), as_bytes(vt))  # eager


def test_vmap_folds_into_the_batch(rng):
    vs = random_e4m3(rng, (3, 2, 40, 2, 128))
    got = jax.vmap(fp8_value_operand_p.bind, in_axes=1, out_axes=1)(vs)
    for i in range(2):
        np.testing.assert_array_equal(as_bytes(got[:, i]), as_bytes(fp8_value_operand(vs[:, i])))


@pytest.mark.parametrize("seq_k, padded", [(1, 32), (300, 320), (4096, 4096)])
def test_cuda_lowering_is_the_ffi_custom_call(seq_k, padded):
    v = jax.ShapeDtypeStruct((2, seq_k, 3, 128), jnp.float8_e4m3fn)
    (call,) = custom_call_lines(cuda_hlo(fp8_value_operand_p.bind, v), FFI_TARGET_VALUE_OPERAND)
    assert "api_version=API_VERSION_TYPED_FFI" in call
    # Row-major operand and result, as the handler reads and writes them.
    assert f"f8e4m3fn[2,3,128,{padded}]{{3,2,1,0}} custom-call(" in call
    assert f"operand_layout_constraints={{f8e4m3fn[2,{seq_k},3,128]{{3,2,1,0}}}}" in call


@pytest.mark.parametrize(
    "shape, dtype",
    [((2, 40, 3, 64), jnp.float8_e4m3fn), ((2, 40, 3, 128), jnp.float32)],
)
def test_cuda_lowering_falls_back_where_the_kernel_does_not_serve(shape, dtype):
    hlo = cuda_hlo(fp8_value_operand_p.bind, jax.ShapeDtypeStruct(shape, dtype))
    assert FFI_TARGET_VALUE_OPERAND not in hlo


def test_cpu_lowering_has_no_custom_call():
    v = jax.ShapeDtypeStruct((2, 300, 3, 128), jnp.float8_e4m3fn)
    text = (
        jax.jit(fp8_value_operand_p.bind).trace(v).lower(lowering_platforms=("cpu",)).as_text(dialect="hlo")
    )
    assert "custom-call" not in text


def test_fp8_kernel_path_takes_v_from_the_value_operand_call(rng, monkeypatch):
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "transposed")  # a short call: the rule would stage V
    (q8, k8, v8), descales = random_fp8_qkv(rng, batch=2, seq_q=40, seq_k=70, heads_q=4, heads_kv=2)
    fn = functools.partial(
        flash_attention_fp8_kernel, softmax_scale=0.125, causal=True, lean_p=True, kernel_required=True
    )
    hlo = cuda_hlo(fn, q8, k8, v8, descales)
    (layout,) = custom_call_lines(hlo, FFI_TARGET_VALUE_OPERAND)
    (attention,) = custom_call_lines(hlo, FFI_TARGET_FP8)
    assert "f8e4m3fn[2,2,128,96]{3,2,1,0} custom-call(" in layout
    operands = attention.split("custom-call(")[1].split(")")[0].split(", ")
    assert operands[2] == layout.split("=")[0].strip()  # vt is the layout call's result
    assert "gather" not in hlo  # no XLA permutation of V left
