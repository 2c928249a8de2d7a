"""The wide head dims (256, and MLA's 192 for q/k with 128 for v) under sliding windows and over varlen
batches, the JAX side on the CPU: their gates (WIDE_WINDOW_KERNEL_VERIFIED and WIDE_VARLEN_KERNEL_VERIFIED, on
since tests/test_wide_kernels_gpu.py passed on an H200; kill switches, with their variables), head dim 256's own gate over all
of it, the CUDA custom calls they lower to, and the primitives' reference lowerings. (The kernels themselves:
tests/test_wide_kernels_gpu.py and tests/test_kernel_build.py.)"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64, naive_varlen_f64
from hlo_utils import cuda_hlo, custom_call_lines

import jzyfa
from jzyfa import api
from jzyfa.primitive import FFI_TARGET
from jzyfa.varlen_primitive import FFI_TARGET_VARLEN, varlen_kernel_config_problem

pytestmark = pytest.mark.usefixtures("cpu_backend")

HEAD_DIMS = {"hd256": (256, 256), "mla": (192, 128)}  # (q/k, v)
WIDE_WINDOW_GATE = (
    r"sliding windows at the wide head dims.*WIDE_WINDOW_KERNEL_VERIFIED is False.*"
    + re.escape("JZYFA_UNVERIFIED_WIDE_WINDOW_KERNEL=1")
)
WIDE_VARLEN_GATE = (
    r"varlen batches at the wide head dims.*WIDE_VARLEN_KERNEL_VERIFIED is False.*"
    + re.escape("JZYFA_UNVERIFIED_WIDE_VARLEN_KERNEL=1")
)
# The gates' values as shipped, read before any fixture switches them.
SHIPPED_GATES = (api.WIDE_WINDOW_KERNEL_VERIFIED, api.WIDE_VARLEN_KERNEL_VERIFIED)
# (causal, window) pairs that stay sliding windows over 300 queries and 500 keys.
SLIDING = [(False, (8, 0)), (True, (16, 16)), (False, (-1, 5)), (False, (128, 64))]


@pytest.fixture(autouse=True)
def no_gate_variables(monkeypatch):
    """Every test starts with the variables unset, head dim 256's own gate on and the wide kill switches OFF,
    so that what is tested is the wide gates and their variables; tests of the verified default path turn
    them on, tests of the hd256 gate switch it off."""
    for env in (
        api.UNVERIFIED_HD256_KERNEL_ENV,
        api.UNVERIFIED_MLA_KERNEL_ENV,
        api.UNVERIFIED_WINDOW_KERNEL_ENV,
        api.UNVERIFIED_VARLEN_KERNEL_ENV,
        api.UNVERIFIED_WIDE_WINDOW_KERNEL_ENV,
        api.UNVERIFIED_WIDE_VARLEN_KERNEL_ENV,
    ):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(api, "HD256_KERNEL_VERIFIED", True)
    monkeypatch.setattr(api, "WIDE_WINDOW_KERNEL_VERIFIED", False)
    monkeypatch.setattr(api, "WIDE_VARLEN_KERNEL_VERIFIED", False)


@pytest.fixture(params=list(HEAD_DIMS))
def head_dims(request) -> tuple[int, int]:
    return HEAD_DIMS[request.param]


def dense_specs(head_dims, dtype=jnp.bfloat16):
    qk, dv = head_dims
    shapes = [(2, 300, 8, qk), (2, 500, 2, qk), (2, 500, 2, dv)]
    return tuple(jax.ShapeDtypeStruct(s, dtype) for s in shapes)


def packed_specs(head_dims, dtype=jnp.bfloat16):
    qk, dv = head_dims
    shapes = [(300, 8, qk), (500, 2, qk), (500, 2, dv)]
    cu = jax.ShapeDtypeStruct((4,), jnp.int32)
    return (*(jax.ShapeDtypeStruct(s, dtype) for s in shapes), cu, cu)


def dense_calls(head_dims, **kwargs) -> list[str]:
    return custom_call_lines(
        cuda_hlo(functools.partial(jzyfa.flash_attention, **kwargs), *dense_specs(head_dims)), FFI_TARGET
    )


def varlen_calls(head_dims, **kwargs) -> list[str]:
    fn = functools.partial(jzyfa.flash_attention_varlen, max_seqlen_q=200, max_seqlen_k=260, **kwargs)
    return custom_call_lines(cuda_hlo(fn, *packed_specs(head_dims)), FFI_TARGET_VARLEN)


def test_the_wide_gates_are_on_since_verified_and_switch_off():
    assert SHIPPED_GATES == (True, True)  # tests/test_wide_kernels_gpu.py on an H200, 2026-12-01
    assert api.UNVERIFIED_WIDE_WINDOW_KERNEL_ENV == "JZYFA_UNVERIFIED_WIDE_WINDOW_KERNEL"
    assert api.UNVERIFIED_WIDE_VARLEN_KERNEL_ENV == "JZYFA_UNVERIFIED_WIDE_VARLEN_KERNEL"
    assert not api.wide_window_kernel_enabled() and not api.wide_varlen_kernel_enabled()


@pytest.mark.parametrize("causal, window", SLIDING)
def test_dense_windows_fall_back_and_kernel_names_the_gate(head_dims, causal, window):
    q, k, v = dense_specs(head_dims)
    assert api.choose_path(q, k, v, 0.1, causal, window, None) is api.Path.REFERENCE
    assert dense_calls(head_dims, causal=causal, window=window) == []
    with pytest.raises(ValueError, match="cannot serve this call: the kernel's " + WIDE_WINDOW_GATE):
        api.choose_path(q, k, v, 0.1, causal, window, "kernel")
    # Causal or none, and windows that come down to them over these lengths, are not gated.
    (call,) = dense_calls(head_dims, window=(8192, 0))
    assert "causal = true" in call and "window_left = -1 : i64" in call
    # Nor are the windows of head dims 64 and 128.
    q, k, v = dense_specs((128, 128))
    assert api.choose_path(q, k, v, 0.1, causal, window, None) is api.Path.PRIMITIVE


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    "causal, window, bounds",
    [(False, (128, 0), (128, 0)), (True, (300, 64), (300, 0)), (False, (-1, 100), (-1, 100))],
)
def test_the_window_variable_lowers_dense_windows_to_the_custom_call(
    monkeypatch, head_dims, dtype, causal, window, bounds
):
    """With the variable, implementation="kernel" is the dense custom call with the window's bounds (causal
    sets the right one to 0) and the causal flag off; None stays on the pure-JAX path until verified."""
    monkeypatch.setenv(api.UNVERIFIED_WIDE_WINDOW_KERNEL_ENV, "1")
    qk, dv = head_dims
    t = "bf16" if dtype == jnp.bfloat16 else "f16"
    fn = functools.partial(jzyfa.flash_attention, causal=causal, window=window, implementation="kernel")
    (call,) = custom_call_lines(cuda_hlo(fn, *dense_specs(head_dims, dtype)), FFI_TARGET)
    assert f"({t}[2,300,8,{dv}]{{3,2,1,0}}, f32[2,8,300]{{2,1,0}}, s32[1]{{0}}) custom-call(" in call
    operands = re.search(r"operand_layout_constraints=\{(.*?)\}, api_version", call).group(1)
    assert re.findall(rf"{t}\[[\d,]+\]", operands) == [
        f"{t}[2,300,8,{qk}]",
        f"{t}[2,500,2,{qk}]",
        f"{t}[2,500,2,{dv}]",
    ]
    assert "causal = false" in call
    assert f"window_left = {bounds[0]} : i64" in call and f"window_right = {bounds[1]} : i64" in call
    assert dense_calls(head_dims, causal=causal, window=window) == []  # None: the pure-JAX path


def test_head_dim_256s_gate_covers_its_windows(monkeypatch):
    """The wide variable does not lift hd256's own gate: with HD256_KERNEL_VERIFIED off, its windows need
    both variables."""
    monkeypatch.setattr(api, "HD256_KERNEL_VERIFIED", False)
    monkeypatch.setenv(api.UNVERIFIED_WIDE_WINDOW_KERNEL_ENV, "1")
    q, k, v = dense_specs(HEAD_DIMS["hd256"])
    with pytest.raises(ValueError, match="head_dim 256 is switched off .*JZYFA_UNVERIFIED_HD256_KERNEL=1"):
        api.choose_path(q, k, v, 0.1, False, (8, 0), "kernel")
    monkeypatch.setenv(api.UNVERIFIED_HD256_KERNEL_ENV, "1")
    assert api.choose_path(q, k, v, 0.1, False, (8, 0), "kernel") is api.Path.KERNEL_REQUIRED
    assert api.choose_path(q, k, v, 0.1, False, (8, 0), None) is api.Path.REFERENCE


def test_verified_windows_are_the_default_path(rng, monkeypatch, head_dims):
    """Once WIDE_WINDOW_KERNEL_VERIFIED is True, implementation=None takes the kernel: its custom call lowered
    for CUDA, the primitive's reference lowering on the CPU (against float64; a row with no key: O = 0,
    LSE = -inf)."""
    monkeypatch.setattr(api, "WIDE_WINDOW_KERNEL_VERIFIED", True)
    (call,) = dense_calls(head_dims, window=(8, 0))
    assert "window_left = 8 : i64" in call and "window_right = 0 : i64" in call
    qk, dv = head_dims
    shapes = [(1, 20, 4, qk), (1, 12, 2, qk), (1, 12, 2, dv)]
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in shapes)
    fn = functools.partial(jzyfa.flash_attention, window=(2, 1), return_lse=True)  # rows 0-6 see no key
    assert FFI_TARGET in str(jax.make_jaxpr(fn)(q, k, v))  # the primitive, bound
    out, lse = jax.jit(fn)(q, k, v)
    want_out, want_lse = naive_attention_f64(
        *(np.asarray(x, np.float32) for x in (q, k, v)), causal=False, softmax_scale=qk**-0.5, window=(2, 1)
    )
    assert out.shape == (1, 20, 4, dv)
    np.testing.assert_allclose(np.asarray(out, np.float64), want_out, atol=2e-2)
    np.testing.assert_allclose(lse, want_lse, atol=1e-4)
    assert np.isneginf(np.asarray(lse)[:, :, :7]).all() and not np.asarray(out[:, :7], np.float32).any()


@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (8, 0)])
def test_varlen_falls_back_and_kernel_names_the_gate(monkeypatch, head_dims, window):
    """Even where the kernel is available (faked), varlen batches at the wide head dims stay on the pure-JAX
    path while the varlen gate is off; implementation="kernel" names it."""
    monkeypatch.setattr(api._platform, "kernel_available", lambda: True)
    q, k, v, _, _ = packed_specs(head_dims)
    assert varlen_kernel_config_problem(q, k, v, 3, 200, 0.1, window) is None  # the kernel has them
    assert api.choose_varlen_path(q, k, v, 3, 200, 0.1, window, None) is api.Path.REFERENCE
    with pytest.raises(ValueError, match="cannot serve this varlen call: the kernel's " + WIDE_VARLEN_GATE):
        api.choose_varlen_path(q, k, v, 3, 200, 0.1, window, "kernel")
    assert varlen_calls(head_dims, window=window) == []
    # Head dims 64 and 128 are not gated.
    q, k, v, _, _ = packed_specs((128, 128))
    assert api.choose_varlen_path(q, k, v, 3, 200, 0.1, window, None) is api.Path.PRIMITIVE


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_the_varlen_variable_lowers_to_the_varlen_custom_call(monkeypatch, head_dims, dtype, causal):
    """With the variable, implementation="kernel" is the varlen custom call: q and k qk wide, v and out dv,
    lse [Hq, total_q]; a sliding window needs the window variable as well."""
    monkeypatch.setenv(api.UNVERIFIED_WIDE_VARLEN_KERNEL_ENV, "1")
    qk, dv = head_dims
    t = "bf16" if dtype == jnp.bfloat16 else "f16"
    fn = functools.partial(
        jzyfa.flash_attention_varlen,
        max_seqlen_q=200,
        max_seqlen_k=260,
        causal=causal,
        implementation="kernel",
    )
    (call,) = custom_call_lines(cuda_hlo(fn, *packed_specs(head_dims, dtype)), FFI_TARGET_VARLEN)
    assert f"({t}[300,8,{dv}]{{2,1,0}}, f32[8,300]{{1,0}}, s32[1]{{0}}) custom-call(" in call
    operands = re.search(r"operand_layout_constraints=\{(.*?)\}, api_version", call).group(1)
    assert re.findall(rf"(?:{t}|s32)\[[\d,]+\]", operands) == [
        f"{t}[300,8,{qk}]",
        f"{t}[500,2,{qk}]",
        f"{t}[500,2,{dv}]",
        "s32[4]",
        "s32[4]",
    ]
    assert f"causal = {str(causal).lower()}" in call and "window_left = -1 : i64" in call
    assert varlen_calls(head_dims, causal=causal) == []  # None: the pure-JAX path until verified
    # A sliding window: the window gate too.
    with pytest.raises(ValueError, match=WIDE_WINDOW_GATE):
        varlen_calls(head_dims, causal=causal, window=(100, 30), implementation="kernel")
    monkeypatch.setenv(api.UNVERIFIED_WIDE_WINDOW_KERNEL_ENV, "1")
    (call,) = varlen_calls(head_dims, causal=causal, window=(100, 30), implementation="kernel")
    assert "causal = false" in call and "window_left = 100 : i64" in call
    assert f"window_right = {0 if causal else 30} : i64" in call


def test_head_dim_256s_gate_covers_its_varlen_batches(monkeypatch):
    monkeypatch.setattr(api, "HD256_KERNEL_VERIFIED", False)
    monkeypatch.setenv(api.UNVERIFIED_WIDE_VARLEN_KERNEL_ENV, "1")
    q, k, v, _, _ = packed_specs(HEAD_DIMS["hd256"])
    with pytest.raises(
        ValueError, match="cannot serve this varlen call: the kernel's head_dim 256 is switched off"
    ):
        api.choose_varlen_path(q, k, v, 3, 200, 0.1, (-1, 0), "kernel")
    monkeypatch.setenv(api.UNVERIFIED_HD256_KERNEL_ENV, "1")
    assert api.choose_varlen_path(q, k, v, 3, 200, 0.1, (-1, 0), "kernel") is api.Path.KERNEL_REQUIRED


def test_verified_varlen_is_the_default_path(rng, monkeypatch, head_dims):
    """Once both wide gates are set, implementation=None takes the varlen kernel where it is available, and
    the primitive's CPU lowering (the reference) serves the call: against float64 per sequence, with an
    empty sequence, a one-token one and tokens past cu_seqlens_q[-1] (O = 0, LSE = -inf)."""
    monkeypatch.setattr(api, "WIDE_VARLEN_KERNEL_VERIFIED", True)
    monkeypatch.setattr(api, "WIDE_WINDOW_KERNEL_VERIFIED", True)
    monkeypatch.setattr(api._platform, "kernel_available", lambda: True)
    for window in ((-1, 0), (8, 4)):
        (call,) = varlen_calls(head_dims, window=window)
        assert FFI_TARGET_VARLEN in call
    qk, dv = head_dims
    lengths_q, lengths_k, pad = [5, 0, 17, 1], [5, 3, 0, 30], 3
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    shapes = [(sum(lengths_q) + pad, 4, qk), (sum(lengths_k), 2, qk), (sum(lengths_k), 2, dv)]
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float16) for s in shapes)
    fn = functools.partial(
        jzyfa.flash_attention_varlen, max_seqlen_q=17, max_seqlen_k=30, window=(6, 2), return_lse=True
    )
    assert FFI_TARGET_VARLEN in str(jax.make_jaxpr(fn)(q, k, v, cu_q, cu_k))
    out, lse = jax.jit(fn)(q, k, v, cu_q, cu_k)
    want_out, want_lse = naive_varlen_f64(
        q, k, v, cu_q, cu_k, causal=False, softmax_scale=qk**-0.5, window=(6, 2)
    )
    assert out.shape == (q.shape[0], 4, dv)
    np.testing.assert_allclose(np.asarray(out, np.float64), want_out, atol=2e-2)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], want_lse[finite], atol=1e-3)
    assert not np.asarray(out[-pad:], np.float32).any() and np.isneginf(np.asarray(lse)[:, -pad:]).all()


@pytest.mark.parametrize(
    "head_dim, head_dim_v, dtype, message",
    [
        (192, 192, jnp.bfloat16, r"head_dim in \(64, 128, 256\), got 192 \(and MLA's \(192, 128\)"),
        (96, 96, jnp.bfloat16, r"head_dim in \(64, 128, 256\), got 96"),
        (256, 128, jnp.bfloat16, r"v's head_dim equal to q's and k's \(256\), got 128"),
        (192, 128, jnp.float32, "bf16 or f16 inputs, got float32"),
        (256, 256, jnp.float32, "bf16 or f16 inputs, got float32"),
    ],
)
def test_what_the_varlen_kernel_still_refuses(monkeypatch, head_dim, head_dim_v, dtype, message):
    """Other head dims and float32 stay on the pure-JAX path, gates or not, with the reason."""
    monkeypatch.setenv(api.UNVERIFIED_WIDE_VARLEN_KERNEL_ENV, "1")
    q, k, v, _, _ = packed_specs((head_dim, head_dim_v), dtype)
    assert re.search(message, varlen_kernel_config_problem(q, k, v, 3, 200, 0.1, (-1, 0)))
    with pytest.raises(ValueError, match="cannot serve this varlen call: .*" + message):
        api.choose_varlen_path(q, k, v, 3, 200, 0.1, (-1, 0), "kernel")
