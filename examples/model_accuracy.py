"""Accuracy of lower-precision attention inside a trained model: KL from the bf16 run, per-layer errors.

Loads a checkpoint of examples/train.py (`--load`), runs held-out text (examples/stdlib_text.py's
held-out split, `--windows` windows of `--seq` bytes) through the model once per attention variant,
and reports per variant:

- KL(bf16 || variant) of the next-byte distributions, mean (and max) over tokens, in nats: the
  measure. The reference run is jzyfa bf16.
- top-1 agreement with the reference run, and the perplexity (exp of the next-byte cross-entropy on
  the text), alongside.
- Per layer: relative L2 error of O and of the LSE against float64 attention, on the q, k, v each
  layer receives in the bf16 run (captured in process, or `--captured PATH` from examples/capture.py),
  on `--ref_pairs` (batch, head) pairs spread over the heads.

    python examples/model_accuracy.py --load /tmp/lm.npz --seq 4096 --windows 2 --json_out acc.json --plot .

The variants (`VARIANTS`; `--variants` picks some): bf16 (jzyfa.flash_attention), fp8_lean_p and
fp8_exact_p (precision="fp8", lean_p True / False), the same with rotate=True (q and k Hadamard-
rotated before quantizing), cudnn_fp8 (JAX's cuDNN FP8 attention, per-tensor descales, as
`jzyfa.bench.accuracy` calls it) and int8 (precision="int8", where jzyfa has it). Each is tried on a
tiny input first; one that cannot run here (cuDNN off a GPU, a precision jzyfa lacks) is skipped
with the reason. Off a Hopper GPU jzyfa's FP8 variants run its pure-JAX FP8 path (input rounding
only; lean P is a kernel feature), so CPU figures check the plumbing, not the kernel.

Markdown tables go to stdout, JSON to `--json_out`, PNGs (KL per variant, error per layer) to the
`--plot` folder where matplotlib is importable.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import pathlib
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # examples/lm.py and its neighbours
import capture
import lm
import prefill
import stdlib_text

import jzyfa
from jzyfa.bench import accuracy, float64
from jzyfa.bench.captured import CapturedFormatError, load_captured
from jzyfa.bench.report import markdown_table, short_error, write_json

# (q, k, v) -> (out, lse or None), causal, default softmax scale; q, k, v bf16 [B, S, H, D].
AttentionWithLse = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array | None]]


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    description: str
    run: AttentionWithLse


def _jzyfa(**options) -> AttentionWithLse:
    def run(q, k, v):
        return jzyfa.flash_attention(q, k, v, causal=True, return_lse=True, **options)

    return run


def _cudnn_fp8(q, k, v):
    setting = accuracy.Setting(causal=True, softmax_scale=1 / math.sqrt(q.shape[-1]))
    out, lse = accuracy.VARIANTS["cudnn_fp8"].run(q, k, v, setting)
    return out.astype(q.dtype), lse


REFERENCE = "bf16"
# Add a variant here; it is tried on a tiny input and skipped with the reason where it cannot run.
VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in [
        Variant("bf16", "jzyfa.flash_attention on bf16 (the reference run)", _jzyfa()),
        Variant("fp8_lean_p", 'precision="fp8", lean P (one FFMA per probability code)', _jzyfa(precision="fp8")),
        Variant("fp8_exact_p", 'precision="fp8", exact P (exp2 rounded to e4m3)', _jzyfa(precision="fp8", lean_p=False)),
        Variant("fp8_lean_p_rotated", 'precision="fp8", lean P, rotate=True', _jzyfa(precision="fp8", rotate=True)),
        Variant(
            "fp8_exact_p_rotated",
            'precision="fp8", exact P, rotate=True',
            _jzyfa(precision="fp8", lean_p=False, rotate=True),
        ),
        Variant("cudnn_fp8", "JAX's cuDNN FP8 attention, per-tensor descales, e4m3 output (no LSE)", _cudnn_fp8),
        Variant("int8", 'precision="int8"', _jzyfa(precision="int8")),
    ]
}  # fmt: skip


def availability(variant: Variant, heads_q: int, heads_kv: int, head_dim: int) -> str | None:
    """None where the variant runs here (tried on a small causal input, 128 tokens), else why not."""
    shape_q, shape_kv = (1, 128, heads_q, head_dim), (1, 128, heads_kv, head_dim)  # cuDNN FP8 wants >= 64
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], shape_q, jnp.bfloat16)
    k = jax.random.normal(keys[1], shape_kv, jnp.bfloat16)
    v = jax.random.normal(keys[2], shape_kv, jnp.bfloat16)
    try:
        jax.block_until_ready(jax.jit(variant.run)(q, k, v))
    except Exception as e:  # noqa: BLE001 - the reason is the report
        return short_error(e)
    return None


# ----------------------------------------------------------------------------------------------
# The model with each variant


def _out_only(variant: Variant) -> prefill.AttentionFn:
    return lambda q, k, v: variant.run(q, k, v)[0]


@functools.partial(jax.jit, static_argnums=(0, 3))
def _logits(config: prefill.Config, params: dict, tokens: jax.Array, variant: Variant) -> jax.Array:
    bf16 = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)  # as lm.apply casts them
    return prefill.forward(bf16, tokens, config, _out_only(variant)).astype(jnp.float32)


def perplexity(logits: np.ndarray, tokens: np.ndarray) -> float:
    """exp of the mean cross-entropy of predicting tokens[:, 1:] from logits[:, :-1]."""
    log_probs = accuracy._log_softmax(np.asarray(logits[:, :-1], np.float64))
    picked = np.take_along_axis(log_probs, np.asarray(tokens[:, 1:, None]), axis=-1)
    return float(np.exp(-np.mean(picked)))


def model_rows(config, params, tokens, variants: list[Variant], log) -> list[dict]:
    """Per variant: KL from the reference run, top-1 agreement, perplexity."""
    reference = np.asarray(_logits(config, params, tokens, VARIANTS[REFERENCE]))
    rows = []
    for variant in variants:
        start = time.perf_counter()
        logits = (
            reference if variant.name == REFERENCE else np.asarray(_logits(config, params, tokens, variant))
        )
        kl = accuracy.kl_divergence(
            reference.reshape(-1, reference.shape[-1]), logits.reshape(-1, logits.shape[-1])
        )
        row = {"variant": variant.name, **kl, "perplexity": perplexity(logits, np.asarray(tokens))}
        row["finite"] = bool(np.all(np.isfinite(logits)))
        rows.append(row)
        log(f"{variant.name}: KL {row['kl_mean']:.3e} nats, top-1 {row['top1_agreement']:.4f}, "
            f"perplexity {row['perplexity']:.4f} ({time.perf_counter() - start:.1f} s)")  # fmt: skip
    return rows


def layer_rows(captured: list, variants: list[Variant], ref_pairs: int, log) -> list[dict]:
    """Per layer and variant: relative L2 error of O and LSE against float64 on the layer's q, k, v."""
    rows = []
    for layer, (q, k, v) in enumerate(captured):
        q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
        pairs = float64.spread_pairs(q.shape[0], q.shape[2], ref_pairs)
        scale = 1 / math.sqrt(q.shape[-1])
        ref = float64.reference_on_pairs(q, k, v, pairs, scale=scale, causal=True)
        for variant in variants:
            out, lse = jax.jit(variant.run)(q, k, v)
            got = float64.take_pairs(out.astype(jnp.float32), ref.batches, ref.heads)
            got_lse = None if lse is None else float64.take_lse_pairs(lse, ref.batches, ref.heads)
            metrics = float64.error_metrics(got, ref.out, got_lse, None if lse is None else ref.lse)
            rows.append({"layer": layer, "variant": variant.name, "pairs": len(pairs), **metrics})
        log(f"layer {layer}: float64 reference on {len(pairs)} (batch, head) pairs in {ref.seconds:.1f} s")
    return rows


