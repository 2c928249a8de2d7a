"""MLA's head dims (q/k 192, v 128) on the FP8 kernel, the JAX side on the CPU: the gate
(jzyfa.api.FP8_MLA_KERNEL_VERIFIED, on since tests/test_fp8_mla_kernel_gpu.py passed on an H200; a kill switch) and
its variable, the CUDA custom call's operand and result shapes (V^T keeps v's head dim 128, out takes it),
what stays on the pure-JAX path (sliding windows, varlen batches, other head-dim pairs) and why, and the
primitive's emulation lowering. (The kernel itself: tests/test_fp8_mla_kernel_gpu.py and
tests/test_kernel_build.py.)"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import random_qkv
from hlo_utils import cuda_hlo, custom_call_lines

import jzyfa
from jzyfa import api
from jzyfa.fp8_emulation import attention_fp8_emulated
from jzyfa.fp8_primitive import (
    FFI_TARGET_FP8,
    FP8_V_LAYOUT_ENV,
    flash_attention_fp8_kernel,
    flash_attention_fp8_shard_p,
    fp8_kernel_config_problem,
    fp8_value_layout,
)
from jzyfa.quantize import fp8_quantize

pytestmark = pytest.mark.usefixtures("cpu_backend")

F8 = jnp.float8_e4m3fn
Q = jax.ShapeDtypeStruct((2, 300, 8, 192), F8)
K = jax.ShapeDtypeStruct((2, 500, 2, 192), F8)
V = jax.ShapeDtypeStruct((2, 500, 2, 128), F8)
DESCALE = jax.ShapeDtypeStruct((), jnp.float32)


@pytest.fixture(autouse=True)
def no_gate_variables(monkeypatch):
    """Every test here starts from the defaults: the gates' variables unset."""
    for env in (
        api.UNVERIFIED_FP8_MLA_KERNEL_ENV,
        api.UNVERIFIED_FP8_KERNEL_ENV,
        api.UNVERIFIED_FP8_WINDOW_KERNEL_ENV,
        api.UNVERIFIED_MLA_KERNEL_ENV,
    ):
        monkeypatch.delenv(env, raising=False)


@pytest.fixture
def fp8_mla_gate_variable(monkeypatch):
    monkeypatch.setenv(api.UNVERIFIED_FP8_MLA_KERNEL_ENV, "1")


def fp8_mla_qkv(rng, *, batch=1, seq_q, seq_k=None, heads_q=4, heads_kv=2, granularity="tensor"):
    """e4m3 q, k [.., 192] and v [.., 128] with their descales: ((q8, k8, v8), (dq, dk, dv))."""
    q, k, v = random_qkv(
        rng, batch=batch, seq_q=seq_q, seq_k=seq_k, heads_q=heads_q, heads_kv=heads_kv, head_dim=192,
        head_dim_v=128, dtype=jnp.float32,
    )  # fmt: skip
    q8, dq = fp8_quantize(q, granularity, kv_heads=heads_kv if granularity == "head" else None)
    k8, dk = fp8_quantize(k, granularity)
    v8, dv = fp8_quantize(v, granularity)
    return (q8, k8, v8), (dq, dk, dv)


def fp8_call(causal=False, window=None, implementation=None, lean_p=True):
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
            lean_p=lean_p,
            return_lse=True,
        )

    return fn


def test_the_kill_switch_keeps_fp8_mla_on_the_pure_jax_path(rng, monkeypatch):
    """Off (the kill switch): implementation=None runs FP8 MLA on the pure-JAX path (lowered for CUDA: no
    FP8 custom call), and implementation="kernel" names the gate and its variable."""
    assert api.FP8_MLA_KERNEL_VERIFIED is True  # verified on an H200 on 2026-12-01
    monkeypatch.setattr(api, "FP8_MLA_KERNEL_VERIFIED", False)
    assert not api.fp8_mla_kernel_enabled()
    (q8, k8, v8), (dq, dk, dv) = fp8_mla_qkv(rng, seq_q=40, seq_k=72)
    for causal in (False, True):
        assert api.choose_fp8_path(q8, k8, v8, causal, None, None) is api.Path.REFERENCE
        hlo = cuda_hlo(fp8_call(causal), Q, K, V, DESCALE, DESCALE, DESCALE)
        assert custom_call_lines(hlo, FFI_TARGET_FP8) == []
    with pytest.raises(
        ValueError,
        match=r"implementation='kernel' cannot serve this FP8 call: the FP8 kernel's MLA head dims "
        r"\(192, 128\).*FP8_MLA_KERNEL_VERIFIED is False.*JZYFA_UNVERIFIED_FP8_MLA_KERNEL=1",
    ):
        jzyfa.flash_attention(
            q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, causal=True, implementation="kernel"
        )
    # The pure-JAX path's answer has v's head dim.
    out = jzyfa.flash_attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, causal=True)
    assert out.shape == (1, 40, 4, 128) and out.dtype == jnp.bfloat16


