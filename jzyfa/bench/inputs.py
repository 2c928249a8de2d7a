"""Attention inputs for benchmarks and accuracy runs: random normal, and activation-like q/k/v.

Random normal q/k/v are the usual benchmark inputs, but they are kind to FP8: every channel has the
same scale and every row's softmax is flat. Activations of trained language models are not like
that, and `activation_qkv` imitates the features that matter for attention kernels:

- RoPE: q and k are rotated by their positions (rotate-half convention, frequencies
  `base^(-i / (D/2))`), so q_m . k_n depends on m - n for fixed vectors.
- Outlier channels in k: a few rotary pairs per KV head carry `outlier_gain` times the RMS of the
  other channels (10-30x is what is measured in LLM keys), mostly as a constant offset with one
  sign for every token, and in the low-frequency pairs, where RoPE barely moves them. q is small in
  those channels, so the outliers shift each row's scores without dominating them (softmax ignores
  a per-row shift), but they set the FP8 scale of k.
- An attention sink: the first token's key points along a direction that every query shares (a
  mean component of q in the lowest-frequency pairs), so it takes most of the attention mass, as
  the first token does in most heads of trained models. Its value is small ("attend to nothing").
- Locality: q and k share a component in the high-frequency pairs; after RoPE it adds a bonus to
  keys near the query's position that fades with distance.
- Spread between heads and tokens: per-head log-normal scales of q, k and v (different softmax
  temperatures per head) and a per-token log-normal scale of v.

Everything is deterministic given the seed (JAX's counter-based PRNG, jitted, on the default
device), and works for GQA (query heads of one group share their KV head's structure). The knobs
live in `ActivationKnobs`; docs/measuring.md describes them.

Model-captured inputs come from a capture file (`--inputs captured:PATH` in the benchmark,
jzyfa/bench/captured.py): no installable package ships a causal language model's weights
(docs/measuring.md lists what was checked), so `model_qkv` raises `ModelInputsUnavailable` pointing
to examples/train.py, examples/capture.py and `captured:PATH`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

INPUT_KINDS = ("gaussian", "activations", "model")

NO_PACKAGED_MODEL = (
    "no installable package ships a causal language model's weights; train one and capture its q/k/v "
    "instead (python examples/train.py --save /tmp/lm.npz; python examples/capture.py --checkpoint "
    "/tmp/lm.npz --out /tmp/qkv.npz) and use --inputs captured:/tmp/qkv.npz (docs/measuring.md)"
)


class ModelInputsUnavailable(RuntimeError):
    """There is no packaged model to capture q/k/v from."""


@dataclasses.dataclass(frozen=True)
class ActivationKnobs:
    """The features `activation_qkv` gives q, k and v; set a strength to 0 to turn a feature off.

    Channel units: an ordinary channel of q, k and v has standard deviation 1 before the per-head
    and per-token scales. Logit units: nats, with the softmax scale 1/sqrt(head_dim).
    """

    rope_base: float = 500_000.0  # RoPE base (Llama 3); 10_000 rotates the sink away past ~8K tokens
    head_scale_sigma: float = 0.3  # log-normal sigma of each head's scale, for q, k and v separately
    token_scale_sigma: float = 0.25  # log-normal sigma of each token's scale of v
    outlier_pairs: int = 2  # rotary pairs of k per KV head that carry outliers (2 pairs: 4 channels)
    outlier_gain: float = 20.0  # RMS of an outlier channel of k over that of an ordinary channel
    outlier_offset: float = 0.8  # share of an outlier channel's RMS that is a constant offset
    sink_logit: float = 8.0  # score of the first key over a typical key, in nats (0: no sink)
    sink_query_bias: float = 4.0  # the queries' mean along the sink direction, in channel stds
    sink_value_scale: float = 0.1  # the sink token's v relative to other tokens' v
    local_logit: float = 2.0  # score bonus of the key at the query's own position, in nats


class ActivationInputs(NamedTuple):
    """q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D], and where the structure was put."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    outlier_pairs: jax.Array  # int32 [Hkv, outlier_pairs]: rotary pair index i (channels i, i + D/2)
    sink_pairs: np.ndarray  # int [2]: the rotary pairs holding the sink direction


# ----------------------------------------------------------------------------------------------
# RoPE


