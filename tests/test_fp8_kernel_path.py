"""The FP8 kernel's JAX side on the CPU: the primitive's emulation lowering, its CUDA custom call, and
the choice of path. (The kernel itself: tests/test_fp8_kernel_gpu.py and tests/test_kernel_build.py.)"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import random_fp8_qkv
from hlo_utils import custom_call_lines
from test_extension import WIDE_MIN_KEYS

import jzyfa
from jzyfa import api, fp8_primitive
from jzyfa.fp8_emulation import attention_fp8_emulated
from jzyfa.fp8_primitive import (
    FFI_TARGET_FP8,
    FFI_TARGET_VALUE_OPERAND,
    FP8_KEY_BLOCK_ENV,
    FP8_STAGED_V_MAX_ROWS,
    FP8_V_LAYOUT_ENV,
    flash_attention_fp8_kernel,
    fp8_value_layout,
)
from jzyfa.quantize import fp8_quantize

pytestmark = pytest.mark.usefixtures("cpu_backend")


@pytest.mark.parametrize("lean_p", [True, False])
@pytest.mark.parametrize(
    "batch, seq_q, seq_k, heads_q, heads_kv, causal, granularity",
    [
        (2, 40, 40, 4, 2, True, "tensor"),
        (1, 30, 75, 2, 1, True, "head"),  # Sk > Sq and not a multiple of 32: a partial V tile
        (1, 90, 20, 2, 2, True, "tensor"),  # Sq > Sk: the first rows see no key
        (1, 33, 130, 2, 2, False, "head"),
    ],
)
def test_primitive_off_cuda_is_the_emulation(
    rng, lean_p, batch, seq_q, seq_k, heads_q, heads_kv, causal, granularity
):
    (q8, k8, v8), descales = random_fp8_qkv(
        rng,
        batch=batch,
        seq_q=seq_q,
        seq_k=seq_k,
        heads_q=heads_q,
        heads_kv=heads_kv,
        granularity=granularity,
    )
    scale = 128**-0.5
    out, lse = jax.jit(
        functools.partial(
            flash_attention_fp8_kernel,
            softmax_scale=scale,
            causal=causal,
            lean_p=lean_p,
            kernel_required=False,
        )
    )(q8, k8, v8, descales)
    want_out, want_lse = attention_fp8_emulated(
        q8, k8, v8, *descales, causal=causal, softmax_scale=scale, lean_p=lean_p, integer_reference=True
    )
    assert out.dtype == jnp.bfloat16 and out.shape == q8.shape and lse.shape == (batch, heads_q, seq_q)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    if causal and seq_q > seq_k:
        assert np.all(np.isneginf(np.asarray(lse)[:, :, : seq_q - seq_k]))


def test_mixed_descale_shapes_broadcast_to_per_head(rng):
    (q8, k8, v8), (dq, dk, dv) = random_fp8_qkv(rng, batch=2, seq_q=16, heads_q=2, granularity="head")
    mixed = (dq, jnp.float32(dk.max()), dv)
    out, _ = flash_attention_fp8_kernel(
        q8, k8, v8, mixed, softmax_scale=0.1, causal=True, lean_p=True, kernel_required=False
    )
    want, _ = attention_fp8_emulated(
        q8, k8, v8, *mixed, causal=True, softmax_scale=0.1, integer_reference=True
    )
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))


def test_cuda_lowering_is_the_fp8_custom_call(rng, monkeypatch):
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "staged")  # (the transposed default: test_v_layout_* below)
    (q8, k8, v8), descales = random_fp8_qkv(
        rng, batch=2, seq_q=40, seq_k=70, heads_q=4, heads_kv=2, granularity="head"
    )
    fn = functools.partial(
        flash_attention_fp8_kernel, softmax_scale=0.125, causal=True, lean_p=False, kernel_required=True
    )
    hlo = jax.jit(fn).trace(q8, k8, v8, descales).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")
    (call,) = [line for line in hlo.splitlines() if f'custom_call_target="{FFI_TARGET_FP8}"' in line]
    # Results: out bf16, lse, the tile counter; operands: q, k, V as it is (the kernel builds V^T in
    # shared memory: no layout pass before it), three descales.
    assert "(bf16[2,40,4,128]{3,2,1,0}, f32[2,4,40]{2,1,0}, s32[1]{0}) custom-call(" in call
    operands = "f8e4m3fn[2,40,4,128]{3,2,1,0}, f8e4m3fn[2,70,2,128]{3,2,1,0}, f8e4m3fn[2,70,2,128]{3,2,1,0}"
    assert f"operand_layout_constraints={{{operands}, f32[4]{{0}}, f32[4]{{0}}, f32[4]{{0}}}}" in call, call
    assert sum("custom-call(" in line for line in hlo.splitlines()) == 1, hlo
    assert call.count("f32[4]{0}") == 3  # per (batch, KV head) descales, flattened
    assert "causal = true" in call and "lean_p = false" in call and "v_transposed = false" in call
    assert re.search(r"softmax_scale = 1.250*e-01 : f32", call)


def lower_fp8_for_cuda(batch, seq_q, seq_k, heads_q, heads_kv, head_dim=128, causal=True):
    """The FP8 kernel path's HLO for CUDA from shapes alone (no arrays)."""
    e4m3 = jnp.float8_e4m3fn
    q = jax.ShapeDtypeStruct((batch, seq_q, heads_q, head_dim), e4m3)
    k = jax.ShapeDtypeStruct((batch, seq_k, heads_kv, head_dim), e4m3)
    v = jax.ShapeDtypeStruct((batch, seq_k, heads_kv, 128), e4m3)
    descales = tuple(jax.ShapeDtypeStruct((batch, heads_kv), jnp.float32) for _ in range(3))
    fn = functools.partial(
        flash_attention_fp8_kernel, softmax_scale=0.125, causal=causal, lean_p=True, kernel_required=True
    )
    return jax.jit(fn).trace(q, k, v, descales).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")


