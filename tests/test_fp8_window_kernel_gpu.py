"""The FP8 kernel's sliding windows on a Hopper GPU (dense batches): against the FP8 emulation with the
same window (the same algorithm, blocks aligned alike: closely) and against float64 attention of the
dequantized inputs (loosely), outputs NaN-poisoned beforehand; rows that see no key give O = 0 and
LSE = -inf; lean and exact P; bitwise-identical reruns.

Skipped without a Hopper GPU and the built extension. Runs the kernel through implementation="kernel"
(the plan's dense FP8 "window" row). Tolerances are tests/test_fp8_kernel_gpu.py's.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import naive_attention_f64, random_fp8_qkv
from gpu_utils import requires_hopper
from hlo_utils import window_attributes
from test_fp8_kernel_gpu import (
    EMULATION_TOLERANCE,
    FLOAT64_TOLERANCE,
    LSE_TOLERANCE,
    emulated_on_cpu,
    run_poisoned,
    run_poisoned_call,
)
from test_kernel_gpu import relative_l2

from jzyfa import _validation

ONE_CODE_LSE = math.log(1 + 2**-3) + 1e-3  # one e4m3 code of a row's largest probability

pytestmark = [pytest.mark.gpu, requires_hopper]


def dequantized(x8, d, heads):
    d = np.asarray(d, np.float64)
    if d.ndim == 2:  # [B, Hkv] -> per head of x
        d = np.repeat(d, heads // d.shape[1], axis=1)[:, None, :, None]
    return np.asarray(x8.astype(jnp.float32), np.float64) * d


def check_window(rng, *, batch, seq_q, seq_k, heads_q, heads_kv, window, causal=False, granularity, lean_p):
    (q8, k8, v8), descales = random_fp8_qkv(
        rng,
        batch=batch,
        seq_q=seq_q,
        seq_k=seq_k,
        heads_q=heads_q,
        heads_kv=heads_kv,
        granularity=granularity,
    )
    out, lse, custom_call = run_poisoned_call(
        q8, k8, v8, descales, causal=causal, window=window, lean_p=lean_p
    )
    attributes = window_attributes(custom_call)
    # The window reached the windowed kernel (not folded into causal or none by the launch).
    mask = _validation.canonical_window(_validation.mask_window(causal, window), seq_q, seq_k)
    assert mask not in (_validation.NO_WINDOW, _validation.CAUSAL_WINDOW), "pick a real sliding window"
    assert attributes == mask
    assert "causal = false" in custom_call, custom_call  # a window the kernel holds whole
    assert not np.isnan(out).any(), "the kernel left elements of O unwritten (NaN poison)"
    assert not np.isnan(lse).any(), "the kernel left LSE entries unwritten (NaN poison)"

    emu_out, emu_lse, _ = emulated_on_cpu(q8, k8, v8, descales, causal=causal, window=window, lean_p=lean_p)
    seen = np.isfinite(emu_lse)
    np.testing.assert_array_equal(np.isfinite(lse), seen, "rows with no visible key must give LSE = -inf")
    assert np.all(np.isneginf(lse[~seen]))
    assert np.all(out[~seen.transpose(0, 2, 1)] == 0), "rows with no visible key must give O = 0"
    assert relative_l2(out, emu_out) < EMULATION_TOLERANCE
    if seen.any():
        # Relative to the LSE's size (as the non-window tests), but never to less than 1, and on
        # average: with few visible keys LSE sits near 0 (window (0, 0): one key) and a row moves by
        # up to ln(1 + 2^-3) where one code differs from the emulation's (lean P rounds twice, exact
        # P's ex2.approx is not exp2).
        difference = np.abs(lse[seen] - emu_lse[seen])
        assert difference.mean() < LSE_TOLERANCE * max(1.0, float(np.abs(emu_lse[seen]).mean()))
        assert difference.max() < ONE_CODE_LSE

    ref_out, ref_lse = naive_attention_f64(
        dequantized(q8, descales[0], heads_q),
        dequantized(k8, descales[1], heads_kv),
        dequantized(v8, descales[2], heads_kv),
        causal=causal,
        window=window,
        softmax_scale=128**-0.5,
    )
    np.testing.assert_array_equal(np.isfinite(ref_lse), seen)
    assert relative_l2(out, ref_out) < FLOAT64_TOLERANCE
    return seen


# (batch, seq_q, seq_k, heads_q, heads_kv, window, granularity)
CASES = [
    # One block of keys per row, GQA; tiles start at first_block > 0 (K and V boxes offset).
    (2, 1000, 1000, 4, 2, (128, 0), "tensor"),
    # Up to 9 key blocks per tile across 2048 keys: a promotion of O (every 8 blocks) inside a window.
    (1, 2048, 2048, 2, 1, (1000, 0), "head"),
    # The diagonal only.
    (1, 300, 300, 2, 2, (0, 0), "tensor"),
    # Two-sided, lengths off multiples of 128 and of 32 (partial V tiles).
    (1, 777, 777, 2, 2, (37, 5), "head"),
    # Left unbounded, more keys than queries, MQA.
    (1, 500, 1300, 4, 1, (-1, 64), "tensor"),
    # Few keys near the end of a long key sequence: every tile starts far in (first_block up to 22).
    (1, 129, 3000, 2, 2, (200, 100), "head"),
    # (0, 0) with Sk = Sq + 64: in a tile, one consumer's rows see only one of its two blocks (the
    # other, fully masked for them, must leave their state as it was, also as their first block).
    (1, 300, 364, 2, 2, (0, 0), "tensor"),
    # The diagonal only, 512 tiles of one key block: every CTA runs several in a row (a one-block tile
    # frees its Q buffer with its first Q K^T).
    (8, 1024, 1024, 8, 8, (0, 0), "head"),
]


@pytest.mark.parametrize("lean_p", [True, False], ids=["lean", "exact"])
@pytest.mark.parametrize("batch, seq_q, seq_k, heads_q, heads_kv, window, granularity", CASES)
def test_fp8_windows_against_emulation_and_float64(
    rng, fp8_v_layout, lean_p, batch, seq_q, seq_k, heads_q, heads_kv, window, granularity
):
    check_window(
        rng,
        batch=batch,
        seq_q=seq_q,
        seq_k=seq_k,
        heads_q=heads_q,
        heads_kv=heads_kv,
        window=window,
        granularity=granularity,
        lean_p=lean_p,
    )


@pytest.mark.parametrize("lean_p", [True, False], ids=["lean", "exact"])
def test_rows_that_see_no_key(rng, lean_p):
    """More queries than keys and a window that ends before the keys for the first rows: rows
    0 .. 689 (positions -700 .. -11, right bound 10) see no key: O = 0, LSE = -inf; whole tiles of
    them have no key block at all."""
    seen = check_window(
        rng,
        batch=1,
        seq_q=1000,
        seq_k=300,
        heads_q=2,
        heads_kv=2,
        window=(20, 10),
        granularity="tensor",
        lean_p=lean_p,
    )
    assert not seen[..., :690].any() and seen[..., 690:].all()


@pytest.mark.parametrize("lean_p", [True, False], ids=["lean", "exact"])
def test_causal_with_a_window(rng, lean_p):
    """causal=True sets the right bound to 0: (300, 7) runs as (300, 0)."""
    check_window(
        rng,
        batch=1,
        seq_q=600,
        seq_k=900,
        heads_q=4,
        heads_kv=2,
        window=(300, 7),
        causal=True,
        granularity="head",
        lean_p=lean_p,
    )


def test_fp8_window_kernel_is_bitwise_deterministic(rng):
    (q8, k8, v8), descales = random_fp8_qkv(rng, batch=2, seq_q=1500, seq_k=1700, heads_q=8, heads_kv=2)
    first = run_poisoned(q8, k8, v8, descales, causal=False, window=(255, 17), lean_p=True)
    for _ in range(3):
        again = run_poisoned(q8, k8, v8, descales, causal=False, window=(255, 17), lean_p=True)
        np.testing.assert_array_equal(first[0].view(np.uint32), again[0].view(np.uint32))
        np.testing.assert_array_equal(first[1].view(np.uint32), again[1].view(np.uint32))
