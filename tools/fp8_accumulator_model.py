"""How much a truncating FP8 wgmma accumulator lowers the FP8 kernel's row sums (docs/fp8.md 10.18).

FP8 wgmma (QGMMA) keeps only ~14 significant bits when it adds a k-step's products into its float32
accumulator: the terms are aligned to the largest of them (the accumulator included) and the bits
below drop (docs/fp8.md 10.2; DeepSeek-V3 reports the same on H800). The kernel's row sums are the
P V wgmma's ones columns, so every P~ smaller than the accumulator's last kept bit loses its low bits
until the accumulator is promoted to float32 (every kPromoteBlocks key blocks). This models one row's
sum that way, in NumPy, on Gaussian scores rounded to e4m3 as lean P rounds them (r fixed at the row's
ceil(max) - 7), and prints the mean relative error of the sum against the exact one for several
promotion intervals and key counts. A model, not a measurement: the kernel's alignment and truncation
are the hypothesis the GPU has to confirm (build with -DJZYFA_FP8_PROMOTE_BLOCKS=4 and compare the
LSE against the emulation's).

    python tools/fp8_accumulator_model.py
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np

from jzyfa.e4m3_codes import round_to_e4m3

K_STEP = 32  # keys per e4m3 wgmma k-step
STEPS_PER_BLOCK = 4  # k-steps per 128-key block


def truncating_sum(p: np.ndarray, bits: int, promote_steps: int) -> float:
    """sum(p) as an accumulator that keeps `bits` significant bits per k-step of K_STEP terms: each term
    and the accumulator truncated (toward zero; all are >= 0 here) to the grid of the largest one's
    leading bit minus bits - 1, summed exactly; every promote_steps k-steps the accumulator is added to
    a float64 total and restarts from zero."""
    total = acc = 0.0
    for step, start in enumerate(range(0, len(p), K_STEP), 1):
        chunk = p[start : start + K_STEP]
        largest = max(acc, float(chunk.max(initial=0.0)))
        if largest > 0.0:
            ulp = 2.0 ** (np.floor(np.log2(largest)) - (bits - 1))
            acc = np.floor(acc / ulp) * ulp + float(np.sum(np.floor(chunk / ulp) * ulp))
        if step % promote_steps == 0:
            total, acc = total + acc, 0.0
    return total + acc


def lean_row(rng: np.random.Generator, keys: int, head_dim: int = 128) -> np.ndarray:
    """One row's P~ = 2^(t - r) rounded to e4m3, t = q k / sqrt(d) in log2 units, Gaussian q and k."""
    q, k = rng.standard_normal(head_dim), rng.standard_normal((keys, head_dim))
    t = (k @ q) / np.sqrt(head_dim) * np.log2(np.e)
    r = np.ceil(t.max()) - 7
    return np.asarray(round_to_e4m3(jnp.asarray(2.0 ** (t - r), jnp.float32)), np.float64)


def mean_sum_error(rng, keys: int, bits: int, promote_blocks: int, rows: int) -> float:
    errors = []
    for _ in range(rows):
        p = lean_row(rng, keys)
        errors.append(truncating_sum(p, bits, promote_blocks * STEPS_PER_BLOCK) / p.sum() - 1.0)
    return float(np.mean(errors))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bits", type=int, default=14)
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--keys", default="1024,4096,16384")
    parser.add_argument("--promote_blocks", default="1,2,4,8,16")
    args = parser.parse_args(argv)
    keys = [int(k) for k in args.keys.split(",")]
    print(f"mean relative error of a row's sum, {args.bits}-bit truncating accumulator, {args.rows} rows")
    print("| promote every (blocks) | " + " | ".join(f"{k} keys" for k in keys) + " |")
    print("|---|" + "---|" * len(keys))
    for blocks in (int(b) for b in args.promote_blocks.split(",")):
        rng = np.random.default_rng(0)
        cells = [f"{mean_sum_error(rng, k, args.bits, blocks, args.rows):.2e}" for k in keys]
        print(f"| {blocks} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
