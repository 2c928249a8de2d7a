"""MLA's head dims (q/k 192, v 128) in the 16-bit kernel, the JAX side on the CPU: the gate
(jzyfa.api.MLA_KERNEL_VERIFIED, on since tests/test_mla_kernel_gpu.py passed on an H200; a kill switch) and its
variable, the CUDA custom call's operand and result shapes, what stays on the pure-JAX path (other
head-dim pairs) and why, and the primitive's reference lowering. (Its sliding windows and varlen batches:
tests/test_wide_kernel_path.py. The kernel itself: tests/test_mla_kernel_gpu.py and
tests/test_kernel_build.py.)"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64, random_qkv
from hlo_utils import cuda_hlo, custom_call_lines

import jzyfa
from jzyfa import api, primitive
from jzyfa.primitive import FFI_TARGET

pytestmark = pytest.mark.usefixtures("cpu_backend")

Q = jax.ShapeDtypeStruct((2, 300, 8, 192), jnp.bfloat16)
K = jax.ShapeDtypeStruct((2, 500, 2, 192), jnp.bfloat16)
V = jax.ShapeDtypeStruct((2, 500, 2, 128), jnp.bfloat16)


@pytest.fixture(autouse=True)
def no_gate_variables(monkeypatch):
    """Every test here starts from the defaults: the gates' variables unset."""
    monkeypatch.delenv(api.UNVERIFIED_MLA_KERNEL_ENV, raising=False)
    monkeypatch.delenv(api.UNVERIFIED_WINDOW_KERNEL_ENV, raising=False)
    monkeypatch.delenv(api.UNVERIFIED_VARLEN_KERNEL_ENV, raising=False)


@pytest.fixture
def mla_gate_variable(monkeypatch):
    monkeypatch.setenv(api.UNVERIFIED_MLA_KERNEL_ENV, "1")


def kernel_call(fn, *args) -> str:
    (call,) = custom_call_lines(cuda_hlo(fn, *args), FFI_TARGET)
    return call


def softmax_scale_attribute(call: str) -> np.float32:
    (value,) = re.findall(r"softmax_scale = ([-+.\de]+) : f32", call)
    return np.float32(value)


def test_the_gate_switches_the_kernel_off(rng, monkeypatch):
    """Off (the kill switch): implementation=None runs MLA on the pure-JAX path (lowered for CUDA: no
    custom call), and implementation="kernel" names the gate and its variable."""
    assert api.MLA_KERNEL_VERIFIED is True  # verified on an H200 on 2026-11-30
    monkeypatch.setattr(api, "MLA_KERNEL_VERIFIED", False)
    assert not api.mla_kernel_enabled()
    q, k, v = random_qkv(rng, seq_q=40, seq_k=72, heads_q=4, heads_kv=2, head_dim=192, head_dim_v=128)
    for causal in (False, True):
        assert api.choose_path(q, k, v, 0.1, causal, None, None) is api.Path.REFERENCE
        fn = functools.partial(jzyfa.flash_attention, causal=causal)
        assert custom_call_lines(cuda_hlo(fn, Q, K, V), FFI_TARGET) == []
    with pytest.raises(
        ValueError,
        match=r"implementation='kernel' cannot serve this call: the kernel's MLA head dims \(192, 128\).*"
        r"MLA_KERNEL_VERIFIED is False.*JZYFA_UNVERIFIED_MLA_KERNEL=1",
    ):
        jzyfa.flash_attention(q, k, v, implementation="kernel")


@pytest.mark.usefixtures("mla_gate_variable")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_the_variable_lowers_mla_to_the_16_bit_custom_call(dtype, causal):
    """With the variable, implementation="kernel" is the 16-bit kernel's custom call: q and k 192 wide,
    v and out 128, lse [B, Hq, Sq], the tile counter; the default scale is 1/sqrt(192)."""
    q, k, v = (jax.ShapeDtypeStruct(x.shape, dtype) for x in (Q, K, V))
    call = kernel_call(
        functools.partial(jzyfa.flash_attention, causal=causal, implementation="kernel"), q, k, v
    )
    t = "bf16" if dtype == jnp.bfloat16 else "f16"
    assert "api_version=API_VERSION_TYPED_FFI" in call
    assert f"({t}[2,300,8,128]{{3,2,1,0}}, f32[2,8,300]{{2,1,0}}, s32[1]{{0}}) custom-call(" in call
    operands = re.search(r"operand_layout_constraints=\{(.*?)\}, api_version", call).group(1)
    assert re.findall(rf"{t}\[[\d,]+\]", operands) == [
        f"{t}[2,300,8,192]",
        f"{t}[2,500,2,192]",
        f"{t}[2,500,2,128]",
    ]
    assert f"causal = {str(causal).lower()}" in call
    assert "window_left = -1 : i64" in call and "window_right = -1 : i64" in call
    assert softmax_scale_attribute(call) == np.float32(1 / np.sqrt(192))


@pytest.mark.usefixtures("mla_gate_variable")
def test_the_variable_lifts_the_gate_for_implementation_kernel_only(rng, monkeypatch):
    """As for the other gates: with MLA_KERNEL_VERIFIED off, implementation=None stays on the pure-JAX
    path whatever the variable says."""
    monkeypatch.setattr(api, "MLA_KERNEL_VERIFIED", False)
    q, k, v = random_qkv(rng, seq_q=40, seq_k=72, heads_q=4, heads_kv=2, head_dim=192, head_dim_v=128)
    assert api.choose_path(q, k, v, 0.1, True, None, "kernel") is api.Path.KERNEL_REQUIRED
    assert api.choose_path(q, k, v, 0.1, True, None, None) is api.Path.REFERENCE
    assert custom_call_lines(cuda_hlo(jzyfa.flash_attention, Q, K, V), FFI_TARGET) == []
    # On the CPU a required kernel is then the platform's error, not the gate's.
    with pytest.raises(ValueError, match="non-CUDA platform"):
        jzyfa.flash_attention(q, k, v, implementation="kernel")


