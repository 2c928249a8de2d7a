"""Test helpers: reading collectives and custom calls out of HLO text."""

from __future__ import annotations

import re

COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")
# An instruction's opcode follows its result shape: `%name = bf16[2,8]{1,0} all-gather(...)`, or a tuple
# of shapes for combined collectives, `(f32[2]{0}, f32[2]{0}) all-reduce(...)`; async forms (GPU) are
# `all-gather-start(...)`.
_OPCODE = re.compile(r"=\s*(?:\([^)]*\)|\S+)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def collective_counts(hlo_text: str) -> dict[str, int]:
    """How many of each collective the HLO holds."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    for match in _OPCODE.finditer(hlo_text):
        counts[match.group(1)] += 1
    return counts


def collective_result_shapes(hlo_text: str, collective: str) -> list[str]:
    """Result shapes (e.g. 'bf16[2,64,2,64]') of every `collective` instruction."""
    pattern = re.compile(r"=\s*(\w+\[[\d,]*\])\S*\s+" + re.escape(collective) + r"(?:-start)?\(")
    return pattern.findall(hlo_text)


def cuda_hlo(fn, *args) -> str:
    """HLO text of jax.jit(fn) traced on args and lowered for CUDA (on any host, no GPU needed)."""
    import jax

    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")


def custom_call_lines(hlo_text: str, target: str) -> list[str]:
    return [line for line in hlo_text.splitlines() if f'custom_call_target="{target}"' in line]


def window_attributes(call: str) -> tuple[int, int]:
    """(window_left, window_right) from a windowed jzyfa custom call's HLO line (lowered or compiled)."""
    left = re.search(r"window_left\s*=\s*(-?\d+)", call)
    right = re.search(r"window_right\s*=\s*(-?\d+)", call)
    assert left and right, call
    return int(left.group(1)), int(right.group(1))
