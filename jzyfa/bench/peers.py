"""The attention implementations that `python -m jzyfa.bench` and `jzyfa.bench.accuracy` put side by side.

Each peer is a small adapter:
- `supports(problem)`: None, or why it cannot serve this problem here (reported as "unsupported"):
  first what the peer declares it lacks (`no_varlen`, `no_window`, `one_head_dim`, `top_left`), then
  its own checks (`_supports`);
- `build(problem, options)`: the function to time, the same for every input set (raises
  `Unsupported` for what only shows when tracing, such as a missing kernel);
- `arguments(problem, inputs)`: its arguments for one input set, converted outside the timed call
  (layout changes, FP8 quantization, DLPack hand-off to PyTorch);
- `decode(raw, args)`: the output as float32 O [B, Sq, Hq, D] (JAX or NumPy; packed [total_q, Hq, D]
  for --varlen problems) for the error check, outside the timed call;
- `notes`: what it computes in, when that differs from the run's dtype.

Variable-length (packed) problems (`Problem.packed`, --varlen): jzyfa's peers call
`jzyfa.flash_attention_varlen` with (q, k, v, cu_seqlens_q, cu_seqlens_k), its FP8 peers also with the
descales (lean P only: jzyfa_fp8_exact_p says why not); every other peer says why not ("no varlen: ...").

JAX peers are jitted and timed with CUPTI; PyTorch peers (`framework == "torch"`) get DLPack views
of the same device buffers and are timed with CUDA events.

FP8 inputs: the 16-bit inputs quantized with `jzyfa.fp8_quantize` (one power-of-two descale per
tensor, unless a peer says otherwise); errors are always measured against float64 attention on the
unquantized inputs.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jzyfa.bench.problem import Problem

PRECISIONS = ("16-bit", "fp8")
# jax.nn's XLA attention materialises the [B, Hq, Sq, Sk] scores; beyond this it is not attempted.
XLA_SCORE_BYTES_LIMIT = 40 * 2**30


class Unsupported(Exception):
    """The implementation does not serve this problem (reported, not an error)."""


# ----------------------------------------------------------------------------------------------
# Inputs, and their FP8 forms


class Fp8Inputs(NamedTuple):
    """e4m3 q, k, v with float32 descales: the values are x8 * descale (a pytree, so jit returns it)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    descale_q: jax.Array
    descale_k: jax.Array
    descale_v: jax.Array


def quantize_qkv(q, k, v, *, granularity: str = "tensor", hadamard_seed: int | None = None) -> Fp8Inputs:
    """FP8 forms of q, k, v through `jzyfa.fp8_quantize`; q and k first Hadamard-rotated if a seed is given.

    granularity "head" gives [B, Hkv] descales (q shares one per KV group). The rotation leaves
    q k^T unchanged, so the result is compared with attention on the unrotated inputs.
    """
    import jzyfa

    if hadamard_seed is not None:
        q, k = jzyfa.hadamard_rotate(q, k, key=hadamard_seed)
    kv_heads = k.shape[2] if granularity == "head" else None
    q8, dq = jzyfa.fp8_quantize(q, granularity, kv_heads=kv_heads)
    k8, dk = jzyfa.fp8_quantize(k, granularity)
    v8, dv = jzyfa.fp8_quantize(v, granularity)
    return Fp8Inputs(q8, k8, v8, dq, dk, dv)


_quantize_jit = jax.jit(quantize_qkv, static_argnames=("granularity", "hadamard_seed"))


class InputSet:
    """One set of q, k, v (the run's 16-bit inputs) and, computed once on demand, its FP8 form."""

    def __init__(self, q: jax.Array, k: jax.Array, v: jax.Array):
        self.q, self.k, self.v = q, k, v
        self._fp8: Fp8Inputs | None = None

    def fp8(self) -> Fp8Inputs:
        if self._fp8 is None:
            self._fp8 = jax.block_until_ready(_quantize_jit(self.q, self.k, self.v))
        return self._fp8