@pytest.mark.usefixtures("fp8_mla_gate_variable")
def test_the_variable_lifts_the_gate_for_implementation_kernel_only(rng, monkeypatch):
    """With the kill switch off, the variable lets implementation="kernel" through; None stays pure-JAX."""
    monkeypatch.setattr(api, "FP8_MLA_KERNEL_VERIFIED", False)
    (q8, k8, v8), (dq, dk, dv) = fp8_mla_qkv(rng, seq_q=40, seq_k=72)
    assert api.fp8_mla_kernel_enabled()
    with monkeypatch.context() as mp:
        mp.setattr(api._platform, "kernel_available", lambda: True)
        for causal in (False, True):
            assert api.choose_fp8_path(q8, k8, v8, causal, None, "kernel") is api.Path.KERNEL_REQUIRED
            assert api.choose_fp8_path(q8, k8, v8, causal, None, None) is api.Path.REFERENCE
        hlo = cuda_hlo(fp8_call(True), Q, K, V, DESCALE, DESCALE, DESCALE)
        assert custom_call_lines(hlo, FFI_TARGET_FP8) == []
    # On the CPU a required kernel is then the platform's error, not the gate's.
    with pytest.raises(ValueError, match="non-CUDA platform"):
        jzyfa.flash_attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, implementation="kernel")
    # The whole FP8 kernel's gate still applies.
    monkeypatch.setattr(api, "FP8_KERNEL_VERIFIED", False)
    with pytest.raises(ValueError, match="has not passed its GPU tests"):
        jzyfa.flash_attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, implementation="kernel")


def test_verified_gate_runs_fp8_mla_on_the_primitive(rng, monkeypatch):
    """With FP8_MLA_KERNEL_VERIFIED on (the default), implementation=None takes the primitive wherever the
    kernel runs (on the CPU kernel_available is False: the pure-JAX path)."""
    (q8, k8, v8), _ = fp8_mla_qkv(rng, seq_q=40, seq_k=72)
    assert api.choose_fp8_path(q8, k8, v8, True, None, None) is api.Path.REFERENCE  # no kernel here
    monkeypatch.setattr(api._platform, "kernel_available", lambda: True)
    for causal in (False, True):
        assert api.choose_fp8_path(q8, k8, v8, causal, None, None) is api.Path.PRIMITIVE
        assert api.choose_fp8_path(q8, k8, v8, causal, None, "kernel") is api.Path.KERNEL_REQUIRED
    # The 16-bit kernel's MLA gate is not this one's.
    monkeypatch.setattr(api, "MLA_KERNEL_VERIFIED", False)
    assert api.choose_fp8_path(q8, k8, v8, True, None, None) is api.Path.PRIMITIVE
    hlo = cuda_hlo(fp8_call(True), Q, K, V, DESCALE, DESCALE, DESCALE)
    assert len(custom_call_lines(hlo, FFI_TARGET_FP8)) == 1


@pytest.mark.usefixtures("fp8_mla_gate_variable")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lean_p", [True, False])
def test_cuda_lowering_is_the_fp8_custom_call_with_v_head_dim(monkeypatch, causal, lean_p):
    """implementation="kernel", V staged (JZYFA_FP8_V_LAYOUT=staged; the default is the layout kernel
    until the staged kernels are verified): one FP8 call on V as it is (the kernel transposes V's tiles
    itself): q and k 192 wide, v and out 128, lse [B, Hq, Sq], the tile counter; no window; the default
    scale is 1/sqrt(192)."""
    monkeypatch.setenv("JZYFA_FP8_V_LAYOUT", "staged")
    window = (-1, 0) if causal else (-1, -1)
    assert fp8_value_layout(300, 8, 2, seq_k=500, head_dim=192, causal=causal, window=window) == "staged"
    hlo = cuda_hlo(fp8_call(causal, None, "kernel", lean_p), Q, K, V, DESCALE, DESCALE, DESCALE)
    (call,) = custom_call_lines(hlo, FFI_TARGET_FP8)
    assert "api_version=API_VERSION_TYPED_FFI" in call
    assert "(bf16[2,300,8,128]{3,2,1,0}, f32[2,8,300]{2,1,0}, s32[1]{0}) custom-call(" in call
    operands = re.search(r"operand_layout_constraints=\{(.*?)\}, api_version", call).group(1)
    assert re.findall(r"(?:f8e4m3fn|f32)\[[\d,]*\]", operands) == [
        "f8e4m3fn[2,300,8,192]",
        "f8e4m3fn[2,500,2,192]",
        "f8e4m3fn[2,500,2,128]",  # v as it is, its own head dim
        "f32[4]",
        "f32[4]",
        "f32[4]",
    ]
    assert len(re.findall(r"custom-call\(", hlo)) == 1  # no V layout pass before it
    assert f"causal = {str(causal).lower()}" in call and f"lean_p = {str(lean_p).lower()}" in call
    assert "window_left = -1 : i64" in call and "window_right = -1 : i64" in call
    (scale,) = re.findall(r"softmax_scale = ([-+.\de]+) : f32", call)
    assert np.float32(scale) == np.float32(1 / np.sqrt(192))