# ----------------------------------------------------------------------------------------------
# Report


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_tables(report: dict) -> str:
    lines = [
        f"Next-byte distributions on {report['tokens']} held-out tokens, KL(bf16 || variant) in nats:",
        "",
    ]
    lines += markdown_table(
        ["variant", "KL mean", "KL max", "top-1 agreement", "perplexity"],
        [
            [r["variant"], _fmt(r["kl_mean"], ".3e"), _fmt(r["kl_max"], ".3e"), _fmt(r["top1_agreement"], ".4f"),
             _fmt(r["perplexity"], ".4f")]
            for r in report["model"]
        ],
    )  # fmt: skip
    variants = list(dict.fromkeys(r["variant"] for r in report["layers"]))
    layers = sorted({r["layer"] for r in report["layers"]})
    by = {(r["layer"], r["variant"]): r for r in report["layers"]}
    for key, title in (("o_rel_l2", "O"), ("lse_rel_l2", "LSE")):
        lines += ["", f"Relative L2 error of {title} per layer against float64 (captured q, k, v):", ""]
        lines += markdown_table(
            ["layer", *variants],
            [[str(i)] + [_fmt(by[(i, n)][key], ".2e") for n in variants] for i in layers],
        )
    if report["skipped"]:
        lines += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in report["skipped"].items())]
    return "\n".join(lines)