def assert_staged(hlo, v_shape):
    """One custom call, the FP8 kernel's, on V as it is (v_transposed = false)."""
    (call,) = [line for line in hlo.splitlines() if "custom-call(" in line]
    assert f'custom_call_target="{FFI_TARGET_FP8}"' in call, call
    assert "v_transposed = false" in call
    assert f"f8e4m3fn[{v_shape}]{{3,2,1,0}}, f32[" in call, call  # v's operand constraint, as it is


def assert_transposed(hlo, vt_shape):
    """The layout kernel's call on V, then the FP8 kernel's on its result (v_transposed = true)."""
    (layout,) = custom_call_lines(hlo, FFI_TARGET_VALUE_OPERAND)
    (call,) = custom_call_lines(hlo, FFI_TARGET_FP8)
    assert sum("custom-call(" in line for line in hlo.splitlines()) == 2, hlo
    assert f"f8e4m3fn[{vt_shape}]{{3,2,1,0}} custom-call(" in layout, layout
    operands = call.split("custom-call(")[1].split(")")[0].split(", ")
    assert operands[2] == layout.split("=")[0].strip()  # vt is the layout call's result
    assert "v_transposed = true" in call


@pytest.fixture
def key_block_rule(monkeypatch):
    """_extension.fp8_key_block replaced by the kernel's key-block rule as tests/test_extension.py pins it
    on the built extension (192-key blocks for head dim 128 with V^T, no window, from WIDE_MIN_KEYS),
    so that the layout rule's tests do not depend on whether this machine built the extension; yields
    the calls it answered."""
    calls = []

    def fp8_key_block(*, v_transposed, head_dim, causal, window, seq_q, seq_k):
        del seq_q  # the rule reads the keys a row sees
        calls.append(
            dict(v_transposed=v_transposed, head_dim=head_dim, causal=causal, window=window, seq_k=seq_k)
        )
        wide = v_transposed and head_dim == 128 and window[0] == -1 and seq_k >= WIDE_MIN_KEYS[causal]
        return 192 if wide else 128

    monkeypatch.setattr(fp8_primitive._extension, "fp8_key_block", fp8_key_block)
    yield calls