@pytest.mark.usefixtures("fp8_mla_gate_variable")
def test_windows_that_come_down_to_causal_or_none_reach_the_kernel():
    for causal, window in ((False, (8192, 0)), (True, (-1, 3)), (False, (499, 299))):
        hlo = cuda_hlo(fp8_call(causal, window, "kernel"), Q, K, V, DESCALE, DESCALE, DESCALE)
        (call,) = custom_call_lines(hlo, FFI_TARGET_FP8)
        assert "window_left = -1 : i64" in call and "window_right = -1 : i64" in call


@pytest.mark.usefixtures("fp8_mla_gate_variable")
def test_sliding_windows_stay_on_the_pure_jax_path_with_a_reason(rng, monkeypatch):
    """The FP8 kernel has no windowed MLA instantiation: whatever the gates say, None runs the pure-JAX
    path and "kernel" says why."""
    monkeypatch.setattr(api, "FP8_MLA_KERNEL_VERIFIED", True)
    monkeypatch.setattr(api._platform, "kernel_available", lambda: True)
    (q8, k8, v8), (dq, dk, dv) = fp8_mla_qkv(rng, seq_q=40, seq_k=72)
    problem = fp8_kernel_config_problem(q8, k8, v8, sliding=True)
    assert "MLA's head dims (192, 128)" in problem and "not a sliding window" in problem
    assert fp8_kernel_config_problem(q8, k8, v8) is None
    for causal, window in ((False, (8, 0)), (True, (16, 4)), (False, (-1, 5))):
        assert api.choose_fp8_path(q8, k8, v8, causal, window, None) is api.Path.REFERENCE
        with pytest.raises(ValueError, match=r"cannot serve this FP8 call: .*not a sliding window"):
            jzyfa.flash_attention(
                q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, causal=causal, window=window,
                implementation="kernel",
            )  # fmt: skip
    hlo = cuda_hlo(fp8_call(False, (16, 4)), Q, K, V, DESCALE, DESCALE, DESCALE)
    assert custom_call_lines(hlo, FFI_TARGET_FP8) == []
    out = jzyfa.flash_attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, window=(8, 0))
    assert out.shape == (1, 40, 4, 128)


@pytest.mark.usefixtures("fp8_mla_gate_variable")
@pytest.mark.parametrize(
    "head_dim, head_dim_v",
    [(192, 192), (192, 64), (128, 64), (64, 128), (128, 192), (256, 128)],
)
def test_other_head_dim_pairs_say_what_the_kernel_has(rng, head_dim, head_dim_v):
    q, k, v = random_qkv(rng, seq_q=8, head_dim=head_dim, head_dim_v=head_dim_v, dtype=jnp.float32)
    (q8, dq), (k8, dk), (v8, dv) = (fp8_quantize(x) for x in (q, k, v))
    message = rf"head dim 128 for q, k and v, or MLA's \(192, 128\) \(q/k, v\), got {head_dim}/{head_dim_v}"
    assert re.search(message, fp8_kernel_config_problem(q8, k8, v8))
    assert api.choose_fp8_path(q8, k8, v8, True, None, None) is api.Path.REFERENCE
    with pytest.raises(ValueError, match=f"cannot serve this FP8 call: .*{message}"):
        jzyfa.flash_attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, implementation="kernel")


