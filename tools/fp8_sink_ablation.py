"""What per-block scaling and rounded sums buy on attention-sink inputs (docs/fp8.md section 10.5).

Runs the FP8 emulation with the switches on and off on activation-like inputs of growing sink
strength and prints the relative L2 error of O (%) against float64 attention of the dequantized
inputs, so that only the softmax side's error remains. CPU: about a minute at the default size.

    python tools/fp8_sink_ablation.py --seq 2048
"""

from __future__ import annotations

import argparse
import math

import jax.numpy as jnp
import numpy as np

from jzyfa.bench import accuracy
from jzyfa.bench import inputs as realistic_inputs
from jzyfa.fp8_emulation import FIXED_OFFSET_OPTIONS, attention_fp8_emulated
from jzyfa.quantize import fp8_quantize

VARIANTS = {
    "both on": {"lean_p": False, "block_scaling": True, "rounded_sum": True},
    "rounded sum only": {"lean_p": False, "block_scaling": False, "rounded_sum": True, **FIXED_OFFSET_OPTIONS},
    "block scaling only": {"lean_p": False, "block_scaling": True, "rounded_sum": False},
    "FA3 style (both off)": {"lean_p": False, "block_scaling": False, "rounded_sum": False, **FIXED_OFFSET_OPTIONS},
    "lean P (both on)": {"lean_p": True},
}


def softmax_side_errors(seq: int, heads: int, sink_logit: float, sink_value_scale: float) -> dict[str, float]:
    knobs = realistic_inputs.ActivationKnobs(sink_logit=sink_logit, sink_value_scale=sink_value_scale)
    q, k, v = realistic_inputs.activation_qkv(
        0, batch=1, seq_q=seq, heads_q=heads, head_dim=128, knobs=knobs
    )[:3]
    (q8, dq), (k8, dk), (v8, dv) = (fp8_quantize(x) for x in (q, k, v))
    dequantized = [x8.astype(jnp.float32) * d for x8, d in ((q8, dq), (k8, dk), (v8, dv))]
    pairs = [(0, h) for h in range(heads)]
    ref = accuracy.reference_on_pairs(*dequantized, pairs, scale=1 / math.sqrt(128), causal=True)
    errors = {}
    for name, switches in VARIANTS.items():
        out, _ = attention_fp8_emulated(q8, k8, v8, dq, dk, dv, causal=True, **switches)
        got = accuracy.take_pairs(out, np.zeros(heads, int), np.arange(heads))
        errors[name] = 100 * accuracy.error_metrics(got, ref.out)["o_rel_l2"]
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=4)
    args = parser.parse_args()
    print("| sink logit, v scale | " + " | ".join(VARIANTS) + " |")
    print("|---" * (len(VARIANTS) + 1) + "|")
    for sink_logit in (8.0, 12.0, 16.0):
        for value_scale in (0.1, 1.0):
            errors = softmax_side_errors(args.seq, args.heads, sink_logit, value_scale)
            cells = " | ".join(f"{errors[name]:.2f}" for name in VARIANTS)
            print(f"| {sink_logit:g}, {value_scale:g} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
