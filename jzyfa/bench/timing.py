"""Timing helpers for `jzyfa.bench`: CUPTI kernel time, CUDA-event time, wall-clock time, the SM clock.

Kernel time comes from CUPTI through `jax.experimental.mosaic.gpu.profiler.measure`, which records
the duration of every kernel a jitted function launches. PyTorch peers are timed with CUDA events
around each rotation over the input sets (`torch_event_time`). Wall time is measured over many
asynchronously dispatched calls, synchronised only at the end of each round. The SM clock and the
board power are polled by a background thread (NVML, else `nvidia-smi`) while a timed loop runs.

Nothing here needs a GPU to import; on CPU the kernel timer raises `TimingUnavailable` and the
clock monitor reports no samples.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax


class TimingUnavailable(RuntimeError):
    """The requested timer cannot run here (no GPU, no CUPTI, no NVML...)."""


# ----------------------------------------------------------------------------------------------
# SM clock


def nvml_device_index(device: jax.Device | None = None) -> int | str:
    """The NVML index (or UUID) of a JAX GPU device.

    NVML numbers GPUs ignoring CUDA_VISIBLE_DEVICES, CUDA does not; map through the variable when
    it is set. Returns an int index, or a "GPU-..." UUID string when the variable lists UUIDs.
    """
    device = device or jax.devices()[0]
    ordinal = getattr(device, "local_hardware_id", None)
    ordinal = device.id if ordinal is None else int(ordinal)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if ordinal < len(entries):
            entry = entries[ordinal]
            return int(entry) if entry.isdigit() else entry
    return ordinal


class _NvmlReader:
    """Reads the SM clock (MHz) and board power (W) through pynvml."""

    source = "nvml"

    def __init__(self, index: int | str):
        import pynvml  # nvidia-ml-py; imported lazily, absent on CPU machines

        self._nvml = pynvml
        pynvml.nvmlInit()
        if isinstance(index, str):
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(index)
        else:
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)

    def read(self) -> tuple[float, float | None]:
        nvml = self._nvml
        mhz = float(nvml.nvmlDeviceGetClockInfo(self._handle, nvml.NVML_CLOCK_SM))
        try:
            watts = nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0
        except nvml.NVMLError:
            watts = None
        return mhz, watts

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down is best effort
            pass


class _NvidiaSmiReader:
    """Reads the SM clock (MHz) and board power (W, None when "[N/A]") through one `nvidia-smi`
    process per sample (slow: ~20-50 ms)."""

    source = "nvidia-smi"

    def __init__(self, index: int | str):
        self._cmd = [
            "nvidia-smi",
            f"--id={index}",
            "--query-gpu=clocks.sm,power.draw",
            "--format=csv,noheader,nounits",
        ]
        self.read()  # fail now, not in the thread

    def read(self) -> tuple[float, float | None]:
        text = (
            subprocess.run(self._cmd, capture_output=True, text=True, check=True, timeout=10)
            .stdout.strip()
            .splitlines()[0]
        )
        fields = [f.strip() for f in text.split(",")]
        watts = None
        if len(fields) > 1:
            try:
                watts = float(fields[1])
            except ValueError:
                pass
        return float(fields[0]), watts

    def close(self) -> None:
        pass


def open_clock_reader(device: jax.Device | None = None):
    """An object with read() -> (sm_mhz, watts|None), or None where no GPU clock can be read."""
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return None
    index = nvml_device_index(device)
    for reader_type in (_NvmlReader, _NvidiaSmiReader):
        try:
            return reader_type(index)
        except Exception:  # noqa: BLE001 - try the next source
            continue
    return None


@dataclasses.dataclass
class ClockStats:
    source: str | None  # "nvml", "nvidia-smi", or None (no GPU clock here)
    samples: int
    median_mhz: float | None
    min_mhz: float | None
    max_mhz: float | None
    # Board power (W) over the samples that had a reading; None where the source gives none. NVML
    # on Ampere and newer GPUs (the H200 included) reports power averaged over the last second.
    median_watts: float | None
    min_watts: float | None = None
    max_watts: float | None = None


class ClockMonitor:
    """Polls the SM clock and board power in a background thread while a `with` block runs.

    The reader is opened once and shared by every `with` block; `stats()` summarises the samples of
    the most recent block. At least one sample is taken per block, even for very short ones.
    """

    def __init__(self, reader, interval_s: float = 0.01):
        self._reader = reader
        self._interval_s = interval_s if not isinstance(reader, _NvidiaSmiReader) else 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._samples: list[tuple[float, float | None]] = []

    def _sample(self) -> None:
        try:
            self._samples.append(self._reader.read())
        except Exception:  # noqa: BLE001 - a lost sample is not worth failing a benchmark for
            pass

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self._interval_s)

    def __enter__(self) -> ClockMonitor:
        self._samples = []
        if self._reader is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="sm-clock", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            if not self._samples:
                self._sample()

    def stats(self) -> ClockStats:
        source = getattr(self._reader, "source", None)
        mhz = [s[0] for s in self._samples]
        watts = [s[1] for s in self._samples if s[1] is not None]
        if not mhz:
            return ClockStats(source, 0, None, None, None, None)
        return ClockStats(
            source,
            len(mhz),
            statistics.median(mhz),
            min(mhz),
            max(mhz),
            statistics.median(watts) if watts else None,
            min(watts) if watts else None,
            max(watts) if watts else None,
        )

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()


# ----------------------------------------------------------------------------------------------
# Timers


@dataclasses.dataclass
class Timing:
    """Per-call times in milliseconds."""

    source: str  # "cupti" or "wall"
    samples_ms: list[float]  # one per sample; each sample averages `calls_per_sample` calls
    calls_per_sample: int
    clock: ClockStats
    kernels: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.samples_ms)
        return {
            "source": self.source,
            "median_ms": self.median_ms,
            "min_ms": ordered[0],
            "p10_ms": ordered[int(0.1 * (len(ordered) - 1))],
            "p90_ms": ordered[math.ceil(0.9 * (len(ordered) - 1))],
            "samples": len(ordered),
            "calls_per_sample": self.calls_per_sample,
            "sm_clock": dataclasses.asdict(self.clock),
            "kernels": self.kernels,
        }


def warm_up(
    fn: Callable,
    arg_sets: Sequence[tuple],
    min_seconds: float,
    min_calls: int = 2,
    sync: Callable[[Any], Any] = jax.block_until_ready,
) -> float:
    """Calls fn over the rotating argument sets (compiling it) and returns the time of one call (s).

    Runs at least `min_calls` calls per set, and for at least `min_seconds` so the GPU clocks
    ramp up. The estimate is taken after the first (compiling) round. `sync(out)` waits for an
    output (JAX's by default; PyTorch peers pass a CUDA synchronize).
    """
    sync(fn(*arg_sets[0]))
    calls = 0
    start = time.perf_counter()
    while True:
        out = None
        for args in arg_sets:
            out = fn(*args)
            calls += 1
        sync(out)
        elapsed = time.perf_counter() - start
        if calls >= min_calls * len(arg_sets) and elapsed >= min_seconds:
            return elapsed / calls


def wall_clock(
    fn: Callable,
    arg_sets: Sequence[tuple],
    *,
    calls: int,
    rounds: int,
    monitor: ClockMonitor,
    sync: Callable[[Any], Any] = jax.block_until_ready,
) -> Timing:
    """Per-call wall time: `rounds` rounds of asynchronously dispatched calls, inputs rotating.

    Each round dispatches its calls back to back and waits only for the last output (the calls of
    one device run in order), so the figure includes dispatch overhead wherever the host cannot
    keep ahead of the device.
    """
    rounds = max(1, min(rounds, calls))
    per_round = max(1, math.ceil(calls / rounds))
    samples = []
    with monitor:
        for _ in range(rounds):
            start = time.perf_counter()
            out = None
            for i in range(per_round):
                out = fn(*arg_sets[i % len(arg_sets)])
            sync(out)
            samples.append((time.perf_counter() - start) * 1e3 / per_round)
            del out
    return Timing("wall", samples, per_round, monitor.stats())


def cupti_available() -> str | None:
    """None when CUPTI kernel timing can run, else why not."""
    if jax.default_backend() != "gpu":
        return f"the JAX backend is {jax.default_backend()!r}, not a GPU"
    try:
        from jax.experimental.mosaic.gpu import profiler
    except Exception as e:  # noqa: BLE001 - any import failure means no CUPTI
        return f"cannot import jax.experimental.mosaic.gpu.profiler: {e}"
    if getattr(profiler, "mosaic_gpu_lib", None) is None:
        return "jaxlib has no Mosaic GPU extension (it carries the CUPTI bindings)"
    return None


def cupti_kernel_time(
    fn: Callable,
    arg_sets: Sequence[tuple],
    *,
    min_samples: int,
    min_seconds: float,
    max_iterations_per_chunk: int,
    monitor: ClockMonitor,
    warmup_s: float = 0.0,
    max_kernel_names: int = 8,
) -> Timing:
    """Per-call kernel time from CUPTI: the sum of the durations of every kernel one call launches.

    One jitted program calls `fn` once on each argument set (so consecutive calls read different
    buffers); `profiler.measure` runs it `iterations` times and returns each iteration's kernels.
    A sample is one iteration's summed kernel time divided by the number of sets. XLA may fuse,
    reorder or share work across the independent calls (on the H200 it computed XLA attention's
    causal mask once for both calls: 0.3% of that call), so only sums are used, never per-kernel
    positions; a single-kernel implementation is unaffected.

    Samples are gathered in chunks (each `measure` keeps all its outputs alive until it returns,
    so a chunk is bounded by memory) until there are `min_samples` and `min_seconds` have passed.
    The rotated program is compiled and run for `warmup_s` first, so the GPU is not idle (and its
    clock not low) when the timed loop starts.
    """
    reason = cupti_available()
    if reason is not None:
        raise TimingUnavailable(reason)
    from jax.experimental.mosaic.gpu import profiler

    n_sets = len(arg_sets)
    rotated = jax.jit(lambda sets: tuple(fn(*args) for args in sets))
    iterations = max(2, min(max_iterations_per_chunk, min_samples))
    timed = profiler.measure(rotated, aggregate=False, iterations=iterations)
    warm_up(rotated, [(list(arg_sets),)], warmup_s, min_calls=1)  # compiles it too

    samples: list[float] = []
    per_kernel_ms: dict[str, float] = collections.defaultdict(float)
    per_kernel_count: dict[str, int] = collections.defaultdict(int)
    start = time.perf_counter()
    with monitor:
        while len(samples) < min_samples or time.perf_counter() - start < min_seconds:
            outs, per_iteration = timed(list(arg_sets))
            del outs
            if per_iteration is None:
                raise TimingUnavailable("CUPTI recorded no kernel launches")
            for kernels in per_iteration:
                samples.append(sum(ms for _, ms in kernels) / n_sets)
                for name, ms in kernels:
                    per_kernel_ms[name] += ms
                    per_kernel_count[name] += 1
    calls = len(samples) * n_sets
    kernels = [
        {
            "name": name if len(name) <= 160 else name[:157] + "...",
            "ms_per_call": total / calls,
            "launches_per_call": per_kernel_count[name] / calls,
        }
        for name, total in sorted(per_kernel_ms.items(), key=lambda kv: -kv[1])
    ][:max_kernel_names]
    return Timing("cupti", samples, n_sets, monitor.stats(), kernels)


def torch_event_time(
    fn: Callable,
    arg_sets: Sequence[tuple],
    *,
    min_samples: int,
    min_seconds: float,
    monitor: ClockMonitor,
    samples_per_chunk: int = 20,
) -> Timing:
    """Per-call GPU time of a PyTorch function, from CUDA events around each rotation over the sets.

    A sample is the time between two events recorded on the current stream before and after one
    call per argument set, divided by the number of sets; a chunk of samples is queued back to back
    and synchronised once, so the GPU does not idle between samples. The events bracket everything
    the stream runs, including any launch gaps (negligible once a call takes more than ~50 us).
    Call `warm_up` first (it compiles nothing here, but ramps the clock up).
    """
    import torch

    n_sets = len(arg_sets)
    samples: list[float] = []
    start = time.perf_counter()
    with monitor:
        while len(samples) < min_samples or time.perf_counter() - start < min_seconds:
            events = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(samples_per_chunk)
            ]
            for begin, end in events:
                begin.record()
                for args in arg_sets:
                    fn(*args)
                end.record()
            torch.cuda.synchronize()
            samples += [begin.elapsed_time(end) / n_sets for begin, end in events]
    return Timing("cuda-events", samples, n_sets, monitor.stats())


def sustained_burst(
    fn: Callable,
    arg_sets: Sequence[tuple],
    *,
    seconds: float,
    per_call_s: float,
    monitor: ClockMonitor,
    sync: Callable[[Any], Any] = jax.block_until_ready,
) -> tuple[int, float, ClockStats]:
    """(calls, wall seconds, clock and power during them) of one burst: enough calls back to back to
    fill `seconds` at `per_call_s` (a warm-up's estimate), inputs rotating, waiting only for the last.
    """
    calls = max(1, math.ceil(seconds / max(per_call_s, 1e-9)))
    with monitor:
        start = time.perf_counter()
        out = None
        for i in range(calls):
            out = fn(*arg_sets[i % len(arg_sets)])
        sync(out)
        elapsed = time.perf_counter() - start
        del out
    return calls, elapsed, monitor.stats()
