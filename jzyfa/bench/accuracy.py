r"""Attention accuracy against float64 attention, and FP8's effect on a model: `python -m jzyfa.bench.accuracy`.

Two reports:

1. Errors of O and LSE. For each input kind and shape, every variant (jzyfa BF16; jzyfa FP8 as the
   kernel will compute it, lean P on and off, with and without the Hadamard rotation, through
   `jzyfa.fp8_emulation`; jzyfa's pure-JAX FP8 path; cuDNN BF16 and FP8 on a GPU; the FP8 kernel
   once it exists) runs on the same 16-bit inputs (FP8 variants quantize them with
   `jzyfa.fp8_quantize`; INT8 variants run precision="int8": the INT8 kernel on a Hopper GPU, and
   its emulation `jzyfa.int8_emulation` as variants of their own), and is compared with float64
   attention on the *unquantized* inputs, for
   a slice of (batch, head) pairs: relative L2 error and max abs error of O, and the same for the
   LSE (natural log). The float64 reference runs over blocks of query rows, so 32K tokens fit.
   `--inputs captured:PATH` (examples/capture.py's q/k/v of a trained model) gives one set of rows
   per layer of the file, each at the file's shape (`--captured_layer N`: layer N only).
2. KL divergence. A small causal transformer (random weights, see `ModelConfig`) runs once with
   BF16 attention and once per FP8 variant; the report gives KL(p_bf16 || p_fp8) of the
   next-token distributions, averaged over positions, and how often the top-1 token agrees.

    python -m jzyfa.bench.accuracy --json_out accuracy.json --markdown    # on the H200
    python -m jzyfa.bench.accuracy --smoke                                # seconds on a CPU

Without a GPU it runs in smoke mode (small shapes and model); GPU-only variants say why not.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jzyfa import plan
from jzyfa.bench import captured as _captured
from jzyfa.bench import inputs as realistic_inputs
from jzyfa.bench import peers
from jzyfa.bench.float64 import (  # noqa: F401 - the report's reference, under these names here too
    Reference,
    attention_float64,
    error_metrics,
    reference_on_pairs,
    spread_pairs,
    take_lse_pairs,
    take_pairs,
)
from jzyfa.bench.problem import parse_shapes
from jzyfa.bench.report import (
    fmt,
    logger,
    markdown_table,
    plain_table,
    run_absl,
    short_error,
    split_list,
    write_json,
)
from jzyfa.fp8_emulation import FIXED_OFFSET_OPTIONS

# ----------------------------------------------------------------------------------------------
# Metrics


def kl_divergence(logits_p, logits_q) -> dict[str, float]:
    """KL(p || q) of the softmax distributions over the last axis, in float64 nats.

    Returns the mean and the max over positions, and the fraction of positions whose top-1 token
    agrees.
    """
    p_log = _log_softmax(np.asarray(logits_p, np.float64))
    q_log = _log_softmax(np.asarray(logits_q, np.float64))
    per_position = np.sum(np.exp(p_log) * (p_log - q_log), axis=-1)
    top1 = np.argmax(p_log, axis=-1) == np.argmax(q_log, axis=-1)
    return {
        "kl_mean": float(np.mean(per_position)),
        "kl_max": float(np.max(per_position)),
        "top1_agreement": float(np.mean(top1)),
    }


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


_REF_FLOP_BUDGET = 6e11  # float64 reference FLOPs per shape when the pair count is -1 (automatic)


def reference_pair_count(requested: int, shape: dict, causal: bool) -> int:
    """The pairs to check: as requested (0: all), or for -1 what the FLOP budget allows (2 to 8)."""
    if requested >= 0:
        return requested
    pairs = shape["seq_q"] * shape["seq_k"] / (2 if causal and shape["seq_q"] == shape["seq_k"] else 1)
    return max(2, min(8, int(_REF_FLOP_BUDGET // (4.0 * shape["head_dim"] * pairs))))


# ----------------------------------------------------------------------------------------------
# Variants


@dataclasses.dataclass(frozen=True)
class Setting:
    """What every variant of one accuracy run shares."""

    causal: bool
    softmax_scale: float
    granularity: str = "tensor"  # FP8 descales: "tensor" or "head"
    hadamard_seed: int = 0  # the rotation of the *_hadamard variants


@dataclasses.dataclass(frozen=True)
class Variant:
    """An attention computation under test: run(q, k, v, setting) -> (O, LSE or None), jax-traceable.

    q, k, v are the 16-bit inputs; FP8 variants quantize them themselves. `run` raises
    `peers.Unsupported` (at trace time) where it cannot serve.
    """

    name: str
    description: str
    run: Callable[..., tuple[jax.Array, jax.Array | None]]


def _quantized(q, k, v, setting: Setting, hadamard: bool) -> peers.Fp8Inputs:
    return peers.quantize_qkv(
        q, k, v, granularity=setting.granularity, hadamard_seed=setting.hadamard_seed if hadamard else None
    )


def _jzyfa_bf16(q, k, v, setting: Setting):
    import jzyfa

    return jzyfa.flash_attention(
        q, k, v, causal=setting.causal, softmax_scale=setting.softmax_scale, return_lse=True
    )


def _cudnn_bf16(q, k, v, setting: Setting):
    if jax.default_backend() != "gpu":
        raise peers.Unsupported("cuDNN needs a CUDA GPU")
    if setting.causal and q.shape[1] != k.shape[1]:
        raise peers.Unsupported("jax.nn's causal mask is top-left aligned; Sq != Sk is not comparable")
    out, residual = jax.nn.dot_product_attention(
        q,
        k,
        v,
        scale=setting.softmax_scale,
        is_causal=setting.causal,
        implementation="cudnn",
        return_residual=True,
    )
    return out, peers.lse_from_btn(residual)


def _jzyfa_fp8(implementation: str | None, hadamard: bool, lean_p: bool = True):
    def run(q, k, v, setting: Setting):
        import jzyfa

        if implementation == "kernel" and jax.default_backend() != "gpu":
            raise peers.Unsupported("the FP8 kernel runs on a GPU")
        f = _quantized(q, k, v, setting, hadamard)
        try:
            return jzyfa.flash_attention(
                f.q,
                f.k,
                f.v,
                descale_q=f.descale_q,
                descale_k=f.descale_k,
                descale_v=f.descale_v,
                causal=setting.causal,
                softmax_scale=setting.softmax_scale,
                return_lse=True,
                implementation=implementation,
                lean_p=lean_p,
            )
        except ValueError as e:
            if implementation == "kernel":
                raise peers.Unsupported(str(e)) from e
            raise

    return run


def _dequant_exact(q, k, v, setting: Setting):
    """jzyfa's pure-JAX FP8 path, one KV head (and its query heads) at a time: that path holds all
    scores at once (16 heads x 32K x 32K in float32 is 64 GiB); per KV head it needs 1/Hkv of that."""
    import jzyfa

    f = _quantized(q, k, v, setting, False)
    batch, seq_q, heads_q, _ = f.q.shape
    heads_kv = f.k.shape[2]

    def by_kv_head(x):  # [B, S, H, D] -> [Hkv, B, S, H / Hkv, D]
        return jnp.moveaxis(x.reshape(*x.shape[:2], heads_kv, -1, x.shape[3]), 2, 0)

    def descale_by_kv_head(d):  # () -> [Hkv]; [B, Hkv] -> [Hkv, B, 1]
        return jnp.broadcast_to(d, (heads_kv,)) if d.ndim == 0 else jnp.moveaxis(d, 1, 0)[..., None]

    def one_kv_head(args):
        qh, kh, vh, dq, dk, dv = args
        return jzyfa.flash_attention(
            qh, kh, vh, descale_q=dq, descale_k=dk, descale_v=dv, causal=setting.causal,
            softmax_scale=setting.softmax_scale, return_lse=True, implementation="xla",
        )  # fmt: skip

    out, lse = lax.map(
        one_kv_head,
        (by_kv_head(f.q), by_kv_head(f.k), by_kv_head(f.v), *map(descale_by_kv_head, f[3:])),
    )
    # out [Hkv, B, Sq, G, Dv] -> [B, Sq, Hq, Dv]; lse [Hkv, B, G, Sq] -> [B, Hq, Sq]
    out = jnp.moveaxis(out, 0, 2).reshape(batch, seq_q, heads_q, -1)
    return out, jnp.moveaxis(lse, 0, 1).reshape(batch, heads_q, seq_q)


def _emulated(hadamard: bool, **switches):
    def run(q, k, v, setting: Setting):
        try:
            fp8_emulation = importlib.import_module("jzyfa.fp8_emulation")
        except ImportError as e:
            raise peers.Unsupported(f"jzyfa.fp8_emulation is not importable: {e}") from e
        f = _quantized(q, k, v, setting, hadamard)
        return fp8_emulation.attention_fp8_emulated(
            f.q,
            f.k,
            f.v,
            f.descale_q,
            f.descale_k,
            f.descale_v,
            causal=setting.causal,
            softmax_scale=setting.softmax_scale,
            **switches,
        )

    return run


def _int8(rotate: bool, implementation: str | None = None):
    """precision="int8" (INT8 Q and K per 128-token block after smoothing the keys, e4m3 V) by its
    default path (the INT8 kernel on a Hopper GPU where it serves the call, the emulation elsewhere)
    or, with implementation="xla", always its emulation. The rotation is precision="int8"'s own (seed
    0); the FP8 descale granularity does not apply."""

    def run(q, k, v, setting: Setting):
        import jzyfa

        return jzyfa.flash_attention(
            q, k, v, causal=setting.causal, softmax_scale=setting.softmax_scale, return_lse=True,
            precision="int8", rotate=rotate, implementation=implementation,
        )  # fmt: skip

    return run


def _cudnn_fp8(hadamard: bool):
    def run(q, k, v, setting: Setting):
        if jax.default_backend() != "gpu":
            raise peers.Unsupported("cuDNN FP8 needs a CUDA GPU")
        if setting.granularity != "tensor":
            raise peers.Unsupported("cuDNN FP8 takes one descale per tensor (use --granularity tensor)")
        if setting.causal and q.shape[1] != k.shape[1]:
            raise peers.Unsupported("cuDNN's causal mask is top-left aligned; Sq != Sk is not comparable")
        f = _quantized(q, k, v, setting, hadamard)
        out8 = peers.cudnn_fp8_attention(
            f.q,
            f.k,
            f.v,
            peers.cudnn_fp8_params(f),
            causal=setting.causal,
            softmax_scale=setting.softmax_scale,
        )
        return out8.astype(jnp.float32) * f.descale_v.reshape(()), None

    return run


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in [
        Variant("jzyfa_bf16", "jzyfa.flash_attention on the bf16 inputs (the kernel on Hopper)", _jzyfa_bf16),
        Variant("cudnn_bf16", 'jax.nn.dot_product_attention(implementation="cudnn")', _cudnn_bf16),
        Variant("jzyfa_fp8", "jzyfa FP8 kernel (implementation='kernel')", _jzyfa_fp8("kernel", False)),
        Variant(
            "jzyfa_fp8_hadamard", "jzyfa FP8 kernel, q and k Hadamard-rotated", _jzyfa_fp8("kernel", True)
        ),
        Variant(
            "jzyfa_fp8_exact_p",
            "jzyfa FP8 kernel, lean P off (exp2 rounded to e4m3)",
            _jzyfa_fp8("kernel", False, lean_p=False),
        ),
        Variant(
            "jzyfa_fp8_exact_p_hadamard",
            "jzyfa FP8 kernel, lean P off, q and k Hadamard-rotated",
            _jzyfa_fp8("kernel", True, lean_p=False),
        ),
        Variant(
            "fp8_dequant_exact",
            "jzyfa's pure-JAX FP8 path: dequantized inputs, exact float32 softmax (input rounding only)",
            _dequant_exact,
        ),
        Variant("fp8_emul_lean", "FP8 kernel emulation, lean P on", _emulated(False, lean_p=True)),
        Variant(
            "fp8_emul_exact", "FP8 kernel emulation, lean P off (exact exp2)", _emulated(False, lean_p=False)
        ),
        Variant(
            "fp8_emul_lean_hadamard",
            "FP8 kernel emulation, lean P on, Hadamard",
            _emulated(True, lean_p=True),
        ),
        Variant(
            "fp8_emul_exact_hadamard",
            "FP8 kernel emulation, lean P off, Hadamard",
            _emulated(True, lean_p=False),
        ),
        Variant(
            "fp8_emul_fa3_style",
            "FP8 emulation with lean P, block scaling and the rounded row sum all off (FA3's scheme)",
            _emulated(False, lean_p=False, block_scaling=False, rounded_sum=False, **FIXED_OFFSET_OPTIONS),
        ),
        Variant(
            "int8_emul",
            "INT8 kernel emulation: smoothed keys, INT8 Q/K per 128-token block, e4m3 V",
            _int8(False, "xla"),
        ),
        Variant("int8_emul_hadamard", "INT8 kernel emulation, q and k Hadamard-rotated", _int8(True, "xla")),
        Variant("int8", 'precision="int8": the INT8 kernel on Hopper, its emulation elsewhere', _int8(False)),
        Variant("int8_hadamard", 'precision="int8", rotate=True (kernel or emulation, as int8)', _int8(True)),
        Variant("cudnn_fp8", "cuDNN FP8 (e4m3 output, per-tensor descales)", _cudnn_fp8(False)),
        Variant("cudnn_fp8_hadamard", "cuDNN FP8, q and k Hadamard-rotated", _cudnn_fp8(True)),
    ]
}
# The FP8 variants compared in the KL report (against BF16 attention in the same model).
KL_VARIANTS = [name for name in VARIANTS if name not in ("jzyfa_bf16", "cudnn_bf16")]


def jzyfa_bf16_path(head_dim: int, causal: bool = True) -> str:
    """What serves the jzyfa_bf16 variant here: the kernel (its row in `jzyfa.plan.KERNELS`, and a
    Hopper GPU), or the pure-JAX path."""
    import jzyfa

    row = plan.Config("16bit", (head_dim, head_dim), "causal" if causal else "none", "dense")
    if jzyfa.kernel_available() and plan.kernel_for(row) is not None:
        return "kernel"
    return "pure-JAX"


# ----------------------------------------------------------------------------------------------
# Error report


def evaluate_variant(variant: Variant, q, k, v, setting: Setting, ref: Reference) -> dict[str, Any]:
    """Runs one variant on the full inputs and compares it with the reference pairs. Never raises."""
    result: dict[str, Any] = {"variant": variant.name, "status": None, "message": None}
    start = time.perf_counter()
    try:
        out, lse = jax.jit(functools.partial(variant.run, setting=setting))(q, k, v)
        out = jax.block_until_ready(out)
    except peers.Unsupported as e:
        result.update(status="unsupported", message=str(e))
        return result
    except Exception as e:  # noqa: BLE001 - reported, and the run goes on
        result.update(status="error", message=short_error(e), traceback=traceback.format_exc(limit=6))
        return result
    got = take_pairs(out.astype(jnp.float32), ref.batches, ref.heads)
    got_lse = None if lse is None else take_lse_pairs(lse, ref.batches, ref.heads)
    result.update(error_metrics(got, ref.out, got_lse, ref.lse if lse is not None else None))
    result["status"] = "ok" if result["finite"] else "bad"
    result["seconds"] = time.perf_counter() - start
    return result


def error_inputs(config: dict[str, Any], kind: str, log: Callable[[str], None]):
    """(inputs, label, shape, q, k, v) per input set of one kind: one per --shapes entry, or for
    captured:PATH one per layer of the file at the file's shape (`inputs` then names the layer)."""
    if _captured.is_captured(kind):
        path = _captured.path_of(kind)
        flag = f"--inputs {kind}"
        for layer in _captured.layers_of(path, config.get("captured_layer"), flag):
            q, k, v = _captured.load_layer(path, layer, flag)
            name = _captured.label(path, layer)
            yield name, name, _captured.shape_of(q, k), jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
        return
    for batch, seq_q, seq_k in config["shapes"]:
        shape = {
            "batch": batch,
            "seq_q": seq_q,
            "seq_k": seq_k,
            "heads_q": config["heads"],
            "heads_kv": config["kv_heads"],
            "head_dim": config["head_dim"],
        }
        label = f"{kind} {batch}x{seq_q}" + ("" if seq_q == seq_k else f"x{seq_k}")
        try:
            q, k, v = realistic_inputs.make_qkv(kind, config["seed"], **shape)
        except realistic_inputs.ModelInputsUnavailable as e:
            log(f"{label}: skipped: {e}")
            continue
        yield kind, label, shape, q, k, v


