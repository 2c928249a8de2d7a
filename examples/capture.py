"""Captures q, k, v of every layer of a trained examples/lm.py model on held-out text.

The captured arrays are the exact inputs of attention (RoPE applied to q and k), bf16, batch 1:
q [1, seq, heads_q, head_dim], k and v [1, seq, heads_kv, head_dim]. The text is the first `--seq`
bytes of the held-out split of examples/stdlib_text.py (documents concatenated, so any length up to
the split's size works). Benchmarks time and check attention on these instead of Gaussian inputs:

    python examples/capture.py --checkpoint lm.npz --seq 16384 --out qkv_16k.npz

    import capture
    for q, k, v in capture.load_captured("qkv_16k.npz"): ...

The file is one `.npz`: `layer{i}_q`, `layer{i}_k`, `layer{i}_v` as uint16 bit patterns of bf16
(numpy has no bf16 of its own; `load_captured` views them back), and `header`, JSON with the layer
count, seq, dtype, each array's shape, and the model's config. The format's reading and writing
live in jzyfa/bench/captured.py; `python -m jzyfa.bench --inputs captured:qkv_16k.npz` times on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # examples/lm.py and its neighbours
import lm
import prefill
import stdlib_text

from jzyfa.bench import captured as captured_format
from jzyfa.bench.captured import load_captured, read_header  # noqa: F401 (re-exported)


def capture_qkv(config: prefill.Config, params: dict, tokens: jax.Array, attention: str = "jzyfa") -> list:
    """[(q, k, v) of layer 0, ...]: the arrays each layer's attention receives in lm.apply."""
    bf16 = jax.tree.map(lambda w: jnp.asarray(w, jnp.bfloat16), params)  # as lm.apply casts them
    x = bf16["embed"][tokens]
    captured = []

    def recording_attention(q, k, v):
        captured.append((q, k, v))
        return lm.attention_fn(attention)(q, k, v)

    for index in range(config.layers):
        layer = {name: weights[index] for name, weights in bf16["layers"].items()}
        x = prefill.transformer_block(x, layer, config, recording_attention)
    return captured


def save_captured(path: str | pathlib.Path, captured: list, config: prefill.Config) -> None:
    captured_format.save_captured(path, captured, dataclasses.asdict(config))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", type=pathlib.Path, required=True, help="written by train.py --save")
    parser.add_argument("--seq", type=int, default=4096, help="held-out bytes (tokens) to run")
    parser.add_argument("--out", type=pathlib.Path, required=True, help="the .npz to write")
    parser.add_argument(
        "--attention", choices=lm.ATTENTIONS, default="jzyfa", help="attention between layers"
    )
    args = parser.parse_args(argv)

    config, params = lm.load_checkpoint(args.checkpoint)
    held_out = stdlib_text.load_corpus().held_out
    if args.seq > len(held_out):
        raise SystemExit(f"--seq {args.seq} is longer than the held-out text ({len(held_out)} bytes)")
    tokens = jnp.asarray(held_out[None, : args.seq], jnp.int32)
    captured = jax.jit(capture_qkv, static_argnums=(0, 3))(config, params, tokens, args.attention)
    save_captured(args.out, captured, config)
    header = read_header(args.out)
    print(
        f"wrote q, k, v of {header['layers']} layers at seq {header['seq']} to {args.out}: "
        f"q {header['shapes']['layer0_q']}, k and v {header['shapes']['layer0_k']} bf16"
    )
    return header


if __name__ == "__main__":
    main()
