r"""Benchmark jzyfa's attention forward against cuDNN and XLA: `python -m jzyfa.bench`.

For every shape and implementation: check the output against a float64 NumPy reference on a
slice of (batch, head) pairs, then time it (CUPTI kernel time on a GPU, and wall-clock time per
call everywhere), reading the SM clock while the timed loop runs. Progress goes to stderr; the
table (plain, or markdown with --markdown) to stdout; everything to --json_out.

Standard run on a Hopper GPU (the defaults): causal, head dim 128, 16 heads, bf16,
(batch, seq) in (16,1024) (8,2048) (4,4096) (2,8192) (1,16384):

  python -m jzyfa.bench --json_out bench.json --markdown

Without a GPU the command runs in smoke mode (small shapes, few iterations), which is also what
`--smoke` forces on a GPU.

FLOPs: 4 * B * Hq * Sq * Sk * D, halved for causal when Sq == Sk (the FA3 / cuDNN convention);
for causal with Sq != Sk the count uses the number of (query, key) pairs the bottom-right
aligned mask leaves visible.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import math
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from jzyfa import _timing

STANDARD_SHAPES = "16x1024,8x2048,4x4096,2x8192,1x16384"
SMOKE_SHAPES = "2x128,1x256"

FLAGS = flags.FLAGS
flags.DEFINE_string(
    "shapes", STANDARD_SHAPES,
    "Comma-separated BxS (Sq = Sk = S) or BxSqxSk problem sizes.")
flags.DEFINE_integer("heads", 16, "Query heads (Hq).")
flags.DEFINE_integer("kv_heads", None, "Key/value heads (Hkv, GQA/MQA); default: --heads.")
flags.DEFINE_integer("head_dim", 128, "Head dimension D.")
flags.DEFINE_bool("causal", True, "Causal mask (bottom-right aligned); --nocausal for none.")
flags.DEFINE_enum("dtype", "bf16", ["bf16", "f16"], "Input and output dtype.")
flags.DEFINE_string(
    "impls", "jzyfa,cudnn,xla",
    "Comma-separated implementations: jzyfa (the kernel on a GPU, the default path elsewhere), "
    "jzyfa_xla (jzyfa's pure-JAX path), cudnn and xla (jax.nn.dot_product_attention), "
    "pallas (Pallas Mosaic GPU attention; f16 only).")
flags.DEFINE_integer(
    "iters", 100,
    "Minimum number of timed samples (kernel time: one per rotation over the input sets) and of "
    "wall-clock calls.")
flags.DEFINE_float("min_time_s", 1.0, "Minimum duration of each timed loop, in seconds.")
flags.DEFINE_float("warmup_s", 0.5, "Minimum warm-up per measurement, in seconds.")
flags.DEFINE_integer("wall_rounds", 10, "Wall-clock rounds; the median over rounds is reported.")
flags.DEFINE_integer(
    "rotate_mb", 256,
    "Inputs rotate over enough sets (q, k, v, out) to span this many MB (2 sets at least), so "
    "the 60 MB L2 cannot hold them between calls.")
flags.DEFINE_integer(
    "cupti_mem_mb", 16384,
    "Memory the outputs of one CUPTI chunk may take (they stay alive until the chunk ends).")
flags.DEFINE_integer(
    "ref_pairs", -1,
    "(batch, head) pairs checked against the float64 reference; -1: as many as a fixed budget "
    "of reference FLOPs allows (2 to 16), 0: all.")
flags.DEFINE_float(
    "max_rel_err", None, "Relative L2 error above which a result is marked BAD; default by "
    "dtype (bf16 2e-2, f16 5e-3).")
flags.DEFINE_bool("cupti", True, "Use CUPTI kernel time on GPUs (wall time is always measured).")
flags.DEFINE_bool(
    "smoke", None,
    "Small shapes and few iterations (the default when the backend is not a GPU). Flags given "
    "explicitly still apply.")
flags.DEFINE_integer("seed", 0, "Seed of the random normal inputs.")
flags.DEFINE_string("json_out", None, "Write the results as JSON to this path.")
flags.DEFINE_bool("markdown", False, "Print markdown tables (for docs/benchmarks.md).")

# What --smoke changes, unless the flag was given explicitly.
_SMOKE_OVERRIDES = {
    "shapes": SMOKE_SHAPES,
    "heads": 4,
    "iters": 3,
    "min_time_s": 0.0,
    "warmup_s": 0.0,
    "wall_rounds": 3,
    "rotate_mb": 1,
    "ref_pairs": 0,
}

_REF_FLOP_BUDGET = 2e11  # float64 reference FLOPs per shape when --ref_pairs=-1


# ----------------------------------------------------------------------------------------------
# Problems and FLOPs


@dataclasses.dataclass(frozen=True)
class Problem:
    batch: int
    seq_q: int
    seq_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool
    dtype: str  # "bf16" | "f16"

    @property
    def jnp_dtype(self):
        return {"bf16": jnp.bfloat16, "f16": jnp.float16}[self.dtype]

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def q_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seq_q, self.heads_q, self.head_dim)

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seq_k, self.heads_kv, self.head_dim)

    @property
    def set_bytes(self) -> int:
        """Bytes of one input set plus its output."""
        itemsize = jnp.dtype(self.jnp_dtype).itemsize
        return itemsize * (2 * math.prod(self.q_shape) + 2 * math.prod(self.kv_shape))

    @property
    def flops(self) -> float:
        return attention_flops(self.batch, self.seq_q, self.seq_k, self.heads_q, self.head_dim,
                               self.causal)

    @property
    def label(self) -> str:
        seq = f"{self.seq_q}" if self.seq_q == self.seq_k else f"{self.seq_q}x{self.seq_k}"
        return f"{self.batch}x{seq}"


def visible_pairs(seq_q: int, seq_k: int, causal: bool) -> int:
    """(query, key) pairs the mask leaves visible; causal is bottom-right aligned."""
    if not causal:
        return seq_q * seq_k
    # Query i sees keys j <= i + seq_k - seq_q: clamp(i + seq_k - seq_q + 1, 0, seq_k) of them.
    per_row = np.clip(np.arange(seq_q, dtype=np.int64) + (seq_k - seq_q + 1), 0, seq_k)
    return int(per_row.sum())


def attention_flops(batch: int, seq_q: int, seq_k: int, heads_q: int, head_dim: int,
                    causal: bool) -> float:
    """Forward FLOPs of attention: two matmuls of 2 * D FLOPs per (query, key) pair.

    4 * B * Hq * Sq * Sk * D, halved for causal when Sq == Sk (the convention of FA3, cuDNN and
    Pallas, slightly under the S(S+1)/2 pairs really computed); for causal with Sq != Sk, the
    visible pairs of the bottom-right aligned mask are counted.
    """
    full = 4.0 * batch * heads_q * seq_q * seq_k * head_dim
    if not causal:
        return full
    if seq_q == seq_k:
        return full / 2
    return 4.0 * batch * heads_q * head_dim * visible_pairs(seq_q, seq_k, True)


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """'16x1024,1x512x4096' -> [(16, 1024, 1024), (1, 512, 4096)] as (batch, seq_q, seq_k)."""
    shapes = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        try:
            dims = [int(d) for d in item.split("x")]
        except ValueError:
            dims = []
        if len(dims) not in (2, 3) or min(dims) < 1:
            raise ValueError(f"--shapes: {item!r} is not BxS or BxSqxSk with positive integers")
        shapes.append((dims[0], dims[1], dims[-1]))
    if not shapes:
        raise ValueError("--shapes: no shape given")
    return shapes


# ----------------------------------------------------------------------------------------------
# Implementations


class Unsupported(Exception):
    """The implementation does not serve this problem (reported, not an error)."""


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    description: str
    # build(problem) -> fn(q, k, v) -> out; raises Unsupported for problems it does not serve.
    build: Callable[[Problem], Callable]
    # prepare(problem, q, k, v) -> (q, k, v): input transforms kept out of the timed call.
    prepare: Callable[[Problem, Any, Any, Any], tuple] = lambda problem, q, k, v: (q, k, v)


def _jzyfa_impl(implementation: str | None) -> Callable[[Problem], Callable]:
    def build(problem: Problem) -> Callable:
        import jzyfa

        mode = implementation
        if mode == "auto":  # on a GPU, time the kernel or fail; never a silent fallback
            mode = "kernel" if jax.default_backend() == "gpu" else None

        def fn(q, k, v):
            return jzyfa.flash_attention(q, k, v, causal=problem.causal,
                                         softmax_scale=problem.softmax_scale,
                                         implementation=mode)
        return fn
    return build


def _jax_nn_impl(implementation: str) -> Callable[[Problem], Callable]:
    def build(problem: Problem) -> Callable:
        if problem.causal and problem.seq_q != problem.seq_k:
            raise Unsupported("jax.nn.dot_product_attention aligns is_causal top-left; "
                              "jzyfa's mask is bottom-right, so Sq != Sk is not comparable")

        def fn(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, scale=problem.softmax_scale,
                                                is_causal=problem.causal,
                                                implementation=implementation)
        return fn
    return build


def _pallas_build(problem: Problem) -> Callable:
    if jax.default_backend() != "gpu":
        raise Unsupported("Pallas Mosaic GPU attention needs a GPU")
    if problem.dtype != "f16":
        raise Unsupported("Pallas Mosaic GPU attention fails in bf16 (its scratch is f16); "
                          "use --dtype f16")
    if problem.causal and problem.seq_q != problem.seq_k:
        raise Unsupported("Pallas attention's causal mask is not bottom-right aligned for Sq != Sk")
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    config = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2,
                                         causal=problem.causal)
    return lambda q, k, v: attention_mgpu.attention(q, k, v, config)


def _prescale_q(problem: Problem, q, k, v):
    """Pallas' attention takes no softmax scale: scale q once, outside the timed call."""
    return (q.astype(jnp.float32) * problem.softmax_scale).astype(q.dtype), k, v