def run_errors(config: dict[str, Any], log: Callable[[str], None]) -> list[dict[str, Any]]:
    results = []
    setting_base = {"granularity": config["granularity"], "hadamard_seed": config["seed"]}
    for kind in config["inputs"]:
        for inputs, label, shape, q, k, v in error_inputs(config, kind, log):
            setting = Setting(
                causal=config["causal"], softmax_scale=1 / math.sqrt(shape["head_dim"]), **setting_base
            )
            pairs = spread_pairs(
                shape["batch"],
                shape["heads_q"],
                reference_pair_count(config["ref_pairs"], shape, setting.causal),
            )
            ref = reference_on_pairs(q, k, v, pairs, scale=setting.softmax_scale, causal=setting.causal)
            log(f"{label}: float64 reference on {len(pairs)} (batch, head) pairs in {ref.seconds:.1f} s")
            for name in config["variants"]:
                r = evaluate_variant(VARIANTS[name], q, k, v, setting, ref)
                r.update(inputs=inputs, **shape, causal=setting.causal, reference_pairs=len(pairs))
                if name == "jzyfa_bf16":
                    r["path"] = jzyfa_bf16_path(shape["head_dim"], config["causal"])
                results.append(r)
                log(f"{label} {name}: {_error_summary(r)}")
            del q, k, v
    return results


