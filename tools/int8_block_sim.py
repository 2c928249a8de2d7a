"""Which INT8 scale block for Q and K: a float64 simulation of the quantization error alone.

For each input kind and scale granularity (one scale per 64, 128 or 256 tokens and head, or per
token), q and k are smoothed (each KV head's mean key subtracted), optionally Hadamard-rotated,
rounded to INT8 with that granularity, v to e4m3 with one power-of-two scale per KV head, and exact
float64 attention on the dequantized values is compared with float64 attention on the unquantized
inputs (relative L2 of O; LSE error after the smoothing correction). The kernel's own arithmetic
(lean P, rounded sums) is not in it: that is `jzyfa.int8_emulation`'s, the same as FP8's.

    PYTHONPATH=. python tools/int8_block_sim.py [--seq 2048] [--heads 8/2]
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from jzyfa.bench import inputs
from jzyfa.quantize import FP8_DTYPE, FP8_MAX, hadamard_matrix

INT8_MAX = 127.0
# Scale granularities of (Q, K): tokens per scale and head, 0 per token; None is e4m3 per head.
GRANULARITIES = {
    "fp8 per head": None,
    "64 / 64": (64, 64),
    "128 / 128": (128, 128),
    "256 / 256": (256, 256),
    "token / token": (0, 0),
    "token / 128": (0, 128),
    "128 / token": (128, 0),
}


def attention(q, k, v, scale):
    """Causal float64 attention: q [Sq, Hq, D], k, v [Sk, Hkv, D] -> (O [Sq, Hq, Dv], LSE [Hq, Sq])."""
    group = q.shape[1] // k.shape[1]
    kk, vv = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("qhd,khd->hqk", q, kk) * scale
    seq_q, seq_k = q.shape[0], k.shape[0]
    visible = np.arange(seq_k)[None, :] <= np.arange(seq_q)[:, None] + seq_k - seq_q
    s = np.where(visible, s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    l_ = p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p / l_, vv), (m + np.log(l_))[..., 0]


def int8_round_trip(x, block):
    """x [S, H, D] rounded to INT8 with one scale per `block` tokens and head (0: per token)."""
    seq, heads, dim = x.shape
    block = 1 if block == 0 else block
    padded = -(-seq // block) * block
    xb = np.pad(x, ((0, padded - seq), (0, 0), (0, 0))).reshape(-1, block, heads, dim)
    amax = np.abs(xb).max(axis=(1, 3), keepdims=True)
    scale = np.where(amax > 0, amax / INT8_MAX, 1.0)
    return (np.clip(np.rint(xb / scale), -INT8_MAX, INT8_MAX) * scale).reshape(padded, heads, dim)[:seq]


def e4m3_round_trip(x):
    """x [S, H, D] through e4m3 with one power-of-two scale per head."""
    amax = np.abs(x).max(axis=(0, 2), keepdims=True)
    scale = 2.0 ** np.ceil(np.log2(np.maximum(amax, 1e-30) / FP8_MAX))
    return np.asarray(np.asarray(x / scale, np.float32).astype(FP8_DTYPE), np.float64) * scale


def run(seq: int, heads_q: int, heads_kv: int, dim: int, seed: int) -> None:
    scale = 1 / np.sqrt(dim)
    signs = np.asarray(jax.random.rademacher(jax.random.key(0), (dim,)), np.float64)
    rotation = signs[:, None] * hadamard_matrix(dim)
    print(f"relative L2 of O (LSE max abs) against float64 on the unquantized inputs; 1 x {seq}, "
          f"{heads_q}/{heads_kv} heads, head dim {dim}, causal; V in e4m3 per head")  # fmt: skip
    print(f"{'inputs':12s} {'Q / K scales':>18s} {'smooth':>14s} {'smooth+rotate':>14s}")
    for kind in ("gaussian", "activations"):
        shape = {"batch": 1, "seq_q": seq, "heads_q": heads_q, "heads_kv": heads_kv, "head_dim": dim}
        q, k, v = (np.asarray(x, np.float64)[0] for x in inputs.make_qkv(kind, seed, **shape))
        want, want_lse = attention(q, k, v, scale)
        v8 = e4m3_round_trip(v)
        smoothed = k - k.mean(axis=0, keepdims=True)
        # The LSE of smoothed keys is lower by scale * q . mean(k): added back, as the call does.
        shift = scale * np.einsum("qhd,hd->hq", q, np.repeat(k.mean(axis=0), heads_q // heads_kv, axis=0))
        for name, blocks in GRANULARITIES.items():
            cells = []
            for rotate in (False, True):
                qq, kk = (q @ rotation, smoothed @ rotation) if rotate else (q, smoothed)
                if blocks is None:
                    qq, kk = e4m3_round_trip(qq), e4m3_round_trip(kk)
                else:
                    qq, kk = int8_round_trip(qq, blocks[0]), int8_round_trip(kk, blocks[1])
                got, lse = attention(qq, kk, v8, scale)
                error = np.linalg.norm(got - want) / np.linalg.norm(want)
                cells.append(f"{error:.4f} ({np.abs(lse + shift - want_lse).max():.3f})")
            print(f"{kind:12s} {name:>18s} {cells[0]:>14s} {cells[1]:>14s}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", default="8/2", help="query/KV heads")
    parser.add_argument("--head_dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    heads_q, heads_kv = (int(h) for h in args.heads.split("/"))
    run(args.seq, heads_q, heads_kv, args.head_dim, args.seed)


if __name__ == "__main__":
    main()
