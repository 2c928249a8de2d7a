"""The rounding-tie slack that the FP8 GPU tests allow between kernel and emulation LSE (CPU)."""

import ml_dtypes
import numpy as np
import pytest
from attention_oracle import random_fp8_qkv
from fp8_lse_slack import _e4m3_value, lse_rounding_slack

from jzyfa.fp8_emulation import trace_attention_fp8_emulated

LSE_NOISE = 2e-5  # float32 noise of the emulation's sums


def test_e4m3_values_of_codes():
    codes = np.arange(0x7F)
    want = codes.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    np.testing.assert_array_equal(_e4m3_value(codes.astype(np.float64)), want)


@pytest.mark.parametrize("lean_p", [True, False], ids=["lean", "exact"])
@pytest.mark.parametrize("seed", [0, 1])
def test_slack_covers_scores_off_by_less_than_the_qgmma_error(seed, lean_p):
    """Scores scaled by 1 + 2^-16 (well inside SCORE_ERROR) flip a few roundings, in few-key rows by
    far more than float32 noise: every row stays within its slack, and the slack is mostly small."""
    (q8, k8, v8), descales = random_fp8_qkv(
        np.random.default_rng(seed),
        batch=1,
        seq_q=400,
        seq_k=300,
        heads_q=2,
        heads_kv=1,
        granularity="tensor",
    )

    def trace(descale_q):
        return trace_attention_fp8_emulated(
            q8, k8, v8, descale_q, *descales[1:], causal=True, lean_p=lean_p, integer_reference=True
        )

    base = trace(descales[0])
    moved = trace(descales[0] * np.float32(1 + 2**-16))
    lse, moved_lse = np.asarray(base.lse), np.asarray(moved.lse)
    seen = np.isfinite(lse)
    assert not seen.all() and seen.any()  # rows before the first key, and rows that see a few
    slack = lse_rounding_slack(q8, k8, descales, lse, base.reference_exponent, causal=True, lean_p=lean_p)
    assert np.all(slack[~seen] == 0)
    difference = np.abs(moved_lse[seen] - lse[seen])
    assert difference.max() > 10 * LSE_NOISE, "no rounding flipped: the case tests nothing"
    assert np.all(difference <= slack[seen] + LSE_NOISE * (1 + np.abs(lse[seen])))
    assert np.median(slack[seen]) < 2e-3
    assert np.mean(slack[seen] == 0) > 0.05  # rows with no probability near a tie are held to noise