IMPLS = {
    impl.name: impl for impl in [
        Impl("jzyfa", "jzyfa.flash_attention (kernel on GPU)", _jzyfa_impl("auto")),
        Impl("jzyfa_xla", 'jzyfa.flash_attention(implementation="xla")', _jzyfa_impl("xla")),
        Impl("cudnn", 'jax.nn.dot_product_attention(implementation="cudnn")',
             _jax_nn_impl("cudnn")),
        Impl("xla", 'jax.nn.dot_product_attention(implementation="xla")', _jax_nn_impl("xla")),
        Impl("pallas", "jax.experimental.pallas.ops.gpu.attention_mgpu (block 64x128)",
             _pallas_build, _prescale_q),
    ]
}


# ----------------------------------------------------------------------------------------------
# Inputs and the float64 reference


def make_inputs(problem: Problem, n_sets: int, seed: int) -> list[tuple[jax.Array, ...]]:
    """n_sets independent (q, k, v) sets of standard normal values, generated on the device."""
    @jax.jit
    def one_set(key):
        kq, kk, kv = jax.random.split(key, 3)
        return (jax.random.normal(kq, problem.q_shape, jnp.float32).astype(problem.jnp_dtype),
                jax.random.normal(kk, problem.kv_shape, jnp.float32).astype(problem.jnp_dtype),
                jax.random.normal(kv, problem.kv_shape, jnp.float32).astype(problem.jnp_dtype))

    keys = jax.random.split(jax.random.key(seed), n_sets)
    return [jax.block_until_ready(one_set(keys[i])) for i in range(n_sets)]