@dataclasses.dataclass(frozen=True)
class Options:
    # On a GPU where jzyfa's kernel cannot serve, time jzyfa's pure-JAX path instead, under a name
    # that says so ("jzyfa[xla-fallback]"); without it the kernel's absence is reported.
    allow_xla_fallback: bool = False


@dataclasses.dataclass(frozen=True)
class Built:
    fn: Callable  # fn(*args) -> raw output
    path: str | None = None  # what runs, where the peer has a choice: "kernel", "pure-JAX", "xla-fallback"


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _gpu_reason() -> str | None:
    return None if _on_gpu() else f"needs a CUDA GPU (the JAX backend is {jax.default_backend()!r})"


def _import_reason(module: str, what: str) -> str | None:
    """None when `module` imports, else why not ('<what> is not importable (...)')."""
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any failure means the peer cannot run
        return f"{what} is not importable ({type(e).__name__}: {e})"
    return None


def lse_from_btn(residual) -> jax.Array:
    """jax.nn's residual is the natural-log LSE as [B, Sq, Hq]; ours is [B, Hq, Sq]."""
    return jnp.swapaxes(residual.astype(jnp.float32), 1, 2)


class Peer:
    """Base adapter; see the module docstring."""

    name = ""
    description = ""
    precision = "16-bit"
    framework = "jax"
    notes = ""
    # What the peer lacks, each the end of its refusal; None: it has it.
    no_varlen: str | None = None  # packed (cu_seqlens) batches: "no varlen: <this>"
    no_window: str | None = None  # sliding windows: "<this> has none"
    one_head_dim: str | None = None  # v's own head dim (MLA): "v's head dim Dv != q's and k's D: <this>"
    top_left: str | None = None  # bottom-right causal alignment: "<this> aligns the causal mask top-left"
    no_backward: str | None = None  # why --direction bwd / fwd+bwd do not time it (jzyfa.bench.directions)
    has_softcap = False  # --softcap: the peer takes a softcap c
    has_sinks = False  # --sinks: the peer takes a sink logit per query head
    needs_gpu = False  # "needs a CUDA GPU (...)" on other backends

    def supports(self, problem: Problem) -> str | None:
        if problem.softcap is not None and not self.has_softcap:
            return f"no softcap: the {self.name} peer has none"
        if problem.sinks is not None and not self.has_sinks:
            return f"no sinks: the {self.name} peer has none"
        if self.no_varlen and problem.varlen:
            return f"no varlen: {self.no_varlen}"
        if self.no_window and (window := problem.sliding_window) is not None:
            return (
                f"no sliding window: {self.no_window} has none, and this run's mask is the window {window} "
                "(left, right)"
            )
        if self.one_head_dim and problem.v_head_dim != problem.head_dim:
            return f"v's head dim {problem.v_head_dim} != q's and k's {problem.head_dim}: {self.one_head_dim}"
        if reason := (self.needs_gpu and _gpu_reason()) or self._supports(problem):
            return reason
        if self.top_left and problem.mask_causal and problem.seq_q != problem.seq_k:
            return (
                f"{self.top_left} aligns the causal mask top-left; jzyfa's is bottom-right, so Sq != Sk is "
                "not comparable"
            )
        return None

    def _supports(self, problem: Problem) -> str | None:
        """The peer's own checks, after what it declares it lacks."""
        return None

    def build(self, problem: Problem, options: Options) -> Built:
        raise NotImplementedError

    def arguments(self, problem: Problem, inputs: InputSet) -> tuple:
        if self.precision == "fp8":
            f = inputs.fp8()
            return (f.q, f.k, f.v, f.descale_q, f.descale_k, f.descale_v)
        return (inputs.q, inputs.k, inputs.v)

    def decode(self, raw, args: tuple):
        """O as float32 [B, Sq, Hq, D] from what fn returned for these arguments."""
        return raw.astype(jnp.float32)

    def compute_dtype(self, problem: Problem) -> str:
        if self.precision == "fp8" or getattr(self, "in_call", None):
            return "fp8"  # 8-bit computation: FP8's error bound
        return "f16" if problem.dtype == "f16" else "bf16"


