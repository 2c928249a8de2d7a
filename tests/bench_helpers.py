"""Helpers of the bench tests: the flags parsed as `python -m jzyfa.bench` parses them, and a recorder
standing in for jzyfa's entry points."""

from __future__ import annotations

import jax.numpy as jnp
from absl import flags

import jzyfa
from jzyfa.bench import peers, speed


def resolve_config(argv: list[str]) -> dict:
    """speed.resolve_config() after parsing argv (without the program name); flags reset afterwards."""
    try:
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["bench", *argv])
        return speed.resolve_config()
    finally:
        flags.FLAGS.unparse_flags()


def record_flash_attention(monkeypatch) -> list[dict]:
    """Off GPU, jzyfa.flash_attention replaced by a recorder of its keyword arguments (returning bf16
    zeros): the list of the calls' kwargs, filled as the peers' built functions run."""
    calls: list[dict] = []

    def recorder(q, k, v, **kwargs):
        calls.append(kwargs)
        return jnp.zeros(q.shape, jnp.bfloat16)

    monkeypatch.setattr(peers, "_on_gpu", lambda: False)
    monkeypatch.setattr(jzyfa, "flash_attention", recorder)
    return calls


def quick_options(allow_xla_fallback: bool = False) -> speed.Options:
    """Timing options for tests: two samples, no warm-up, no CUPTI."""
    return speed.Options(
        iters=2,
        min_time_s=0,
        warmup_s=0,
        wall_rounds=1,
        cupti=False,
        cupti_mem_mb=1,
        max_rel_err=None,
        peer_options=peers.Options(allow_xla_fallback=allow_xla_fallback),
    )