def rotation_sets(problem: Problem, rotate_mb: int) -> int:
    """How many input sets to rotate over: at least 2, spanning rotate_mb MB."""
    return max(2, math.ceil(rotate_mb * 2**20 / problem.set_bytes))


def reference_pairs(problem: Problem, requested: int) -> list[tuple[int, int]]:
    """(batch, query head) pairs to check, spread evenly over the flattened batch*heads index."""
    total = problem.batch * problem.heads_q
    if requested == 0:
        n = total
    elif requested > 0:
        n = min(requested, total)
    else:
        per_pair = 4.0 * problem.head_dim * visible_pairs(problem.seq_q, problem.seq_k,
                                                          problem.causal)
        n = min(total, max(2, min(16, int(_REF_FLOP_BUDGET // per_pair))))
    flat = sorted({round(i * (total - 1) / max(1, n - 1)) for i in range(n)})
    return [(i // problem.heads_q, i % problem.heads_q) for i in flat]


def attention_float64(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
                      causal: bool) -> np.ndarray:
    """Attention of one head in float64: q [Sq, D], k and v [Sk, D] -> [Sq, D].

    Runs over blocks of query rows so long sequences fit in memory; under the causal mask a
    block only multiplies the keys its rows can see. Rows that see no key give 0.
    """
    seq_q, seq_k = q.shape[0], k.shape[0]
    offset = seq_k - seq_q  # bottom-right: row i sees keys j <= i + offset
    out = np.zeros((seq_q, v.shape[1]), np.float64)
    rows_per_block = max(1, min(seq_q, 2**22 // seq_k))
    for start in range(0, seq_q, rows_per_block):
        stop = min(seq_q, start + rows_per_block)
        keys = min(seq_k, stop + offset) if causal else seq_k
        if keys <= 0:
            continue
        scores = (q[start:stop] @ k[:keys].T) * scale
        if causal:
            rows = np.arange(start, stop)[:, None]
            scores = np.where(np.arange(keys)[None, :] <= rows + offset, scores, -np.inf)
        row_max = scores.max(axis=1, keepdims=True)
        seen = np.isfinite(row_max)
        probs = np.exp(scores - np.where(seen, row_max, 0.0))
        row_sum = probs.sum(axis=1, keepdims=True)
        out[start:stop] = np.where(seen, (probs @ v[:keys]) / np.where(seen, row_sum, 1.0), 0.0)
    return out


def take_pairs(x: jax.Array, batches: np.ndarray, heads: np.ndarray) -> np.ndarray:
    """x[b, :, h, :] for each pair, as float64 [pairs, S, D] on the host."""
    return np.asarray(jax.device_get(x[batches, :, heads, :]), dtype=np.float64)


@dataclasses.dataclass
class Reference:
    batches: np.ndarray
    heads: np.ndarray
    out: np.ndarray  # float64 [pairs, Sq, D]
    seconds: float


def compute_reference(problem: Problem, q, k, v, requested_pairs: int) -> Reference:
    start = time.perf_counter()
    pairs = reference_pairs(problem, requested_pairs)
    batches = np.array([b for b, _ in pairs])
    heads = np.array([h for _, h in pairs])
    group = problem.heads_q // problem.heads_kv
    qs = take_pairs(q, batches, heads)
    ks = take_pairs(k, batches, heads // group)
    vs = take_pairs(v, batches, heads // group)
    out = np.stack([attention_float64(qs[i], ks[i], vs[i], problem.softmax_scale, problem.causal)
                    for i in range(len(pairs))])
    return Reference(batches, heads, out, time.perf_counter() - start)


def relative_error(out: jax.Array, ref: Reference) -> dict[str, float]:
    """Relative L2 error and max abs error of out against the reference, over the checked pairs."""
    got = take_pairs(out, ref.batches, ref.heads)
    diff = got - ref.out
    ref_norm = float(np.linalg.norm(ref.out))
    diff_norm = float(np.linalg.norm(diff))
    return {
        "rel_l2": diff_norm / ref_norm if ref_norm > 0 else diff_norm,
        "max_abs": float(np.max(np.abs(diff))) if diff.size else 0.0,
        "finite": bool(np.all(np.isfinite(got))),
    }


# ----------------------------------------------------------------------------------------------
# Environment


def _run_text(cmd: Sequence[str]) -> str | None:
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, check=True,
                              timeout=20).stdout.strip() or None
    except Exception:  # noqa: BLE001 - optional information
        return None


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            return version.decode() if isinstance(version, bytes) else version
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - fall back to nvidia-smi
        text = _run_text(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        return text.splitlines()[0] if text else None


def _cuda_versions() -> dict[str, Any]:
    try:
        from jax._src.lib import cuda_versions
    except Exception:  # noqa: BLE001
        return {}
    if cuda_versions is None:
        return {}
    versions = {}
    for key in ("cuda_runtime_get_version", "cuda_driver_get_version", "cudnn_get_version",
                "cublas_get_version", "cupti_get_version"):
        try:
            versions[key.replace("_get_version", "")] = getattr(cuda_versions, key)()
        except Exception:  # noqa: BLE001
            pass
    return versions


def _jzyfa_status() -> dict[str, Any]:
    info: dict[str, Any] = {}
    try:
        import jzyfa

        info["kernel_unavailable"] = jzyfa.kernel_unavailable_reason()
    except Exception as e:  # noqa: BLE001
        info["kernel_unavailable"] = f"unknown ({type(e).__name__}: {e})"
    try:
        import importlib.metadata

        info["version"] = importlib.metadata.version("jzyfa")
    except Exception:  # noqa: BLE001 - running from a source tree
        info["version"] = None
    info["git_commit"] = _run_text(["git", "-C", str(_package_dir()), "rev-parse", "--short",
                                    "HEAD"])
    return info


def _package_dir():
    import pathlib

    return pathlib.Path(__file__).resolve().parent


def collect_env() -> dict[str, Any]:
    import jaxlib

    device = jax.devices()[0]
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": jax.default_backend(),
        "device_count": jax.device_count(),
        "device": device.device_kind,
        "compute_capability": getattr(device, "compute_capability", None),
        "driver": None,
        "cuda": _cuda_versions(),
        "jzyfa": _jzyfa_status(),
    }
    if device.platform == "gpu":
        env["driver"] = _driver_version()
    return env


def header_line(env: dict[str, Any]) -> str:
    parts = [env["device"]]
    if env.get("compute_capability"):
        parts[0] += f" (sm {env['compute_capability']})"
    if env.get("driver"):
        parts.append(f"driver {env['driver']}")
    cuda = env.get("cuda") or {}
    if "cuda_runtime" in cuda:
        parts.append(f"CUDA runtime {cuda['cuda_runtime']}")
    if "cudnn" in cuda:
        parts.append(f"cuDNN {cuda['cudnn']}")
    parts.append(f"jax {env['jax']} / jaxlib {env['jaxlib']}")
    jz = env.get("jzyfa") or {}
    if jz.get("git_commit"):
        parts.append(f"jzyfa {jz['git_commit']}")
    return ", ".join(parts)


# ----------------------------------------------------------------------------------------------
# One measurement


@dataclasses.dataclass
class Options:
    iters: int
    min_time_s: float
    warmup_s: float
    wall_rounds: int
    cupti: bool
    cupti_mem_mb: int
    max_rel_err: float


def _short_error(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(e).__name__}: {first}"[:300]


def measure_impl(impl: Impl, problem: Problem, sets: list[tuple], ref: Reference,
                 opts: Options, monitor: _timing.ClockMonitor) -> dict[str, Any]:
    """Checks one implementation on one problem, then times it. Never raises."""
    result: dict[str, Any] = {
        "impl": impl.name,
        "batch": problem.batch,
        "seq_q": problem.seq_q,
        "seq_k": problem.seq_k,
        "heads_q": problem.heads_q,
        "heads_kv": problem.heads_kv,
        "head_dim": problem.head_dim,
        "causal": problem.causal,
        "dtype": problem.dtype,
        "flops": problem.flops,
        "input_sets": len(sets),
        "status": None,
        "message": None,
        "rel_err": None,
        "max_abs_err": None,
        "err_ok": None,
        "median_ms": None,
        "tflops": None,
        "timing_source": None,
        "sm_clock_mhz": None,
        "kernel": None,  # CUPTI kernel-time summary, GPU only
        "kernel_unavailable": None,  # why there is no kernel time, when CUPTI failed
        "wall": None,  # wall-clock summary
        "wall_tflops": None,
    }
    # Build and check.
    try:
        fn = impl.build(problem)
        args = [impl.prepare(problem, *s) for s in sets]
        jitted = jax.jit(fn)
        out = jax.block_until_ready(jitted(*args[0]))
    except Unsupported as e:
        result.update(status="unsupported", message=str(e))
        return result
    except Exception as e:  # noqa: BLE001 - reported, and the run goes on
        result.update(status="error", message=_short_error(e),
                      traceback=traceback.format_exc(limit=8))
        return result
    err = relative_error(out, ref)
    del out
    result.update(rel_err=err["rel_l2"], max_abs_err=err["max_abs"])
    result["err_ok"] = bool(err["finite"] and err["rel_l2"] <= opts.max_rel_err)

    # Time.
    try:
        per_call_s = _timing.warm_up(jitted, args, opts.warmup_s)
        if opts.cupti:
            try:
                out_bytes = _out_bytes(problem) * len(args)  # one chunk iteration's outputs
                max_chunk = max(2, int(opts.cupti_mem_mb * 2**20 // out_bytes))
                kernel = _timing.cupti_kernel_time(
                    fn, args, min_samples=opts.iters, min_seconds=opts.min_time_s,
                    max_iterations_per_chunk=max_chunk, monitor=monitor,
                    warmup_s=opts.warmup_s)
                result["kernel"] = kernel.summary()
            except Exception as e:  # noqa: BLE001 - wall time still serves
                result["kernel_unavailable"] = _short_error(e)
        calls = max(opts.iters, math.ceil(opts.min_time_s / max(per_call_s, 1e-9)))
        wall = _timing.wall_clock(jitted, args, calls=calls, rounds=opts.wall_rounds,
                                  monitor=monitor)
        result["wall"] = wall.summary()
    except Exception as e:  # noqa: BLE001
        result.update(status="error", message="timing: " + _short_error(e),
                      traceback=traceback.format_exc(limit=8))
        return result

    primary = result["kernel"] or result["wall"]
    result["timing_source"] = primary["source"]
    result["median_ms"] = primary["median_ms"]
    result["tflops"] = problem.flops / (primary["median_ms"] * 1e-3) / 1e12
    result["sm_clock_mhz"] = primary["sm_clock"]["median_mhz"]
    result["wall_tflops"] = problem.flops / (result["wall"]["median_ms"] * 1e-3) / 1e12
    result["status"] = "ok" if result["err_ok"] else "bad"
    if not result["err_ok"]:
        result["message"] = f"relative error {err['rel_l2']:.3g} > {opts.max_rel_err:g}"
    return result


def _out_bytes(problem: Problem) -> int:
    return math.prod(problem.q_shape) * jnp.dtype(problem.jnp_dtype).itemsize


# ----------------------------------------------------------------------------------------------
# Reporting


def _fmt(value, spec: str, missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec)


def _fmt_tflops(value: float | None) -> str:
    """Whole TFLOP/s on a GPU; three significant digits for the small CPU figures."""
    if value is None:
        return "n/a"
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _shape_cells(r: dict[str, Any]) -> list[str]:
    seq = str(r["seq_q"]) if r["seq_q"] == r["seq_k"] else f"{r['seq_q']}/{r['seq_k']}"
    heads = (str(r["heads_q"]) if r["heads_q"] == r["heads_kv"]
             else f"{r['heads_q']}/{r['heads_kv']}")
    return [str(r["batch"]), seq, heads, str(r["head_dim"]), "yes" if r["causal"] else "no"]


TABLE_COLUMNS = ["impl", "B", "S", "H", "D", "causal", "median ms", "wall ms", "TFLOP/s",
                 "SM MHz", "rel err", "status"]


def table_rows(results: Sequence[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in results:
        wall_ms = r["wall"]["median_ms"] if r.get("wall") else None
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['message']}"
        rows.append([r["impl"], *_shape_cells(r), _fmt(r["median_ms"], ".3f"),
                     _fmt(wall_ms, ".3f"), _fmt_tflops(r["tflops"]),
                     _fmt(r["sm_clock_mhz"], ".0f"), _fmt(r["rel_err"], ".2e"), status])
    return rows


def format_plain(results: Sequence[dict[str, Any]]) -> str:
    rows = [TABLE_COLUMNS] + table_rows(results)
    widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE_COLUMNS) - 1)]
    lines = []
    for row in rows:
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells + [row[-1]]))
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def format_markdown(results: Sequence[dict[str, Any]], env: dict[str, Any],
                    config: dict[str, Any]) -> str:
    def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
        return out

    source = sorted({r["timing_source"] for r in results if r["timing_source"]})
    timing = {"cupti": "CUPTI kernel time", "wall": "wall-clock time per call"}
    lines = [
        f"{header_line(env)}; {config['dtype']}, head dim {config['head_dim']}, "
        f"{_heads_text(config)}, {'causal' if config['causal'] else 'non-causal'}; "
        f"median {' / '.join(timing[s] for s in source) or 'n/a'}, "
        "causal FLOPs counted half; random normal inputs.",
        "",
    ]
    # Summary: TFLOP/s per implementation (rows) and shape (columns).
    labels = list(dict.fromkeys(_label(r) for r in results))
    impls = list(dict.fromkeys(r["impl"] for r in results))
    by_key = {(r["impl"], _label(r)): r for r in results}
    summary = []
    for impl in impls:
        row = [impl]
        for label in labels:
            r = by_key.get((impl, label))
            if r is None or r["tflops"] is None:
                row.append("-" if r is None else r["status"])
            else:
                mhz = _fmt(r["sm_clock_mhz"], ".0f", "")
                row.append(_fmt_tflops(r["tflops"]) + (f" ({mhz} MHz)" if mhz else "")
                           + ("" if r["status"] == "ok" else " BAD"))
        summary.append(row)
    lines += ["TFLOP/s (SM clock during the timed loop):", ""]
    lines += md_table(["impl"] + labels, summary)
    lines += ["", "Details:", ""]
    lines += md_table(TABLE_COLUMNS, table_rows(results))
    return "\n".join(lines)


def _label(r: dict[str, Any]) -> str:
    seq = str(r["seq_q"]) if r["seq_q"] == r["seq_k"] else f"{r['seq_q']}x{r['seq_k']}"
    return f"{r['batch']}x{seq}"


def _heads_text(config: dict[str, Any]) -> str:
    kv = config.get("kv_heads") or config["heads"]
    return f"{config['heads']} heads" + ("" if kv == config["heads"] else f" ({kv} kv heads)")


def progress_line(r: dict[str, Any]) -> str:
    head = (f"{r['impl']:>10} B={r['batch']} Sq={r['seq_q']} Sk={r['seq_k']} "
            f"H={r['heads_q']}/{r['heads_kv']} D={r['head_dim']}"
            f"{' causal' if r['causal'] else ''}")
    if r["status"] in ("unsupported", "error"):
        return f"{head}: {r['status']}: {r['message']}"
    parts = [f"err {r['rel_err']:.2e}"]
    if r.get("kernel"):
        k = r["kernel"]
        parts.append(f"kernel {k['median_ms']:.4f} ms ({k['samples']} samples)")
    elif r.get("kernel_unavailable"):
        parts.append(f"no kernel time ({r['kernel_unavailable'][:80]})")
    if r.get("wall"):
        parts.append(f"wall {r['wall']['median_ms']:.4f} ms")
    parts.append(f"{_fmt_tflops(r['tflops'])} TFLOP/s")
    parts.append(f"SM {_fmt(r['sm_clock_mhz'], '.0f')} MHz")
    return f"{head}: " + ", ".join(parts) + ("" if r["status"] == "ok" else " [BAD]")


# ----------------------------------------------------------------------------------------------
# Main


def _log(text: str) -> None:
    print(f"[jzyfa.bench] {text}", file=sys.stderr, flush=True)


def resolve_config() -> dict[str, Any]:
    """The flag values after smoke mode, as a plain dict."""
    smoke = FLAGS.smoke
    if smoke is None:
        smoke = jax.default_backend() != "gpu"
    config = {name: FLAGS[name].value for name in [
        "shapes", "heads", "kv_heads", "head_dim", "causal", "dtype", "impls", "iters",
        "min_time_s", "warmup_s", "wall_rounds", "rotate_mb", "cupti_mem_mb", "ref_pairs",
        "max_rel_err", "cupti", "seed", "json_out", "markdown"]}
    if smoke:
        for name, value in _SMOKE_OVERRIDES.items():
            if not FLAGS[name].present:
                config[name] = value
    config["smoke"] = smoke
    if config["max_rel_err"] is None:
        config["max_rel_err"] = {"bf16": 2e-2, "f16": 5e-3}[config["dtype"]]
    return config


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Runs the benchmark described by config (see resolve_config) and returns the report."""
    shapes = parse_shapes(config["shapes"])
    impl_names = [name.strip() for name in config["impls"].split(",") if name.strip()]
    unknown = [name for name in impl_names if name not in IMPLS]
    if unknown:
        raise ValueError(f"--impls: unknown {unknown}; known: {sorted(IMPLS)}")
    heads_q = config["heads"]
    heads_kv = config["kv_heads"] or heads_q
    if heads_q % heads_kv:
        raise ValueError(f"--heads ({heads_q}) must be a multiple of --kv_heads ({heads_kv})")

    env = collect_env()
    _log(header_line(env))
    if config["smoke"]:
        _log("smoke mode: small shapes, few iterations (no GPU, or --smoke)")
    opts = Options(iters=config["iters"], min_time_s=config["min_time_s"],
                   warmup_s=config["warmup_s"], wall_rounds=config["wall_rounds"],
                   cupti=config["cupti"], cupti_mem_mb=config["cupti_mem_mb"],
                   max_rel_err=config["max_rel_err"])
    if opts.cupti and (reason := _timing.cupti_available()) is not None:
        _log(f"no CUPTI kernel time ({reason}); timing wall clock only")
        opts.cupti = False
    monitor = _timing.ClockMonitor(_timing.open_clock_reader())

    results = []
    try:
        for batch, seq_q, seq_k in shapes:
            problem = Problem(batch, seq_q, seq_k, heads_q, heads_kv, config["head_dim"],
                              config["causal"], config["dtype"])
            n_sets = rotation_sets(problem, config["rotate_mb"])
            sets = make_inputs(problem, n_sets, config["seed"])
            ref = compute_reference(problem, *sets[0], config["ref_pairs"])
            _log(f"{problem.label}: {n_sets} input sets of {problem.set_bytes / 2**20:.0f} MB, "
                 f"reference on {len(ref.batches)} (batch, head) pairs in {ref.seconds:.1f} s")
            for name in impl_names:
                result = measure_impl(IMPLS[name], problem, sets, ref, opts, monitor)
                result["reference_pairs"] = len(ref.batches)
                results.append(result)
                _log(progress_line(result))
            del sets
            gc.collect()
    finally:
        monitor.close()
    return {"env": env, "config": config, "results": results}


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = resolve_config()
    report = run(config)
    if config["markdown"]:
        print(format_markdown(report["results"], report["env"], config))
    else:
        print(header_line(report["env"]))
        print(format_plain(report["results"]))
    if config["json_out"]:
        with open(config["json_out"], "w") as f:
            json.dump(_json_safe(report), f, indent=1, allow_nan=False)
            f.write("\n")
        _log(f"wrote {config['json_out']}")


def _json_safe(value):
    """The report as strict JSON values: NumPy scalars unwrapped, non-finite floats as strings."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (np.generic, np.ndarray)):
        return _json_safe(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf"
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def run_main() -> None:
    app.run(main)


if __name__ == "__main__":
    run_main()
