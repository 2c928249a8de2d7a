"""One causal attention call on the kernel, for a profiler to record (e.g. Nsight Compute).

    ncu -k regex:FlashFwd --launch-skip 1 --launch-count 1 python tools/profile_call.py --dtype fp8
    ncu --kernel-name-base demangled -k regex:BwdDkdv --launch-skip 1 --launch-count 1 \
        python tools/profile_call.py --dtype bf16 --direction bwd

Runs the call twice: the first compiles and warms up, the second is the one to profile (hence
--launch-skip 1). `--direction bwd` runs the gradient of sum(out * do) instead (16-bit only), so
the forward and the backward kernels each run once per call. tools/gpu_session.sh runs it under ncu
through JZYFA_NCU_RUNS.
"""

from __future__ import annotations

import argparse
import os
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


def gradient_call(call, inputs):
    """(jitted gradient of sum(call(q, k, v) * do) w.r.t. q, k, v, its inputs): do is Gaussian."""
    import jax
    import jax.numpy as jnp

    do = jnp.asarray(np.random.default_rng(1).standard_normal(inputs[0].shape), inputs[0].dtype)

    def loss(q, k, v):
        return jnp.sum(call(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), inputs


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_call_arguments(parser, default_seq=16384)
    parser.add_argument("--direction", choices=("fwd", "bwd"), default="fwd")
    parser.add_argument(
        "--set_env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment setting made before jzyfa is imported (e.g. JZYFA_FP8_V_LAYOUT=staged)",
    )
    args = parser.parse_args(argv)
    if args.direction == "bwd" and args.dtype != "bf16":
        parser.error("--direction bwd differentiates 16-bit inputs only: pass --dtype bf16")
    for setting in args.set_env:
        name, sep, value = setting.partition("=")
        if not sep or not name:
            parser.error(f"--set_env takes NAME=VALUE, got {setting!r}")
        os.environ[name] = value

    import jax

    call, inputs = kernel_call(args.dtype, args.batch, args.seq, args.heads)
    if args.direction == "bwd":
        call, inputs = gradient_call(call, inputs)
    for _ in range(2):
        jax.block_until_ready(call(*inputs))
    print(f"ran {args.dtype} causal {args.direction} {inputs[0].shape} twice")


if __name__ == "__main__":
    main()