def test_varlen_fp8_mla_is_refused_with_a_reason(rng):
    """flash_attention_varlen has no FP8 MLA (the FP8 varlen kernel is head dim 128 only)."""
    (q8, k8, v8), (dq, dk, dv) = fp8_mla_qkv(rng, seq_q=40, seq_k=40, heads_q=2, heads_kv=2)
    cu = jnp.asarray([0, 15, 40], jnp.int32)
    message = r"FP8 inputs with head_dim 128 for q, k and v only, got 192 \(q, k\)"
    with pytest.raises(ValueError, match=message):
        jzyfa.flash_attention_varlen(
            q8[0], k8[0], v8[0], cu, cu, 25, 25, descale_q=dq, descale_k=dk, descale_v=dv
        )


@pytest.mark.parametrize("lean_p", [True, False])
@pytest.mark.parametrize(
    "batch, seq_q, seq_k, heads_q, heads_kv, causal, granularity",
    [
        (2, 40, 40, 4, 2, True, "tensor"),
        (1, 30, 75, 2, 1, True, "head"),  # Sk > Sq and not a multiple of 32: padded V^T
        (1, 90, 20, 2, 2, True, "tensor"),  # Sq > Sk: the first rows see no key
        (1, 33, 130, 4, 1, False, "head"),
    ],
)
def test_primitive_off_cuda_is_the_emulation(
    rng, lean_p, batch, seq_q, seq_k, heads_q, heads_kv, causal, granularity
):
    (q8, k8, v8), descales = fp8_mla_qkv(
        rng, batch=batch, seq_q=seq_q, seq_k=seq_k, heads_q=heads_q, heads_kv=heads_kv,
        granularity=granularity,
    )  # fmt: skip
    scale = 192**-0.5
    fn = functools.partial(
        flash_attention_fp8_kernel, softmax_scale=scale, causal=causal, lean_p=lean_p, kernel_required=False
    )
    out, lse = jax.jit(fn)(q8, k8, v8, descales)
    want_out, want_lse = attention_fp8_emulated(
        q8, k8, v8, *descales, causal=causal, softmax_scale=scale, lean_p=lean_p, integer_reference=True
    )
    assert out.dtype == jnp.bfloat16 and out.shape == (batch, seq_q, heads_q, 128)
    assert lse.shape == (batch, heads_q, seq_q)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    if causal and seq_q > seq_k:
        assert np.all(np.isneginf(np.asarray(lse)[:, :, : seq_q - seq_k]))


def test_abstract_evals_and_vmap_keep_v_head_dim():
    """out takes v's head dim in the primitive's and the per-shard primitive's abstract evals (from V^T's
    rows where v is V^T); vmap folds into one call."""
    fn = functools.partial(
        flash_attention_fp8_kernel, softmax_scale=0.1, causal=True, lean_p=True, kernel_required=False
    )
    descales = (DESCALE,) * 3
    out, lse = jax.eval_shape(lambda q, k, v, *d: fn(q, k, v, d), Q, K, V, *descales)
    assert (out.shape, out.dtype, lse.shape) == ((2, 300, 8, 128), jnp.bfloat16, (2, 8, 300))
    d = jax.ShapeDtypeStruct((4,), jnp.float32)
    params = {
        "softmax_scale": 0.1,
        "causal": True,
        "window": (-1, -1),
        "lean_p": True,
        "kernel_required": False,
    }
    vt = jax.ShapeDtypeStruct((2, 2, 128, 512), F8)
    for v, v_transposed in ((V, False), (vt, True)):
        shard_out, shard_lse = flash_attention_fp8_shard_p.abstract_eval(
            Q, K, v, d, d, d, **params, v_transposed=v_transposed
        )[0]
        assert shard_out.shape == (2, 300, 8, 128) and shard_lse.shape == (2, 8, 300)

    stacked = [jax.ShapeDtypeStruct((3,) + x.shape, x.dtype) for x in (Q, K, V)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(api.UNVERIFIED_FP8_MLA_KERNEL_ENV, "1")
        vmapped = jax.vmap(fp8_call(True, None, "kernel"), in_axes=(0, 0, 0, None, None, None))
        for layout, v_shape in (("staged", "f8e4m3fn[6,500,2,128]"), ("transposed", "f8e4m3fn[6,2,128,512]")):
            mp.setenv(FP8_V_LAYOUT_ENV, layout)
            jax.clear_caches()  # the layout is read when the call is traced
            (call,) = custom_call_lines(cuda_hlo(vmapped, *stacked, *descales), FFI_TARGET_FP8)
            # v as it is, or V^T from the layout kernel: v's head dim 128 either way.
            for shape in ("bf16[6,300,8,128]", "f8e4m3fn[6,500,2,192]", v_shape):
                assert shape in call, (layout, shape)
