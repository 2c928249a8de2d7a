r"""A call's overhead above its kernels, next to cuDNN's and XLA's: `python -m jzyfa.bench.overhead`.

  python -m jzyfa.bench.overhead                     # batch 1, 512 tokens, 16 heads, head dim 128
  python -m jzyfa.bench.overhead --seq 2048 --markdown

For one small causal problem (q, k, v all [batch, seq, heads, head_dim], bf16 by default), each of

  jzyfa     jzyfa.flash_attention(q, k, v, causal=True, implementation="kernel")
  cudnn     jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
  xla       jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  trivial   q + 1: the floor, what any jitted call costs

is compiled twice, with XLA's command buffers (CUDA graphs) off and on (COMMAND_BUFFERS), and measured:

  wall      host wall time per call: --calls calls dispatched back to back on the same inputs,
            block_until_ready once at the end of the loop; the best of --rounds loops.
  kernel    GPU time per call of every kernel the call launches, from CUPTI (jzyfa.bench.timing); measured
            once per implementation, since command buffers change how kernels are launched, not them.
  overhead  wall - kernel: what a call costs beyond its kernels when calls run back to back. Near 0
            when the GPU is the bottleneck (the host's work hides behind the kernels); large when the
            host is (dispatch, the custom-call handler, launches).
  floor     the trivial op's wall time in the same mode; `over floor` is wall - floor.

Where CUPTI cannot run, the report gives wall times only and says why. An implementation that fails
(cuDNN unavailable, the kernel needing Hopper, an option XLA rejects) gets a row saying why. Needs a
CUDA GPU; without one it exits with status 1 and says so. Progress goes to stderr, the table to stdout.

The command-buffer options are DebugOptions fields passed as `compiler_options`. Every backend parses
them (a misspelt name or enum value is an error even on CPU), but only the GPU compiler acts on them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

import jzyfa
from jzyfa.bench import timing as _timing
from jzyfa.bench.report import logger, markdown_table, plain_table, short_error

# compiler_options per mode. A repeated enum field is a comma-separated list of names that replaces
# XLA's default list; "" turns command buffers off. min_graph_size 1 records even a single command.
COMMAND_BUFFERS: dict[str, dict[str, str | int]] = {
    "off": {"xla_gpu_enable_command_buffer": ""},
    "on": {"xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL,CUDNN", "xla_gpu_graph_min_graph_size": 1},
}
DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16}
FLOOR = "trivial"  # the implementation whose wall time is every row's floor


class NeedsGpu(RuntimeError):
    """Raised where the default JAX backend is not a CUDA GPU."""


@dataclasses.dataclass(frozen=True)
class Implementation:
    name: str
    description: str
    fn: Callable  # (q, k, v) -> array


def _dot_product_attention(q, k, v, *, implementation: str):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


def _trivial(q, k, v):
    return q + 1


IMPLEMENTATIONS = [
    Implementation(
        "jzyfa",
        'jzyfa.flash_attention(causal=True, implementation="kernel")',
        functools.partial(jzyfa.flash_attention, causal=True, implementation="kernel"),
    ),
    Implementation(
        "cudnn",
        'jax.nn.dot_product_attention(is_causal=True, implementation="cudnn")',
        functools.partial(_dot_product_attention, implementation="cudnn"),
    ),
    Implementation(
        "xla",
        'jax.nn.dot_product_attention(is_causal=True, implementation="xla")',
        functools.partial(_dot_product_attention, implementation="xla"),
    ),
    Implementation(FLOOR, "q + 1, jitted (the floor)", _trivial),
]


@dataclasses.dataclass
class Row:
    """One implementation in one command-buffer mode; times in microseconds per call."""

    impl: str
    command_buffers: str  # "off" or "on"
    wall_us: float | None = None
    kernel_us: float | None = None
    floor_us: float | None = None
    error: str | None = None  # why there is no measurement
    note: str | None = None  # e.g. why there is no kernel time for this implementation

    @property
    def overhead_us(self) -> float | None:
        if self.wall_us is None or self.kernel_us is None:
            return None
        return self.wall_us - self.kernel_us

    @property
    def over_floor_us(self) -> float | None:
        if self.wall_us is None or self.floor_us is None:
            return None
        return self.wall_us - self.floor_us


@dataclasses.dataclass
class Report:
    args: argparse.Namespace
    rows: list[Row]
    device: str
    jax_version: str
    kernel_time_unavailable: str | None = None  # None: CUPTI kernel time; else why wall time only


# ----------------------------------------------------------------------------------------------
# Arguments


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m jzyfa.bench.overhead",
        description="Per-call wall time, kernel time and overhead of jzyfa's kernel, cuDNN's and XLA's "
        "attention, with XLA's command buffers off and on. Needs a CUDA GPU.",
    )
    parser.add_argument("--batch", type=_positive_int, default=1, help="batch size (default 1)")
    parser.add_argument("--seq", type=_positive_int, default=512, help="tokens, Sq = Sk (default 512)")
    parser.add_argument("--heads", type=_positive_int, default=16, help="heads of q, k and v (default 16)")
    parser.add_argument("--head_dim", type=_positive_int, default=128, help="head dimension (default 128)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="input dtype (default bf16)")
    parser.add_argument(
        "--calls", type=_positive_int, default=2000, help="calls per timed loop (default 2000)"
    )
    parser.add_argument(
        "--rounds", type=_positive_int, default=3, help="timed loops; the best is reported (default 3)"
    )
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# Measuring


def require_gpu() -> None:
    backend = jax.default_backend()
    if backend != "gpu":
        raise NeedsGpu(f"jzyfa.bench.overhead needs a CUDA GPU: the default JAX backend is {backend!r}")


def wall_us_per_call(fn: Callable, args: tuple, *, calls: int, rounds: int) -> float:
    """Best over `rounds` loops of the wall time per call of `calls` back-to-back calls (one warm-up)."""
    jax.block_until_ready(fn(*args))
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def kernel_us_per_call(fn: Callable, args: tuple) -> float:
    """Median CUPTI time of all kernels one call launches; raises _timing.TimingUnavailable."""
    timing = _timing.cupti_kernel_time(
        fn,
        [args],
        min_samples=50,
        min_seconds=0.2,
        max_iterations_per_chunk=50,
        monitor=_timing.ClockMonitor(None),
        warmup_s=0.1,
    )
    return timing.median_ms * 1e3


def attach_floor(rows: list[Row]) -> None:
    """Sets every row's floor_us to the trivial op's wall time in the same command-buffer mode."""
    floors = {r.command_buffers: r.wall_us for r in rows if r.impl == FLOOR}
    for r in rows:
        r.floor_us = floors.get(r.command_buffers)


_progress = logger("jzyfa.bench.overhead")


def measure(args: argparse.Namespace, implementations: Sequence[Implementation] = IMPLEMENTATIONS) -> Report:
    """Measures every implementation in both modes. Raises NeedsGpu without a GPU; else never raises."""
    require_gpu()
    shape = (args.batch, args.seq, args.heads, args.head_dim)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, shape, DTYPES[args.dtype]) for key in keys)
    inputs = (q, k, v)
    kernel_reason = _timing.cupti_available()
    rows: list[Row] = []
    for impl in implementations:
        impl_rows = []
        for mode, options in COMMAND_BUFFERS.items():
            row = Row(impl.name, mode)
            try:
                compiled = jax.jit(impl.fn).lower(*inputs).compile(compiler_options=options)
                row.wall_us = wall_us_per_call(compiled, inputs, calls=args.calls, rounds=args.rounds)
                _progress(f"{impl.name}, command buffers {mode}: {row.wall_us:.1f} us per call (wall)")
            except Exception as e:  # noqa: BLE001 - reported in the row, the run goes on
                row.error = short_error(e, 240)
                _progress(f"{impl.name}, command buffers {mode}: failed: {row.error}")
            impl_rows.append(row)
        if kernel_reason is None and any(r.error is None for r in impl_rows):
            try:
                kernel_us = kernel_us_per_call(impl.fn, inputs)
                _progress(f"{impl.name}: {kernel_us:.1f} us per call (kernels, CUPTI)")
                for r in impl_rows:
                    r.kernel_us = kernel_us if r.error is None else None
            except Exception as e:  # noqa: BLE001 - wall time still serves
                for r in impl_rows:
                    r.note = f"no kernel time: {short_error(e, 240)}"
        rows += impl_rows
    attach_floor(rows)
    device = jax.devices()[0]
    return Report(
        args=args,
        rows=rows,
        device=f"{device.device_kind} ({device.platform})",
        jax_version=jax.__version__,
        kernel_time_unavailable=kernel_reason,
    )


# ----------------------------------------------------------------------------------------------
# Reporting

COLUMNS = [
    "impl",
    "command buffers",
    "wall µs/call",
    "kernel µs/call",
    "overhead µs (wall - kernel)",
    "floor µs (q + 1)",
    "over floor µs",
    "note",
]


def _us(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _cells(row: Row) -> list[str]:
    note = f"failed: {row.error}" if row.error else (row.note or "")
    return [
        row.impl,
        row.command_buffers,
        _us(row.wall_us),
        _us(row.kernel_us),
        _us(row.overhead_us),
        _us(row.floor_us),
        _us(row.over_floor_us),
        note,
    ]


def _title(report: Report) -> list[str]:
    a = report.args
    problem = f"batch {a.batch}, {a.seq} tokens, {a.heads} heads, head dim {a.head_dim}, causal, {a.dtype}"
    loops = f"{a.calls} calls per loop, best of {a.rounds} loops"
    lines = [
        f"Per-call time: {problem}; {loops}; {report.device}, jax {report.jax_version}.",
        f"Command buffers: off = {_options_text('off')}; on = {_options_text('on')}.",
    ]
    if report.kernel_time_unavailable:
        lines.append(f"Kernel time unavailable ({report.kernel_time_unavailable}): wall time only.")
    else:
        lines.append("Kernel time: CUPTI, all kernels of one call (median).")
    return lines


def _options_text(mode: str) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in COMMAND_BUFFERS[mode].items())


def format_plain(report: Report) -> str:
    lines = plain_table(COLUMNS, [_cells(r) for r in report.rows], right=range(2, len(COLUMNS) - 1))
    return "\n".join(_title(report) + [""] + lines)


def format_markdown(report: Report) -> str:
    align = ["---", "---"] + ["---:"] * (len(COLUMNS) - 3) + ["---"]
    lines = markdown_table(COLUMNS, [_cells(r) for r in report.rows], align)
    return "\n".join(_title(report) + [""] + lines)


def format_report(report: Report, markdown: bool = False) -> str:
    return format_markdown(report) if markdown else format_plain(report)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = measure(args)
    except NeedsGpu as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_report(report, markdown=args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
