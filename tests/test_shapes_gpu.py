"""Every shape a prefill brings, on the Hopper kernel: length regressions, GQA ratios and MQA, more
queries than keys, 64-bit offsets, fused-QKV slices, sliding windows and varlen on the default path,
and what falls back to the pure-JAX path.
Skips without a Hopper GPU and the built extension.

Kernel outputs are checked against float64 attention in NaN-poisoned buffers, with the helpers of
tests/test_kernel_gpu.py (an element the kernel does not write shows up as NaN).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64, naive_varlen_f64
from gpu_utils import has_custom_call, kernel_call, requires_hopper
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
from jzyfa import api, plan
from jzyfa.primitives import FFI_TARGET

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
    call = kernel_call(compiled)
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


# --- the default path (implementation=None): the kernel where the plan has a row for the call
# (jzyfa.plan.KERNELS), the pure-JAX path on the GPU where it does not -----------------------------


def binds_kernel(fn, *args) -> bool:
    return has_custom_call(jax.jit(fn).lower(*args).compile().as_text(), FFI_TARGET)


@pytest.mark.parametrize(
    "options,shapes,kernel",
    [
        ({"window": (8, 0)}, {"head_dim": 128}, True),  # the windowed kernel
        ({"window": (4096, 0)}, {"head_dim": 128}, True),  # wider than the keys: causal
        ({"causal": True, "window": (16, 16)}, {"head_dim": 64}, True),  # the windowed kernel, (16, 0)
        ({"causal": True}, {"head_dim": 192, "head_dim_v": 128}, True),  # MLA
        ({"causal": True, "window": (16, 0)}, {"head_dim": 192, "head_dim_v": 128}, True),
        ({"causal": True}, {"head_dim": 256}, True),
        ({"causal": True}, {"head_dim": 96}, False),  # no instantiation: the pure-JAX path on the GPU
    ],
    ids=["window", "wide_window", "causal_window", "mla", "mla_window", "head_dim_256", "head_dim_96"],
)
def test_default_path_serves_what_the_kernel_lacks(options, shapes, kernel):
    rng = np.random.default_rng(5)
    head_dim, head_dim_v = shapes["head_dim"], shapes.get("head_dim_v", shapes["head_dim"])
    # The expectation is the plan's: a row for this configuration, or none.
    mask, _, _ = api.kernel_mask(options.get("causal", False), options.get("window"), 300, 300)
    config = plan.Config("16bit", (head_dim, head_dim_v), mask, "dense")
    assert (config in plan.KERNELS) == kernel, config
    q = jnp.asarray(rng.standard_normal((2, 300, 8, head_dim)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((2, 300, 2, head_dim)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((2, 300, 2, head_dim_v)), jnp.bfloat16)
    fn = functools.partial(jzyfa.flash_attention, return_lse=True, **options)
    assert binds_kernel(fn, q, k, v) == kernel
    if not kernel:
        problem = re.escape(f"implementation='kernel' cannot serve this call: {plan.config_problem(config)}")
        with pytest.raises(ValueError, match=problem):
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
    # The default path is the varlen kernel (the plan's 16-bit (128, 128) causal varlen row).
    assert plan.Config("16bit", (128, 128), "causal", "varlen") in plan.KERNELS
    assert "varlen = true" in kernel_call(fn.lower(*args).compile().as_text())
    out, lse = fn(*args)
    want_out, want_lse = naive_varlen_f64(
        *(np.asarray(x, np.float32) for x in (q, k, v)), cu_q, cu_k, causal=True
    )
    assert relative_l2(np.asarray(out, np.float32), want_out) < O_TOLERANCE
    seen = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), seen)
    assert relative_l2(np.asarray(lse)[seen], want_lse[seen]) < LSE_TOLERANCE


# --- every row of the plan, through the default path, and the configurations next to them that are
# not rows (jzyfa.plan.KERNELS: the table dispatch, the errors and the README's support matrix read) ---

# Masks as flash_attention's arguments, each of its kind for every length used below (api.kernel_mask).
MASK_OPTIONS = {"none": {}, "causal": {"causal": True}, "window": {"window": (40, 8)}}
DENSE_SEQS = (2, 260, 200)  # batch, seq_q, seq_k: causal and windowed rows that see no key
# Query and key lengths: a sequence without keys (its rows see none), one without queries.
PACKED_LENGTHS = ([70, 30, 0, 130], [90, 0, 20, 170])
HEADS = (4, 2)


def config_id(config: plan.Config) -> str:
    return f"{config.family}-{config.head_dims[0]}x{config.head_dims[1]}-{config.mask}-{config.layout}"


def offsets_of(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def plan_call(config: plan.Config, implementation):
    """A call of `config` through flash_attention(_varlen): (fn of the arrays, the arrays, the float64
    reference (out, lse), True for a varlen layout, the FP8 descales (q, k, v) or ()). FP8 inputs are
    quantized per tensor."""
    rng = np.random.default_rng(list(config.as_tuple()[1:3]) + [len(config.mask), len(config.layout)])
    options = dict(MASK_OPTIONS[config.mask], return_lse=True, implementation=implementation)
    (dqk, dv), (hq, hkv) = config.head_dims, HEADS
    varlen = config.layout == "varlen"
    if varlen:
        cu_q, cu_k = (offsets_of(x) for x in PACKED_LENGTHS)
        shapes = [(int(cu_q[-1]), hq, dqk), (int(cu_k[-1]), hkv, dqk), (int(cu_k[-1]), hkv, dv)]
    else:
        batch, sq, sk = DENSE_SEQS
        shapes = [(batch, sq, hq, dqk), (batch, sk, hkv, dqk), (batch, sk, hkv, dv)]
    floats = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    if config.family == "fp8":
        quantized = [jzyfa.fp8_quantize(jnp.asarray(x)) for x in floats]
        arrays = [x8 for x8, _ in quantized]
        descales = dict(zip(("descale_q", "descale_k", "descale_v"), (d for _, d in quantized)))
        exact = [np.asarray(x8.astype(jnp.float32), np.float64) * float(d) for x8, d in quantized]
    else:
        arrays = [jnp.asarray(x, jnp.bfloat16) for x in floats]
        descales = {}
        exact = [np.asarray(x.astype(jnp.float32)) for x in arrays]
    mask = {
        "causal": "causal" in MASK_OPTIONS[config.mask],
        "window": MASK_OPTIONS[config.mask].get("window"),
    }
    if varlen:
        max_q, max_k = max(PACKED_LENGTHS[0]), max(PACKED_LENGTHS[1])

        def fn(q, k, v, cu_q, cu_k):
            return jzyfa.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **options, **descales)

        want = naive_varlen_f64(*exact, cu_q, cu_k, **mask)
        return fn, (*arrays, jnp.asarray(cu_q), jnp.asarray(cu_k)), want, True, tuple(descales.values())

    def fn(q, k, v):
        return jzyfa.flash_attention(q, k, v, **options, **descales)

    return fn, tuple(arrays), naive_attention_f64(*exact, **mask), False, tuple(descales.values())


def test_plan_masks_are_of_their_kind():
    """MASK_OPTIONS give their mask kind at both the dense and the packed lengths."""
    for kind, options in MASK_OPTIONS.items():
        causal, window = options.get("causal", False), options.get("window")
        assert api.kernel_mask(causal, window, *DENSE_SEQS[1:])[0] == kind
        assert api.kernel_mask(causal, window, max(PACKED_LENGTHS[0]), max(PACKED_LENGTHS[1]))[0] == kind


@pytest.mark.parametrize("config", sorted(plan.KERNELS), ids=config_id)
def test_every_plan_row_runs_the_kernel_by_default(config):
    """Each row of the table: the default path (implementation=None) lowers to one jzyfa_attention_fwd
    call with the row's layout and mask, and its results match float64 attention (of the dequantized
    inputs for FP8, with tests/test_fp8_varlen_kernel_gpu.py's tolerances; dense FP8 also the kernel's
    emulation, as tests/test_fp8_kernel_gpu.py checks it)."""
    from test_fp8_kernel_gpu import FLOAT64_TOLERANCE, assert_matches_emulation
    from test_fp8_window_kernel_gpu import ONE_CODE_LSE

    fn, args, (want_out, want_lse), varlen, descales = plan_call(config, implementation=None)
    call = kernel_call(jax.jit(fn).lower(*args).compile().as_text())
    assert f"varlen = {str(varlen).lower()}" in call, call
    assert f"causal = {str(config.mask == 'causal').lower()}" in call, call
    window = re.search(r"window_left = (-?\d+) : i64.*window_right = (-?\d+) : i64", call)
    assert window and ((window.group(1), window.group(2)) == ("40", "8")) == (config.mask == "window"), call
    out, lse = jax.jit(fn)(*args)
    out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    seen = np.isfinite(want_lse)
    if varlen or config.mask != "none":
        assert not seen.all(), "the inputs hold rows that see no key (a sequence without keys, Sq > Sk)"
    np.testing.assert_array_equal(np.isfinite(lse), seen, "rows with no visible key must give LSE = -inf")
    rows_seen = seen.T if varlen else np.swapaxes(seen, 1, 2)
    assert np.all(out[~rows_seen] == 0), "rows with no visible key must give O = 0"
    if config.family == "fp8" and varlen:
        assert relative_l2(out, want_out) < FLOAT64_TOLERANCE
        np.testing.assert_allclose(lse[seen], want_lse[seen], rtol=0, atol=ONE_CODE_LSE)
    elif config.family == "fp8":
        # Few-key rows of the dense kernel may sit up to one e4m3 code from float64 and another from the
        # emulation (rounding ties): the emulation, with its rounding-tie slack, holds the LSE.
        assert relative_l2(out, want_out) < FLOAT64_TOLERANCE
        q8, k8, v8 = args
        window = MASK_OPTIONS[config.mask].get("window")
        causal = config.mask == "causal"
        assert_matches_emulation(out, lse, q8, k8, v8, descales, causal=causal, lean_p=True, window=window)
    else:
        assert relative_l2(out, want_out) < O_TOLERANCE
        assert relative_l2(lse[seen], want_lse[seen]) < LSE_TOLERANCE


# Configurations one step from a row: head dims some row has (or 96, which none has), every mask and
# layout, that the table does not list. flash_attention_varlen refuses FP8 inputs at head dims other
# than 128 before any plan (jzyfa._validation.check_packed_qkv: no pure-JAX path either).
NEAR_ROWS = sorted(
    plan.Config(family, dims, mask, layout)
    for family in plan.FAMILIES
    for dims in sorted({row.head_dims for row in plan.KERNELS} | {(96, 96)})
    for mask in plan.MASKS
    for layout in plan.LAYOUTS
    if plan.Config(family, dims, mask, layout) not in plan.KERNELS
)
REFUSED = [
    c for c in NEAR_ROWS if c.family == "fp8" and c.layout == "varlen" and c.head_dims not in ((64, 64), (128, 128), (256, 256))
]
NOT_ROWS = [c for c in NEAR_ROWS if c not in REFUSED]


@pytest.mark.parametrize("config", REFUSED, ids=config_id)
def test_fp8_varlen_calls_at_other_head_dims_are_refused(config):
    for implementation in (None, "kernel", "xla"):
        fn, args, _, _, _ = plan_call(config, implementation=implementation)
        with pytest.raises(ValueError, match="flash_attention_varlen takes FP8 inputs with one head_dim of 64, 128 or 256"):
            fn(*args)


@pytest.mark.parametrize("config", NOT_ROWS, ids=config_id)
def test_configurations_outside_the_plan_take_the_pure_jax_path(config):
    """implementation="kernel" raises naming what the kernels take (plan.config_problem); the default
    path runs no custom call and matches float64 attention (of the dequantized inputs for FP8)."""
    fn, args, _, _, _ = plan_call(config, implementation="kernel")
    problem = f"implementation='kernel' cannot serve this call: {plan.config_problem(config)}"
    with pytest.raises(ValueError, match=re.escape(problem)):
        fn(*args)
    fn, args, (want_out, want_lse), _, _ = plan_call(config, implementation=None)
    assert not has_custom_call(jax.jit(fn).lower(*args).compile().as_text(), FFI_TARGET)
    out, lse = jax.jit(fn)(*args)
    out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
    seen = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(lse), seen)
    assert relative_l2(out, want_out) < O_TOLERANCE
    assert relative_l2(lse[seen], want_lse[seen]) < LSE_TOLERANCE