def layout_of(seq_q, seq_k, heads_q, heads_kv, head_dim=128, causal=True):
    """fp8_value_layout for a call of these shapes, the window as the FP8 primitive holds it."""
    window = (-1, 0) if causal else (-1, -1)
    kwargs = dict(seq_k=seq_k, head_dim=head_dim, causal=causal, window=window)
    return fp8_value_layout(seq_q, heads_q, heads_kv, **kwargs)


@pytest.mark.parametrize(
    "batch, seq_q, seq_k, heads_q, heads_kv, layout",
    [
        (16, 1024, 1024, 16, 16, "staged"),  # 1024 rows per KV head
        (1, 1024, 1024, 16, 8, "staged"),  # GQA: 2048 rows, the threshold
        (1, 1025, 1024, 16, 8, "transposed"),  # 2050 rows
        (4, 4096, 4096, 16, 16, "transposed"),
        (1, 16384, 16384, 16, 16, "transposed"),
        (1, 512, 16384, 32, 4, "transposed"),  # short q, 8 query heads per KV head: 4096 rows
        # 2048 rows, but they see enough keys for 192-key blocks, which only the V^T kernel has:
        (1, 512, 16384, 32, 8, "transposed"),  # a prefill chunk against a long cache
        (2, 2048, 8192, 16, 16, "transposed"),
        (2, 2048, 3072, 16, 16, "transposed"),
        (2, 2048, 3071, 16, 16, "staged"),  # 128-key blocks in either layout
    ],
)
def test_v_layout_follows_rows_per_kv_head_and_keys(
    monkeypatch, key_block_rule, batch, seq_q, seq_k, heads_q, heads_kv, layout
):
    """The rule, on by default (FP8_STAGED_V_VERIFIED): staged up to FP8_STAGED_V_MAX_ROWS rows per KV
    head unless the kernel given V^T would run 192-key blocks (docs/fp8.md 10.30, 10.31)."""
    monkeypatch.delenv(FP8_V_LAYOUT_ENV, raising=False)
    assert fp8_primitive.FP8_STAGED_V_VERIFIED is True
    assert layout_of(seq_q, seq_k, heads_q, heads_kv) == layout
    few_rows = seq_q * (heads_q // heads_kv) <= FP8_STAGED_V_MAX_ROWS
    assert (few_rows and seq_k < WIDE_MIN_KEYS[True]) == (layout == "staged")
    if layout == "transposed" and few_rows:  # the extension was asked about the V^T kernel for this call
        asked = dict(v_transposed=True, head_dim=128, causal=True, window=(-1, 0), seq_k=seq_k)
        assert key_block_rule[-1] == asked
    hlo = lower_fp8_for_cuda(batch, seq_q, seq_k, heads_q, heads_kv)
    if layout == "staged":
        assert_staged(hlo, f"{batch},{seq_k},{heads_kv},128")
    else:
        assert_transposed(hlo, f"{batch},{heads_kv},128,{-(-seq_k // 32) * 32}")


@pytest.mark.parametrize("seq_k, layout", [(1535, "staged"), (1536, "transposed")])
def test_v_layout_without_a_mask_takes_its_own_key_threshold(monkeypatch, key_block_rule, seq_k, layout):
    monkeypatch.delenv(FP8_V_LAYOUT_ENV, raising=False)
    assert layout_of(1024, seq_k, 16, 16, causal=False) == layout
    hlo = lower_fp8_for_cuda(1, 1024, seq_k, 16, 16, causal=False)
    if layout == "staged":
        assert_staged(hlo, f"1,{seq_k},16,128")
    else:
        assert_transposed(hlo, f"1,16,128,{-(-seq_k // 32) * 32}")


def test_v_layout_stays_staged_where_no_192_key_kernel_exists(monkeypatch, key_block_rule):
    """Few rows that see many keys, but MLA's head dims or a sliding window: the V^T kernel would run
    128-key blocks too, so V stays as it is."""
    monkeypatch.delenv(FP8_V_LAYOUT_ENV, raising=False)
    assert layout_of(512, 16384, 16, 16, head_dim=192) == "staged"
    assert key_block_rule[-1]["head_dim"] == 192  # asked, and the answer was 128
    window = (1023, 0)
    assert fp8_value_layout(512, 16, 16, seq_k=16384, head_dim=128, causal=True, window=window) == "staged"


def test_v_layout_kill_switch_sends_every_shape_to_the_transposed_kernels(monkeypatch):
    """With FP8_STAGED_V_VERIFIED switched off every shape takes the layout kernel and the V^T kernels,
    short calls included."""
    monkeypatch.delenv(FP8_V_LAYOUT_ENV, raising=False)
    monkeypatch.setattr(fp8_primitive, "FP8_STAGED_V_VERIFIED", False)
    assert layout_of(1024, 1024, 16, 16) == "transposed"
    assert_transposed(lower_fp8_for_cuda(16, 1024, 1024, 16, 16), "16,16,128,1024")


def test_v_layout_env_overrides_the_rule(monkeypatch):
    short, long = (2, 100, 70, 4, 2), (1, 8192, 8192, 8, 8)
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "transposed")
    assert_transposed(lower_fp8_for_cuda(*short), "2,2,128,96")
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "staged")
    assert_staged(lower_fp8_for_cuda(*long), "1,8192,8,128")
    # MLA's q/k 192 too: vt's rows are v's head dim (128).
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "transposed")
    assert_transposed(lower_fp8_for_cuda(1, 64, 100, 2, 2, head_dim=192), "1,2,128,128")


