"""Jitted prefill of a small causal transformer (RMSNorm, RoPE, GQA attention, gated MLP) in bf16.

Attention goes through `jzyfa.flash_attention(..., causal=True)`: the Hopper kernel on an H100/H200
with the extension built, the pure-JAX path elsewhere. The script prints prefill tokens per second,
the largest deviation of jzyfa's attention from `jax.nn.dot_product_attention` on the first layer's
q, k, v, and the largest deviation of the final logits between the jzyfa model and the same model
using `jax.nn.dot_product_attention`.

    python examples/prefill.py                 # small sizes, seconds on a CPU
    python examples/prefill.py --preset gpu    # an H100/H200-sized run
    python examples/prefill.py --preset gpu --seq 8192 --implementation kernel
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

import jzyfa

AttentionFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class Config:
    batch: int
    seq: int
    layers: int
    d_model: int
    heads_q: int
    heads_kv: int
    head_dim: int
    mlp: int
    vocab: int
    rope_base: float = 10000.0


PRESETS = {
    "cpu": Config(batch=1, seq=256, layers=2, d_model=256, heads_q=4, heads_kv=2, head_dim=64, mlp=512,
                  vocab=1024),
    "gpu": Config(batch=4, seq=4096, layers=4, d_model=2048, heads_q=16, heads_kv=4, head_dim=128, mlp=5632,
                  vocab=32000),
}


def init_params(cfg: Config, key: jax.Array) -> dict:
    """Random bf16 weights; the per-layer ones stacked on a leading axis for `lax.scan`."""
    def dense(key, *shape):
        fan_in = shape[-2]
        return (jax.random.normal(key, (cfg.layers, *shape)) / fan_in**0.5).astype(jnp.bfloat16)

    keys = jax.random.split(key, 9)
    q_dim, kv_dim = cfg.heads_q * cfg.head_dim, cfg.heads_kv * cfg.head_dim
    ones = jnp.ones((cfg.layers, cfg.d_model), jnp.bfloat16)
    return {
        "embed": jax.random.normal(keys[0], (cfg.vocab, cfg.d_model)).astype(jnp.bfloat16),
        "layers": {
            "attn_norm": ones, "mlp_norm": ones,
            "wq": dense(keys[1], cfg.d_model, q_dim),
            "wk": dense(keys[2], cfg.d_model, kv_dim),
            "wv": dense(keys[3], cfg.d_model, kv_dim),
            "wo": dense(keys[4], q_dim, cfg.d_model),
            "w_gate": dense(keys[5], cfg.d_model, cfg.mlp),
            "w_up": dense(keys[6], cfg.d_model, cfg.mlp),
            "w_down": dense(keys[7], cfg.mlp, cfg.d_model),
        },
        "final_norm": jnp.ones((cfg.d_model,), jnp.bfloat16),
        "unembed": (jax.random.normal(keys[8], (cfg.d_model, cfg.vocab)) / cfg.d_model**0.5)
        .astype(jnp.bfloat16),
    }


def rms_norm(x: jax.Array, weight: jax.Array, eps: float = 1e-6) -> jax.Array:
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf**2, axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, base: float) -> jax.Array:
    """Rotary position embedding of x [B, S, H, D], rotating the two halves of D."""
    half = x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freqs  # [S, D/2]
    cos, sin = jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]  # broadcast over heads
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def project_qkv(x: jax.Array, layer: dict, cfg: Config) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Normalised input of one layer -> q [B, S, Hq, D], k and v [B, S, Hkv, D], RoPE applied."""
    h = rms_norm(x, layer["attn_norm"])
    batch, seq = x.shape[:2]
    q = (h @ layer["wq"]).reshape(batch, seq, cfg.heads_q, cfg.head_dim)
    k = (h @ layer["wk"]).reshape(batch, seq, cfg.heads_kv, cfg.head_dim)
    v = (h @ layer["wv"]).reshape(batch, seq, cfg.heads_kv, cfg.head_dim)
    return rope(q, cfg.rope_base), rope(k, cfg.rope_base), v