# ---- jzyfa


class Jzyfa(Peer):
    """jzyfa.flash_attention: the kernel on a GPU (or the reason it cannot run), the default path elsewhere.

    FP8 peers pass `lean_p` (the FP8 kernel's rounding of P; the pure-JAX FP8 path ignores it);
    16-bit peers do not pass it. `fp8_only` peers are unsupported in 16-bit runs. `in_call` peers take
    the run's 16-bit inputs and quantize them in the call (`precision=in_call`; "int8" with
    rotate=True, the setting docs/int8.md recommends), so their time includes the quantization; they
    run in FP8 runs (8-bit accuracy) on dense problems.
    """

    has_sinks = True  # every path: the kernel's (out, lse) merged with the sinks (jzyfa.merge)

    def __init__(
        self,
        name: str,
        precision: str,
        forced: str | None = None,
        lean_p: bool | None = None,
        fp8_only: bool = False,
        in_call: str | None = None,
    ):
        self.name = name
        self.precision = precision
        self.forced = forced  # "xla": always the pure-JAX path
        fp8 = precision == "fp8"
        self.in_call = in_call  # "fp8" or "int8": flash_attention(precision=...) on the 16-bit inputs
        if fp8 and lean_p is None:
            lean_p = True  # flash_attention's default, passed explicitly
        if not fp8 and (lean_p is not None or fp8_only):
            raise ValueError(f"{name}: lean_p and fp8_only are for FP8 peers")
        self.lean_p = lean_p
        self.fp8_only = fp8_only
        # The 16-bit kernels and the pure-JAX path cap scores; the FP8 kernel does not.
        self.has_softcap = (not fp8 or forced == "xla") and not in_call
        self.description = "jzyfa.flash_attention" + (
            " on fp8_quantize'd e4m3 inputs with descales (bf16 out)" if fp8 else ""
        )
        if in_call == "int8":
            self.description += (
                '(precision="int8", rotate=True) on the 16-bit inputs: smoothed k, INT8 q and k per 128 tokens, '
                "e4m3 v, quantized in the call"
            )
        elif in_call == "fp8":
            self.description += '(precision="fp8") on the 16-bit inputs: e4m3 per (batch, KV head), quantized in the call'
        if in_call:
            self.notes = "quantization included in the time; lean P"
        if forced:
            self.description += f' (implementation="{forced}")'
        if fp8 and forced != "xla":
            self.description += (
                ", lean_p=True: each probability's e4m3 code from one FFMA"
                if lean_p
                else ", lean_p=False: exact P, exp2 rounded to e4m3"
            )
        if fp8:
            self.notes = "e4m3 q/k/v, one power-of-two descale per tensor; bf16 output"
            if forced != "xla":
                self.notes += "; lean P" if lean_p else "; exact P (lean_p=False)"

    def _supports(self, problem: Problem) -> str | None:
        if self.in_call and problem.varlen:
            return "no varlen: this peer times dense calls that quantize in the call"
        if self.in_call and problem.dtype != "fp8":
            return "an 8-bit peer: it runs with --dtype fp8 (quantizing the run's bf16 inputs in the call)"
        if self.fp8_only and problem.dtype != "fp8":
            return (
                f"an FP8-kernel variant (lean_p={self.lean_p}) that runs only with --dtype fp8; this run is "
                f"{problem.dtype}"
            )
        if self.precision == "fp8" and problem.varlen and self.lean_p is False:
            return "no varlen: flash_attention_varlen's FP8 path is lean P only (jzyfa_fp8 times it)"
        return None

    def arguments(self, problem: Problem, inputs: InputSet) -> tuple:
        if not problem.varlen:
            return super().arguments(problem, inputs)
        cu_q, cu_k = (jnp.asarray(c, jnp.int32) for c in (problem.cu_seqlens_q, problem.cu_seqlens_k))
        if self.precision == "fp8":  # descales after the offsets, as varlen_fn takes them
            f = inputs.fp8()
            return (f.q, f.k, f.v, cu_q, cu_k, f.descale_q, f.descale_k, f.descale_v)
        return (inputs.q, inputs.k, inputs.v, cu_q, cu_k)

    def _call(self, problem: Problem, implementation: str | None) -> Callable:
        import jzyfa

        kwargs = {
            "causal": problem.causal,
            "softmax_scale": problem.softmax_scale,
            "implementation": implementation,
        }
        if problem.window is not None:
            kwargs["window"] = problem.window
        if problem.softcap is not None:
            kwargs["softcap"] = problem.softcap
        if problem.sinks is not None:
            kwargs["sinks"] = jnp.asarray(problem.sinks, jnp.float32)
        if problem.varlen:  # max_seqlen_q/k are the longest sequences; FP8: lean P, the only varlen path
            max_q, max_k = problem.seq_q, problem.seq_k

            def varlen_fn(q, k, v, cu_q, cu_k, *descales):
                named = dict(zip(("descale_q", "descale_k", "descale_v"), descales))
                return jzyfa.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **named, **kwargs)

            return varlen_fn
        if self.in_call:
            precision, rotate = self.in_call, self.in_call == "int8"

            def fn(q, k, v):
                return jzyfa.flash_attention(q, k, v, precision=precision, rotate=rotate, **kwargs)

        elif self.precision == "fp8":
            lean_p = self.lean_p

            def fn(q8, k8, v8, dq, dk, dv):
                return jzyfa.flash_attention(
                    q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, lean_p=lean_p, **kwargs
                )
        else:

            def fn(q, k, v):
                return jzyfa.flash_attention(q, k, v, **kwargs)

        return fn

    def _abstract_args(self, problem: Problem) -> tuple:
        if self.precision == "fp8":
            scalar = jax.ShapeDtypeStruct((), jnp.float32)
            return (*problem.abstract(jnp.float8_e4m3fn), scalar, scalar, scalar)
        return problem.abstract(problem.jnp_dtype)

    def build(self, problem: Problem, options: Options) -> Built:
        if self.forced == "xla":
            return Built(self._call(problem, "xla"), "pure-JAX")
        if not _on_gpu():  # the primitive's CPU lowering (16-bit) or the pure-JAX FP8 path
            return Built(self._call(problem, None), "pure-JAX (no GPU)")
        fp8 = self.precision == "fp8"
        kernel = self._call(problem, "kernel")
        try:  # the kernel's checks run at trace time: nothing launches here
            jax.eval_shape(kernel, *self._abstract_args(problem))
        except ValueError as e:
            if options.allow_xla_fallback and self.lean_p is not False:
                return Built(self._call(problem, "xla"), "xla-fallback")
            if self.in_call:
                raise Unsupported(f"{e}; --allow_xla_fallback times the pure-JAX path instead") from e
            if fp8:
                message = str(e)
                if options.allow_xla_fallback:  # lean_p=False differs from jzyfa_fp8 in the kernel only
                    raise Unsupported(
                        f"{message}; no fallback for lean_p=False: the pure-JAX FP8 path has no lean P, so it "
                        "would time what jzyfa_fp8[xla-fallback] times"
                    ) from e
                raise Unsupported(
                    f"{message}; --allow_xla_fallback times the pure-JAX FP8 path instead"
                ) from e
            raise
        return Built(kernel, "kernel")


