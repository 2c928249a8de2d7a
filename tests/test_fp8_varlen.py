"""FP8 (e4m3) inputs to `flash_attention_varlen` on the CPU: argument checks, the pure-JAX path against
dense FP8 attention per sequence, the varlen V^T layout, the CUDA custom call (V as it is up to
FP8_VARLEN_STAGED_V_MAX_ROWS rows per KV head in the longest sequence, else V^T; JZYFA_FP8_V_LAYOUT
overrides) and the kernel's gate. (The
kernel itself: tests/test_fp8_varlen_kernel_gpu.py and tests/test_kernel_build.py.)"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import dequantized_f64, naive_varlen_f64, offsets, random_fp8_packed

import jzyfa
from jzyfa import api, fp8_primitive
from jzyfa.fp8_layout import (
    KEY_GROUP,
    KEY_PERMUTATION,
    fp8_varlen_value_operand,
    varlen_padded_keys,
    varlen_value_columns,
    varlen_value_from_operand,
)
from jzyfa.fp8_primitive import FFI_TARGET_VALUE_OPERAND, FP8_V_LAYOUT_ENV
from jzyfa.fp8_varlen_primitive import FFI_TARGET_FP8_VARLEN

pytestmark = pytest.mark.usefixtures("cpu_backend")

E4M3 = jnp.float8_e4m3fn


def spec(shape, dtype=E4M3):
    return jax.ShapeDtypeStruct(shape, dtype)


def call_varlen(q, k, v, cu_q, cu_k, descales, *, max_q=64, max_k=64, **kwargs):
    dq, dk, dv = descales
    return jzyfa.flash_attention_varlen(
        q, k, v, cu_q, cu_k, max_q, max_k, descale_q=dq, descale_k=dk, descale_v=dv, **kwargs
    )


SCALAR = spec((), jnp.float32)
GOOD = {"q": spec((10, 4, 128)), "k": spec((12, 2, 128)), "v": spec((12, 2, 128))}
CU = spec((3,), jnp.int32)


@pytest.mark.parametrize(
    "replace, descales, error, message",
    [
        ({}, (SCALAR, None, SCALAR), ValueError, "FP8 inputs need descale_q, descale_k and descale_v; missing descale_k"),
        ({}, (SCALAR, spec((2, 2), jnp.float32), spec((3, 2), jnp.float32)), ValueError,
         r"descale_v must have shape \(\), \(1,\) or \[num_seqs, kv_heads\] = \[2, 2\], got \(3, 2\)"),
        ({}, (SCALAR, SCALAR, spec((), jnp.bfloat16)), TypeError, "descale_v must be float32, got bfloat16"),
        ({n: spec(GOOD[n].shape, jnp.bfloat16) for n in "qkv"}, (SCALAR, None, None), ValueError,
         "descale_q given for bfloat16 inputs; descales apply only to FP8 inputs"),
        ({n: spec(GOOD[n].shape[:2] + (64,)) for n in "qkv"}, (SCALAR,) * 3, ValueError,
         r"FP8 inputs with head_dim 128 for q, k and v only, got 64 \(q, k\) and 64 \(v\)"),
        ({"v": spec((12, 2, 128), jnp.bfloat16)}, (SCALAR,) * 3, TypeError, "q, k and v must share a dtype"),
    ],
)  # fmt: skip
def test_bad_calls_raise(replace, descales, error, message):
    args = {**GOOD, **replace}
    descales = [None if d is None else jnp.zeros(d.shape, d.dtype) for d in descales]
    q, k, v = (jnp.zeros(args[n].shape, args[n].dtype) for n in "qkv")
    cu = jnp.asarray([0, 4, 10], jnp.int32)
    with pytest.raises(error, match=message):
        call_varlen(q, k, v, cu, jnp.asarray([0, 5, 12], jnp.int32), descales, max_q=6, max_k=7)


def dense_fp8_per_sequence(q8, k8, v8, descales, cu_q, cu_k, *, causal):
    """Each sequence alone through dense FP8 `flash_attention` (pure-JAX path): (out, lse) packed."""
    out = np.zeros(q8.shape, np.float32)
    lse = np.full((q8.shape[1], q8.shape[0]), -np.inf, np.float32)
    for s in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        if cu_q[s + 1] == cu_q[s] or cu_k[s + 1] == cu_k[s]:
            continue  # no query, or no key: out = 0, lse = -inf
        ds = [d if d.ndim < 2 else d[s : s + 1] for d in descales]
        o, l = jzyfa.flash_attention(
            q8[None, rows], k8[None, keys], v8[None, keys], causal=causal, return_lse=True,
            implementation="xla", descale_q=ds[0], descale_k=ds[1], descale_v=ds[2],
        )  # fmt: skip
        out[rows], lse[:, rows] = np.asarray(o[0], np.float32), np.asarray(l[0])
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
def test_pure_jax_path_is_dense_fp8_per_sequence(rng, causal, per_head):
    """Unequal lengths, a sequence with no query, one with queries but no key, tokens past the end."""
    lengths_q, lengths_k = [5, 0, 17, 3, 40], [9, 4, 30, 0, 33]
    (q8, k8, v8), descales, cu_q, cu_k = random_fp8_packed(
        rng, lengths_q, lengths_k, pad_q=3, per_head=per_head
    )
    fn = jax.jit(functools.partial(call_varlen, max_q=40, max_k=33, causal=causal, return_lse=True))
    out, lse = fn(q8, k8, v8, cu_q, cu_k, descales)
    assert out.dtype == jnp.bfloat16 and out.shape == q8.shape and lse.shape == (4, q8.shape[0])
    want_out, want_lse = dense_fp8_per_sequence(q8, k8, v8, descales, cu_q, cu_k, causal=causal)
    # The same float32 attention, summed in another order: bf16 outputs may differ by one rounding.
    np.testing.assert_allclose(np.asarray(out, np.float32), want_out, rtol=2**-7, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-6, atol=1e-6)
    # And against float64 on the dequantized values (out is bf16).
    f64 = [dequantized_f64(x, d, cu) for x, d, cu in zip((q8, k8, v8), descales, (cu_q, cu_k, cu_k))]
    ref_out, ref_lse = naive_varlen_f64(*f64, cu_q, cu_k, causal=causal)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref_out, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=1e-4, rtol=1e-5)


def test_sliding_window_pure_jax_path(rng):
    lengths = [50, 1, 70]
    (q8, k8, v8), descales, cu_q, cu_k = random_fp8_packed(rng, lengths, lengths, per_head=True)
    out = call_varlen(q8, k8, v8, cu_q, cu_k, descales, max_q=70, max_k=70, window=(8, 2))
    f64 = [dequantized_f64(x, d, cu) for x, d, cu in zip((q8, k8, v8), descales, (cu_q, cu_k, cu_k))]
    ref, _ = naive_varlen_f64(*f64, cu_q, cu_k, causal=False, window=(8, 2))
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=2e-2, rtol=2e-2)


def value_operand_np(v: np.ndarray, cu_k: np.ndarray) -> np.ndarray:
    """The varlen V^T built key by key: sequence s's key j at column roundup32(cu_k[s]) + 32 s + the
    column of j in its permuted group; zeros elsewhere."""
    total_k, heads_kv, head_dim = v.shape
    num_seqs = len(cu_k) - 1
    vt = np.zeros((heads_kv, head_dim, varlen_padded_keys(total_k, num_seqs)), v.dtype)
    column_of = np.argsort(KEY_PERMUTATION)  # column k of a group holds key KEY_PERMUTATION[k]
    for s in range(num_seqs):
        start = -(-cu_k[s] // 32) * 32 + 32 * s
        for j in range(cu_k[s + 1] - cu_k[s]):
            vt[:, :, start + 32 * (j // 32) + column_of[j % 32]] = v[cu_k[s] + j]
    return vt


@pytest.mark.parametrize(
    "lengths",
    [[1, 63, 64, 65, 0, 127, 129], [32, 32], [0, 0, 5], [300], [31, 33, 0]],
)
def test_varlen_value_operand(rng, lengths):
    cu_k = offsets(lengths)
    v = rng.integers(1, 256, (int(cu_k[-1]), 2, 128), dtype=np.uint8)  # no zero bytes: gaps show
    v = v & np.uint8(0x7E) | np.uint8(1)  # no NaN codes (0x7F, 0xFF) either
    v8 = jnp.asarray(v).view(E4M3)
    vt = jax.jit(fp8_varlen_value_operand)(v8, cu_k)
    np.testing.assert_array_equal(np.asarray(vt.view(jnp.uint8)), value_operand_np(v, cu_k))
    # Every sequence starts on a 32-key group; ranges never overlap and stay inside the buffer.
    starts = np.asarray(varlen_value_columns(jnp.asarray(cu_k)))
    assert np.all(starts % KEY_GROUP == 0)
    ends = starts + np.diff(cu_k)
    assert np.all(ends[:-1] <= starts[1:]) and ends[-1] <= vt.shape[2]
    # And back: every token from its one column.
    back = jax.jit(varlen_value_from_operand, static_argnums=2)(vt, cu_k, int(cu_k[-1]))
    np.testing.assert_array_equal(np.asarray(back.view(jnp.uint8)), v)


def test_value_operand_with_traced_offsets():
    """One compiled program serves every packing with the same totals."""
    v8 = jnp.asarray(np.arange(1, 41, dtype=np.uint8).reshape(40, 1, 1).repeat(128, axis=2)).view(E4M3)
    fn = jax.jit(fp8_varlen_value_operand)
    for lengths in ([10, 30], [40, 0], [0, 40]):
        cu = offsets(lengths)
        want = value_operand_np(np.asarray(v8.view(jnp.uint8)), cu)
        np.testing.assert_array_equal(np.asarray(fn(v8, jnp.asarray(cu)).view(jnp.uint8)), want)


def fp8_varlen_custom_calls(
    implementation, window=None, per_head=False, causal=True, target=FFI_TARGET_FP8_VARLEN
) -> list[str]:
    """The custom calls to `target` of an FP8 flash_attention_varlen lowered for CUDA (on this CPU host)."""
    descale = spec((2, 2) if per_head else (), jnp.float32)
    fn = functools.partial(
        call_varlen,
        max_q=200,
        max_k=260,
        causal=causal,
        window=window,
        implementation=implementation,
        return_lse=True,
        softmax_scale=0.25,
    )
    args = (GOOD["q"], GOOD["k"], GOOD["v"], CU, CU, (descale,) * 3)
    hlo = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")
    return [line for line in hlo.splitlines() if "custom-call(" in line and f'"{target}"' in line]


@pytest.mark.parametrize("layout", [None, "transposed", "staged"])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize(
    "window, causal_attr, bounds", [(None, "true", (-1, -1)), ((16, 0), "false", (16, 0))]
)
def test_cuda_lowering_is_the_fp8_varlen_custom_call(
    monkeypatch, layout, per_head, window, causal_attr, bounds
):
    """By default (400 rows per KV head: the rule stages V) and with JZYFA_FP8_V_LAYOUT=staged the kernel
    alone on V as it is; with JZYFA_FP8_V_LAYOUT=transposed V's varlen V^T first (a gather, then the
    layout kernel), then the kernel with v_transposed."""
    monkeypatch.setenv(api.UNVERIFIED_FP8_VARLEN_KERNEL_ENV, "1")
    if layout is not None:
        monkeypatch.setenv(FP8_V_LAYOUT_ENV, layout)
    staged = layout != "transposed"
    (call,) = fp8_varlen_custom_calls("kernel", window, per_head)
    assert f'custom_call_target="{FFI_TARGET_FP8_VARLEN}"' in call
    # q, k, v as it is [12, 2, 128] (staged) or the varlen V^T [Hkv, 128, roundup32(12) + 32 * 3], the
    # offsets, three descales [2 * 2].
    v_operand = "f8e4m3fn[12,2,128]{2,1,0}" if staged else "f8e4m3fn[2,128,128]{2,1,0}"
    operands = f"f8e4m3fn[10,4,128]{{2,1,0}}, f8e4m3fn[12,2,128]{{2,1,0}}, {v_operand}, "
    operands += "s32[3]{0}, s32[3]{0}, f32[4]{0}, f32[4]{0}, f32[4]{0}"
    assert f"operand_layout_constraints={{{operands}}}" in call, call
    assert re.search(r"bf16\[10,4,128\]\{2,1,0\}, f32\[4,10\]\{1,0\}, s32\[1\]", call)
    assert f"causal = {causal_attr}" in call
    assert f"window_left = {bounds[0]} : i64" in call and f"window_right = {bounds[1]} : i64" in call
    assert "max_seqlen_q = 200 : i64" in call and "max_seqlen_k = 260 : i64" in call
    assert re.search(r"softmax_scale = 2.50*e-01 : f32", call)
    assert f"v_transposed = {str(not staged).lower()}" in call, call
    layouts = fp8_varlen_custom_calls("kernel", window, per_head, target=FFI_TARGET_VALUE_OPERAND)
    if staged:
        assert not layouts  # no V layout pass before the kernel
    else:
        # V's layout: token rows gathered into the sequences' columns, then the dense layout's kernel
        # over them as one batch of 128 keys.
        (layout_call,) = layouts
        assert "operand_layout_constraints={f8e4m3fn[1,128,2,128]{3,2,1,0}}" in layout_call, layout_call


@pytest.mark.parametrize(
    "max_seqlen_q, heads_q, heads_kv, layout",
    [
        (8192, 16, 16, "staged"),  # the bench's batch (8192, 4096, ..., 64): measured 701 vs 633 TFLOP/s
        (4096, 16, 8, "staged"),  # GQA: 8192 rows, the threshold
        (8193, 16, 16, "transposed"),
        (2048, 32, 4, "transposed"),  # 8 query heads per KV head: 16384 rows
        (32768, 16, 16, "transposed"),
    ],
)
def test_varlen_v_layout_follows_rows_per_kv_head(monkeypatch, max_seqlen_q, heads_q, heads_kv, layout):
    """The varlen rule (FP8_VARLEN_STAGED_V_MAX_ROWS on the longest sequence's rows per KV head), its kill
    switch and the override."""
    monkeypatch.delenv(FP8_V_LAYOUT_ENV, raising=False)
    assert fp8_primitive.fp8_varlen_value_layout(max_seqlen_q, heads_q, heads_kv) == layout
    rows = max_seqlen_q * (heads_q // heads_kv)
    assert (rows <= fp8_primitive.FP8_VARLEN_STAGED_V_MAX_ROWS) == (layout == "staged")
    monkeypatch.setattr(fp8_primitive, "FP8_STAGED_V_VERIFIED", False)
    assert fp8_primitive.fp8_varlen_value_layout(max_seqlen_q, heads_q, heads_kv) == "transposed"
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "staged")
    assert fp8_primitive.fp8_varlen_value_layout(max_seqlen_q, heads_q, heads_kv) == "staged"


def test_cuda_lowering_rejects_an_unknown_layout(monkeypatch):
    monkeypatch.setenv(api.UNVERIFIED_FP8_VARLEN_KERNEL_ENV, "1")
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "sideways")
    with pytest.raises(ValueError, match=FP8_V_LAYOUT_ENV):
        fp8_varlen_custom_calls("kernel")


def test_gate(rng, monkeypatch):
    """FP8_VARLEN_KERNEL_VERIFIED is on since the GPU tests passed; its kill switch off, implementation=None
    runs the pure-JAX path (kernel or not), and "kernel" needs the variable."""
    assert api.FP8_VARLEN_KERNEL_VERIFIED  # tests/test_fp8_varlen_kernel_gpu.py on an H200, 2026-12-01
    monkeypatch.setattr(api, "FP8_VARLEN_KERNEL_VERIFIED", False)
    (q8, k8, v8), descales, cu_q, cu_k = random_fp8_packed(rng, [7, 0, 12], [7, 3, 12])
    monkeypatch.delenv(api.UNVERIFIED_FP8_VARLEN_KERNEL_ENV, raising=False)
    monkeypatch.setattr(api._platform, "kernel_available", lambda: True)
    choose = functools.partial(api.choose_fp8_varlen_path, q8, k8, 3, 12)
    with pytest.raises(
        ValueError, match=r"FP8_VARLEN_KERNEL_VERIFIED is False.*JZYFA_UNVERIFIED_FP8_VARLEN_KERNEL=1"
    ):
        call_varlen(q8, k8, v8, cu_q, cu_k, descales, max_q=12, max_k=12, implementation="kernel")
    assert choose((-1, 0), None) is api.Path.REFERENCE
    assert fp8_varlen_custom_calls(None) == []
    monkeypatch.setenv(api.UNVERIFIED_FP8_VARLEN_KERNEL_ENV, "1")
    assert choose((-1, 0), None) is api.Path.REFERENCE  # the variable serves "kernel" only
    for window in ((-1, 0), (-1, -1), (4, 0)):
        assert choose(window, "kernel") is api.Path.KERNEL_REQUIRED
    # The variable lifts the gate: on the CPU a required kernel is then the platform's error.
    with pytest.raises(ValueError, match="non-CUDA platform"):
        call_varlen(q8, k8, v8, cu_q, cu_k, descales, max_q=12, max_k=12, implementation="kernel")
    # Verified, implementation=None takes the kernel where it is available.
    monkeypatch.delenv(api.UNVERIFIED_FP8_VARLEN_KERNEL_ENV)
    monkeypatch.setattr(api, "FP8_VARLEN_KERNEL_VERIFIED", True)
    assert choose((-1, 0), None) is api.Path.PRIMITIVE
    (call,) = fp8_varlen_custom_calls(None)
    assert FFI_TARGET_FP8_VARLEN in call
    monkeypatch.setattr(api._platform, "kernel_available", lambda: False)
    assert choose((-1, 0), None) is api.Path.REFERENCE


def test_primitive_off_cuda_is_the_pure_jax_path(rng, monkeypatch):
    """The primitive's non-CUDA lowering (what implementation=None runs once verified, on a CPU with the
    kernel faked available) equals the pure-JAX path."""
    (q8, k8, v8), descales, cu_q, cu_k = random_fp8_packed(
        rng, [7, 0, 12], [9, 3, 12], pad_q=2, per_head=True
    )
    want = call_varlen(q8, k8, v8, cu_q, cu_k, descales, max_q=12, max_k=12, causal=True, return_lse=True)
    monkeypatch.setattr(api, "FP8_VARLEN_KERNEL_VERIFIED", True)
    monkeypatch.setattr(api._platform, "kernel_available", lambda: True)
    got = call_varlen(q8, k8, v8, cu_q, cu_k, descales, max_q=12, max_k=12, causal=True, return_lse=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
