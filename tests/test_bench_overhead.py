"""`python -m jzyfa.bench.overhead`: arguments, the tables, the timing loop, and failing clearly without a GPU.

The measurement itself needs a CUDA GPU; `test_measures_every_implementation_on_hopper` runs it there.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from gpu_utils import requires_hopper

from jzyfa.bench import overhead
from jzyfa.bench.overhead import Report, Row

# ---- Arguments


def test_defaults_are_the_issue_shape():
    args = overhead.parse_args([])
    assert (args.batch, args.seq, args.heads, args.head_dim) == (1, 512, 16, 128)
    assert (args.dtype, args.calls, args.rounds, args.markdown) == ("bf16", 2000, 3, False)


def test_arguments_override_the_defaults():
    argv = "--batch 2 --seq 1024 --heads 8 --head_dim 64 --calls 50 --rounds 5 --dtype f16 --markdown"
    args = overhead.parse_args(argv.split())
    assert (args.batch, args.seq, args.heads, args.head_dim) == (2, 1024, 8, 64)
    assert (args.dtype, args.calls, args.rounds, args.markdown) == ("f16", 50, 5, True)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--seq", "0"], "argument --seq: must be a positive integer, got 0"),
        (["--calls", "-3"], "argument --calls: must be a positive integer, got -3"),
        (["--batch", "two"], "argument --batch: must be a positive integer, got 'two'"),
        (["--dtype", "fp8"], "argument --dtype: invalid choice"),
        (["--heads"], "argument --heads: expected one argument"),
    ],
)
def test_bad_arguments_are_rejected(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        overhead.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# ---- Tables from fake measurements


def fake_report(kernel_time_unavailable: str | None = None) -> Report:
    rows = [
        Row("jzyfa", "off", wall_us=30.0, kernel_us=12.5),
        Row("jzyfa", "on", wall_us=14.0, kernel_us=12.5),
        Row("cudnn", "off", error="JaxRuntimeError: cuDNN is not available | here"),
        Row("cudnn", "on", error="JaxRuntimeError: cuDNN is not available | here"),
        Row("xla", "off", wall_us=80.0, note="no kernel time: CUPTI recorded no kernel launches"),
        Row("xla", "on", wall_us=60.0),
        Row("trivial", "off", wall_us=8.0, kernel_us=1.5),
        Row("trivial", "on", wall_us=6.5, kernel_us=1.5),
    ]
    overhead.attach_floor(rows)
    args = overhead.parse_args(["--calls", "100"])
    return Report(args, rows, "NVIDIA H200 (gpu)", "0.11.2", kernel_time_unavailable)


def test_floor_is_the_trivial_op_in_the_same_mode():
    rows = fake_report().rows
    assert [r.floor_us for r in rows] == [8.0, 6.5] * 4
    jzyfa_off = rows[0]
    assert jzyfa_off.overhead_us == pytest.approx(17.5)
    assert jzyfa_off.over_floor_us == pytest.approx(22.0)
    assert rows[2].overhead_us is None and rows[2].over_floor_us is None  # failed: nothing to subtract
    assert rows[4].overhead_us is None and rows[4].over_floor_us == pytest.approx(72.0)


def test_plain_table():
    text = overhead.format_report(fake_report())
    lines = text.splitlines()
    assert lines[0].startswith("Per-call time: batch 1, 512 tokens, 16 heads, head dim 128, causal, bf16")
    assert "100 calls per loop, best of 3 loops; NVIDIA H200 (gpu), jax 0.11.2." in lines[0]
    assert "xla_gpu_enable_command_buffer='FUSION,CUSTOM_CALL,CUDNN'" in lines[1]
    assert "Kernel time: CUPTI" in text
    header = next(i for i, line in enumerate(lines) if line.startswith("impl"))
    table = lines[header:]
    assert len(table) == 1 + 8
    # Number columns are right-aligned under their headers.
    wall_end = table[0].index("wall µs/call") + len("wall µs/call")
    assert [line[wall_end - 4 : wall_end] for line in table[1:]] == [
        "30.0", "14.0", " n/a", " n/a", "80.0", "60.0", " 8.0", " 6.5"
    ]  # fmt: skip
    assert table[1].split()[:7] == ["jzyfa", "off", "30.0", "12.5", "17.5", "8.0", "22.0"]
    assert table[2].split()[:7] == ["jzyfa", "on", "14.0", "12.5", "1.5", "6.5", "7.5"]
    assert "failed: JaxRuntimeError: cuDNN is not available | here" in table[3]
    assert table[3].split()[2:7] == ["n/a", "n/a", "n/a", "8.0", "n/a"]  # the floor is still known
    assert "no kernel time: CUPTI recorded no kernel launches" in table[5]


def test_markdown_table():
    text = overhead.format_report(fake_report(), markdown=True)
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| impl"))
    assert lines[header + 1] == "|---|---|---:|---:|---:|---:|---:|---|"
    rows = lines[header + 2 :]
    assert len(rows) == 8
    assert rows[0] == "| jzyfa | off | 30.0 | 12.5 | 17.5 | 8.0 | 22.0 |  |"
    # The cell separator inside an error message is escaped, so every row has the header's cells.
    assert "cuDNN is not available \\| here" in rows[2]
    cells = lines[header].count(" | ")
    assert all(row.replace("\\|", "").count(" | ") == cells for row in rows)


def test_without_kernel_time_the_report_says_so():
    text = overhead.format_report(fake_report("jaxlib has no Mosaic GPU extension"))
    assert "Kernel time unavailable (jaxlib has no Mosaic GPU extension): wall time only." in text
    assert "Kernel time: CUPTI" not in text


# ---- The timing loop and the options (run on the CPU backend)


def test_wall_time_is_the_best_loop_of_back_to_back_calls():
    calls = []

    def fn(x):
        calls.append(x)
        return x

    us = overhead.wall_us_per_call(fn, (jnp.zeros(3),), calls=7, rounds=4)
    assert len(calls) == 1 + 7 * 4  # one warm-up call, then the timed loops
    assert 0 < us < 1e6


def test_command_buffer_options_are_valid_compile_options():
    """The option names and enum values exist in this jaxlib: every backend parses them, CPU too."""
    x = jnp.ones((4,), jnp.float32)
    lowered = jax.jit(lambda x: x + 1).lower(x)
    for options in overhead.COMMAND_BUFFERS.values():
        assert float(lowered.compile(compiler_options=options)(x)[0]) == 2.0
    # A misspelt enum value is rejected, so the check above would catch one.
    with pytest.raises(Exception, match="BOGUS"):
        lowered.compile(compiler_options={"xla_gpu_enable_command_buffer": "FUSION,BOGUS"})


def test_short_error_keeps_the_first_line():
    """The reports' one-line errors (jzyfa.bench.report, shared by the speed, accuracy and overhead reports)."""
    from jzyfa.bench.report import short_error

    error = RuntimeError("INVALID_ARGUMENT: no cuDNN here\n" + "traceback line\n" * 50)
    assert short_error(error) == "RuntimeError: INVALID_ARGUMENT: no cuDNN here"
    assert len(short_error(RuntimeError("x" * 1000), 240)) == 240
    assert short_error(RuntimeError("x" * 1000), 240).endswith("...")
    assert short_error(ValueError()) == "ValueError"