# ---- jax.nn.dot_product_attention (cuDNN, XLA)


def jax_nn_mask(problem: Problem, implementation: str) -> tuple[bool, tuple[int, int] | None] | str:
    """(is_causal, local_window_size) for jax.nn.dot_product_attention that mask exactly as the problem
    does, or why it cannot.

    jax.nn's window (left, right) lets query i see keys i - left <= j <= i + right (top-left: its
    position is i), so only Sq == Sk matches jzyfa's bottom-right windows; an unbounded side (-1 in
    jzyfa, which jax.nn does not take) becomes seq_k, beyond every key. Through cuDNN, jax.nn sets
    cuDNN's sliding_window_length to left + 1 (keys pos - left .. pos) with the causal mask and takes
    no other window, so cuDNN runs only windows (left, 0), with is_causal=True.
    """
    window = problem.sliding_window
    if window is None:  # no window, or one that is causal or no mask for these lengths
        return problem.mask_causal, None
    if problem.seq_q != problem.seq_k:
        return (
            "jax.nn.dot_product_attention aligns its window top-left; jzyfa's is bottom-right, so Sq != Sk "
            "is not comparable"
        )
    left, right = window
    if implementation == "cudnn":
        if right != 0:
            return (
                f"cuDNN through jax.nn.dot_product_attention takes only sliding windows (left, 0) (its "
                f"sliding_window_length with the causal mask); this run's mask is the window {window} "
                "(left, right)"
            )
        return True, (left, 0)
    unbounded = problem.seq_k
    return False, (left if left >= 0 else unbounded, right if right >= 0 else unbounded)