def test_v_layout_env_rejects_other_values(monkeypatch):
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "vt")
    with pytest.raises(ValueError, match=FP8_V_LAYOUT_ENV):
        lower_fp8_for_cuda(1, 64, 64, 2, 2)


@pytest.mark.parametrize("value", ["auto", "128", "192", ""])
def test_key_block_env_takes_auto_128_or_192(monkeypatch, value):
    """JZYFA_FP8_KEY_BLOCK is read by the launch (no trace-time effect: the same HLO), checked at trace
    time."""
    monkeypatch.setenv(FP8_KEY_BLOCK_ENV, value)
    assert_transposed(lower_fp8_for_cuda(1, 8192, 8192, 8, 8), "1,8,128,8192")


def test_key_block_env_rejects_other_values(monkeypatch):
    monkeypatch.setenv(FP8_KEY_BLOCK_ENV, "256")
    with pytest.raises(ValueError, match=f"{FP8_KEY_BLOCK_ENV} must be one of auto, 128, 192"):
        lower_fp8_for_cuda(1, 64, 64, 2, 2)


@pytest.mark.parametrize("layout", ["staged", "transposed"])
def test_both_v_layouts_are_the_emulation_off_cuda(rng, monkeypatch, layout):
    """Off CUDA the transposed layout round-trips V through fp8_value_operand: the same result."""
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, layout)
    (q8, k8, v8), descales = random_fp8_qkv(rng, batch=1, seq_q=30, seq_k=75, heads_q=2, heads_kv=1)
    out, lse = flash_attention_fp8_kernel(
        q8, k8, v8, descales, softmax_scale=0.125, causal=True, lean_p=True, kernel_required=False
    )
    want_out, want_lse = attention_fp8_emulated(
        q8, k8, v8, *descales, causal=True, softmax_scale=0.125, lean_p=True, integer_reference=True
    )
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))


