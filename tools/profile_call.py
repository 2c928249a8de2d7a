"""One causal attention call on the kernel, for a profiler to record (e.g. Nsight Compute).

    ncu -k regex:FlashFwd --launch-skip 1 --launch-count 1 python tools/profile_call.py --dtype fp8

Runs the call twice: the first compiles and warms up, the second is the one to profile (hence
--launch-skip 1). tools/gpu_session.sh runs it under ncu through JZYFA_NCU_RUNS.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np


def add_call_arguments(parser: argparse.ArgumentParser, default_seq: int) -> None:
    """The call's shape flags (shared with tools/kernel_timeline.py)."""
    parser.add_argument("--dtype", choices=("fp8", "bf16"), default="fp8")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=default_seq)
    parser.add_argument("--heads", type=int, default=16)


def kernel_call(dtype: str, batch: int, seq: int, heads: int):
    """(jitted causal call on the kernel, its inputs): Gaussian bf16 q, k, v [batch, seq, heads, 128],
    quantized to e4m3 with per-tensor descales for fp8."""
    import jax
    import jax.numpy as jnp

    import jzyfa

    rng = np.random.default_rng(0)
    shape = (batch, seq, heads, 128)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3))
    kwargs = {}
    if dtype == "fp8":
        (q, dq), (k, dk), (v, dv) = (jzyfa.fp8_quantize(x) for x in (q, k, v))
        kwargs = {"descale_q": dq, "descale_k": dk, "descale_v": dv}
    call = jax.jit(
        lambda q, k, v: jzyfa.flash_attention(q, k, v, causal=True, implementation="kernel", **kwargs)
    )
    return call, (q, k, v)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_call_arguments(parser, default_seq=16384)
    args = parser.parse_args(argv)

    import jax

    call, inputs = kernel_call(args.dtype, args.batch, args.seq, args.heads)
    for _ in range(2):
        jax.block_until_ready(call(*inputs))
    print(f"ran {args.dtype} causal {inputs[0].shape} twice")


if __name__ == "__main__":
    main()