class JaxNn(Peer):
    top_left = "jax.nn.dot_product_attention"

    def __init__(self, name: str, implementation: str):
        self.name = name
        self.implementation = implementation
        self.description = f'jax.nn.dot_product_attention(implementation="{implementation}")'
        cudnn = implementation == "cudnn"
        self.no_varlen = (
            "jax.nn.dot_product_attention has no packed (cu_seqlens) API in JAX, only padded batches "
            "(query_seq_lengths / key_value_seq_lengths; a padded baseline is not run)"
            + ("; cuDNN's own varlen is not reachable through it" if cudnn else "")
        )
        self.one_head_dim = "jax.nn.dot_product_attention checks that v has k's shape" + (
            "; cuDNN's own unequal head dims are not reachable through it" if cudnn else ""
        )

    def _supports(self, problem: Problem) -> str | None:
        if isinstance(mask := jax_nn_mask(problem, self.implementation), str):
            return mask
        if self.implementation == "cudnn" and (reason := _gpu_reason()):
            return reason
        if self.implementation == "xla":
            score_bytes = 4 * problem.batch * problem.heads_q * problem.seq_q * problem.seq_k
            if score_bytes > XLA_SCORE_BYTES_LIMIT:
                return f"would materialise {score_bytes / 2**30:.0f} GiB of float32 scores"
        return None

    def build(self, problem: Problem, options: Options) -> Built:
        mask = jax_nn_mask(problem, self.implementation)
        if isinstance(mask, str):
            raise Unsupported(mask)
        is_causal, local_window_size = mask
        window_kwargs = {} if local_window_size is None else {"local_window_size": local_window_size}

        def fn(q, k, v):
            out = jax.nn.dot_product_attention(
                q,
                k,
                v,
                scale=problem.softmax_scale,
                is_causal=is_causal,
                implementation=self.implementation,
                **window_kwargs,
            )
            return out

        return Built(fn)


# ---- cuDNN FP8 through JAX's private module


def cudnn_fp8_params(fp8: Fp8Inputs) -> dict[str, jax.Array]:
    """The fp8_params of JAX's cuDNN FP8 attention for per-tensor descales.

    cuDNN computes S = (q8 k8^T) * descale_q * descale_k * scale, P = softmax(S), quantizes P * scale_s
    to e4m3 (scale_s = 448 uses e4m3's range; descale_s = 1/448 undoes it), O = (P8 v8) * descale_s
    * descale_v, and returns O * scale_o in e4m3. With scale_o = 1 / descale_v (a power of two), the
    e4m3 output is P v8, whose magnitude is bounded by max|v8| <= 448, so it neither overflows nor
    wastes range; O = out8 * descale_v (`decode`). The backward-only entries are ones.
    """
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    def cell(x):
        return jnp.asarray(x, jnp.float32).reshape(1, 1, 1, 1)

    params = {key: cell(1.0) for key in cudnn_attention.fp8_params_keys}
    params.update(
        descale_q=cell(fp8.descale_q),
        descale_k=cell(fp8.descale_k),
        descale_v=cell(fp8.descale_v),
        scale_s=cell(448.0),
        descale_s=cell(1.0 / 448.0),
        scale_o=cell(1.0 / jnp.asarray(fp8.descale_v, jnp.float32)),
    )
    return params