def test_kernel_gate(rng, monkeypatch):
    """FP8_KERNEL_VERIFIED (on since the kernel passed its GPU tests) is a kill switch: off, FP8
    calls stay on the exact pure-JAX path and implementation="kernel" needs the variable."""
    (q8, k8, v8), (dq, dk, dv) = random_fp8_qkv(rng, seq_q=16, heads_q=2)
    call = functools.partial(jzyfa.flash_attention, descale_q=dq, descale_k=dk, descale_v=dv, causal=True)
    monkeypatch.delenv(api.UNVERIFIED_FP8_KERNEL_ENV, raising=False)
    assert api.FP8_KERNEL_VERIFIED
    assert api.choose_fp8_path(q8, k8, v8, True, None, "kernel") is api.Path.KERNEL_REQUIRED
    # Lowered for the CPU, a required kernel is an error, as for 16-bit inputs.
    with pytest.raises(ValueError, match="non-CUDA platform"):
        call(q8, k8, v8, implementation="kernel")

    monkeypatch.setattr(api, "FP8_KERNEL_VERIFIED", False)
    with pytest.raises(ValueError, match="has not passed its GPU tests"):
        call(q8, k8, v8, implementation="kernel")
    assert api.choose_fp8_path(q8, k8, v8, True, None, None) is api.Path.REFERENCE
    monkeypatch.setenv(api.UNVERIFIED_FP8_KERNEL_ENV, "1")
    assert api.choose_fp8_path(q8, k8, v8, True, None, "kernel") is api.Path.KERNEL_REQUIRED


@pytest.mark.parametrize(
    "shapes, kwargs, message",
    [
        (((1, 16, 2, 64), (1, 16, 2, 64)), {}, "head dim 128"),
        # With the windows' kill switch off (tests/test_fp8_window_kernel_path.py has the rest).
        (((1, 16, 2, 128), (1, 16, 2, 128)), {"window": (4, 0)}, "sliding windows are switched off"),
    ],
)
def test_kernel_refuses_what_it_cannot_serve(rng, monkeypatch, shapes, kwargs, message):
    monkeypatch.setenv(api.UNVERIFIED_FP8_KERNEL_ENV, "1")
    monkeypatch.setattr(api, "FP8_WINDOW_KERNEL_VERIFIED", False)
    monkeypatch.delenv(api.UNVERIFIED_FP8_WINDOW_KERNEL_ENV, raising=False)
    q_shape, kv_shape = shapes
    q8, dq = fp8_quantize(jnp.asarray(rng.standard_normal(q_shape), jnp.float32))
    k8, dk = fp8_quantize(jnp.asarray(rng.standard_normal(kv_shape), jnp.float32))
    with pytest.raises(ValueError, match=message):
        jzyfa.flash_attention(
            q8,
            k8,
            k8,
            descale_q=dq,
            descale_k=dk,
            descale_v=dk,
            causal=True,
            implementation="kernel",
            **kwargs,
        )


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_vmap_folds_into_the_batch(rng, granularity):
    """vmap over a leading axis (per-element descales too) equals a loop over it."""
    sets = [
        random_fp8_qkv(rng, batch=2, seq_q=24, seq_k=40, heads_q=2, heads_kv=1, granularity=granularity)
        for _ in range(3)
    ]
    stack = lambda i: jnp.stack([s[0][i] for s in sets])
    stack_d = lambda i: jnp.stack([s[1][i] for s in sets])
    call = functools.partial(
        flash_attention_fp8_kernel, softmax_scale=0.1, causal=True, lean_p=True, kernel_required=False
    )
    out, lse = jax.vmap(lambda q, k, v, dq, dk, dv: call(q, k, v, (dq, dk, dv)))(
        stack(0), stack(1), stack(2), stack_d(0), stack_d(1), stack_d(2)
    )
    for i, ((q8, k8, v8), descales) in enumerate(sets):
        want_out, want_lse = call(q8, k8, v8, descales)
        np.testing.assert_array_equal(np.asarray(out[i], np.float32), np.asarray(want_out, np.float32))
        np.testing.assert_array_equal(np.asarray(lse[i]), np.asarray(want_lse))


def test_vmap_with_shared_descales_and_unmapped_kv(rng):
    (q8, k8, v8), descales = random_fp8_qkv(rng, seq_q=16, seq_k=32, heads_q=2)
    qs = jnp.stack([q8, q8[:, ::-1]])
    call = functools.partial(
        flash_attention_fp8_kernel, softmax_scale=0.1, causal=False, lean_p=False, kernel_required=False
    )
    out, _ = jax.vmap(lambda q: call(q, k8, v8, descales))(qs)
    for i in range(2):
        want, _ = call(qs[i], k8, v8, descales)
        np.testing.assert_array_equal(np.asarray(out[i], np.float32), np.asarray(want, np.float32))
