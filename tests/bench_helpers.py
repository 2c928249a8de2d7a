"""Helpers of the bench tests: the flags parsed as `python -m jzyfa.bench` parses them, the command run
as a user runs it, a recorder standing in for jzyfa's entry points, and a result row for the reports."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
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


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ON_GPU = jax.default_backend() == "gpu"


def run_bench(*args: str, module: str = "jzyfa.bench", timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m <module> <args>` from the repository, its output captured; on a GPU a smoke run
    times 3 samples without a minimum duration."""
    cmd = [sys.executable, "-m", module, *args]
    if ON_GPU and "--smoke" in args:
        cmd += ["--iters", "3", "--min_time_s", "0"]
    return subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def fake_result(**overrides) -> dict:
    """A measured result row as `speed.measure_peer` returns it (the keys the reports read)."""
    result = {
        "impl": "jzyfa", "inputs": "gaussian", "compute_dtype": "bf16", "notes": None, "batch": 2,
        "seq_q": 8192, "seq_k": 8192, "heads_q": 32, "heads_kv": 8, "head_dim": 128, "causal": True,
        "window": None, "varlen": None, "status": "ok", "message": None, "median_ms": 1.5, "tflops": 733.0,
        "sm_clock_mhz": 1755.0, "board_power_w": None, "rel_err": 2.5e-3, "timing_source": "cupti",
        "wall": {"median_ms": 1.6},
    }  # fmt: skip
    result.update(overrides)
    return result


def accuracy_config(**overrides) -> dict:
    """A config of `jzyfa.bench.accuracy.run` at CPU sizes (no KL unless asked), with overrides."""
    config = {
        "shapes": [(1, 64, 64)],
        "heads": 2,
        "kv_heads": 2,
        "head_dim": 32,
        "causal": True,
        "inputs": ["gaussian"],
        "captured_layer": -1,
        "granularity": "tensor",
        "variants": ["jzyfa_bf16"],
        "ref_pairs": 0,
        "kl": False,
        "kl_variants": [],
        "model": None,
        "seed": 0,
        "smoke": True,
        "json_out": None,
        "markdown": True,
    }
    return config | overrides