def _error_summary(r: dict[str, Any]) -> str:
    if r["status"] in ("unsupported", "error"):
        return f"{r['status']}: {r['message']}"
    text = f"O rel {r['o_rel_l2']:.3e} max {r['o_max_abs']:.3e}"
    if r["lse_rel_l2"] is not None:
        text += f", LSE rel {r['lse_rel_l2']:.3e} max {r['lse_max_abs']:.3e}"
    return text


# ----------------------------------------------------------------------------------------------
# KL divergence of a small model


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A small causal transformer with random weights (RMSNorm, RoPE, GQA attention, SiLU MLP).

    No trained causal LM ships inside an installable package (docs/measuring.md), so the weights
    are random; `qk_gain` and `logit_gain` make its attention and next-token distributions peaked
    enough (score std ~qk_gain^2, logit std ~logit_gain) for rounding to matter. The token sequence
    starts with a BOS token whose embedding is `bos_gain` times larger, which gives the model an
    attention-sink-like first token.
    """

    batch: int = 1  # sequences
    seq: int = 4096  # tokens per sequence, the first a BOS token
    layers: int = 4  # blocks: RMSNorm, attention, RMSNorm, SiLU MLP
    d_model: int = 1024  # the residual stream's width
    mlp: int = 2048  # the MLP's hidden width
    heads_q: int = 8  # query heads (GQA: heads_q / heads_kv share a KV head)
    heads_kv: int = 2
    head_dim: int = 128
    vocab: int = 8192  # tokens; 0 is BOS
    rope_base: float = 500_000.0  # RoPE's base (Llama 3)
    qk_gain: float = 1.5  # scale of q's and k's projections: score std ~qk_gain^2
    logit_gain: float = 3.0  # scale of the unembedding: logit std ~logit_gain
    bos_gain: float = 8.0  # the BOS embedding's scale over the others: an attention sink


SMOKE_MODEL = ModelConfig(
    batch=1, seq=64, layers=2, d_model=64, heads_q=4, heads_kv=2, head_dim=16, mlp=128, vocab=128
)


def init_model(cfg: ModelConfig, seed: int) -> dict[str, Any]:
    """Random bf16 weights: N(0, 1/fan_in) projections, q and k scaled by qk_gain."""
    keys = iter(jax.random.split(jax.random.key(seed), 4 + 7 * cfg.layers))

    def dense(fan_in, fan_out, gain=1.0):
        w = jax.random.normal(next(keys), (fan_in, fan_out)) * (gain / math.sqrt(fan_in))
        return w.astype(jnp.bfloat16)

    q_dim, kv_dim = cfg.heads_q * cfg.head_dim, cfg.heads_kv * cfg.head_dim
    layers = [
        {
            "wq": dense(cfg.d_model, q_dim, cfg.qk_gain),
            "wk": dense(cfg.d_model, kv_dim, cfg.qk_gain),
            "wv": dense(cfg.d_model, kv_dim),
            "wo": dense(q_dim, cfg.d_model),
            "w_gate": dense(cfg.d_model, cfg.mlp),
            "w_up": dense(cfg.d_model, cfg.mlp),
            "w_down": dense(cfg.mlp, cfg.d_model),
        }
        for _ in range(cfg.layers)
    ]
    embed = jax.random.normal(next(keys), (cfg.vocab, cfg.d_model))
    embed = embed.at[0].multiply(cfg.bos_gain)  # token 0 is BOS
    return {
        "embed": embed.astype(jnp.bfloat16),
        "layers": layers,
        "unembed": dense(cfg.d_model, cfg.vocab, cfg.logit_gain),
    }


def _rms_norm(x):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf**2, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)


def model_logits(params, tokens, cfg: ModelConfig, attention: Callable) -> jax.Array:
    """tokens [B, S] -> float32 logits [B, S, vocab]; attention(q, k, v) -> bf16 [B, S, Hq, D]."""
    batch, seq = tokens.shape
    positions = jnp.arange(seq)
    x = params["embed"][tokens]
    for layer in params["layers"]:
        h = _rms_norm(x)
        q = (h @ layer["wq"]).reshape(batch, seq, cfg.heads_q, cfg.head_dim)
        k = (h @ layer["wk"]).reshape(batch, seq, cfg.heads_kv, cfg.head_dim)
        v = (h @ layer["wv"]).reshape(batch, seq, cfg.heads_kv, cfg.head_dim)
        q = realistic_inputs.apply_rope(q, positions, cfg.rope_base)
        k = realistic_inputs.apply_rope(k, positions, cfg.rope_base)
        o = attention(q, k, v).astype(jnp.bfloat16)
        x = x + o.reshape(batch, seq, -1) @ layer["wo"]
        h = _rms_norm(x)
        x = x + (jax.nn.silu(h @ layer["w_gate"]) * (h @ layer["w_up"])) @ layer["w_down"]
    return (_rms_norm(x) @ params["unembed"]).astype(jnp.float32)


def model_tokens(cfg: ModelConfig, seed: int) -> jax.Array:
    """BOS (token 0) followed by uniformly random tokens."""
    tokens = jax.random.randint(jax.random.key(seed + 1), (cfg.batch, cfg.seq), 1, cfg.vocab)
    return tokens.at[:, 0].set(0)


def run_kl(cfg: ModelConfig, variant_names: Sequence[str], setting_base: dict, seed: int, log) -> dict:
    """KL(p_bf16 || p_variant) for each variant, and the same for float32 attention (the floor)."""
    params = init_model(cfg, seed)
    tokens = model_tokens(cfg, seed)
    setting = Setting(causal=True, softmax_scale=1 / math.sqrt(cfg.head_dim), **setting_base)

    def logits_with(attention):
        return jax.block_until_ready(jax.jit(lambda p, t: model_logits(p, t, cfg, attention))(params, tokens))

    def bf16_attention(q, k, v):
        return _jzyfa_bf16(q, k, v, setting)[0]

    def f32_attention(q, k, v):
        import jzyfa

        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        return jzyfa.attention_reference(*f32, causal=True, softmax_scale=setting.softmax_scale)[0]

    start = time.perf_counter()
    base = logits_with(bf16_attention)
    rows = []
    candidates = [("f32_attention", f32_attention)] + [
        (name, lambda q, k, v, variant=VARIANTS[name]: variant.run(q, k, v, setting)[0])
        for name in variant_names
    ]
    for name, attention in candidates:
        row: dict[str, Any] = {"variant": name, "status": "ok", "message": None}
        try:
            row.update(kl_divergence(base, logits_with(attention)))
        except peers.Unsupported as e:
            row.update(status="unsupported", message=str(e))
        except Exception as e:  # noqa: BLE001
            row.update(status="error", message=short_error(e), traceback=traceback.format_exc(limit=6))
        rows.append(row)
        if row["status"] == "ok":
            log(f"KL {name}: mean {row['kl_mean']:.3e}, top-1 agreement {row['top1_agreement']:.4f}")
        else:
            log(f"KL {name}: {row['status']}: {row['message']}")
    entropy = _mean_entropy(base)
    return {
        "model": dataclasses.asdict(cfg),
        "bf16_entropy_nats": entropy,
        "seconds": time.perf_counter() - start,
        "results": rows,
    }


def _mean_entropy(logits) -> float:
    logp = _log_softmax(np.asarray(logits, np.float64))
    return float(np.mean(-np.sum(np.exp(logp) * logp, axis=-1)))


# ----------------------------------------------------------------------------------------------
# Report


def _fmt(value, spec: str = ".3e") -> str:
    return fmt(value, spec)


def format_tables(report: dict[str, Any], markdown: bool) -> str:
    def table(header: list[str], rows: list[list[str]]) -> list[str]:
        if markdown:
            return markdown_table(header, rows)
        lines = plain_table(header + [""], [row + [""] for row in rows])
        return [lines[0], "-" * len(lines[0])] + lines[1:]

    lines = []
    cfg = report["config"]
    lines.append(
        f"{report['env']['device']}; jax {report['env']['jax']}; head dim {cfg['head_dim']}, "
        f"{cfg['heads']} heads ({cfg['kv_heads']} kv), {'causal' if cfg['causal'] else 'non-causal'}, "
        f"FP8 descales per {cfg['granularity']}; errors against float64 attention on the unquantized inputs."
    )
    groups: dict[tuple, list] = {}
    for r in report["errors"]:
        key = (r["inputs"], r["batch"], r["seq_q"], r["seq_k"])
        groups.setdefault(key, []).append(r)
    header = ["variant", "O rel L2", "O max abs", "LSE rel L2", "LSE max abs", "status"]
    for (kind, batch, seq_q, seq_k), rows in groups.items():
        seq = f"{seq_q}" if seq_q == seq_k else f"{seq_q}x{seq_k}"
        heads = ""
        if _captured.is_captured(kind):  # the title line's heads and head dim are the flags'
            heads = (
                f", {rows[0]['heads_q']}/{rows[0]['heads_kv']} heads of {rows[0]['head_dim']} (the file's)"
            )
        pairs = f"{rows[0]['reference_pairs']} (batch, head) pairs"
        lines += ["", f"{kind} inputs, {batch}x{seq}{heads} ({pairs}):", ""]
        cells = []
        for r in rows:
            status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['message']}"
            name = r["variant"] + (f" ({r['path']})" if r.get("path") else "")
            cells.append(
                [
                    name,
                    _fmt(r.get("o_rel_l2")),
                    _fmt(r.get("o_max_abs")),
                    _fmt(r.get("lse_rel_l2")),
                    _fmt(r.get("lse_max_abs")),
                    status,
                ]
            )
        lines += table(header, cells)
    if report.get("kl"):
        kl = report["kl"]
        m = kl["model"]
        lines += [
            "",
            (
                f"KL(p_bf16 || p_variant) of next-token distributions: random-weight model, {m['layers']} layers, "
                f"d_model {m['d_model']}, {m['heads_q']}/{m['heads_kv']} heads of {m['head_dim']}, vocab {m['vocab']}, "
                f"{m['batch']}x{m['seq']} tokens; BF16 entropy {kl['bf16_entropy_nats']:.2f} nats."
            ),
            "",
        ]
        cells = []
        for r in kl["results"]:
            status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['message']}"
            cells.append(
                [
                    r["variant"],
                    _fmt(r.get("kl_mean")),
                    _fmt(r.get("kl_max")),
                    _fmt(r.get("top1_agreement"), ".4f"),
                    status,
                ]
            )
        lines += table(["variant", "KL mean", "KL max", "top-1 agree", "status"], cells)
    return "\n".join(lines)


def _env() -> dict[str, Any]:
    import jaxlib

    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
    }


def run(config: dict[str, Any], log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The accuracy report for a resolved config (see `resolve_config`)."""
    log = log or _log
    unknown = [n for n in list(config["variants"]) + list(config["kl_variants"]) if n not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    report: dict[str, Any] = {"env": _env(), "config": config}
    report["errors"] = run_errors(config, log)
    if config["kl"]:
        setting_base = {"granularity": config["granularity"], "hadamard_seed": config["seed"]}
        report["kl"] = run_kl(config["model"], config["kl_variants"], setting_base, config["seed"], log)
    return report


_log = logger("jzyfa.bench.accuracy")


# ----------------------------------------------------------------------------------------------
# Command line (flags are defined only when this module is the program, so that importing it defines
# none: `python -m jzyfa.bench`'s flags share some names)

GPU_SHAPES = "1x4096,1x32768"
SMOKE_SHAPES = "1x256"


def _define_flags():
    from absl import flags

    flags.DEFINE_string("shapes", GPU_SHAPES, "Comma-separated BxS or BxSqxSk sizes.")
    flags.DEFINE_integer("heads", 16, "Query heads.")
    flags.DEFINE_integer("kv_heads", None, "Key/value heads (default: --heads).")
    flags.DEFINE_integer("head_dim", 128, "Head dimension.")
    flags.DEFINE_bool("causal", True, "Causal mask (bottom-right aligned).")
    flags.DEFINE_string(
        "inputs",
        "gaussian,activations",
        "Input kinds: gaussian, activations, captured:PATH (examples/capture.py's q/k/v of a trained "
        "model; every layer, each at the file's shape; --shapes and the head flags do not apply to it).",
    )
    flags.DEFINE_integer(
        "captured_layer", -1, "The layer of each captured:PATH file to check; -1: every layer."
    )
    flags.DEFINE_enum("granularity", "tensor", ["tensor", "head"], "FP8 descale granularity.")
    flags.DEFINE_string(
        "variants", ",".join(VARIANTS), f"Variants for the error report: {', '.join(VARIANTS)}."
    )
    flags.DEFINE_integer(
        "ref_pairs",
        -1,
        "(batch, head) pairs compared with float64 attention: 0 all, -1 as many as a budget of "
        "float64 FLOPs allows (8 at 4K tokens, 2 at 32K).",
    )
    flags.DEFINE_bool("kl", True, "Also run the KL-divergence report.")
    flags.DEFINE_string("kl_variants", ",".join(KL_VARIANTS), "Variants for the KL report.")
    flags.DEFINE_string(
        "model",
        "",
        "Overrides of the KL model's ModelConfig, e.g. 'seq=8192,layers=8' (defaults: "
        + ", ".join(f"{f.name}={getattr(ModelConfig(), f.name)}" for f in dataclasses.fields(ModelConfig))
        + ").",
    )
    flags.DEFINE_integer("seed", 0, "Seed of the inputs, the model and the Hadamard rotation.")
    flags.DEFINE_bool("smoke", None, "Small shapes and model (the default without a GPU).")
    flags.DEFINE_string("json_out", None, "Write the report as JSON here.")
    flags.DEFINE_bool("markdown", False, "Print markdown tables.")


def parse_model_overrides(text: str, base: ModelConfig) -> ModelConfig:
    """'seq=8192,layers=8' -> base with those fields replaced."""
    fields = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    changes = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, value = item.partition("=")
        if name not in fields or not value:
            raise ValueError(f"--model: {item!r} is not FIELD=VALUE with FIELD one of {list(fields)}")
        changes[name] = float(value) if isinstance(getattr(base, name), float) else int(value)
    return dataclasses.replace(base, **changes)


def resolve_config() -> dict[str, Any]:
    from absl import flags

    f = flags.FLAGS
    smoke = f.smoke if f.smoke is not None else jax.default_backend() != "gpu"
    shapes_text = f.shapes if (f["shapes"].present or not smoke) else SMOKE_SHAPES
    heads = f.heads if (f["heads"].present or not smoke) else 2
    model = parse_model_overrides(f.model, SMOKE_MODEL if smoke else ModelConfig())
    kv_heads = f.kv_heads or heads
    if heads % kv_heads:
        raise ValueError(f"--heads ({heads}) must be a multiple of --kv_heads ({kv_heads})")
    return {
        "shapes": parse_shapes(shapes_text),
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": f.head_dim,
        "causal": f.causal,
        "inputs": split_list(f.inputs),
        "captured_layer": f.captured_layer,
        "granularity": f.granularity,
        "variants": split_list(f.variants),
        "ref_pairs": f.ref_pairs,
        "kl": f.kl,
        "kl_variants": split_list(f.kl_variants),
        "model": model,
        "seed": f.seed,
        "smoke": smoke,
        "json_out": f.json_out,
        "markdown": f.markdown,
    }


def main(argv: Sequence[str]) -> None:
    from absl import app

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = resolve_config()
    for kind in config["inputs"]:
        if _captured.is_captured(kind):
            try:  # the file and --captured_layer checked before any work
                _captured.layers_of(_captured.path_of(kind), config["captured_layer"], f"--inputs {kind}")
            except _captured.CapturedFormatError as e:
                raise app.UsageError(str(e)) from e
        elif kind not in realistic_inputs.INPUT_KINDS:
            raise app.UsageError(
                f"--inputs: unknown kind {kind!r}; known: {realistic_inputs.INPUT_KINDS} or captured:PATH"
            )
    report = run(config)
    print(format_tables(report, config["markdown"]))
    if config["json_out"]:
        write_json(report, config["json_out"])
        _log(f"wrote {config['json_out']}")


def run_main() -> None:
    _define_flags()
    run_absl(main, __doc__)


if __name__ == "__main__":
    run_main()