def write_plots(report: dict, folder: pathlib.Path) -> list[str]:
    """model_kl.png (KL per variant) and model_layer_error.png (O error per layer); [] without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    rows = [r for r in report["model"] if r["variant"] != REFERENCE]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.bar([r["variant"] for r in rows], [max(r["kl_mean"], 1e-12) for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("KL(bf16 || variant), nats per token")
    ax.set_title(f"next-byte KL from the bf16 run ({report['tokens']} tokens)")
    ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    kl_path = folder / "model_kl.png"
    fig.savefig(kl_path, dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name in dict.fromkeys(r["variant"] for r in report["layers"]):
        points = [(r["layer"], r["o_rel_l2"]) for r in report["layers"] if r["variant"] == name]
        ax.plot([p[0] for p in points], [max(p[1], 1e-12) for p in points], marker="o", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("relative L2 error of O vs float64")
    ax.legend(fontsize="small")
    fig.tight_layout()
    layer_path = folder / "model_layer_error.png"
    fig.savefig(layer_path, dpi=120)
    plt.close(fig)
    return [str(kl_path), str(layer_path)]


# ----------------------------------------------------------------------------------------------
# Main


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--load", type=pathlib.Path, required=True, help="checkpoint written by train.py --save"
    )
    parser.add_argument(
        "--seq", type=int, default=None, help="bytes per window (default: the checkpoint's seq)"
    )
    parser.add_argument(
        "--windows", type=int, default=1, help="consecutive held-out windows run as one batch"
    )
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}"
    )
    parser.add_argument("--captured", type=pathlib.Path, default=None,
                        help="q/k/v of examples/capture.py for the per-layer errors (default: captured here "
                             "from the first window of the bf16 run)")  # fmt: skip
    parser.add_argument(
        "--ref_pairs", type=int, default=2, help="(batch, head) pairs per layer checked in float64"
    )
    parser.add_argument("--json_out", type=pathlib.Path, default=None, help="write the report as JSON")
    parser.add_argument(
        "--plot", type=pathlib.Path, default=None, help="folder for the PNGs (needs matplotlib)"
    )
    args = parser.parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    if not args.load.is_file():
        parser.error(f"--load {args.load}: no such checkpoint (write one with examples/train.py --save)")
    return args, [REFERENCE] + [n for n in names if n != REFERENCE]


def main(argv: list[str] | None = None) -> dict:
    args, names = parse_args(argv)
    log = functools.partial(print, file=sys.stderr, flush=True)
    config, params = lm.load_checkpoint(args.load)
    seq = args.seq or config.seq
    held_out = stdlib_text.load_corpus().held_out
    if args.windows * seq > len(held_out):
        raise SystemExit(
            f"--windows {args.windows} x --seq {seq} is longer than the held-out text ({len(held_out)} bytes)"
        )
    tokens = jnp.asarray(held_out[: args.windows * seq].reshape(args.windows, seq), jnp.int32)
    skipped = {}
    variants = []
    for name in names:
        reason = availability(VARIANTS[name], config.heads_q, config.heads_kv, config.head_dim)
        if reason is None:
            variants.append(VARIANTS[name])
        else:
            skipped[name] = reason
            log(f"{name}: skipped: {reason}")
    if REFERENCE in skipped:
        raise SystemExit(f"the reference variant {REFERENCE} cannot run here: {skipped[REFERENCE]}")
    if args.captured is not None:  # read first: a bad file fails before the model runs
        try:
            captured = load_captured(args.captured, flag="--captured")
        except CapturedFormatError as e:
            raise SystemExit(str(e)) from e
    else:
        captured = jax.jit(capture.capture_qkv, static_argnums=(0, 3))(config, params, tokens[:1], "jzyfa")
    rows = model_rows(config, params, tokens, variants, log)
    report = {
        "checkpoint": str(args.load),
        "config": dataclasses.asdict(config),
        "tokens": int(tokens.size),
        "seq": seq,
        "windows": args.windows,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "variants": {v.name: v.description for v in variants},
        "skipped": skipped,
        "model": rows,
        "layers": layer_rows(captured, variants, args.ref_pairs, log),
    }
    print(format_tables(report))
    if args.json_out:
        write_json(report, str(args.json_out))
        log(f"wrote {args.json_out}")
    if args.plot:
        written = write_plots(report, args.plot)
        log(f"wrote {', '.join(written)}" if written else "no plots: matplotlib is not importable")
    return report


if __name__ == "__main__":
    main()