def rope_frequencies(head_dim: int, base: float) -> np.ndarray:
    """Angular frequency of each rotary pair i (channels i and i + D/2): base^(-i / (D/2))."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    half = head_dim // 2
    return base ** (-np.arange(half, dtype=np.float64) / half)


def apply_rope(x: jax.Array, positions: jax.Array, base) -> jax.Array:
    """Rotates x [..., S, H, D] by positions [S]: pair (i, i + D/2) by the angle position * freq_i.

    The rotate-half convention of Llama and GPT-NeoX; computed in float32 (base may be traced),
    output in x's dtype. The frequencies are `rope_frequencies`.
    """
    half = x.shape[-1] // 2
    freqs = jnp.asarray(base, jnp.float32) ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * freqs  # [S, D/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]  # broadcast over heads
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# ----------------------------------------------------------------------------------------------
# Generators


def _key(seed) -> jax.Array:
    return jax.random.key(seed) if isinstance(seed, (int, np.integer)) else seed


def gaussian_qkv(seed, *, batch, seq_q, seq_k=None, heads_q, heads_kv=None, head_dim, dtype=jnp.bfloat16):
    """Standard normal q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D] (the benchmark's plain inputs)."""
    seq_k = seq_q if seq_k is None else seq_k
    heads_kv = heads_q if heads_kv is None else heads_kv
    return _gaussian(_key(seed), (batch, seq_q, heads_q, head_dim), (batch, seq_k, heads_kv, head_dim), dtype)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _gaussian(key, q_shape, kv_shape, dtype):
    kq, kk, kv = jax.random.split(key, 3)
    return (
        jax.random.normal(kq, q_shape, jnp.float32).astype(dtype),
        jax.random.normal(kk, kv_shape, jnp.float32).astype(dtype),
        jax.random.normal(kv, kv_shape, jnp.float32).astype(dtype),
    )


def structure_pairs(head_dim: int, outlier_pairs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Which rotary pairs hold what: (sink pairs, candidates for outliers, locality pairs).

    The sink takes the two lowest-frequency pairs (RoPE barely rotates them over 32K tokens at base
    500K, so every query still aligns with the first key); outliers are drawn from the rest of the
    low-frequency half; locality uses the high-frequency half, whose fast rotation makes it fade
    with distance.
    """
    half = head_dim // 2
    if half < 8:
        raise ValueError(f"activation-like inputs need head_dim >= 16, got {head_dim}")
    sink = np.array([half - 1, half - 2])
    candidates = np.arange(half // 2, half - 2)
    if outlier_pairs > len(candidates):
        raise ValueError(f"outlier_pairs={outlier_pairs} exceeds the {len(candidates)} low-frequency pairs")
    local = np.arange(0, half // 2)
    return sink, candidates, local


def activation_qkv(
    seed,
    *,
    batch: int,
    seq_q: int,
    seq_k: int | None = None,
    heads_q: int,
    heads_kv: int | None = None,
    head_dim: int,
    dtype=jnp.bfloat16,
    knobs: ActivationKnobs = ActivationKnobs(),
) -> ActivationInputs:
    """Activation-like q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D] (see the module docstring).

    seed: an int or a JAX PRNG key. Queries sit at the last Sq of the Sk positions (the bottom-right
    alignment of the causal mask), so a chunk of queries after a prefix of context is modelled too.
    The structure (channels, directions, head scales) follows from the seed; so does the noise.
    """
    seq_k = seq_q if seq_k is None else seq_k
    heads_kv = heads_q if heads_kv is None else heads_kv
    if heads_q % heads_kv:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv})")
    sink_pairs, _, _ = structure_pairs(head_dim, knobs.outlier_pairs)
    # Only the number of outlier pairs shapes the program; the other knobs are traced values, so
    # changing them does not recompile.
    values = {
        f.name: jnp.float32(getattr(knobs, f.name))
        for f in dataclasses.fields(knobs)
        if f.name != "outlier_pairs"
    }
    q, k, v, outliers = _activations(
        _key(seed),
        batch,
        seq_q,
        seq_k,
        heads_q,
        heads_kv,
        head_dim,
        jnp.dtype(dtype),
        knobs.outlier_pairs,
        values,
    )
    return ActivationInputs(q, k, v, outliers, sink_pairs)


@functools.partial(jax.jit, static_argnums=tuple(range(1, 9)))
def _activations(key, batch, seq_q, seq_k, heads_q, heads_kv, head_dim, dtype, outlier_pairs, knobs: dict):
    half = head_dim // 2
    group = heads_q // heads_kv
    sink_pairs, candidates, local_pairs = structure_pairs(head_dim, outlier_pairs)
    q_shape = (batch, seq_q, heads_kv, group, head_dim)
    kv_shape = (batch, seq_k, heads_kv, head_dim)
    # One draw of standard normals for everything (one PRNG program to compile), cut into parts.
    sizes = {
        "q": q_shape,
        "k": kv_shape,
        "v": kv_shape,
        "signs": (heads_kv, head_dim),
        "choice": (heads_kv, len(candidates)),
        "q_head": (heads_kv, group, 1),
        "k_head": (heads_kv, 1),
        "v_head": (heads_kv, 1),
        "v_token": (batch, seq_k, 1, 1),
    }
    flat = jax.random.normal(key, (sum(math.prod(shape) for shape in sizes.values()),), jnp.float32)
    parts, start = {}, 0
    for name, shape in sizes.items():
        parts[name] = flat[start : start + math.prod(shape)].reshape(shape)
        start += math.prod(shape)

    # Outlier pairs per KV head (the largest of random scores: a random subset), and the sign of
    # each outlier channel's offset.
    outliers = jnp.asarray(candidates)[jax.lax.top_k(parts["choice"], outlier_pairs)[1]]  # [Hkv, n]
    # Both channels of a pair, so the outlier keeps its size as RoPE turns the pair.
    channels = jnp.concatenate([outliers, outliers + half], axis=1)
    outlier_mask = jnp.zeros((heads_kv, head_dim), bool).at[jnp.arange(heads_kv)[:, None], channels].set(True)
    signs = jnp.where(parts["signs"] >= 0, 1.0, -1.0)

    # Unit directions (pre-RoPE, first channel of each pair): the sink's, and the locality one.
    sink_dir = np.zeros(head_dim, np.float32)
    sink_dir[sink_pairs] = 1 / math.sqrt(len(sink_pairs))
    local_dir = np.zeros(head_dim, np.float32)
    local_dir[local_pairs] = 1 / math.sqrt(len(local_pairs))
    sink_mask = sink_dir != 0

    sqrt_d = math.sqrt(head_dim)
    # Shared components: q.k / sqrt(D) gains sink_logit on the first key, local_logit on the diagonal.
    a = knobs["sink_query_bias"]
    b = jnp.where(a > 0, knobs["sink_logit"] * sqrt_d / jnp.where(a > 0, a, 1.0), 0.0)
    c = jnp.sqrt(jnp.maximum(knobs["local_logit"], 0.0) * sqrt_d)

    q, k, v = parts["q"], parts["k"], parts["v"]

    # Queries are small where k has outliers (else those channels would dominate every score) and
    # in the sink channels (so the sink's score varies little between queries).
    q_gain = jnp.where(outlier_mask, 1.0 / jnp.maximum(knobs["outlier_gain"], 1.0), 1.0)
    q_gain = jnp.where(sink_mask, 0.25, q_gain)
    q = q * q_gain[None, None, :, None, :] + a * sink_dir + c * local_dir

    # Keys: outlier channels (offset + noise, RMS = gain), locality, and the sink on the first key.
    offset = knobs["outlier_offset"]
    outlier_k = knobs["outlier_gain"] * (offset * signs + jnp.sqrt(jnp.maximum(0.0, 1 - offset**2)) * k)
    k = jnp.where(outlier_mask[None, None], outlier_k, k) + c * local_dir
    k = k.at[:, 0].add(b * sink_dir)
    v = v.at[:, 0].multiply(knobs["sink_value_scale"])

    # Per-head and per-token scales.
    sigma = knobs["head_scale_sigma"]
    q = q * jnp.exp(sigma * parts["q_head"])
    k = k * jnp.exp(sigma * parts["k_head"])
    v = v * jnp.exp(sigma * parts["v_head"])
    v = v * jnp.exp(knobs["token_scale_sigma"] * parts["v_token"])

    q = q.reshape(batch, seq_q, heads_q, head_dim)
    q = apply_rope(q, jnp.arange(seq_k - seq_q, seq_k), knobs["rope_base"])
    k = apply_rope(k, jnp.arange(seq_k), knobs["rope_base"])
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), outliers.astype(jnp.int32)


def model_qkv(*args, **kwargs):
    """q/k/v captured from a packaged causal language model: not available (see NO_PACKAGED_MODEL)."""
    raise ModelInputsUnavailable(NO_PACKAGED_MODEL)


def make_qkv(kind: str, seed, **shape) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(q, k, v) of the given kind ("gaussian", "activations" or "model") and shape keywords."""
    if kind == "gaussian":
        return gaussian_qkv(seed, **shape)
    if kind == "activations":
        return tuple(activation_qkv(seed, **shape)[:3])
    if kind == "model":
        return model_qkv(seed, **shape)
    raise ValueError(f"unknown input kind {kind!r}; known: {INPUT_KINDS}")
