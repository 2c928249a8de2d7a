"""tools/fp8_sink_ablation.py at a tiny size: every variant runs and gives a small, finite error."""

import numpy as np
from repo_tools import load_tool


def test_ablation_runs_every_variant():
    module = load_tool("fp8_sink_ablation")
    errors = module.softmax_side_errors(seq=128, heads=1, sink_logit=8.0, sink_value_scale=0.1)
    assert list(errors) == list(module.VARIANTS)
    values = np.array(list(errors.values()))
    # Against float64 attention of the same dequantized inputs only P's rounding remains: under 5%.
    assert np.all(np.isfinite(values)) and np.all(values >= 0) and np.all(values < 5)
    assert errors["lean P (both on)"] >= errors["both on"]  # lean P rounds the exponent's fraction too