def cudnn_fp8_attention(q8, k8, v8, params, *, causal: bool, softmax_scale: float) -> jax.Array:
    """JAX's cuDNN FP8 attention forward (inference: no LSE); returns the e4m3 output."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    mask = cudnn_attention.MaskType.CAUSAL if causal else cudnn_attention.MaskType.NO_MASK
    out, _, _ = cudnn_attention.dot_product_attention(
        q8, k8, v8, fp8_params=params, scale=softmax_scale, mask_type=mask, qkv_layout="BTNH", use_fp8=True
    )
    return out


class CudnnFp8(Peer):
    name = "cudnn_fp8"
    precision = "fp8"
    description = "cuDNN FP8 attention (jax._src.cudnn.fused_attention_stablehlo, use_fp8=True)"
    notes = "e4m3 q/k/v, per-tensor descales; e4m3 output (scale_o = 1/descale_v), so its error includes the output rounding; no LSE"

    no_varlen = "JAX's cuDNN FP8 attention takes dense [B, S, H, D] batches only"
    no_window, top_left = "JAX's cuDNN FP8 attention", "cuDNN FP8 attention"
    one_head_dim = "JAX's cuDNN FP8 attention is not wired for unequal head dims"
    needs_gpu = True

    def _supports(self, problem: Problem) -> str | None:
        module = "jax._src.cudnn.fused_attention_stablehlo"  # a private module: it may move
        if reason := _import_reason(module, "JAX's cuDNN attention module"):
            return reason
        if problem.head_dim > 256 or problem.head_dim % 16:
            return f"cuDNN FP8 inference needs head_dim <= 256 and a multiple of 16, got {problem.head_dim}"
        return None

    def arguments(self, problem: Problem, inputs: InputSet) -> tuple:
        f = inputs.fp8()
        return (f.q, f.k, f.v, cudnn_fp8_params(f))

    def build(self, problem: Problem, options: Options) -> Built:
        def fn(q8, k8, v8, params):
            return cudnn_fp8_attention(
                q8, k8, v8, params, causal=problem.mask_causal, softmax_scale=problem.softmax_scale
            )

        return Built(fn)

    def decode(self, raw, args: tuple):
        descale_v = args[3]["descale_v"].reshape(())
        return raw.astype(jnp.float32) * descale_v

    def compute_dtype(self, problem: Problem) -> str:
        return "fp8"


# ---- Pallas Mosaic GPU attention


class Pallas(Peer):
    name = "pallas"
    description = "jax.experimental.pallas.ops.gpu.attention_mgpu (block 64x128, 2 stages)"
    notes = "computes in f16 (its scratch is f16; bf16 fails): inputs converted and q pre-scaled outside the timed call"
    block_q, block_kv = 64, 128
    no_varlen = "Pallas attention_mgpu takes dense [B, S, H, D] batches only"
    no_window, top_left = "Pallas attention_mgpu", "Pallas attention"
    one_head_dim = "Pallas attention_mgpu takes one head dim for q, k and v"
    no_backward = (
        "Pallas attention_mgpu's backward has no causal mask and needs its own block sizes (not wired)"
    )
    needs_gpu = True

    def _supports(self, problem: Problem) -> str | None:
        if problem.head_dim % 64:
            return f"needs head_dim a multiple of 64, got {problem.head_dim}"
        if problem.seq_q % (2 * self.block_q) or problem.seq_k % self.block_kv:
            return f"needs Sq a multiple of {2 * self.block_q} and Sk a multiple of {self.block_kv}"
        return _import_reason("jax.experimental.pallas.ops.gpu.attention_mgpu", "attention_mgpu")

    def arguments(self, problem: Problem, inputs: InputSet) -> tuple:
        # It takes no softmax scale: fold it into q (in float32, then one rounding to f16).
        q = (inputs.q.astype(jnp.float32) * problem.softmax_scale).astype(jnp.float16)
        return (q, inputs.k.astype(jnp.float16), inputs.v.astype(jnp.float16))

    def build(self, problem: Problem, options: Options) -> Built:
        from jax.experimental.pallas.ops.gpu import attention_mgpu

        config = attention_mgpu.TuningConfig(
            block_q=self.block_q, block_kv=self.block_kv, max_concurrent_steps=2, causal=problem.mask_causal
        )
        return Built(lambda q, k, v: attention_mgpu.attention(q, k, v, config))

    def compute_dtype(self, problem: Problem) -> str:
        return "f16"


# ---- PyTorch peers (SDPA, FlashAttention), through DLPack


def _torch_reason() -> str | None:
    if reason := _gpu_reason() or _import_reason("torch", "PyTorch"):
        return reason
    import torch

    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA device"
    return None


def to_torch(x: jax.Array):
    """A PyTorch view of a JAX device array (DLPack; FP8 travels as uint8 bits and is viewed back)."""
    import torch

    if jnp.dtype(x.dtype) == jnp.dtype(jnp.float8_e4m3fn):
        return torch.from_dlpack(jax.lax.bitcast_convert_type(x, jnp.uint8)).view(torch.float8_e4m3fn)
    return torch.from_dlpack(x)


def torch_to_numpy(t) -> np.ndarray:
    return t.detach().float().cpu().numpy()


class TorchSdpa(Peer):
    framework = "torch"

    def __init__(self, name: str, backend: str):
        self.name = name
        self.backend = backend  # a torch.nn.attention.SDPBackend member name
        self.description = f"torch.nn.functional.scaled_dot_product_attention, {backend} backend"
        self.notes = "layout [B, H, S, D] made contiguous outside the timed call"
        self.no_varlen = "PyTorch SDPA takes dense [B, H, S, D] batches (nested tensors are not wired here)"
        self.no_window = "PyTorch SDPA (without an explicit mask)"
        self.one_head_dim = "this peer is not wired for unequal head dims (untested without PyTorch)"
        self.top_left = "PyTorch SDPA"

    def _supports(self, problem: Problem) -> str | None:
        return _torch_reason()

    def arguments(self, problem: Problem, inputs: InputSet) -> tuple:
        return tuple(to_torch(x).transpose(1, 2).contiguous() for x in (inputs.q, inputs.k, inputs.v))

    def build(self, problem: Problem, options: Options) -> Built:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, self.backend)
        gqa = problem.heads_q != problem.heads_kv

        def fn(q, k, v):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=problem.mask_causal, scale=problem.softmax_scale, enable_gqa=gqa
                )

        return Built(fn)

    def decode(self, raw, args: tuple):
        return np.swapaxes(torch_to_numpy(raw), 1, 2)


class FlashAttn(Peer):
    """FlashAttention 2 (`flash_attn`) or 3 (`flash_attn_interface`, Hopper), if importable."""

    framework = "torch"

    def __init__(self, name: str, module: str, precision: str = "16-bit"):
        self.name = name
        self.module = module
        self.precision = precision
        self.description = f"{module}.flash_attn_func"
        if precision == "fp8":
            self.notes = "e4m3 q/k/v with [B, Hkv] descales (the per-tensor ones broadcast); bf16 output"
        # flash_attn_varlen_func exists (FA2 and FA3) but is not wired here: it could not be tested
        # (no PyTorch on the CPU machine), and an untested peer is not timed.
        self.no_varlen = (
            f"{module}.flash_attn_varlen_func exists but this peer does not call it yet (not wired: "
            "untested without PyTorch)"
        )
        # flash_attn_func has a window_size, not passed here yet (not measured): a sliding window is refused.
        self.no_window = f"the {name} peer"
        # FlashAttention 3 takes v's own head dim ((192, 128) among them); FlashAttention 2 and FA3's FP8
        # path are not known to.
        if module != "flash_attn_interface" or precision == "fp8":
            self.one_head_dim = f"{module}.flash_attn_func ({precision}) needs one head dim"

    def _supports(self, problem: Problem) -> str | None:
        if reason := _torch_reason():
            return reason
        return _import_reason(self.module, self.module)  # bottom-right causal alignment, like jzyfa

    def arguments(self, problem: Problem, inputs: InputSet) -> tuple:
        if self.precision == "fp8":
            f = inputs.fp8()
            per_head = (problem.batch, problem.heads_kv)
            descales = [
                jnp.broadcast_to(d.reshape(()) if d.ndim < 2 else d, per_head)
                for d in (f.descale_q, f.descale_k, f.descale_v)
            ]
            return tuple(
                to_torch(x) for x in (f.q, f.k, f.v, *(jnp.asarray(d, jnp.float32) for d in descales))
            )
        return tuple(to_torch(x) for x in (inputs.q, inputs.k, inputs.v))

    def build(self, problem: Problem, options: Options) -> Built:
        flash_attn_func = importlib.import_module(self.module).flash_attn_func
        scale, causal = problem.softmax_scale, problem.mask_causal

        if self.precision == "fp8":

            def fn(q, k, v, dq, dk, dv):
                out = flash_attn_func(
                    q, k, v, softmax_scale=scale, causal=causal, q_descale=dq, k_descale=dk, v_descale=dv
                )
                return out[0] if isinstance(out, tuple) else out  # some versions also return the LSE
        else:

            def fn(q, k, v):
                out = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)
                return out[0] if isinstance(out, tuple) else out

        return Built(fn)

    def decode(self, raw, args: tuple):
        return torch_to_numpy(raw)


# ----------------------------------------------------------------------------------------------
# The registry


PEERS: dict[str, Peer] = {
    peer.name: peer
    for peer in [
        Jzyfa("jzyfa", "16-bit"),
        Jzyfa("jzyfa_xla", "16-bit", forced="xla"),
        Jzyfa("jzyfa_fp8", "fp8", lean_p=True),
        Jzyfa("jzyfa_fp8_exact_p", "fp8", lean_p=False, fp8_only=True),
        Jzyfa("jzyfa_fp8_xla", "fp8", forced="xla"),
        Jzyfa("jzyfa_fp8_in_call", "16-bit", in_call="fp8"),
        Jzyfa("jzyfa_int8", "16-bit", in_call="int8"),
        JaxNn("cudnn", "cudnn"),
        JaxNn("xla", "xla"),
        CudnnFp8(),
        Pallas(),
        TorchSdpa("torch_sdpa_cudnn", "CUDNN_ATTENTION"),
        TorchSdpa("torch_sdpa_flash", "FLASH_ATTENTION"),
        FlashAttn("flash_attn", "flash_attn"),
        FlashAttn("flash_attn3", "flash_attn_interface"),
        FlashAttn("flash_attn3_fp8", "flash_attn_interface", precision="fp8"),
    ]
}

# What `--impls auto` runs: every peer of the run's precision (unsupported ones say why), and in
# FP8 runs the 16-bit jzyfa and cuDNN as baselines.
AUTO_16BIT = [
    "jzyfa",
    "cudnn",
    "xla",
    "pallas",
    "torch_sdpa_cudnn",
    "torch_sdpa_flash",
    "flash_attn",
    "flash_attn3",
]
AUTO_FP8 = [
    "jzyfa_fp8",
    "jzyfa_fp8_exact_p",
    "jzyfa_fp8_in_call",
    "jzyfa_int8",
    "cudnn_fp8",
    "flash_attn3_fp8",
    "jzyfa",
    "cudnn",
]


def auto_peers(dtype: str) -> list[str]:
    return list(AUTO_FP8 if dtype == "fp8" else AUTO_16BIT)


def uses_torch(names) -> bool:
    return any(PEERS[name].framework == "torch" for name in names if name in PEERS)
