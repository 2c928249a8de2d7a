"""tools/fp8_accumulator_model.py: the truncating-accumulator model of the FP8 kernel's row sums."""

import numpy as np
import pytest
from repo_tools import load_tool


@pytest.fixture(scope="module")
def model():
    return load_tool("fp8_accumulator_model")


def test_a_small_term_below_the_accumulators_last_bit_is_lost(model):
    # 14 bits: next to 2^13 the grid is 1, so 0.5 drops and 1.75 keeps 1; the next k-step's 0.5 too.
    p = np.array([8192.0, 0.5, 1.75] + [0.0] * 29 + [0.5] + [0.0] * 31)
    assert model.truncating_sum(p, bits=14, promote_steps=8) == 8193.0
    # Promoted after every k-step, the second step's 0.5 starts a fresh accumulator and survives.
    assert model.truncating_sum(p, bits=14, promote_steps=1) == 8193.5


def test_enough_bits_give_the_exact_sum_of_e4m3_values(model):
    p = model.lean_row(np.random.default_rng(1), keys=2048)
    assert model.truncating_sum(p, bits=40, promote_steps=32) == pytest.approx(p.sum(), rel=1e-15)


def test_the_row_sum_runs_low_and_more_so_between_rarer_promotions(model):
    errors = [
        model.mean_sum_error(np.random.default_rng(2), 2048, 14, blocks, rows=4) for blocks in (1, 4, 8)
    ]
    assert all(e < 0 for e in errors)
    assert errors[0] > errors[1] > errors[2]
    assert -1e-2 < errors[2] < -2e-3  # kPromoteBlocks = 8: about the kernel's LSE bias (docs/fp8.md 10.18)
