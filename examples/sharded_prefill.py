"""Sharded prefill of a small causal transformer under `jax.jit` over a device mesh.

The model is the one in examples/prefill.py (RMSNorm, RoPE, GQA attention, gated MLP, bf16); what
changes is where its arrays live:
- data x tensor: batch split over `data`; attention heads and MLP columns over `tensor` (Megatron
  style). `jzyfa.flash_attention` is partitioned by its sharding rule and needs no collective itself.
- data x sequence: batch over `data`, the sequence over `sequence` (context parallelism). Tokens are
  kept in the balanced chunk order from the embedding on, RoPE gets the matching positions, and
  attention is `jzyfa.context_parallel_attention` with `--strategy allgather` or `ring`.

It prints tokens/s of the sharded prefill and of the same prefill on one device, and the largest
difference between their logits (at the first, last and quarter positions).

    python examples/sharded_prefill.py                               # all devices, data x tensor
    python examples/sharded_prefill.py --mesh data=2,sequence=4 --strategy ring
    python examples/sharded_prefill.py --preset gpu --seq 32768 --mesh sequence=8

On a CPU, `XLA_FLAGS=--xla_force_host_platform_device_count=8` (or `jax_num_cpu_devices`) gives 8
devices.
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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # the model of examples/prefill.py
import prefill

import jzyfa

MESH_AXES = ("data", "tensor", "sequence")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the prefill's arrays live; mesh None means one device."""

    mesh: jax.sharding.Mesh | None
    strategy: str = "allgather"
    seq_layout: str = "balanced"

    def size(self, axis: str) -> int:
        return self.mesh.shape.get(axis, 1) if self.mesh is not None else 1

    def spec(self, *entries) -> P:
        """entries with axes this mesh lacks (or has at size 1) replaced by None."""
        return P(*(e if e is not None and self.size(e) > 1 else None for e in entries))

    def sharding(self, *entries) -> NamedSharding | None:
        return NamedSharding(self.mesh, self.spec(*entries)) if self.mesh is not None else None

    @property
    def sequence_parallel(self) -> bool:
        return self.size("sequence") > 1


def parse_mesh(text: str, devices: list) -> jax.sharding.Mesh:
    """'data=2,tensor=4' -> a Mesh over the first 8 devices (axes of size 1 may be left out)."""
    sizes = {}
    for part in filter(None, text.split(",")):
        name, _, size = part.partition("=")
        if name not in MESH_AXES:
            raise ValueError(f"mesh axis {name!r} is not one of {MESH_AXES}")
        sizes[name] = int(size)
    count = int(np.prod(list(sizes.values())))
    if count > len(devices):
        raise ValueError(f"mesh {text!r} needs {count} devices, there are {len(devices)}")
    axis_types = (jax.sharding.AxisType.Auto,) * len(sizes)
    return jax.sharding.Mesh(
        np.array(devices[:count]).reshape(tuple(sizes.values())), tuple(sizes), axis_types
    )


def kv_heads_axis(cfg: prefill.Config, layout: Layout) -> str | None:
    """K/V heads split over `tensor` only when there are enough of them; else each device has all."""
    return "tensor" if cfg.heads_kv % layout.size("tensor") == 0 else None


def param_shardings(params: dict, cfg: prefill.Config, layout: Layout) -> dict:
    """Megatron-style tensor parallelism over `tensor`; everything else replicated."""
    column, row = layout.sharding(None, None, "tensor"), layout.sharding(None, "tensor", None)
    kv_column = layout.sharding(None, None, kv_heads_axis(cfg, layout))
    by_name = {"wq": column, "wk": kv_column, "wv": kv_column, "w_gate": column, "w_up": column}
    by_name |= {"wo": row, "w_down": row}
    replicated = layout.sharding()
    return {
        name: {n: by_name.get(n, replicated) for n in value} if name == "layers" else replicated
        for name, value in params.items()
    }


def rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """Rotary embedding of x [B, S, H, D] at the given token positions [S]."""
    half = x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * freqs
    cos, sin = jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention_fn(layout: Layout, implementation: str | None) -> Callable:
    if layout.sequence_parallel:
        return functools.partial(
            jzyfa.context_parallel_attention,
            mesh=layout.mesh,
            seq_axis="sequence",
            batch_axis="data" if layout.size("data") > 1 else None,
            head_axis="tensor" if layout.size("tensor") > 1 else None,
            strategy=layout.strategy,
            layout=layout.seq_layout,
            implementation=implementation,
        )
    return functools.partial(jzyfa.flash_attention, causal=True, implementation=implementation)


def probe_positions(seq: int) -> np.ndarray:
    """Token positions whose logits the prefill returns: first, quarters, last.

    A real prefill unembeds only the last token; a few more positions check the whole sequence
    without materialising [B, S, vocab] logits (16 GB in float32 at 128K tokens and a 32K vocab).
    """
    return np.unique(np.array([0, seq // 4, seq // 2, 3 * seq // 4, seq - 1]))


def forward(params, tokens, positions, *, cfg: prefill.Config, layout: Layout, probes, implementation=None):
    """tokens [B, S] (in the layout's sequence order) -> float32 logits [B, P, vocab].

    probes: static indices, in the layout's order, of the P tokens whose logits are returned.
    """
    attention = attention_fn(layout, implementation)

    def constrain(x, *entries):  # activations: batch over data, sequence or heads as the mesh says
        sharding = layout.sharding(*entries)
        return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)

    def block(x, layer):
        h = prefill.rms_norm(x, layer["attn_norm"])
        batch, seq = x.shape[:2]
        kv_axis = kv_heads_axis(cfg, layout)

        def heads(w, count, axis):
            return constrain((h @ w).reshape(batch, seq, count, cfg.head_dim), "data", "sequence", axis)

        q = rope(heads(layer["wq"], cfg.heads_q, "tensor"), positions, cfg.rope_base)
        k = rope(heads(layer["wk"], cfg.heads_kv, kv_axis), positions, cfg.rope_base)
        v = heads(layer["wv"], cfg.heads_kv, kv_axis)
        x = x + attention(q, k, v).reshape(batch, seq, -1) @ layer["wo"]
        h = prefill.rms_norm(x, layer["mlp_norm"])
        x = x + (jax.nn.silu(h @ layer["w_gate"]) * (h @ layer["w_up"])) @ layer["w_down"]
        return constrain(x, "data", "sequence", None), None

    x = constrain(params["embed"][tokens], "data", "sequence", None)
    x, _ = jax.lax.scan(block, x, params["layers"])
    x = x[:, np.asarray(probes)]
    return (prefill.rms_norm(x, params["final_norm"]) @ params["unembed"]).astype(jnp.float32)


def compile_prefill(params, tokens, cfg, layout: Layout, implementation):
    """(compiled prefill, its arguments placed on the mesh) for natural-order tokens."""
    seq_shards = layout.size("sequence")
    positions = np.arange(cfg.seq)
    if layout.sequence_parallel and layout.seq_layout == "balanced":
        tokens = jzyfa.to_balanced_layout(tokens, seq_shards)
        positions = jzyfa.balanced_positions(cfg.seq, seq_shards)
    # Where each probed token sits in the layout's order (positions[i] is the token at index i).
    probes = tuple(int(i) for i in np.argsort(positions)[probe_positions(cfg.seq)])
    if layout.mesh is not None:
        params = jax.device_put(params, param_shardings(params, cfg, layout))
        tokens = jax.device_put(tokens, layout.sharding("data", "sequence"))
        positions = jax.device_put(positions, layout.sharding("sequence"))
    fn = jax.jit(
        functools.partial(forward, cfg=cfg, layout=layout, probes=probes, implementation=implementation)
    )
    args = (params, tokens, positions)
    return fn.lower(*args).compile(), args


def seconds_per_call(fn: Callable[[], jax.Array], iters: int) -> float:
    jax.block_until_ready(fn())  # warm up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def run(cfg: prefill.Config, layout: Layout, *, implementation=None, iters=3, seed=0, single=None) -> dict:
    """Times the sharded prefill and compares its logits with a one-device run.

    `single` reuses a one-device result ({'logits', 'seconds'}) of the same cfg and seed.
    """
    params_key, tokens_key = jax.random.split(jax.random.key(seed))
    params = prefill.init_params(cfg, params_key)
    tokens = jax.random.randint(tokens_key, (cfg.batch, cfg.seq), 0, cfg.vocab)
    if single is None:
        one_device, args = compile_prefill(params, tokens, cfg, Layout(None), implementation)
        single = {
            "logits": np.asarray(one_device(*args)),
            "seconds": seconds_per_call(lambda: one_device(*args), iters),
        }
    sharded, args = compile_prefill(params, tokens, cfg, layout, implementation)
    seconds = seconds_per_call(lambda: sharded(*args), iters)
    logits = np.asarray(sharded(*args))
    tokens_total = cfg.batch * cfg.seq
    devices = layout.mesh.size if layout.mesh is not None else 1
    return {
        "devices": devices,
        "tokens_per_second": tokens_total / seconds,
        "tokens_per_second_per_device": tokens_total / seconds / devices,
        "single_device_tokens_per_second": tokens_total / single["seconds"],
        "logits_max_abs_diff": float(np.max(np.abs(logits - single["logits"]))),
        "single": single,
    }


def parse_args(argv: list[str] | None) -> tuple[prefill.Config, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=prefill.PRESETS, default="cpu", help="sizes to start from")
    for field in dataclasses.fields(prefill.Config):
        kind = type(getattr(prefill.PRESETS["cpu"], field.name))
        parser.add_argument(
            f"--{field.name.replace('_', '-')}", type=kind, help=f"overrides the preset's {field.name}"
        )
    parser.add_argument(
        "--mesh", help="axis sizes, e.g. data=2,tensor=4 or data=2,sequence=4 (default: all devices)"
    )
    parser.add_argument(
        "--strategy", choices=["allgather", "ring"], default="allgather", help="context parallelism"
    )
    parser.add_argument(
        "--layout", choices=["balanced", "contiguous"], default="balanced", help="sequence order"
    )
    parser.add_argument("--implementation", choices=["auto", "kernel", "xla"], default="auto")
    parser.add_argument("--iters", type=int, default=3, help="timed prefills (median)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(prefill.Config)
        if getattr(args, f.name) is not None
    }
    return dataclasses.replace(prefill.PRESETS[args.preset], **overrides), args


def default_mesh_text(device_count: int, cfg: prefill.Config) -> str:
    """data x tensor over as many devices as the batch and the query heads divide evenly."""
    data = math.gcd(device_count, cfg.batch)
    tensor = math.gcd(device_count // data, cfg.heads_q)
    return f"data={data},tensor={tensor}"


def main(argv: list[str] | None = None) -> dict:
    cfg, args = parse_args(argv)
    devices = jax.devices()
    mesh_text = args.mesh or default_mesh_text(len(devices), cfg)
    layout = Layout(parse_mesh(mesh_text, devices), strategy=args.strategy, seq_layout=args.layout)
    implementation = None if args.implementation == "auto" else args.implementation
    results = run(cfg, layout, implementation=implementation, iters=args.iters, seed=args.seed)
    kernel = "Hopper kernel" if jzyfa.kernel_available() and implementation != "xla" else "pure-JAX path"
    cp = f", context parallel: {args.strategy}, {args.layout}" if layout.sequence_parallel else ""
    print(f"{cfg}\nmesh {mesh_text}{cp}; jzyfa attention: {kernel} on {devices[0].device_kind}")
    print(
        f"sharded prefill: {results['tokens_per_second']:,.0f} tokens/s over {results['devices']} devices "
        f"({results['tokens_per_second_per_device']:,.0f} per device); one device: "
        f"{results['single_device_tokens_per_second']:,.0f} tokens/s"
    )
    print(f"max |logits(sharded) - logits(one device)|: {results['logits_max_abs_diff']:.3e}")
    return results


if __name__ == "__main__":
    main()
