"""Scaling of the sharded prefill (examples/sharded_prefill.py) over all local devices.

For each sequence length it runs the prefill on one device, then sharded four ways over N devices:
- batch:      N sequences, batch split over `data=N`
- heads:      one sequence, attention heads and MLP split over `tensor=N`
- cp-gather:  one sequence split over `sequence=N`, K/V all-gathered (balanced layout)
- cp-ring:    the same with the K/V ring
and checks each sharded run's logits against the one-device run of the same problem. It prints
tokens/s per device next to one device's tokens/s (their ratio is the scaling efficiency).

    python tools/multi_gpu_prefill.py                      # N GPUs, 32K-128K tokens
    python tools/multi_gpu_prefill.py --seqs 65536 --modes cp-gather,cp-ring
    # tiny, on 8 CPU devices:
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tools/multi_gpu_prefill.py --preset cpu \\
        --seqs 128 --layers 1 --heads-q 8

Needs heads_q divisible by N for `heads` (and heads_kv for K/V to split too) and seq divisible by 2N
for the context-parallel modes.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

import jax

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
import prefill  # the model
import sharded_prefill  # placing it on a mesh

# mode -> (mesh axis, context-parallel strategy, whether the batch grows with the device count)
MODES = {
    "batch": ("data", "allgather", True),
    "heads": ("tensor", "allgather", False),
    "cp-gather": ("sequence", "allgather", False),
    "cp-ring": ("sequence", "ring", False),
}
# Largest |logits(sharded) - logits(one device)| accepted: a few bf16 ulps of logits of size ~4.
LOGITS_TOLERANCE = 0.125


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=prefill.PRESETS, default="gpu")
    parser.add_argument("--seqs", default="32768,65536,131072", help="comma-separated sequence lengths")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {list(MODES)}")
    for field in dataclasses.fields(prefill.Config):
        if field.name not in ("batch", "seq"):
            kind = type(getattr(prefill.PRESETS["cpu"], field.name))
            parser.add_argument(
                f"--{field.name.replace('_', '-')}", type=kind, help=f"overrides the preset's {field.name}"
            )
    parser.add_argument(
        "--batch", type=int, default=1, help="sequences per run (times the device count for `batch`)"
    )
    parser.add_argument("--devices", type=int, help="use the first N devices (default: all)")
    parser.add_argument("--implementation", choices=["auto", "kernel", "xla"], default="auto")
    parser.add_argument("--iters", type=int, default=3)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    devices = jax.devices()[: args.devices] if args.devices else jax.devices()
    count = len(devices)
    implementation = None if args.implementation == "auto" else args.implementation
    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(prefill.Config)
        if f.name not in ("batch", "seq") and getattr(args, f.name) is not None
    }
    base = dataclasses.replace(prefill.PRESETS[args.preset], **overrides)
    print(f"{count} x {devices[0].device_kind}; model {base}")
    print(
        f"{'mode':>10} {'seq':>7} {'batch':>5} {'tok/s/device':>13} {'1 device':>11} {'ratio':>6} {'max |dlogits|':>13}"
    )
    rows, singles = [], {}
    for seq in (int(s) for s in args.seqs.split(",")):
        for mode in args.modes.split(","):
            axis, strategy, batch_scales = MODES[mode]
            cfg = dataclasses.replace(base, seq=seq, batch=args.batch * (count if batch_scales else 1))
            mesh = jax.sharding.Mesh(devices, (axis,), (jax.sharding.AxisType.Auto,))
            layout = sharded_prefill.Layout(mesh, strategy=strategy)
            result = sharded_prefill.run(
                cfg, layout, implementation=implementation, iters=args.iters, single=singles.get(cfg)
            )
            singles[cfg] = result.pop("single")  # one one-device run per problem
            ratio = result["tokens_per_second_per_device"] / result["single_device_tokens_per_second"]
            row = dict(result, mode=mode, seq=seq, batch=cfg.batch, ratio=ratio)
            row["ok"] = row["logits_max_abs_diff"] <= LOGITS_TOLERANCE
            rows.append(row)
            print(
                f"{mode:>10} {seq:>7} {cfg.batch:>5} {row['tokens_per_second_per_device']:>13,.0f} "
                f"{row['single_device_tokens_per_second']:>11,.0f} {ratio:>6.2f} "
                f"{row['logits_max_abs_diff']:>13.3e}{'' if row['ok'] else '  MISMATCH'}"
            )
    if not all(row["ok"] for row in rows):
        raise SystemExit(f"sharded logits differ from the one-device run by more than {LOGITS_TOLERANCE}")
    return rows


if __name__ == "__main__":
    main()
