r"""The attention benchmark: `python -m jzyfa.bench`.

For every input kind, shape and implementation: check the output against float64 attention
(NumPy, on a slice of (batch, head) pairs of the unquantized inputs), then time it: the median of
many launches after a warm-up, with the inputs rotating over enough sets that L2 cannot hold them,
and the SM clock and board power read while the timed loop runs. JAX implementations are timed by
CUPTI kernel time (and wall clock per call), PyTorch ones by CUDA events. A progress line per
measurement goes to stderr; the table (plain, or markdown with --markdown) to stdout; everything to
--json_out; a PNG of TFLOP/s against sequence length per implementation to --plot.

Standard runs on a Hopper GPU (docs/measuring.md explains every column):

  python -m jzyfa.bench --json_out bench.json --markdown --plot bench.png        # bf16
  python -m jzyfa.bench --dtype fp8 --json_out bench_fp8.json --markdown          # FP8 (+ bf16 baselines)

Defaults: causal, head dim 128, 16 heads, (batch, seq) in (16,1024) (8,2048) (4,4096) (2,8192)
(1,16384), Gaussian and activation-like inputs (`jzyfa.bench.inputs`), every implementation
of the run's precision (`jzyfa.bench.peers`; those that cannot run here say why). Without a GPU the
command runs in smoke mode (small shapes, few iterations); `--smoke` forces it on a GPU.

FLOPs: 4 * B * Hq * Sq * Sk * D, halved for causal when Sq == Sk (the FA3 / cuDNN convention);
for causal with Sq != Sk the count uses the (query, key) pairs the bottom-right mask leaves visible.
With --window L,R (a sliding window, jzyfa's convention: query i at position p = i + Sk - Sq sees
keys p - L .. p + R, -1 unbounded on that side; --causal, the default, sets R to 0 as
`jzyfa.flash_attention(causal=True, window=...)` does): 4 * D * B * Hq * the visible (query, key)
pairs, sum over rows of max(0, min(p + R, Sk - 1) - max(p - L, 0) + 1) (`visible_pairs`), whatever
the window; no halving convention, so --window -1,0 counts the S(S+1)/2 pairs of causal exactly.
Windowed runs check against a windowed float64 reference; peers that have no such window say so.

MLA's head dims: --head_dim 192 --v_head_dim 128 gives v (and the output) a head dim of its own. A
visible pair then costs 2 * (D + Dv) FLOPs (Q K^T and P V), which the counts above take as 4 * D with D
the mean of the two. Peers with one head dim for q, k and v say why not (jax.nn.dot_product_attention
checks that v has k's shape, so cuDNN through it is not applicable: it gets no figure).

Variable-length (packed) batches: --varlen 8192,4096,...,64 (Sq = Sk per sequence, or Lq:Lk items)
replaces --shapes with ONE packed batch: q [total_q, Hq, D], k and v [total_k, Hkv, D] with
cu_seqlens, each sequence's inputs generated on their own (positions restart per sequence). jzyfa and
jzyfa_xla call `jzyfa.flash_attention_varlen`, and in --dtype fp8 runs jzyfa_fp8 and jzyfa_fp8_xla on the
e4m3 inputs with descales; the other peers say why not ("no varlen: ..."). The
mask (causal, --window) applies per sequence, bottom-right aligned; FLOPs are the sum over sequences
of each one's dense count above (`attention_flops(1, Lq, Lk, ...)`). The float64 reference covers
every sequence on a few query heads. The rows hold the lengths ("varlen": [[Lq, Lk], ...]; batch is
the number of sequences, seq_q/seq_k the longest); --plot draws nothing for such a run (one batch, no
sequence-length sweep) and says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import subprocess
import time
import traceback
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from absl import app, flags

from jzyfa import plan
from jzyfa.bench import captured as _captured
from jzyfa.bench import directions as _directions
from jzyfa.bench import float64, peers
from jzyfa.bench import inputs as realistic_inputs
from jzyfa.bench import sustained as _sustained
from jzyfa.bench import timing as _timing
from jzyfa.bench.float64 import Reference, take_pairs
from jzyfa.bench.peers import Unsupported
from jzyfa.bench.problem import (
    Problem,
    Window,
    mask_window,
    parse_shapes,
    parse_varlen,
    parse_window,
    sink_logits,
    varlen_label,
    visible_pairs,
    window_text,
)
from jzyfa.bench.report import fmt, logger, markdown_table, plain_table, run_absl, short_error, write_json
from jzyfa.bench.report import split_list as _split

STANDARD_SHAPES = "16x1024,8x2048,4x4096,2x8192,1x16384"
SMOKE_SHAPES = "2x128,1x256"

FLAGS = flags.FLAGS
flags.DEFINE_string("shapes", STANDARD_SHAPES, "Comma-separated BxS (Sq = Sk = S) or BxSqxSk problem sizes.")
flags.DEFINE_string(
    "varlen",
    None,
    "Comma-separated sequence lengths of ONE variable-length (packed) batch, timed through "
    "jzyfa.flash_attention_varlen: L (Sq = Sk = L) or Lq:Lk per sequence, e.g. "
    "8192,4096,2048,1024,512,256,128,64. Replaces --shapes (give one of them). Default: dense --shapes.",
)
flags.DEFINE_integer("heads", 16, "Query heads (Hq).")
flags.DEFINE_integer("kv_heads", None, "Key/value heads (Hkv, GQA/MQA); default: --heads.")
flags.DEFINE_integer("head_dim", 128, "Head dimension D (of q and k; of v too unless --v_head_dim).")
flags.DEFINE_integer(
    "v_head_dim",
    None,
    "v's (and the output's) head dimension Dv where it differs from --head_dim: MLA is --head_dim 192 "
    "--v_head_dim 128. Peers with one head dim for q, k and v say so. Default: --head_dim.",
)
flags.DEFINE_string(
    "direction",
    "fwd",
    "Comma-separated directions to time: fwd (O from q, k, v), bwd (dq, dk, dv from the forward's "
    "residuals and dout, the pullback alone), fwd+bwd (both in one program, as a training step runs). "
    "Backward rows are named '<impl> bwd' / '<impl> fwd+bwd', count 2.5x / 3.5x the forward's FLOPs and "
    "are checked against float64 gradients; JAX peers on 16-bit inputs only (jzyfa.bench.directions).",
)
flags.DEFINE_bool("causal", True, "Causal mask (bottom-right aligned); --nocausal for none.")
flags.DEFINE_string(
    "window",
    None,
    "Sliding window L,R (jzyfa.flash_attention's window=(L, R)): query i at position i + Sk - Sq sees "
    "keys pos-L .. pos+R; -1: unbounded on that side. --causal (the default) sets R to 0, as "
    "flash_attention(causal=True, window=...) does; --nocausal for a right bound. Default: no window.",
)
flags.DEFINE_float(
    "softcap",
    None,
    "Softcap c > 0 (jzyfa.flash_attention's softcap=c, Gemma 2's c * tanh(s / c) of the scaled scores); "
    "peers without one say so. Default: none.",
)
flags.DEFINE_float(
    "sinks",
    None,
    "Attention sinks (gpt-oss; jzyfa.flash_attention's sinks=): one sink logit per query head, this value "
    "plus a seeded standard normal draw per head, joining each row's softmax denominator (about log Sk "
    "makes a sink weigh as much as the keys); peers without sinks say so. Default: none.",
)
flags.DEFINE_enum(
    "dtype",
    "bf16",
    ["bf16", "f16", "fp8"],
    "Precision of the run: 16-bit inputs and outputs, or fp8 (bf16 inputs quantized to e4m3 outside "
    "the timed call, one power-of-two descale per tensor; bf16 peers run on the unquantized inputs).",
)
flags.DEFINE_string(
    "inputs",
    "gaussian,activations",
    "Comma-separated input kinds: gaussian (standard normal), activations (activation-like: RoPE, "
    "outlier channels in k, an attention sink, head scale spread), captured:PATH (q/k/v of one layer "
    "of a trained LM, written by examples/capture.py; its shapes come from the file and --shapes is "
    "ignored for it; --captured_layer picks the layer), model (not available: use captured:PATH).",
)
flags.DEFINE_float(
    "sustained",
    0.0,
    "Also time each implementation back to back for this many seconds of wall time per burst, two "
    "passes interleaved (A, B, A, B); rows '<impl> sustained' give the better pass's TFLOP/s from "
    "wall time and the SM clock and board power during it (jzyfa.bench.sustained). 0: off.",
)
flags.DEFINE_integer("captured_layer", 0, "The layer of a --inputs captured:PATH file to run on.")
flags.DEFINE_string(
    "impls",
    "auto",
    "Comma-separated implementations, or auto (every one of the run's precision; in fp8 runs also "
    f"the bf16 jzyfa and cuDNN). Known: {', '.join(peers.PEERS)}.",
)
flags.DEFINE_bool(
    "allow_xla_fallback",
    False,
    "Where jzyfa's kernel cannot serve on a GPU (FP8 today), time jzyfa's pure-JAX path instead, "
    "reported as jzyfa...[xla-fallback]; without it the kernel's absence is reported.",
)
flags.DEFINE_enum(
    "fp8_v_layout",
    None,
    ["staged", "transposed"],
    "Where the FP8 kernel's V operand is built, for every FP8 call of the run (JZYFA_FP8_V_LAYOUT while "
    "it runs): staged in the kernel, or transposed by the layout kernel first. Default: the per-call "
    "rule (docs/fp8.md 10.13, 10.16).",
)
flags.DEFINE_integer(
    "iters",
    100,
    "Minimum number of timed samples (kernel time: one per rotation over the input sets) and of "
    "wall-clock calls.",
)
flags.DEFINE_float("min_time_s", 1.0, "Minimum duration of each timed loop, in seconds.")
flags.DEFINE_float("warmup_s", 0.5, "Minimum warm-up per measurement, in seconds.")
flags.DEFINE_integer("wall_rounds", 10, "Wall-clock rounds; the median over rounds is reported.")
flags.DEFINE_integer(
    "rotate_mb",
    256,
    "Inputs rotate over enough sets (q, k, v, out) to span this many MB (2 sets at least), so "
    "the 60 MB L2 cannot hold them between calls.",
)
flags.DEFINE_integer(
    "cupti_mem_mb",
    16384,
    "Memory the outputs of one CUPTI chunk may take (they stay alive until the chunk ends).",
)
flags.DEFINE_integer(
    "ref_pairs",
    -1,
    "(batch, head) pairs checked against the float64 reference; -1: as many as a fixed budget "
    "of reference FLOPs allows (2 to 16), 0: all.",
)
flags.DEFINE_float(
    "max_rel_err",
    None,
    "Relative L2 error above which a result is marked BAD; default by what the implementation "
    "computes in (bf16 2e-2, f16 5e-3, fp8 0.15).",
)
flags.DEFINE_bool(
    "cupti", True, "Use CUPTI kernel time for JAX implementations on GPUs (wall time is always measured)."
)
flags.DEFINE_bool(
    "smoke",
    None,
    "Small shapes and few iterations (the default when the backend is not a GPU). Flags given explicitly still apply.",
)
flags.DEFINE_integer("seed", 0, "Seed of the inputs.")
flags.DEFINE_string("json_out", None, "Write the results as JSON to this path.")
flags.DEFINE_bool("markdown", False, "Print markdown tables (for docs/benchmarks.md).")
flags.DEFINE_string("plot", None, "Write a PNG of TFLOP/s against sequence length per implementation here.")
flags.DEFINE_string(
    "replot",
    None,
    "Measure nothing: draw the --plot PNG from this JSON (an earlier run's --json_out) and print its tables.",
)

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
# BAD above this relative L2 error of O, by what the implementation computes in.
DEFAULT_MAX_REL_ERR = {"bf16": 2e-2, "f16": 5e-3, "fp8": 0.15}
# JAX preallocates 75% of GPU memory; with PyTorch peers in the run it gets this share instead.
_JAX_MEMORY_FRACTION_WITH_TORCH = "0.5"


# ----------------------------------------------------------------------------------------------
# Inputs and the float64 reference


def make_input_sets(problem: Problem, kind: str, n_sets: int, seed: int) -> list[peers.InputSet]:
    """n_sets independent input sets of the given kind, generated on the device.

    Set i comes from key i of jax.random.split(key(seed), n_sets), so the first set is the same for
    every rotation count (and the Gaussian sets match the earlier benchmark runs).
    """
    keys = jax.random.split(jax.random.key(seed), n_sets)
    if isinstance(kind, CapturedInputs):
        return [kind.input_set(problem) for _ in range(n_sets)]  # copies: rotation still beats L2
    if problem.varlen:
        return [_packed_input_set(problem, kind, key) for key in keys]
    shape = dict(problem.sizes, dtype=problem.jnp_dtype)
    sets = []
    for i in range(n_sets):
        q, k, v = realistic_inputs.make_qkv(kind, keys[i], **shape)
        sets.append(peers.InputSet(*jax.block_until_ready((q, k, _v_columns(problem, v)))))
    return sets


@dataclasses.dataclass(frozen=True)
class CapturedInputs:
    """`--inputs captured:PATH`: one layer's q, k, v (numpy bf16) read from a capture file."""

    path: str
    layer: int
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray

    @classmethod
    def load(cls, kind: str, layer: int) -> CapturedInputs:
        path = _captured.path_of(kind)
        q, k, v = _captured.load_layer(path, layer, flag=f"--inputs {kind}")
        return cls(path, layer, q, k, v)

    @property
    def label(self) -> str:
        """The inputs' name in the report's rows."""
        return _captured.label(self.path, self.layer)

    def problem(self, template: Problem) -> Problem:
        """template (heads, mask, dtype from the flags) with the file's shapes."""
        return dataclasses.replace(template, **_captured.shape_of(self.q, self.k), head_dim_v=None)

    def input_set(self, problem: Problem) -> peers.InputSet:
        dtype = problem.jnp_dtype
        q, k, v = (jax.device_put(np.asarray(a).astype(dtype)) for a in (self.q, self.k, self.v))
        return peers.InputSet(*jax.block_until_ready((q, k, v)))