# ---- Without a GPU


def test_measure_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    with pytest.raises(overhead.NeedsGpu, match="needs a CUDA GPU: the default JAX backend is 'cpu'"):
        overhead.measure(overhead.parse_args([]))


def test_the_command_fails_clearly_without_a_gpu():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "jzyfa.bench.overhead", "--calls", "10"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    assert "error: jzyfa.bench.overhead needs a CUDA GPU" in proc.stderr
    assert proc.stdout == ""


# ---- On a GPU


@pytest.mark.gpu
@requires_hopper
def test_measures_every_implementation_on_hopper():
    args = overhead.parse_args(["--calls", "50", "--rounds", "2"])
    report = overhead.measure(args)
    rows = {(r.impl, r.command_buffers): r for r in report.rows}
    assert set(rows) == {(i.name, mode) for i in overhead.IMPLEMENTATIONS for mode in ("off", "on")}
    for name in ("jzyfa", "xla", "trivial"):  # cuDNN may be missing; its row then says why
        for mode in ("off", "on"):
            row = rows[name, mode]
            assert row.error is None, row.error
            assert row.wall_us > 0 and row.floor_us == rows["trivial", mode].wall_us
            if report.kernel_time_unavailable is None and row.note is None:
                assert row.kernel_us > 0
    assert rows["cudnn", "off"].error or rows["cudnn", "off"].wall_us > 0
    print("\n" + overhead.format_report(report))