def test_verified_mla_is_the_default_path(rng, monkeypatch):
    """Once MLA_KERNEL_VERIFIED is True, implementation=None takes the kernel: its custom call lowered for
    CUDA, the primitive's reference lowering on the CPU (against float64)."""
    monkeypatch.setattr(api, "MLA_KERNEL_VERIFIED", True)
    q, k, v = random_qkv(rng, seq_q=40, seq_k=72, heads_q=4, heads_kv=2, head_dim=192, head_dim_v=128)
    assert api.choose_path(q, k, v, 0.1, True, None, None) is api.Path.PRIMITIVE
    assert api.choose_path(q, k, v, 0.1, True, None, "kernel") is api.Path.KERNEL_REQUIRED
    call = kernel_call(functools.partial(jzyfa.flash_attention, causal=True), Q, K, V)
    assert "(bf16[2,300,8,128]{3,2,1,0}, f32[2,8,300]{2,1,0}, s32[1]{0}) custom-call(" in call
    assert FFI_TARGET in str(jax.make_jaxpr(jzyfa.flash_attention)(q, k, v))
    for causal in (False, True):
        out, lse = jax.jit(functools.partial(jzyfa.flash_attention, causal=causal, return_lse=True))(q, k, v)
        assert out.shape == (1, 40, 4, 128) and out.dtype == jnp.bfloat16 and lse.shape == (1, 4, 40)
        want_out, want_lse = naive_attention_f64(
            *(np.asarray(x, np.float32) for x in (q, k, v)), causal=causal, softmax_scale=192**-0.5
        )
        np.testing.assert_allclose(np.asarray(out, np.float64), want_out, atol=2e-2)
        np.testing.assert_allclose(lse, want_lse, atol=1e-4)


@pytest.mark.usefixtures("mla_gate_variable")
def test_abstract_eval_vmap_and_grad_keep_v_head_dim(rng):
    """The kernel path's shapes: out takes v's head dim; vmap folds into one call; the backward is the
    pure-JAX path's."""
    assert [
        x.shape for x in jax.eval_shape(functools.partial(jzyfa.flash_attention, return_lse=True), Q, K, V)
    ] == [
        (2, 300, 8, 128),
        (2, 8, 300),
    ]
    stacked = [jax.ShapeDtypeStruct((3,) + x.shape, x.dtype) for x in (Q, K, V)]
    fn = jax.vmap(functools.partial(jzyfa.flash_attention, causal=True, implementation="kernel"))
    (call,) = custom_call_lines(cuda_hlo(fn, *stacked), FFI_TARGET)
    assert "bf16[6,300,8,128]" in call and "bf16[6,500,2,192]" in call

    q, k, v = random_qkv(rng, seq_q=12, seq_k=20, heads_q=4, heads_kv=2, head_dim=192, head_dim_v=128)

    def loss(q):
        return jnp.sum(jzyfa.flash_attention(q, k, v, causal=True, implementation="kernel"))

    hlo = cuda_hlo(jax.value_and_grad(loss), q)
    assert len(custom_call_lines(hlo, FFI_TARGET)) == 1  # the forward only


@pytest.mark.usefixtures("mla_gate_variable")
@pytest.mark.parametrize(
    "head_dim, head_dim_v, message",
    [
        (128, 64, r"v's head_dim equal to q's and k's \(128\), got 64; of unequal head dims it has MLA's"),
        (64, 128, r"v's head_dim equal to q's and k's \(64\), got 128"),
        (192, 192, r"head_dim in \(64, 128, 256\), got 192 \(and MLA's \(192, 128\) for q/k and v\)"),
        (192, 64, r"head_dim in \(64, 128, 256\), got 192 \(and MLA's \(192, 128\) for q/k and v\)"),
        (128, 192, r"v's head_dim equal to q's and k's \(128\), got 192"),
    ],
)
def test_other_head_dim_pairs_say_what_the_kernel_has(rng, head_dim, head_dim_v, message):
    q, k, v = random_qkv(rng, seq_q=8, head_dim=head_dim, head_dim_v=head_dim_v)
    assert primitive.kernel_config_problem(q, k, v, 0.1) is not None
    assert api.choose_path(q, k, v, 0.1, True, None, None) is api.Path.REFERENCE
    with pytest.raises(ValueError, match=f"cannot serve this call: .*{message}"):
        jzyfa.flash_attention(q, k, v, implementation="kernel")


@pytest.mark.usefixtures("mla_gate_variable")
def test_mla_kernel_takes_16_bit_inputs_only(rng):
    """float32 MLA stays on the pure-JAX path (the dtype's reason comes first); FP8 MLA too, by default (the
    FP8 kernel's MLA instantiation has a gate of its own: tests/test_fp8_mla_kernel_path.py)."""
    q, k, v = random_qkv(rng, seq_q=8, head_dim=192, head_dim_v=128, dtype=jnp.float32)
    assert "bf16 or f16" in primitive.kernel_config_problem(q, k, v, 0.1)
    q8, k8, v8 = (x.astype(jnp.float8_e4m3fn) for x in (q, k, v))
    assert api.choose_fp8_path(q8, k8, v8, True, None, None) is api.Path.REFERENCE