def _v_columns(problem: Problem, v):
    """v made at q's head dim, cut to the problem's own (--v_head_dim): its first Dv columns, so that
    activation-like inputs keep their structure there."""
    return v[..., : problem.v_head_dim]


def _packed_input_set(problem: Problem, kind: str, key) -> peers.InputSet:
    """One packed set: each sequence's q, k, v made on their own (key folded with its index, positions
    from 0, so activation-like inputs restart RoPE and the sink per sequence), then concatenated."""
    parts = []
    for s, (seq_q, seq_k) in enumerate(problem.seqlens):
        q, k, v = realistic_inputs.make_qkv(
            kind,
            jax.random.fold_in(key, s),
            batch=1,
            seq_q=seq_q,
            seq_k=seq_k,
            heads_q=problem.heads_q,
            heads_kv=problem.heads_kv,
            head_dim=problem.head_dim,
            dtype=problem.jnp_dtype,
        )
        parts.append((q[0], k[0], _v_columns(problem, v[0])))
    packed = [jax.numpy.concatenate([p[i] for p in parts]) for i in range(3)]
    return peers.InputSet(*jax.block_until_ready(packed))


def rotation_sets(problem: Problem, rotate_mb: int) -> int:
    """How many input sets to rotate over: at least 2, spanning rotate_mb MB."""
    return max(2, math.ceil(rotate_mb * 2**20 / problem.set_bytes))


