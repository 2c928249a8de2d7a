"""Every shape a prefill brings, on the Hopper kernel: length regressions, GQA ratios and MQA, more
queries than keys, 64-bit offsets, fused-QKV slices, sliding windows and varlen on the default path,
and what falls back to the pure-JAX path.
Skips without a Hopper GPU and the built extension.

Kernel outputs are checked against float64 attention in NaN-poisoned buffers, with the helpers of
tests/test_kernel_gpu.py (an element the kernel does not write shows up as NaN).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64, naive_varlen_f64
from gpu_utils import requires_hopper
from hlo_utils import custom_call_lines
from test_kernel_gpu import (
    LSE_TOLERANCE,
    O_TOLERANCE,
    attention_float64,
    check_against_float64,
    random_qkv,
    relative_l2,
    run_kernel_poisoned_on_device,
)

import jzyfa
from jzyfa.primitive import FFI_TARGET
from jzyfa.varlen_primitive import FFI_TARGET_VARLEN

pytestmark = [pytest.mark.gpu, requires_hopper]

LENGTHS = [1, 2, 63, 64, 65, 127, 128, 129, 4095, 4097]


def shape_for(seq_q: int, seq_k: int) -> tuple[int, int, int]:
    """(batch, heads_q, heads_kv): smaller for long sequences, which the float64 oracle holds whole."""
    return (1, 2, 2) if seq_q * seq_k > 10**6 else (2, 4, 2)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length", LENGTHS)
def test_length_regressions(length, causal, head_dim):
    rng = np.random.default_rng(length * 4 + causal * 2 + head_dim)
    batch, hq, hkv = shape_for(length, length)
    q, k, v = random_qkv(rng, batch, length, length, hq, hkv, head_dim, jnp.bfloat16)
    check_against_float64(q, k, v, causal=causal)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_q,seq_k", [(2, 1), (65, 1), (129, 64), (128, 127), (4097, 65), (4095, 129)])
def test_more_queries_than_keys(seq_q, seq_k, causal, head_dim):
    # Causal: the first seq_q - seq_k rows see no key (O = 0, LSE = -inf).
    rng = np.random.default_rng(seq_q * 7 + seq_k + causal)
    batch, hq, hkv = shape_for(seq_q, seq_k)
    q, k, v = random_qkv(rng, batch, seq_q, seq_k, hq, hkv, head_dim, jnp.bfloat16)
    check_against_float64(q, k, v, causal=causal)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_q,heads_kv", [(2, 2), (4, 2), (8, 2), (16, 2), (32, 2), (16, 1)])
@pytest.mark.parametrize("seq_q,seq_k", [(129, 129), (65, 300), (300, 65)])
def test_gqa_ratios_and_mqa(seq_q, seq_k, heads_q, heads_kv, causal, head_dim):
    rng = np.random.default_rng(heads_q * 100 + heads_kv * 10 + seq_q + causal)
    q, k, v = random_qkv(rng, 1, seq_q, seq_k, heads_q, heads_kv, head_dim, jnp.bfloat16)
    check_against_float64(q, k, v, causal=causal)


# --- 64-bit offsets: tensors of more than 2^31 elements (over 4 GiB of bf16) -------------------

LONG = 131072 + 128  # 131200 * 128 heads * 128 = 2^31 + 2^21 elements


def device_normal(seed: int, shape) -> jax.Array:
    """bf16 standard-normal data made on the GPU (a 2^31-element NumPy array would take minutes)."""
    return jax.random.normal(jax.random.key(seed), shape, jnp.bfloat16)


def check_rows(out, lse, q, k, v, *, rows, heads, causal):
    """Kernel rows/heads against float64; out, lse device arrays, q/k/v whole (rows of q only when
    non-causal, where rows are independent)."""
    group = q.shape[2] // k.shape[2]
    kv_heads = sorted({h // group for h in heads})
    q_sel = np.asarray(q[:, rows][:, :, heads].astype(jnp.float32))
    k_sel, v_sel = (np.asarray(x[:, :, kv_heads].astype(jnp.float32)) for x in (k, v))
    # Each selected query head with its own KV head: pass them as heads 1:1.
    k_sel = k_sel[:, :, [kv_heads.index(h // group) for h in heads]]
    v_sel = v_sel[:, :, [kv_heads.index(h // group) for h in heads]]
    want_out, want_lse = attention_float64(q_sel, k_sel, v_sel, causal=causal, scale=q.shape[-1] ** -0.5)
    got_out = np.asarray(out[:, rows][:, :, heads].astype(jnp.float32))
    got_lse = np.asarray(lse[:, heads][:, :, rows])
    assert relative_l2(got_out, want_out) < O_TOLERANCE
    assert relative_l2(got_lse, want_lse) < LSE_TOLERANCE


def test_64_bit_offsets_in_q_and_out():
    # q and O hold 2^31 + 2^21 elements; K/V are short, so the work is small.
    q = device_normal(1, (1, LONG, 128, 128))
    k = device_normal(2, (1, 256, 8, 128))
    v = device_normal(3, (1, 256, 8, 128))
    assert q.size > 2**31
    out, lse = run_kernel_poisoned_on_device(q, k, v, causal=False)
    assert not bool(jnp.isnan(out).any()), "the kernel left elements of O unwritten (NaN poison)"
    assert bool(jnp.isfinite(lse).all()), "every row sees keys: LSE must be finite everywhere"
    rows = [0, 1, 65535, 65536, 131071, 131072, LONG - 1]  # around the 2^31-element boundary too
    check_rows(out, lse, q, k, v, rows=rows, heads=[0, 17, 127], causal=False)


def test_64_bit_offsets_in_k_and_v():
    # K and V hold 2^31 + 2^21 elements each; 256 queries over all of them, causal bottom-right.
    q = device_normal(4, (1, 256, 128, 128))
    k = device_normal(5, (1, LONG, 128, 128))
    v = device_normal(6, (1, LONG, 128, 128))
    assert k.size > 2**31
    out, lse = run_kernel_poisoned_on_device(q, k, v, causal=True)
    assert not bool(jnp.isnan(out).any()), "the kernel left elements of O unwritten (NaN poison)"
    assert bool(jnp.isfinite(lse).all())
    check_rows(out, lse, q, k, v, rows=list(range(256)), heads=[0, 127], causal=True)


# --- slices of a fused QKV projection -----------------------------------------------------------


def test_fused_qkv_slices_reach_the_kernel():
    rng = np.random.default_rng(21)
    qkv = jnp.asarray(rng.standard_normal((2, 1000, 3, 8, 128)), jnp.bfloat16)

    def fn(qkv):
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        return jzyfa.flash_attention(q, k, v, causal=True, return_lse=True, implementation="kernel")

    compiled = jax.jit(fn).lower(qkv).compile().as_text()
    (call,) = custom_call_lines(compiled, FFI_TARGET)
    # XLA materialises the three slices as dense buffers before the call (docs/shapes.md): at most
    # one fusion or copy per operand. Printed for the record (-s).
    entry = compiled[compiled.index("ENTRY") :]
    producers = [line.strip() for line in entry.splitlines() if " fusion(" in line or " copy(" in line]
    print("\n".join(["fused-QKV custom call:", call.strip(), "producers:", *producers]))
    assert len(producers) <= 3

    out, lse = jax.jit(fn)(qkv)
    q, k, v = (np.asarray(qkv[:, :, i].astype(jnp.float32)) for i in range(3))
    want_out, want_lse = attention_float64(q, k, v, causal=True, scale=128**-0.5)
    assert relative_l2(np.asarray(out.astype(jnp.float32)), want_out) < O_TOLERANCE
    assert relative_l2(np.asarray(lse), want_lse) < LSE_TOLERANCE


# --- the default path (implementation=None): the kernel where it serves (sliding windows too, since
# tests/test_window_kernel_gpu.py passed), the pure-JAX path on the GPU where it does not ------------


def binds_kernel(fn, *args) -> bool:
    return bool(custom_call_lines(jax.jit(fn).lower(*args).compile().as_text(), FFI_TARGET))


@pytest.mark.parametrize(
    "options,shapes,kernel",
    [
        ({"window": (8, 0)}, {"head_dim": 128}, True),  # the windowed kernel
        ({"window": (4096, 0)}, {"head_dim": 128}, True),  # wider than the keys: causal
        ({"causal": True, "window": (16, 16)}, {"head_dim": 64}, True),  # the windowed kernel, (16, 0)
        # MLA and head dim 256, windows included, are the default since verified (2026-11-30, 12-01).
        ({"causal": True}, {"head_dim": 192, "head_dim_v": 128}, True),
        ({"causal": True, "window": (16, 0)}, {"head_dim": 192, "head_dim_v": 128}, True),
        ({"causal": True}, {"head_dim": 256}, True),
        ({"causal": True}, {"head_dim": 96}, False),  # no instantiation: the pure-JAX path on the GPU
    ],
    ids=["window", "wide_window", "causal_window", "mla", "mla_window", "head_dim_256", "head_dim_96"],
)
def test_default_path_serves_what_the_kernel_lacks(options, shapes, kernel):
    rng = np.random.default_rng(5)
    head_dim, head_dim_v = shapes["head_dim"], shapes.get("head_dim_v", shapes["head_dim"])
    q = jnp.asarray(rng.standard_normal((2, 300, 8, head_dim)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((2, 300, 2, head_dim)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((2, 300, 2, head_dim_v)), jnp.bfloat16)
    fn = functools.partial(jzyfa.flash_attention, return_lse=True, **options)
    assert binds_kernel(fn, q, k, v) == kernel
    if not kernel:
        with pytest.raises(ValueError, match="implementation='kernel' cannot serve this call"):
            jzyfa.flash_attention(q, k, v, implementation="kernel", **options)
    out, lse = jax.jit(fn)(q, k, v)
    want_out, want_lse = naive_attention_f64(
        *(np.asarray(x, np.float32) for x in (q, k, v)),
        causal=options.get("causal", False),
        window=options.get("window"),
    )
    assert relative_l2(np.asarray(out, np.float32), want_out) < O_TOLERANCE
    seen = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), seen)
    assert relative_l2(np.asarray(lse)[seen], want_lse[seen]) < LSE_TOLERANCE


def test_varlen_on_the_gpu():
    rng = np.random.default_rng(9)
    lengths_q, lengths_k = [100, 0, 257, 3], [100, 40, 300, 0]
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((cu_q[-1], 8, 128)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((cu_k[-1], 2, 128)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((cu_k[-1], 2, 128)), jnp.bfloat16)
    fn = jax.jit(lambda *a: jzyfa.flash_attention_varlen(*a, 257, 300, causal=True, return_lse=True))
    args = (q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k))
    # The default path is the varlen kernel (tests/test_varlen_kernel_gpu.py passed).
    assert custom_call_lines(fn.lower(*args).compile().as_text(), FFI_TARGET_VARLEN)
    out, lse = fn(*args)
    want_out, want_lse = naive_varlen_f64(
        *(np.asarray(x, np.float32) for x in (q, k, v)), cu_q, cu_k, causal=True
    )
    assert relative_l2(np.asarray(out, np.float32), want_out) < O_TOLERANCE
    seen = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), seen)
    assert relative_l2(np.asarray(lse)[seen], want_lse[seen]) < LSE_TOLERANCE