def transformer_block(x: jax.Array, layer: dict, cfg: Config, attention: AttentionFn) -> jax.Array:
    """One pre-norm layer: x plus attention of x, then plus the gated MLP of that."""
    q, k, v = project_qkv(x, layer, cfg)
    x = x + attention(q, k, v).reshape(x.shape[0], x.shape[1], -1) @ layer["wo"]
    h = rms_norm(x, layer["mlp_norm"])
    return x + (jax.nn.silu(h @ layer["w_gate"]) * (h @ layer["w_up"])) @ layer["w_down"]


def forward(params: dict, tokens: jax.Array, cfg: Config, attention: AttentionFn) -> jax.Array:
    """Prefill: tokens [B, S] -> float32 logits [B, S, vocab]."""
    def block(x, layer):
        return transformer_block(x, layer, cfg, attention), None

    x, _ = jax.lax.scan(block, params["embed"][tokens], params["layers"])
    return (rms_norm(x, params["final_norm"]) @ params["unembed"]).astype(jnp.float32)


def jzyfa_attention(implementation: str | None) -> AttentionFn:
    return functools.partial(jzyfa.flash_attention, causal=True, implementation=implementation)


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def max_abs_diff(a: jax.Array, b: jax.Array) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def tokens_per_second(fn: Callable[[], jax.Array], tokens: int, iters: int) -> float:
    jax.block_until_ready(fn())  # compile and warm up
    start = time.perf_counter()
    for _ in range(iters):
        out = fn()
    jax.block_until_ready(out)
    return tokens * iters / (time.perf_counter() - start)


def parse_args(argv: list[str] | None) -> tuple[Config, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=PRESETS, default="cpu", help="sizes to start from")
    for field in dataclasses.fields(Config):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(getattr(PRESETS["cpu"], field.name)),
                            help=f"overrides the preset's {field.name}")
    parser.add_argument("--implementation", choices=["auto", "kernel", "xla"], default="auto",
                        help="jzyfa's implementation; auto uses the kernel where it can")
    parser.add_argument("--iters", type=int, default=5, help="timed prefills")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    overrides = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(Config) if getattr(args, f.name) is not None
    }
    return dataclasses.replace(PRESETS[args.preset], **overrides), args


def main(argv: list[str] | None = None) -> dict[str, float]:
    cfg, args = parse_args(argv)
    implementation = None if args.implementation == "auto" else args.implementation
    params_key, tokens_key = jax.random.split(jax.random.key(args.seed))
    params = init_params(cfg, params_key)
    tokens = jax.random.randint(tokens_key, (cfg.batch, cfg.seq), 0, cfg.vocab)

    jzyfa_prefill = jax.jit(functools.partial(forward, cfg=cfg, attention=jzyfa_attention(implementation)))
    xla_prefill = jax.jit(functools.partial(forward, cfg=cfg, attention=xla_attention))

    first_layer = jax.tree.map(lambda w: w[0], params["layers"])
    q, k, v = jax.jit(project_qkv, static_argnums=2)(params["embed"][tokens], first_layer, cfg)
    results = {
        "tokens_per_second": tokens_per_second(
            lambda: jzyfa_prefill(params, tokens), cfg.batch * cfg.seq, args.iters
        ),
        "attention_max_abs_diff": max_abs_diff(jax.jit(jzyfa_attention(implementation))(q, k, v),
                                               jax.jit(xla_attention)(q, k, v)),
        "logits_max_abs_diff": max_abs_diff(jzyfa_prefill(params, tokens), xla_prefill(params, tokens)),
    }
    kernel = "Hopper kernel" if jzyfa.kernel_available() and implementation != "xla" else "pure-JAX path"
    print(f"{cfg}\njzyfa attention: {kernel} on {jax.devices()[0].device_kind}")
    print(f"prefill: {results['tokens_per_second']:,.0f} tokens/s")
    print(f"max |attention(jzyfa) - jax.nn.dot_product_attention|: {results['attention_max_abs_diff']:.3e}")
    print(f"max |logits(jzyfa model) - logits(jax.nn model)|: {results['logits_max_abs_diff']:.3e}")
    return results


if __name__ == "__main__":
    main()