def _visible_pairs_per_head(problem: Problem) -> int:
    """Visible (query, key) pairs of one (batch, head) pair, or of one head over every packed sequence."""
    if problem.varlen:
        return sum(visible_pairs(q, k, problem.causal, problem.window) for q, k in problem.seqlens)
    return visible_pairs(problem.seq_q, problem.seq_k, problem.causal, problem.window)


def reference_pairs(problem: Problem, requested: int) -> list[tuple[int, int]]:
    """(batch, query head) pairs to check, spread evenly over the flattened batch*heads index.

    Varlen problems: (0, head) pairs, each head over every sequence of the packed batch (the budget
    counts all of them), spread over the query heads."""
    total = problem.heads_q if problem.varlen else problem.batch * problem.heads_q
    count = requested
    if requested < 0:
        per_pair = 4.0 * problem.flops_head_dim * max(1, _visible_pairs_per_head(problem))
        count = min(total, max(2, min(16, int(_REF_FLOP_BUDGET // per_pair))))
    return [(i // problem.heads_q, i % problem.heads_q) for i in float64.spread(total, count)]


def _reference_window(problem: Problem) -> Window | None:
    """The window `attention_float64` takes for the problem's mask (None: causal's or none)."""
    return None if problem.window is None else problem.mask


def compute_varlen_reference(problem: Problem, q, k, v, requested_pairs: int) -> Reference:
    """float64 attention of a packed batch (q [total_q, Hq, D], k and v [total_k, Hkv, D]) on a few
    query heads (`reference_pairs`), every sequence on its own with the mask bottom-right per sequence;
    out [heads, total_q, D], compared with the output seen as [1, total_q, Hq, D]."""
    start = time.perf_counter()
    heads = np.array([h for _, h in reference_pairs(problem, requested_pairs)])
    group = problem.heads_q // problem.heads_kv
    qs = take_pairs(q[None], np.zeros_like(heads), heads)  # [P, total_q, D]
    ks = take_pairs(k[None], np.zeros_like(heads), heads // group)
    vs = take_pairs(v[None], np.zeros_like(heads), heads // group)
    cu_q, cu_k = problem.cu_seqlens_q, problem.cu_seqlens_k
    out = np.zeros((*qs.shape[:-1], vs.shape[-1]), np.float64)  # v's head dim
    window = _reference_window(problem)
    for s in range(problem.batch):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        for i in range(len(heads)):
            out[i, rows] = float64.attention_float64(
                qs[i, rows], ks[i, keys], vs[i, keys], problem.softmax_scale, problem.causal, window=window,
                softcap=problem.softcap, sink=problem.sink(heads[i]),
            )  # fmt: skip
    return Reference(np.zeros_like(heads), heads, out, None, time.perf_counter() - start)


def compute_reference(problem: Problem, q, k, v, requested_pairs: int) -> Reference:
    if problem.varlen:
        return compute_varlen_reference(problem, q, k, v, requested_pairs)
    pairs = reference_pairs(problem, requested_pairs)
    return float64.reference_on_pairs(
        q, k, v, pairs, scale=problem.softmax_scale, causal=problem.causal, window=_reference_window(problem),
        softcap=problem.softcap, sinks=problem.sinks,
    )  # fmt: skip


def relative_error(out, ref: Reference) -> dict[str, float]:
    """Relative L2 error and max abs error of out (JAX or NumPy [B, Sq, Hq, D], or packed
    [total_q, Hq, D], seen as one batch row) on the checked pairs."""
    if out.ndim == 3:
        out = out[None]
    err = float64.error_metrics(take_pairs(out, ref.batches, ref.heads), ref.out)
    return {"rel_l2": err["o_rel_l2"], "max_abs": err["o_max_abs"], "finite": err["finite"]}


# ----------------------------------------------------------------------------------------------
# Environment


def _run_text(cmd: Sequence[str]) -> str | None:
    try:
        return (
            subprocess.run(list(cmd), capture_output=True, text=True, check=True, timeout=20).stdout.strip()
            or None
        )
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
    for key in (
        "cuda_runtime_get_version",
        "cuda_driver_get_version",
        "cudnn_get_version",
        "cublas_get_version",
        "cupti_get_version",
    ):
        try:
            versions[key.replace("_get_version", "")] = getattr(cuda_versions, key)()
        except Exception:  # noqa: BLE001
            pass
    return versions


def _gpu_limits() -> dict[str, Any]:
    """Maximum SM clock and power limit of the first GPU (nvidia-smi), for the report's header."""
    text = _run_text(["nvidia-smi", "--query-gpu=clocks.max.sm,power.limit", "--format=csv,noheader,nounits"])
    if not text:
        return {}
    fields = [f.strip() for f in text.splitlines()[0].split(",")]
    limits: dict[str, Any] = {}
    for key, value in zip(("sm_clock_max_mhz", "power_limit_w"), fields):
        try:
            limits[key] = float(value)
        except ValueError:
            pass
    return limits


def _package_versions() -> dict[str, str | None]:
    """Versions of the optional peers' packages, read from their metadata (nothing is imported)."""
    versions = {}
    for name in ("torch", "flash_attn", "flash_attn_3", "triton", "nvidia-ml-py", "matplotlib"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _jzyfa_status() -> dict[str, Any]:
    info: dict[str, Any] = {}
    try:
        import jzyfa

        info["kernel_unavailable"] = jzyfa.kernel_unavailable_reason()
    except Exception as e:  # noqa: BLE001
        info["kernel_unavailable"] = f"unknown ({type(e).__name__}: {e})"
    try:
        info["version"] = importlib.metadata.version("jzyfa")
    except Exception:  # noqa: BLE001 - running from a source tree
        info["version"] = None
    info["fp8_v_layout_env"] = os.environ.get(plan.FP8_V_LAYOUT_ENV)  # --fp8_v_layout, or set outside
    info["fp8_key_block_env"] = os.environ.get(plan.FP8_KEY_BLOCK_ENV)  # the dense V^T kernel's, forced
    # An installed copy is no git checkout: tools/gpu_session.sh can pass the commit it built.
    info["git_commit"] = os.environ.get("JZYFA_GIT_COMMIT") or _run_text(
        ["git", "-C", str(_package_dir()), "rev-parse", "--short", "HEAD"]
    )
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
        "packages": _package_versions(),
        "xla_python_client_mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
    }
    if device.platform == "gpu":
        env["driver"] = _driver_version()
        env.update(_gpu_limits())
    return env


def header_line(env: dict[str, Any]) -> str:
    parts = [env["device"]]
    if env.get("compute_capability"):
        parts[0] += f" (sm {env['compute_capability']})"
    if env.get("driver"):
        parts.append(f"driver {env['driver']}")
    cuda = env.get("cuda") or {}
    libraries = (("cuda_runtime", "CUDA runtime"), ("cudnn", "cuDNN"))
    parts += [f"{name} {cuda[key]}" for key, name in libraries if key in cuda]
    limits = (("sm_clock_max_mhz", "max SM clock {:.0f} MHz"), ("power_limit_w", "power limit {:.0f} W"))
    parts += [text.format(env[key]) for key, text in limits if env.get(key)]
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
    max_rel_err: float | None  # None: by compute dtype (DEFAULT_MAX_REL_ERR)
    peer_options: peers.Options = dataclasses.field(default_factory=peers.Options)
    seed: int = 0  # of the backward's cotangents


def _torch_sync(_out=None) -> None:
    import torch

    torch.cuda.synchronize()


def build_timed(
    peer: peers.Peer, problem: Problem, sets: list[peers.InputSet], opts: Options, direction: str
):
    """(built, the timed function, its callable form (jitted for JAX peers), argument sets, sync) of one
    implementation in one direction; raises Unsupported where it cannot run the problem."""
    if (reason := peer.supports(problem)) is not None:
        raise Unsupported(reason)
    if direction != "fwd" and (reason := _directions.no_backward_reason(peer, problem)) is not None:
        raise Unsupported(reason)
    built = peer.build(problem, opts.peer_options)
    douts = (
        [_directions.cotangent(problem, i, opts.seed) for i in range(len(sets))] if direction != "fwd" else []
    )
    timed_fn, args = _directions.timed_call(
        built.fn, [peer.arguments(problem, s) for s in sets], douts, direction
    )
    torch_peer = peer.framework == "torch"
    fn = timed_fn if torch_peer else jax.jit(timed_fn)
    return built, timed_fn, fn, args, _torch_sync if torch_peer else jax.block_until_ready


def measure_peer(
    peer: peers.Peer,
    problem: Problem,
    sets: list[peers.InputSet],
    ref: Reference,
    opts: Options,
    monitor: _timing.ClockMonitor,
    direction: str = "fwd",
    grad_ref: _directions.GradientReference | None = None,
    keep: list[_sustained.Entry] | None = None,
) -> dict[str, Any]:
    """Checks one implementation on one problem in one direction (the forward's output against `ref`,
    the backward's gradients against `grad_ref`), then times it. Never raises. With `keep`, a timed
    row's callable is appended to it (for --sustained)."""
    compute_dtype = peer.compute_dtype(problem)
    max_rel_err = opts.max_rel_err if opts.max_rel_err is not None else DEFAULT_MAX_REL_ERR[compute_dtype]
    result: dict[str, Any] = {
        "impl": peer.name if direction == "fwd" else f"{peer.name} {direction}",
        "peer": peer.name,
        "direction": direction,
        "description": peer.description,
        "notes": peer.notes or None,
        "framework": peer.framework,
        "path": None,
        **problem.sizes,
        "v_head_dim": problem.v_head_dim,
        "causal": problem.causal,
        # The (left, right) window of the mask, causal folded in (right 0 under --causal); None: no --window.
        "window": None if problem.window is None else list(problem.mask),
        # --varlen: [[len_q, len_k], ...] per packed sequence (batch: their number; seq_q/k: the longest).
        "varlen": None if problem.seqlens is None else [list(p) for p in problem.seqlens],
        "dtype": problem.dtype,
        "compute_dtype": compute_dtype,
        "flops": problem.flops * _directions.FLOP_FACTORS[direction],
        "input_sets": len(sets),
        "status": None,
        "message": None,
        "rel_err": None,
        "max_abs_err": None,
        "max_rel_err": max_rel_err,
        "err_ok": None,
        "median_ms": None,
        "tflops": None,
        "timing_source": None,
        "sm_clock_mhz": None,
        "board_power_w": None,  # median board power during the primary timed loop, where readable
        "kernel": None,  # CUPTI kernel-time (or CUDA-event) summary, GPU only
        "kernel_unavailable": None,  # why there is no kernel time, when CUPTI failed
        "wall": None,  # wall-clock summary
        "wall_tflops": None,
        "memory_mb": None,  # what XLA holds for one call: arguments, results, temporaries (JAX peers)
        "compile_s": None,  # lowering and compiling the timed call once (JAX peers)
    }
    torch_peer = peer.framework == "torch"
    # Build and check.
    try:
        built, timed_fn, fn, args, sync = build_timed(peer, problem, sets, opts, direction)
        result["path"] = built.path
        if built.path == "xla-fallback":  # never timed under the kernel's name
            result["impl"] = result["impl"].replace(peer.name, f"{peer.name}[xla-fallback]", 1)
        raw = fn(*args[0])
        sync(raw)
        if direction == "fwd":
            out = peer.decode(raw, args[0])
        else:
            err = _directions.gradient_error(raw, grad_ref, problem.heads_q, problem.heads_kv)
        del raw
        if not torch_peer:
            memory, result["compile_s"] = _directions.compile_stats(timed_fn, args[0])
            result["memory_mb"] = None if memory is None else memory / 2**20
    except Unsupported as e:
        result.update(status="unsupported", message=str(e))
        return result
    except Exception as e:  # noqa: BLE001 - reported, and the run goes on
        result.update(status="error", message=short_error(e), traceback=traceback.format_exc(limit=8))
        return result
    if direction == "fwd":
        err = relative_error(out, ref)
        del out
    else:
        result.update({k: v for k, v in err.items() if k.startswith("d")})
    result.update(rel_err=err["rel_l2"], max_abs_err=err["max_abs"])
    result["err_ok"] = bool(err["finite"] and err["rel_l2"] <= max_rel_err)

    # Time.
    try:
        per_call_s = _timing.warm_up(fn, args, opts.warmup_s, sync=sync)
        if torch_peer:
            kernel = _timing.torch_event_time(
                fn, args, min_samples=opts.iters, min_seconds=opts.min_time_s, monitor=monitor
            )
            result["kernel"] = kernel.summary()
        elif opts.cupti:
            try:
                # one chunk iteration's outputs (the gradients: q's, k's and v's sizes)
                out_bytes = (_out_bytes(problem) if direction == "fwd" else problem.set_bytes) * len(args)
                max_chunk = max(2, int(opts.cupti_mem_mb * 2**20 // out_bytes))
                kernel = _timing.cupti_kernel_time(
                    timed_fn,
                    args,
                    min_samples=opts.iters,
                    min_seconds=opts.min_time_s,
                    max_iterations_per_chunk=max_chunk,
                    monitor=monitor,
                    warmup_s=opts.warmup_s,
                )
                result["kernel"] = kernel.summary()
            except Exception as e:  # noqa: BLE001 - wall time still serves
                result["kernel_unavailable"] = short_error(e)
        calls = max(opts.iters, math.ceil(opts.min_time_s / max(per_call_s, 1e-9)))
        wall = _timing.wall_clock(fn, args, calls=calls, rounds=opts.wall_rounds, monitor=monitor, sync=sync)
        result["wall"] = wall.summary()
    except Exception as e:  # noqa: BLE001
        result.update(
            status="error", message="timing: " + short_error(e), traceback=traceback.format_exc(limit=8)
        )
        return result

    primary = result["kernel"] or result["wall"]
    result["timing_source"] = primary["source"]
    result["median_ms"] = primary["median_ms"]
    result["tflops"] = result["flops"] / (primary["median_ms"] * 1e-3) / 1e12
    result["sm_clock_mhz"] = primary["sm_clock"]["median_mhz"]
    result["board_power_w"] = primary["sm_clock"].get("median_watts")
    result["wall_tflops"] = result["flops"] / (result["wall"]["median_ms"] * 1e-3) / 1e12
    result["status"] = "ok" if result["err_ok"] else "bad"
    if not result["err_ok"]:
        result["message"] = f"relative error {err['rel_l2']:.3g} > {max_rel_err:g}"
    if keep is not None:
        keep.append(_sustained.Entry(result, fn, args, sync, per_call_s))
    return result


def _out_bytes(problem: Problem) -> int:
    return math.prod(problem.out_shape) * 2  # 16-bit outputs (bf16 for FP8 inputs)


# ----------------------------------------------------------------------------------------------
# Reporting


def _fmt_tflops(value: float | None) -> str:
    """Whole TFLOP/s on a GPU; three significant digits for the small CPU figures."""
    if value is None:
        return "n/a"
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _varlen_totals(r: dict[str, Any]) -> tuple[int, int]:
    return sum(q for q, _ in r["varlen"]), sum(k for _, k in r["varlen"])


def _shape_cells(r: dict[str, Any]) -> list[str]:
    seq = str(r["seq_q"]) if r["seq_q"] == r["seq_k"] else f"{r['seq_q']}/{r['seq_k']}"
    if r.get("varlen"):  # B: the sequences; S: the packed tokens
        total_q, total_k = _varlen_totals(r)
        seq = f"varlen {total_q}" if total_q == total_k else f"varlen {total_q}/{total_k}"
    heads = str(r["heads_q"]) if r["heads_q"] == r["heads_kv"] else f"{r['heads_q']}/{r['heads_kv']}"
    mask = "yes" if r["causal"] else "no"
    if r.get("window") is not None:  # the window with causal folded in, one word: "win(1024,0)"
        mask = f"win({r['window'][0]},{r['window'][1]})"
    return [str(r["batch"]), seq, heads, _head_dims_text(r), mask]


def _head_dims_text(r: dict[str, Any]) -> str:
    """D, or D/Dv where v's head dim differs (MLA: 192/128), of a result row or the config (older
    reports, and a config without --v_head_dim, have one head dim)."""
    v_head_dim = r.get("v_head_dim") or r["head_dim"]
    return str(r["head_dim"]) if v_head_dim == r["head_dim"] else f"{r['head_dim']}/{v_head_dim}"


TABLE_COLUMNS = [
    "impl",
    "inputs",
    "dtype",
    "B",
    "S",
    "H",
    "D",
    "causal",
    "median ms",
    "wall ms",
    "top kernel ms",
    "TFLOP/s",
    "SM MHz",
    "W",
    "rel err",
    "mem MB",
    "compile s",
    "status",
]


def top_kernel_ms(r: dict[str, Any]) -> float | None:
    """Per-call time of the call's longest kernel (CUPTI): the attention kernel itself, where the call
    also runs helpers (jzyfa FP8's V-operand layout, XLA's broadcasts of the descales)."""
    kernels = (r.get("kernel") or {}).get("kernels") or []
    return max((k["ms_per_call"] for k in kernels), default=None)


def table_rows(results: Sequence[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in results:
        wall_ms = r["wall"]["median_ms"] if r.get("wall") else None
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['message']}"
        rows.append(
            [
                r["impl"],
                r.get("inputs") or "gaussian",
                r.get("compute_dtype") or r.get("dtype") or "",
                *_shape_cells(r),
                fmt(r["median_ms"], ".3f"),
                fmt(wall_ms, ".3f"),
                fmt(top_kernel_ms(r), ".3f"),
                _fmt_tflops(r["tflops"]),
                fmt(r["sm_clock_mhz"], ".0f"),
                fmt(r.get("board_power_w"), ".0f"),
                fmt(r["rel_err"], ".2e"),
                fmt(r.get("memory_mb"), ".0f"),
                fmt(r.get("compile_s"), ".2f"),
                status,
            ]
        )
    return rows


def format_plain(results: Sequence[dict[str, Any]]) -> str:
    lines = plain_table(TABLE_COLUMNS, table_rows(results), right=range(3, len(TABLE_COLUMNS)))
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


_TIMING_TEXT = {
    "cupti": "CUPTI kernel time",
    "cuda-events": "CUDA-event time",
    "wall": "wall-clock time per call",
}


def format_markdown(results: Sequence[dict[str, Any]], env: dict[str, Any], config: dict[str, Any]) -> str:
    source = sorted({r["timing_source"] for r in results if r["timing_source"]})
    kinds = list(dict.fromkeys(r.get("inputs") or "gaussian" for r in results))
    lines = [
        (
            f"{env.get('date', '')} {header_line(env)}; {config['dtype']}, head dim {_head_dims_text(config)}, "
            f"{_heads_text(config)}, {_mask_text(config)}; "
            f"median {' / '.join(_TIMING_TEXT.get(s, s) for s in source) or 'n/a'}, "
            f"{_flops_text(config)}; inputs: {', '.join(kinds)}{_varlen_text(config)}."
        ),
    ]
    for kind in kinds:
        subset = [r for r in results if (r.get("inputs") or "gaussian") == kind]
        labels = list(dict.fromkeys(_label(r) for r in subset))
        impls = list(dict.fromkeys(r["impl"] for r in subset))
        by_key = {(r["impl"], _label(r)): r for r in subset}
        summary = []
        for impl in impls:
            row = [impl]
            for label in labels:
                r = by_key.get((impl, label))
                if r is None or r["tflops"] is None:
                    row.append("-" if r is None else r["status"])
                else:
                    row.append(
                        _fmt_tflops(r["tflops"]) + _clock_text(r) + ("" if r["status"] == "ok" else " BAD")
                    )
            summary.append(row)
        during = (
            "SM clock and board power"
            if any(r.get("board_power_w") is not None for r in subset)
            else "SM clock"
        )
        lines += ["", f"TFLOP/s on {kind} inputs ({during} during the timed loop):", ""]
        lines += markdown_table(["impl"] + labels, summary)
    notes = {r["impl"]: r["notes"] for r in results if r.get("notes") and r["status"] not in ("unsupported",)}
    if notes:
        lines += ["", "Notes:"] + [f"- {impl}: {note}" for impl, note in notes.items()]
    lines += ["", "Details:", ""]
    lines += markdown_table(TABLE_COLUMNS, table_rows(results))
    return "\n".join(lines)


def _clock_text(r: dict[str, Any]) -> str:
    """' (1560 MHz, 690 W)' after a headline figure: the readings that exist, or nothing."""
    readings = [
        f"{value:.0f} {unit}"
        for value, unit in ((r["sm_clock_mhz"], "MHz"), (r.get("board_power_w"), "W"))
        if value is not None
    ]
    return f" ({', '.join(readings)})" if readings else ""


def _label(r: dict[str, Any]) -> str:
    if r.get("varlen"):
        return varlen_label(r["varlen"])
    seq = str(r["seq_q"]) if r["seq_q"] == r["seq_k"] else f"{r['seq_q']}x{r['seq_k']}"
    return f"{r['batch']}x{seq}"


def _config_window(config: dict[str, Any]) -> Window | None:
    """The run's --window as given (a pair, or the flag's text in a hand-made config), or None."""
    window = config.get("window")
    if isinstance(window, str) or window is None:
        return parse_window(window)
    return int(window[0]), int(window[1])


def _config_head_dim_v(config: dict[str, Any]) -> int | None:
    """--v_head_dim where it differs from --head_dim, else None (one head dim)."""
    v_head_dim = config.get("v_head_dim")
    if v_head_dim is None or v_head_dim == config["head_dim"]:
        return None
    if v_head_dim < 1:
        raise ValueError(f"--v_head_dim must be at least 1, got {v_head_dim}")
    return int(v_head_dim)


def _mask_text(config: dict[str, Any]) -> str:
    """'causal', 'non-causal', or with --window the mask's window: 'causal, window (1024, 0)'."""
    text = "causal" if config["causal"] else "non-causal"
    if config.get("softcap") is not None:
        text += f", softcap {config['softcap']:g}"
    if config.get("sinks") is not None:
        text += f", sinks {config['sinks']:g} + N(0, 1) per head"
    window = _config_window(config)
    if window is None:
        return text
    return f"{text}, {window_text(mask_window(config['causal'], window))} (left, right)"


def _varlen_text(config: dict[str, Any]) -> str:
    """'; varlen (packed, ...) lengths 8192,4096,512:1024' for --varlen runs, else ''."""
    seqlens = config.get("varlen")
    if not seqlens:
        return ""
    items = ",".join(str(q) if q == k else f"{q}:{k}" for q, k in seqlens)
    return f"; varlen (packed, mask per sequence; FLOPs summed per sequence) lengths {items}"


def _flops_text(config: dict[str, Any]) -> str:
    if _config_window(config) is not None:
        return "FLOPs 4 * D per visible (query, key) pair"
    return "causal FLOPs counted half"


def _heads_text(config: dict[str, Any]) -> str:
    kv = config.get("kv_heads") or config["heads"]
    return f"{config['heads']} heads" + ("" if kv == config["heads"] else f" ({kv} kv heads)")


def progress_line(r: dict[str, Any]) -> str:
    shape = f"B={r['batch']} Sq={r['seq_q']} Sk={r['seq_k']}"
    if r.get("varlen"):
        shape = f"{varlen_label(r['varlen'])} (max Sq={r['seq_q']} Sk={r['seq_k']})"
    head = (
        f"{r['impl']:>17} {r.get('inputs') or 'gaussian'} {shape} "
        f"H={r['heads_q']}/{r['heads_kv']} D={_head_dims_text(r)}"
        f"{' causal' if r['causal'] else ''}"
        f"{'' if r.get('window') is None else ' ' + window_text(r['window'])}"
    )
    if r["status"] in ("unsupported", "error"):
        return f"{head}: {r['status']}: {r['message']}"
    parts = [f"err {r['rel_err']:.2e}"]
    if r.get("kernel"):
        k = r["kernel"]
        parts.append(f"{k['source']} {k['median_ms']:.4f} ms ({k['samples']} samples)")
    elif r.get("kernel_unavailable"):
        parts.append(f"no kernel time ({r['kernel_unavailable'][:80]})")
    if r.get("wall"):
        parts.append(f"wall {r['wall']['median_ms']:.4f} ms")
    parts.append(f"{_fmt_tflops(r['tflops'])} TFLOP/s")
    parts.append(f"SM {fmt(r['sm_clock_mhz'], '.0f')} MHz, {fmt(r.get('board_power_w'), '.0f')} W")
    return f"{head}: " + ", ".join(parts) + ("" if r["status"] == "ok" else " [BAD]")


class PlotUnavailable(RuntimeError):
    """The plot cannot be drawn here (matplotlib is missing)."""


def write_plot(
    results: Sequence[dict[str, Any]], env: dict[str, Any], config: dict[str, Any], path: str
) -> int:
    """A PNG of TFLOP/s against sequence length (log2 axis), one line per implementation and one
    panel per input kind; returns the number of points drawn. matplotlib is imported only here."""
    try:
        import matplotlib
    except ImportError as e:
        raise PlotUnavailable(
            f"--plot needs matplotlib, which is not installed ({e}); `pip install matplotlib`, or "
            "draw the plot later from the JSON (--json_out)"
        ) from e
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    timed = [r for r in results if r["tflops"] is not None]
    kinds = list(dict.fromkeys(r.get("inputs") or "gaussian" for r in results)) or ["gaussian"]
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.5 * len(kinds), 4.8), squeeze=False, sharey=True)
    points = 0
    for ax, kind in zip(axes[0], kinds):
        subset = [r for r in timed if (r.get("inputs") or "gaussian") == kind]
        for impl in dict.fromkeys(r["impl"] for r in subset):
            rows = sorted((r for r in subset if r["impl"] == impl), key=lambda r: (r["seq_k"], r["seq_q"]))
            xs = [r["seq_k"] for r in rows]
            ys = [r["tflops"] for r in rows]
            ax.plot(
                xs, ys, marker="o", label=impl + ("" if all(r["status"] == "ok" for r in rows) else " (BAD)")
            )
            points += len(rows)
        ax.set_xscale("log", base=2)
        ticks = sorted({r["seq_k"] for r in subset})
        if ticks:
            ax.set_xticks(ticks, [f"{t // 1024}K" if t % 1024 == 0 else str(t) for t in ticks])
            ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_xlabel("sequence length (keys)")
        ax.set_title(f"{kind} inputs")
        ax.grid(True, which="both", alpha=0.3)
        if subset:
            ax.legend(fontsize="small")
    ylabel = "TFLOP/s (causal FLOPs counted half)" if config["causal"] else "TFLOP/s"
    if _config_window(config) is not None:
        ylabel = "TFLOP/s (FLOPs of the visible pairs)"
    axes[0][0].set_ylabel(ylabel)
    fig.suptitle(
        f"{env.get('device', '')}: attention {'/'.join(config.get('direction') or ['fwd'])}, {config['dtype']}, head dim {_head_dims_text(config)}, "
        f"{_heads_text(config)}, {_mask_text(config)} ({env.get('date', '')[:10]})",
        fontsize="medium",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return points


# ----------------------------------------------------------------------------------------------
# Main


_log = logger("jzyfa.bench")


def resolve_config() -> dict[str, Any]:
    """The flag values after smoke mode, as a plain dict."""
    smoke = FLAGS.smoke
    if smoke is None:
        smoke = jax.default_backend() != "gpu"
    names = [
        "shapes",
        "varlen",
        "heads",
        "kv_heads",
        "head_dim",
        "v_head_dim",
        "causal",
        "window",
        "softcap",
        "sinks",
        "direction",
        "dtype",
        "inputs",
        "captured_layer",
        "impls",
        "allow_xla_fallback",
        "fp8_v_layout",
        "iters",
        "min_time_s",
        "warmup_s",
        "wall_rounds",
        "sustained",
        "rotate_mb",
        "cupti_mem_mb",
        "ref_pairs",
        "max_rel_err",
        "cupti",
        "seed",
        "json_out",
        "markdown",
        "plot",
    ]
    config = {name: FLAGS[name].value for name in names}
    window = parse_window(config["window"])  # ValueError naming --window, before any work
    config["window"] = None if window is None else list(window)
    if config["softcap"] is not None and not (math.isfinite(config["softcap"]) and config["softcap"] > 0):
        raise ValueError(
            f"--softcap must be a finite number > 0 (the cap c of c * tanh(s / c)), got {config['softcap']}"
        )
    if config["sinks"] is not None and not math.isfinite(config["sinks"]):
        raise ValueError(f"--sinks must be a finite number (the sink logits' mean), got {config['sinks']}")
    if FLAGS["varlen"].present and FLAGS["shapes"].present:
        raise ValueError(
            "--varlen and --shapes were both given: --varlen replaces --shapes (one packed batch of "
            "those sequence lengths); give one of them"
        )
    config["direction"] = _directions.parse_directions(config["direction"])  # ValueError naming --direction
    seqlens = parse_varlen(config["varlen"])  # ValueError naming --varlen, before any work
    config["varlen"] = None if seqlens is None else [list(p) for p in seqlens]
    if smoke:
        for name, value in _SMOKE_OVERRIDES.items():
            if not FLAGS[name].present:
                config[name] = value
    config["smoke"] = smoke
    if config["varlen"] is not None:
        config["shapes"] = None  # replaced by the packed batch
    return config


def resolve_impls(text: str, dtype: str) -> list[str]:
    names = []
    for name in _split(text):
        names += peers.auto_peers(dtype) if name == "auto" else [name]
    unknown = [name for name in names if name not in peers.PEERS]
    if unknown:
        raise ValueError(f"--impls: unknown {unknown}; known: {sorted(peers.PEERS)} or auto")
    return list(dict.fromkeys(names))


def resolve_inputs(text: str) -> list[str]:
    kinds = _split(text)
    unknown = [k for k in kinds if k not in realistic_inputs.INPUT_KINDS and not _captured.is_captured(k)]
    if unknown or not kinds:
        raise ValueError(
            f"--inputs: unknown {unknown or text!r}; known: {realistic_inputs.INPUT_KINDS} or captured:PATH"
        )
    return list(dict.fromkeys(kinds))


@contextlib.contextmanager
def fp8_v_layout(layout: str | None):
    """JZYFA_FP8_V_LAYOUT = layout while the benchmark traces and runs its calls (None: as it is, the
    rule unless set outside), restored afterwards."""
    if layout is None:
        yield
        return
    before = os.environ.get(plan.FP8_V_LAYOUT_ENV)
    os.environ[plan.FP8_V_LAYOUT_ENV] = layout
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(plan.FP8_V_LAYOUT_ENV, None)
        else:
            os.environ[plan.FP8_V_LAYOUT_ENV] = before


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Runs the benchmark described by config (see resolve_config) and returns the report."""
    with fp8_v_layout(config.get("fp8_v_layout")):
        return _run(config)


def _run(config: dict[str, Any]) -> dict[str, Any]:
    window = _config_window(config)
    impl_names = resolve_impls(config["impls"], config["dtype"])
    kinds = resolve_inputs(config["inputs"])
    heads_q = config["heads"]
    heads_kv = config["kv_heads"] or heads_q
    if heads_q % heads_kv:
        raise ValueError(f"--heads ({heads_q}) must be a multiple of --kv_heads ({heads_kv})")
    dims = (heads_q, heads_kv, config["head_dim"], config["causal"], config["dtype"], window)
    head_dim_v = _config_head_dim_v(config)
    extras = {
        "softcap": config.get("softcap"),
        "sinks": sink_logits(config.get("sinks"), heads_q, config["seed"]),
    }
    if config.get("varlen"):
        problems = [Problem.packed(config["varlen"], *dims, head_dim_v=head_dim_v, **extras)]
    else:
        problems = [
            Problem(batch, seq_q, seq_k, *dims, head_dim_v=head_dim_v, **extras)
            for batch, seq_q, seq_k in parse_shapes(config["shapes"])
        ]

    captured = {
        kind: CapturedInputs.load(kind, config.get("captured_layer") or 0)
        for kind in kinds
        if _captured.is_captured(kind)
    }  # errors naming --inputs / --captured_layer, before any work
    if captured and config.get("varlen"):
        raise ValueError(
            "--inputs captured:PATH and --varlen: a capture is one dense batch; drop one of them"
        )

    env = collect_env()
    _log(header_line(env))
    for kind, c in captured.items():
        _log(
            f"{c.label}: q {list(c.q.shape)}, k and v {list(c.k.shape)} from the file "
            f"(--shapes, --heads, --kv_heads, --head_dim ignored for these inputs)"
        )
    if config["smoke"]:
        _log("smoke mode: small shapes, few iterations (no GPU, or --smoke)")
    if window is not None:
        mask = mask_window(config["causal"], window)
        _log(f"sliding {window_text(mask)} (left, right); FLOPs count its visible (query, key) pairs")
        if mask != window:
            _log(
                f"--causal sets the window's right bound to 0 (jzyfa's convention): --window "
                f"{window[0]},{window[1]} masks as ({mask[0]}, {mask[1]}); --nocausal keeps {window[1]}"
            )
    opts = Options(
        iters=config["iters"],
        min_time_s=config["min_time_s"],
        warmup_s=config["warmup_s"],
        wall_rounds=config["wall_rounds"],
        cupti=config["cupti"],
        cupti_mem_mb=config["cupti_mem_mb"],
        max_rel_err=config["max_rel_err"],
        peer_options=peers.Options(allow_xla_fallback=config["allow_xla_fallback"]),
        seed=config["seed"],
    )
    run_directions = config.get("direction") or ["fwd"]
    if opts.cupti and (reason := _timing.cupti_available()) is not None:
        _log(f"no CUPTI kernel time ({reason}); timing wall clock only")
        opts.cupti = False
    monitor = _timing.ClockMonitor(_timing.open_clock_reader())

    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    kind_problems = {
        kind: [captured[kind].problem(problems[0])] if kind in captured else problems for kind in kinds
    }
    total = sum(map(len, kind_problems.values())) * len(impl_names) * len(run_directions)
    done = 0
    try:
        for kind in kinds:
            source = captured.get(kind, kind)
            label = source.label if kind in captured else kind
            for problem in kind_problems[kind]:
                n_sets = rotation_sets(problem, config["rotate_mb"])
                try:
                    sets = make_input_sets(problem, source, n_sets, config["seed"])
                except realistic_inputs.ModelInputsUnavailable as e:
                    skipped[kind] = str(e)
                    _log(f"{kind} inputs skipped: {e}")
                    done += len(problems) * len(impl_names) * len(run_directions)
                    break
                ref = compute_reference(problem, sets[0].q, sets[0].k, sets[0].v, config["ref_pairs"])
                checked = (
                    f"{len(ref.heads)} heads x every sequence"
                    if problem.varlen
                    else f"{len(ref.batches)} (batch, head) pairs"
                )
                _log(
                    f"{label} {problem.label}: {n_sets} input sets of {problem.set_bytes / 2**20:.0f} MB, "
                    f"reference on {checked} in {ref.seconds:.1f} s"
                )
                grad_ref = None
                if any(d != "fwd" for d in run_directions) and not problem.varlen:
                    dout = _directions.cotangent(problem, 0, config["seed"])
                    grad_ref = _directions.gradient_reference(
                        problem, sets[0].q, sets[0].k, sets[0].v, dout, config["ref_pairs"]
                    )
                    _log(
                        f"gradients checked on {len(grad_ref.groups)} (batch, kv head) groups, {grad_ref.seconds:.1f} s"
                    )
                keep: dict[str, list[_sustained.Entry]] | None = (
                    {d: [] for d in run_directions} if config.get("sustained") else None
                )
                for name in impl_names:
                    for direction in run_directions:
                        done += 1
                        result = measure_peer(
                            peers.PEERS[name],
                            problem,
                            sets,
                            ref,
                            opts,
                            monitor,
                            direction,
                            grad_ref,
                            None if keep is None else keep[direction],
                        )
                        result["inputs"] = label
                        result["reference_pairs"] = len(ref.batches)
                        results.append(result)
                        _log(f"[{done}/{total}] " + progress_line(result))
                for entries in (keep or {}).values():
                    if entries:
                        _log(
                            f"sustained: {len(entries)} implementations x {_sustained.PASSES} passes of "
                            f"{config['sustained']:g} s, interleaved"
                        )
                    for row in _sustained.sustained_rows(entries, config["sustained"], monitor):
                        results.append(row)
                        _log(progress_line(row))
                del keep
                del sets
                gc.collect()
    finally:
        monitor.close()
    if not results and skipped:
        raise ValueError("nothing to run: " + "; ".join(f"--inputs {k}: {v}" for k, v in skipped.items()))
    return {"env": env, "config": config, "impls": impl_names, "skipped_inputs": skipped, "results": results}


def _reserve_gpu_memory_for_torch() -> None:
    """JAX takes 75% of GPU memory at start-up; leave PyTorch peers room (before JAX starts)."""
    try:
        names = resolve_impls(FLAGS.impls, FLAGS.dtype)
    except ValueError:
        return
    if peers.uses_torch(names) and importlib.util.find_spec("torch") is not None:
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", _JAX_MEMORY_FRACTION_WITH_TORCH)


def _print_tables(results, env, config, markdown: bool) -> None:
    if markdown:
        print(format_markdown(results, env, config))
    else:
        window = _config_window(config)
        print(header_line(env) + ("" if window is None else f"; {_mask_text(config)}") + _varlen_text(config))
        print(format_plain(results))


def _write_plot(results, env, config, path: str) -> int:
    """The PNG at path; 0, or 3 (the exit status) where matplotlib is missing. --varlen runs: no PNG
    (the plot is TFLOP/s against sequence length; a packed batch is one point of no single length)."""
    if config.get("varlen"):
        _log(
            f"no plot for --varlen: the plot is TFLOP/s against sequence length, a packed batch has no "
            f"single length; the tables and --json_out hold its figures ({path} not written)"
        )
        return 0
    try:
        points = write_plot(results, env, config, path)
    except PlotUnavailable as e:
        _log(f"no plot: {e}")
        return 3
    _log(f"wrote {path} ({points} points)")
    return 0


def replot(json_path: str, plot_path: str | None, markdown: bool) -> int:
    """Tables (and a PNG, if plot_path) from a saved report: figures from a GPU run, drawn anywhere."""
    with open(json_path) as f:
        report = json.load(f)
    results, env, config = report["results"], report["env"], report["config"]
    _print_tables(results, env, config, markdown)
    return _write_plot(results, env, config, plot_path) if plot_path else 0


def main(argv: Sequence[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.replot:
        return replot(FLAGS.replot, FLAGS.plot, FLAGS.markdown)
    _reserve_gpu_memory_for_torch()
    try:
        config = resolve_config()
        report = run(config)
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    _print_tables(report["results"], report["env"], config, config["markdown"])
    if config["json_out"]:
        write_json(report, config["json_out"])
        _log(f"wrote {config['json_out']}")
    if config["plot"]:
        return _write_plot(report["results"], report["env"], config, config["plot"])
    return 0


def run_main() -> None:
    run_absl(main, __doc__)


if __name__ == "__main__":
    run_main()
