"""What `jax.export` needs to export programs that call jzyfa."""

from __future__ import annotations

import jax

from jzyfa.primitives import FFI_TARGET, FFI_TARGET_BWD, FFI_TARGET_VALUE_OPERAND

FFI_TARGETS = (FFI_TARGET, FFI_TARGET_BWD, FFI_TARGET_VALUE_OPERAND)


def export_safety_checks() -> list[jax.export.DisabledSafetyCheck]:
    """The `disabled_checks=` for `jax.export.export` of a program calling jzyfa: jzyfa's FFI custom
    calls (forward, backward, FP8 value operand) are not on JAX's list of stable custom calls, so
    exporting them is an explicit choice; the artifact then needs the same jzyfa extension where it
    runs on CUDA (its CPU branch is pure JAX). Symbolic batch and sequence sizes are accepted: a
    launch limit undecidable at export time is checked by the FFI handler on the concrete sizes.

        exported = jax.export.export(jax.jit(f), disabled_checks=jzyfa.export_safety_checks())(*specs)
    """
    return [jax.export.DisabledSafetyCheck.custom_call(target) for target in FFI_TARGETS]
